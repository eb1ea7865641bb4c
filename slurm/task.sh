#!/bin/bash
# One rank of an SPMD job, started by srun (one task per GPU): activates the repository's environment,
# exports the rendezvous (MASTER_ADDR/MASTER_PORT) and runs `python ARGS...`. Rank, world size and local
# rank come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (mcpo_megatron.parallel.distributed reads them).
# Used by train/eval/export.sbatch and by the nemo-run launcher (launch/run.py).
set -euo pipefail
# srun gives the rank layout; stale torchrun variables from the submitting shell must not override it.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
mcpo_setup_env
cd "$MCPO_REPO"
exec "$MCPO_PYTHON" "$@"

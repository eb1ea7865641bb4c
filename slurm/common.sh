# shellcheck shell=bash
# Shared helpers for the sbatch scripts in this folder (sourced, not executed).
#
# Environment knobs (all optional; set them in the environment that calls sbatch -- sbatch exports it):
#   MCPO_REPO          repository root on the compute nodes     (default: the folder above this file)
#   MCPO_VENV          python virtual environment to activate     (default: $MCPO_REPO/.venv if it exists;
#                      "none" = use whatever python is on PATH, e.g. inside a container image)
#   GPUS_PER_NODE      ranks (srun tasks) per node                (default: SLURM_NTASKS_PER_NODE, else the
#                      GPUs SLURM gave the node, else 8)
#   MASTER_ADDR/PORT   rendezvous of torch.distributed            (default: first node of the job; port
#                      derived from the job id so jobs sharing a node do not collide)
#   CONTAINER_IMAGE    pyxis/enroot image -> srun --container-image; the repository is mounted at the same
#                      path and used as the working directory
#   CONTAINER_MOUNTS   extra mounts "src:dst[,src:dst...]" -> srun --container-mounts
#   SRUN_EXTRA_ARGS    extra srun flags, word-split             (e.g. "--cpu-bind=none")

mcpo_log() { echo "[mcpo $(date -u +%H:%M:%S)] $*" >&2; }
mcpo_die() { mcpo_log "ERROR: $*"; exit 1; }

# mcpo_setup_env: repository, venv, rank layout, rendezvous, NCCL defaults. Sets MCPO_REPO, MCPO_PYTHON,
# GPUS_PER_NODE, NNODES, MASTER_ADDR, MASTER_PORT.
mcpo_setup_env() {
  MCPO_REPO=${MCPO_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
  [ -d "$MCPO_REPO/mcpo_megatron" ] ||
    mcpo_die "MCPO_REPO=$MCPO_REPO is not the mcpo-megatron repository (no mcpo_megatron/ in it); submit from the repository root or export MCPO_REPO"
  export MCPO_REPO
  local venv=${MCPO_VENV:-$MCPO_REPO/.venv}
  if [ "$venv" != none ] && [ -f "$venv/bin/activate" ]; then
    # shellcheck disable=SC1091
    source "$venv/bin/activate"
  elif [ -n "${MCPO_VENV:-}" ] && [ "$MCPO_VENV" != none ]; then
    mcpo_die "MCPO_VENV=$MCPO_VENV has no bin/activate"
  fi
  MCPO_PYTHON=${MCPO_PYTHON:-python}
  export PYTHONPATH="$MCPO_REPO${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1

  NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
  GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}}
  GPUS_PER_NODE=${GPUS_PER_NODE%%(*}   # SLURM_NTASKS_PER_NODE may read "8(x4)"
  export GPUS_PER_NODE NNODES
  if [ -z "${MASTER_ADDR:-}" ]; then
    MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n 1)
    MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
  fi
  MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
  export MASTER_ADDR MASTER_PORT

  # NCCL / InfiniBand defaults for H100 clusters; every one is only set when the user has not set it.
  # They are inert on CPU (gloo) runs.
  : "${CUDA_DEVICE_MAX_CONNECTIONS:=1}"        # megatron: keeps TP communication ordered with compute
  : "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}"     # a hung/failed collective aborts the job instead of hanging
  : "${TORCH_NCCL_AVOID_RECORD_STREAMS:=1}"     # frees collective buffers promptly (lower peak memory)
  : "${NCCL_IB_TIMEOUT:=22}"                    # IB retransmit timeout 4.096us*2^22 ~ 17 s: rides out congestion
  : "${NCCL_IB_RETRY_CNT:=7}"
  : "${NCCL_DEBUG:=WARN}"
  : "${NCCL_NVLS_ENABLE:=0}"                    # NVLink SHARP buffers cost GPU memory the colocated engine needs
  : "${OMP_NUM_THREADS:=1}"
  export CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING TORCH_NCCL_AVOID_RECORD_STREAMS \
    NCCL_IB_TIMEOUT NCCL_IB_RETRY_CNT NCCL_DEBUG NCCL_NVLS_ENABLE OMP_NUM_THREADS
  # Site-specific and left to the user: NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_GID_INDEX, UCX_NET_DEVICES.
}

# mcpo_srun_args: srun flags for one task per GPU on every node (+ container flags). Prints one per line.
mcpo_srun_args() {
  printf '%s\n' "--nodes=$NNODES" "--ntasks-per-node=$GPUS_PER_NODE" "--ntasks=$((NNODES * GPUS_PER_NODE))" \
    "--kill-on-bad-exit=1" "--export=ALL"
  if [ -n "${CONTAINER_IMAGE:-}" ]; then
    printf '%s\n' "--container-image=$CONTAINER_IMAGE" \
      "--container-mounts=$MCPO_REPO:$MCPO_REPO${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}" \
      "--container-workdir=$MCPO_REPO"
  fi
  if [ -n "${SRUN_EXTRA_ARGS:-}" ]; then
    # shellcheck disable=SC2086
    printf '%s\n' $SRUN_EXTRA_ARGS
  fi
}

# mcpo_print_config CONFIG OVERRIDES...: print the resolved, validated config (fails fast on a bad config).
mcpo_print_config() {
  mcpo_log "resolved config ($1 ${*:2}) for $((NNODES * GPUS_PER_NODE)) ranks:"
  "$MCPO_PYTHON" -m mcpo_megatron.cli config --world-size "$((NNODES * GPUS_PER_NODE))" "$@" ||
    mcpo_die "config $1 did not load or validate (see the message above); nothing was launched"
}

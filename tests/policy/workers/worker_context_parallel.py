"""Worker (torchrun, 4 processes): context parallelism against the unpacked CP=1 run.

Usage: worker_context_parallel.py OUT_DIR QWEN3_DIR.  The first layout (DP=4, CP=1) computes the probe batch's
log-probs, entropy, MCPO loss metrics and gradient with padded micro-batches: the reference.  Its old log-probs
and loss weights are kept in this process and handed to every CP layout (CP=2 x DP=2; CP=2 x TP=2 with sequence
parallelism; CP=2 x PP=2), which computes the same from packed bins, each sequence split over the CP group.
Rank 0 writes OUT_DIR/<layout>.pt.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # reshard_compare.py

from common import (  # noqa: E402
    TEMPERATURE, add_weights, gather_by_index, hf_tensors, make_batch, perturb_old_logp, policy_loss_fn, shard,
)

from reshard_compare import plan_vs_stream  # noqa: E402
from mcpo_megatron.models.optim import OptimSettings  # noqa: E402
from mcpo_megatron.models.policy import MegatronPolicy  # noqa: E402
from mcpo_megatron.models.policy_settings import PolicySettings  # noqa: E402
from mcpo_megatron.parallel.distributed import barrier, destroy_distributed, init_distributed  # noqa: E402

# (name, tp, pp, cp, sequence_parallel)
LAYOUTS = [("unpacked_dp4", 1, 1, 1, False), ("cp2", 1, 1, 2, False), ("cp2tp2_sp", 2, 1, 2, True),
           ("cp2pp2", 1, 2, 2, False)]
PACK_BUDGET = 24
OPTIM = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.5,
             use_distributed_optimizer=False)


def run_layout(name, tp, pp, cp, sp, out_dir: Path, model_dir: str, shared: dict) -> None:
    info = init_distributed(tp, pp, cp=cp, seed=0)
    packed = cp > 1
    pol = MegatronPolicy(model_dir, PolicySettings(optim=OptimSettings(**OPTIM), logprob_chunk_size=5,
                                                   temperature=TEMPERATURE, sequence_parallel=sp,
                                                   sequence_packing=packed,
                                                   max_tokens_per_microbatch=PACK_BUDGET if packed else 10_000),
                         parallel_info=info)
    batch = make_batch(pol.vocab_size)
    n = len(batch)
    idx, mine = shard(batch, info.dp_rank, info.dp)
    lp, ent = pol.compute_logprobs(mine)
    res = {"cp": info.cp, "dp": info.dp, "logp": gather_by_index(idx, lp, info, n),
           "entropy": gather_by_index(idx, ent, info, n)}
    if not shared:  # the reference layout: the old log-probs every layout trains against
        shared["old_logp"] = perturb_old_logp(res["logp"])
    batch.token_fields["old_logp"] = shared["old_logp"]
    add_weights(batch)
    idx, mine = shard(batch, info.dp_rank, info.dp)
    res["local_tokens"] = [mb.input_ids.shape[1] for mb in pol._microbatches(mine)]
    res["metrics"] = pol.forward_backward(mine, policy_loss_fn)
    res["grads"] = hf_tensors(pol, use_grad=True)
    res["plan_vs_stream"] = plan_vs_stream(pol)
    if info.rank == 0:
        torch.save(res, out_dir / f"{name}.pt")
    barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    shared: dict = {}
    for name, tp, pp, cp, sp in LAYOUTS:
        run_layout(name, tp, pp, cp, sp, out_dir, model_dir, shared)
    destroy_distributed()


if __name__ == "__main__":
    main()

"""Worker (torchrun, 4 processes): the packed (THD) passes against the padded ones, layout by layout.

Usage: worker_packing.py OUT_DIR QWEN3_DIR MOE_DIR [LAYOUT,...].  For every layout one policy computes, on the
probe batch (each DP rank its share), the log-probs and entropy, then the MCPO loss, its metric sums and its
gradient, once with padded micro-batches (one per rank) and once packed into bins of PACK_BUDGET tokens (several
per rank, one of them holding a sequence longer than the rest of its bin together).  The pp2dp2 layout also runs
the frozen reference packed, and a packed run resumed from a checkpoint against the uninterrupted one.  Rank 0
writes OUT_DIR/<layout>.pt with the gathered results; the pytest side compares them.
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py

from common import (  # noqa: E402
    TEMPERATURE, add_weights, gather_by_index, hf_tensors, make_batch, perturb_old_logp, policy_loss_fn,
    save_checkpoint, shard,
)

from mcpo_megatron.models.optim import OptimSettings  # noqa: E402
from mcpo_megatron.models.policy import MegatronPolicy  # noqa: E402
from mcpo_megatron.models.policy_settings import PolicySettings  # noqa: E402
from mcpo_megatron.parallel.distributed import (  # noqa: E402
    all_gather_objects, barrier, destroy_distributed, init_distributed,
)

# (name, tp, pp, vpp, ep, sequence_parallel, model)
LAYOUTS = [("tp2pp2", 2, 2, None, 1, False, "qwen3"), ("pp2dp2", 1, 2, None, 1, False, "qwen3"),
           ("tp2dp2_sp", 2, 1, None, 1, True, "qwen3"), ("vpp2", 1, 2, 2, 1, False, "qwen3"),
           ("moe_ep2", 1, 1, None, 2, False, "moe")]
PADDED_BUDGET = 10_000  # one padded micro-batch per rank
PACK_BUDGET = 24  # sequences of 7..15 tokens: two or three per bin
OPTIM = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.5,
             use_distributed_optimizer=False)


def passes(pol, mine, idx, info, n, *, packed: bool) -> dict:
    """Log-probs, entropy, bins, and (with old_logp in the batch) the loss metrics and gradient."""
    pol.sequence_packing = packed
    pol.max_tokens_per_microbatch = PACK_BUDGET if packed else PADDED_BUDGET
    out = {}
    mbs = pol._microbatches(mine)
    out["bins"] = all_gather_objects(([[idx[i] for i in mb.indices] for mb in mbs if not mb.filler],
                                      sum(mb.filler for mb in mbs)), group=info.dp_group)
    lp, ent = pol.compute_logprobs(mine)
    out["logp"], out["entropy"] = gather_by_index(idx, lp, info, n), gather_by_index(idx, ent, info, n)
    return out


def run_layout(name, tp, pp, vpp, ep, sp, out_dir: Path, model_dir: str) -> None:
    info = init_distributed(tp, pp, vpp=vpp, ep=ep, seed=0)
    settings = PolicySettings(optim=OptimSettings(**OPTIM), logprob_chunk_size=5, temperature=TEMPERATURE,
                              sequence_parallel=sp)
    pol = MegatronPolicy(model_dir, settings, parallel_info=info)
    batch = make_batch(pol.vocab_size)
    n = len(batch)
    idx, mine = shard(batch, info.dp_rank, info.dp)
    res = {"dp": info.dp, "padded": passes(pol, mine, idx, info, n, packed=False),
           "packed": passes(pol, mine, idx, info, n, packed=True)}

    batch.token_fields["old_logp"] = perturb_old_logp(res["padded"]["logp"])
    add_weights(batch)
    idx, mine = shard(batch, info.dp_rank, info.dp)
    for mode in ("padded", "packed"):
        pol.sequence_packing = mode == "packed"
        pol.max_tokens_per_microbatch = PACK_BUDGET if pol.sequence_packing else PADDED_BUDGET
        res[mode]["metrics"] = pol.forward_backward(mine, policy_loss_fn)
        res[mode]["grads"] = hf_tensors(pol, use_grad=True)

    if name == "pp2dp2":
        res.update(reference_and_resume(pol, model_dir, mine, idx, info, n, settings, out_dir))
    if info.rank == 0:
        torch.save(res, out_dir / f"{name}.pt")
    barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def reference_and_resume(pol, model_dir, mine, idx, info, n, settings, out_dir: Path) -> dict:
    """The frozen reference's packed log-probs (before any update), and a packed run resumed from a checkpoint."""
    from mcpo_megatron.models.reference import ReferencePolicy

    packed = dataclasses.replace(settings, max_tokens_per_microbatch=PACK_BUDGET, sequence_packing=True)
    ref = ReferencePolicy(model_dir, packed, parallel_info=info)
    lp, _ = ref.compute_logprobs(mine, compute_entropy=False)
    out = {"reference_logp": gather_by_index(idx, lp, info, n)}
    del ref
    pol.sequence_packing, pol.max_tokens_per_microbatch = True, PACK_BUDGET
    pol.train_step(mine, policy_loss_fn)
    ckpt = out_dir / "ckpt_packed"
    save_checkpoint(pol, ckpt, info.rank)
    resumed = MegatronPolicy(model_dir, packed, parallel_info=info, load_weights=False)
    resumed.load_checkpoint(ckpt)
    m_run, m_resumed = pol.train_step(mine, policy_loss_fn), resumed.train_step(mine, policy_loss_fn)
    a, b = hf_tensors(pol, use_grad=False), hf_tensors(resumed, use_grad=False)
    out["resume"] = (m_run, m_resumed, max(float((a[k] - b[k]).abs().max()) for k in a))
    return out


def main() -> None:
    out_dir, dirs = Path(sys.argv[1]), {"qwen3": sys.argv[2], "moe": sys.argv[3]}
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else None
    for name, tp, pp, vpp, ep, sp, model in LAYOUTS:
        if only is None or name in only:
            run_layout(name, tp, pp, vpp, ep, sp, out_dir, dirs[model])
    destroy_distributed()


if __name__ == "__main__":
    main()

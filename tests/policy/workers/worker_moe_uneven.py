"""Worker (torchrun, 4 processes): MoE with expert parallelism when data-parallel ranks hold shares that split
into different numbers of micro-batches.

Usage: worker_moe_uneven.py OUT_DIR MODEL_DIR.  Layouts: EP=2 with DP=4 (one pipeline stage), and PP=2 x EP=2
with a virtual pipeline of 2 (the interleaved schedule's fixed-shape micro-batches).  Each DP rank takes an
uneven share of the probe batch; with a small token budget the shares split into different counts (recorded),
with a large one every rank has one micro-batch.  Recorded under both budgets: log-probs, the MCPO loss's
metric sums and the DP-summed gradient.  Rank 0 writes OUT_DIR/<layout>.pt.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py

from common import TEMPERATURE, add_weights, hf_tensors, make_batch, perturb_old_logp, policy_loss_fn  # noqa: E402

from mcpo_megatron.models.batch import SequenceBatch, fixed_shape_microbatches, split_by_token_budget  # noqa: E402
from mcpo_megatron.models.optim import OptimSettings  # noqa: E402
from mcpo_megatron.models.policy import MegatronPolicy  # noqa: E402
from mcpo_megatron.models.policy_settings import PolicySettings  # noqa: E402
from mcpo_megatron.parallel.distributed import all_gather_objects, barrier, destroy_distributed, init_distributed  # noqa: E402

# (name, pp, vpp, ep, shares of the 8 probe sequences per DP rank)
LAYOUTS = [("ep2_dp4", 1, None, 2, [[0], [1, 2], [3, 4, 5], [6, 7]]),
           ("pp2_vpp2_ep2", 2, 2, 2, [[0], [1, 2, 3, 4, 5, 6, 7]])]
SMALL_BUDGET = 16  # about one sequence per micro-batch
BIG_BUDGET = 10_000


def take(batch: SequenceBatch, idx: list[int]) -> SequenceBatch:
    t = torch.tensor(idx)
    return SequenceBatch(input_ids=[batch.input_ids[i] for i in idx], prompt_lens=batch.prompt_lens[t],
                         response_lens=batch.response_lens[t],
                         token_fields={k: [v[i] for i in idx] for k, v in batch.token_fields.items()},
                         seq_fields={k: v[t] for k, v in batch.seq_fields.items()})


def run_layout(name, pp, vpp, ep, shares, out_dir: Path, model_dir: str) -> None:
    from megatron.core import parallel_state as ps

    info = init_distributed(1, pp, vpp=vpp, ep=ep, seed=0)
    assert info.dp == len(shares), (info.dp, shares)
    pol = MegatronPolicy(model_dir, PolicySettings(logprob_chunk_size=5, temperature=TEMPERATURE,
                                                   optim=OptimSettings(lr=1e-3, use_distributed_optimizer=False),
                                                   max_tokens_per_microbatch=BIG_BUDGET), parallel_info=info)
    batch = make_batch(pol.vocab_size)
    add_weights(batch)  # global loss weights, from the whole batch
    mine = take(batch, shares[info.dp_rank])
    if vpp:  # the interleaved schedule's fixed-shape micro-batches, before any filler
        own = sum(not mb.filler for mb in fixed_shape_microbatches(mine, SMALL_BUDGET, pp))
    else:
        own = len(split_by_token_budget(mine, SMALL_BUDGET))
    res: dict = {"counts": all_gather_objects(own, group=info.dp_group)}
    for tag, budget in (("big", BIG_BUDGET), ("small", SMALL_BUDGET)):
        pol.max_tokens_per_microbatch = budget
        logp, _ = pol.compute_logprobs(mine)
        if tag == "big":
            mine.token_fields["old_logp"] = perturb_old_logp(logp, seed=1 + info.dp_rank)
        res[f"logp_{tag}"] = all_gather_objects((shares[info.dp_rank], logp), group=info.dp_group)
        res[f"metrics_{tag}"] = pol.forward_backward(mine, policy_loss_fn)
        res[f"grads_{tag}"] = hf_tensors(pol, use_grad=True)
    if info.rank == 0:
        torch.save(res, out_dir / f"{name}.pt")
    barrier()
    del pol
    ps.destroy_model_parallel()


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    for layout in LAYOUTS:
        run_layout(*layout, out_dir, model_dir)
    destroy_distributed()


if __name__ == "__main__":
    main()

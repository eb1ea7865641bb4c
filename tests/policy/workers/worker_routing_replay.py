"""Worker (torchrun, 4 processes): R2 routing replay of a near-tie Qwen3-MoE policy at TP=2 x EP=2 (sequence
parallel) and PP=2 x EP=2.

Usage: worker_routing_replay.py OUT_DIR MODEL_DIR [LAYOUTS].  Per layout: the old-log-prob pass (one sequence
per micro-batch) records the routing; then two forward-backward passes over other micro-batches (all sequences
of a DP rank in one), the first measuring only (replay not applied), the second replaying; then the same two
over the old pass's own micro-batches (what the trainer runs).  Rank 0 writes
OUT_DIR/<layout>.pt with the log-probs of every pass, the mismatch metric, the record and the replayed
gradient in HF names.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py

from common import TEMPERATURE, gather_by_index, hf_tensors, make_batch, shard  # noqa: E402

from mcpo_megatron.models.optim import OptimSettings  # noqa: E402
from mcpo_megatron.models.policy import MegatronPolicy  # noqa: E402
from mcpo_megatron.models.policy_settings import PolicySettings  # noqa: E402
from mcpo_megatron.parallel.distributed import (  # noqa: E402
    all_gather_objects,
    barrier,
    destroy_distributed,
    init_distributed,
)

# (name, tp, pp, ep, sequence_parallel, virtual pipeline, recompute)
LAYOUTS = [("tp2ep2", 2, 1, 2, True, None, False), ("pp2ep2", 1, 2, 2, False, None, False),
           ("pp2vpp2ep2", 1, 2, 2, False, 2, True)]
OLD_BUDGET = 16  # one sequence per micro-batch in the old-log-prob pass
UPDATE_BUDGET = 10_000  # all of a rank's sequences in one micro-batch in the updates
# forward-backward passes after the old-log-prob pass: (name, token budget, replay applied)
PASSES = [("plain", UPDATE_BUDGET, False), ("replay", UPDATE_BUDGET, True),
          ("same_plain", OLD_BUDGET, False), ("same_replay", OLD_BUDGET, True)]


def token_weights(batch) -> list[torch.Tensor]:
    """Fixed per-token weights of the test loss sum(w * logp)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(int(n), generator=g) for n in batch.response_lens]


def merge_records(parts, n):
    """Per-sequence records from every rank (each knows its own pipeline stage's layers) -> one record."""
    out = [None] * n
    for idx, recs in parts:
        for i, r in zip(idx, recs):
            out[i] = r.clone() if out[i] is None else torch.where(r >= 0, r, out[i])
    return out


def run_layout(name, tp, pp, ep, sp, vpp, recompute, out_dir: Path, model_dir: str) -> None:
    info = init_distributed(tp, pp, ep=ep, vpp=vpp, seed=0)
    plain = OptimSettings(lr=1e-3, use_distributed_optimizer=False)
    pol = MegatronPolicy(model_dir, PolicySettings(optim=plain, max_tokens_per_microbatch=OLD_BUDGET,
                                                   logprob_chunk_size=5, temperature=TEMPERATURE,
                                                   sequence_parallel=sp, recompute_activations=recompute,
                                                   moe_routing_replay="r2"), parallel_info=info)
    batch = make_batch(pol.vocab_size)
    batch.token_fields["w"] = token_weights(batch)
    n = len(batch)
    idx, mine = shard(batch, info.dp_rank, info.dp)
    res: dict = {}
    old, _ = pol.compute_logprobs(mine, compute_entropy=False)
    res["old_logp"] = gather_by_index(idx, old, info, n)
    res["record"] = merge_records(all_gather_objects((idx, mine.routing)), n)

    for key, budget, apply in PASSES:
        pol.max_tokens_per_microbatch = budget
        pol.routing.apply = apply
        seen: dict[int, torch.Tensor] = {}

        def loss_fn(logp, entropy, mb):
            for row, i in enumerate(mb.indices):
                seen[idx[i]] = logp[row, : int(mb.response_lens[row])].detach().clone()
            return (logp * mb.token_fields["w"]).sum(), {}

        res[f"{key}_metrics"] = pol.forward_backward(mine, loss_fn)
        merged = {}
        for part in all_gather_objects(seen):  # the last stage's log-probs, from every DP rank
            merged.update(part)
        res[f"{key}_logp"] = [merged[i] for i in range(n)]
        if key == "replay":
            res["grads"] = hf_tensors(pol, use_grad=True)
    if info.rank == 0:
        torch.save(res, out_dir / f"{name}.pt")
    barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


R3_PROMPTS = [[3, 17, 42], [5, 6, 7, 8, 9, 10], [100], [11, 12], [40, 41, 42, 43]]


def run_r3(out_dir: Path, model_dir: str) -> None:
    """R3 at TP=2 x EP=2 (SP): the PyTorch engine samples with its routing reported; the trainer's log-probs of
    the samples without and with the engine's routing replayed, and the mismatch metric of both passes."""
    from mcpo_megatron.models.batch import SequenceBatch
    from mcpo_megatron.rollout.engines.contract import policy_contract_figures
    from mcpo_megatron.rollout.engines.interface import SamplingParams, generate_data_parallel
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    info = init_distributed(2, 1, ep=2, seed=0)
    pol = MegatronPolicy(model_dir, PolicySettings(max_tokens_per_microbatch=OLD_BUDGET, logprob_chunk_size=5,
                                                   temperature=TEMPERATURE, sequence_parallel=True,
                                                   moe_routing_replay="r3"), parallel_info=info)
    engine = TorchRolloutEngine.from_pretrained(model_dir, return_routed_experts=True)
    out = generate_data_parallel(engine, R3_PROMPTS, SamplingParams(n=2, temperature=TEMPERATURE, max_new_tokens=12,
                                                                    seed=3), rollout_tp=1)
    res: dict = {"engine_logp": out.logprobs, "routed": out.routed_experts,
                 "samples": [(R3_PROMPTS[x.prompt_index], x.token_ids) for x in out]}
    batch = SequenceBatch(
        input_ids=[torch.tensor(p + t) for p, t in res["samples"]],
        prompt_lens=torch.tensor([len(p) for p, _ in res["samples"]]),
        response_lens=torch.tensor([len(t) for _, t in res["samples"]]), routing=out.routed_experts)
    n = len(batch)
    idx, mine = shard(batch, info.dp_rank, info.dp)
    mine.routing = [batch.routing[i] for i in idx]
    for key, apply in (("plain", False), ("replay", True)):
        pol.routing.apply = apply
        lp, _ = pol.compute_logprobs(mine, compute_entropy=False)
        res[f"{key}_logp"] = gather_by_index(idx, lp, info, n)
        res[f"{key}_metrics"] = dict(pol.routing.last_metrics)
    res["contract"] = policy_contract_figures(pol, R3_PROMPTS, out)
    if info.rank == 0:
        torch.save(res, out_dir / "r3.pt")
    barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    for layout in LAYOUTS:
        if only is None or layout[0] in only:
            run_layout(*layout, out_dir, model_dir)
    if only is None or "r3" in only:
        run_r3(out_dir, model_dir)
    destroy_distributed()


if __name__ == "__main__":
    main()

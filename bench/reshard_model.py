"""The weight update at a recipe's scale, from the compiled reshard plan and stated link speeds (no GPU needed).

For a recipe (``configs/*.yaml``) and a placement, every rank's part of the plan is compiled exactly as the run
compiles it (``rollout/weights/plan.py``; the model's shape from its public config), and each rank's bytes are
split by where they go: copied on the GPU (``local``), to a GPU of the same node (NVLink) or to another node
(InfiniBand). A rank's time is the sum of its bytes over each path's bandwidth plus the rounds' latency; the
update takes the slowest rank's. Printed per recipe: the collectives per update (rounds: one ``all_to_all``
each), the bytes per rank on each path, and the modelled seconds.

Placements: ``colocated`` (vLLM on the training GPUs at the recipe's rollout TP) and ``separate`` (the same
training layout, vLLM on ``--engine-nodes`` nodes of its own at the recipe's rollout TP; each trainer rank first
stages its shards into pinned host memory, overlapped with training, then sends them through a device buffer:
its PCIe copy is part of its time).

    python bench/reshard_model.py                      # the 14B, 32B and 30B-A3B MCPO recipes, H100 nodes
    python bench/reshard_model.py --recipes configs/qwen3_8b_mcpo.yaml --nvlink-gbps 300
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECIPES = ["configs/qwen3_14b_mcpo.yaml", "configs/qwen3_32b_mcpo.yaml", "configs/qwen3_30b_a3b_mcpo.yaml"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=RECIPES, help="recipe YAML files")
    p.add_argument("--placements", default="colocated,separate", help="colocated, separate or both")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--engine-nodes", type=int, default=1, help="nodes of engines with separate placement")
    p.add_argument("--hbm-gbps", type=float, default=1300.0,
                   help="a device-to-device copy on one GPU, GB/s (H100 SXM: ~1.3 TB/s copied, read + write)")
    p.add_argument("--nvlink-gbps", type=float, default=350.0,
                   help="NCCL all_to_all within a node, per GPU and direction, GB/s (H100 NVLink 4: ~350)")
    p.add_argument("--ib-gbps", type=float, default=45.0,
                   help="between nodes, per GPU and direction, GB/s (one 400 Gb/s NIC per GPU: ~45)")
    p.add_argument("--pcie-gbps", type=float, default=50.0,
                   help="host <-> GPU copy, GB/s (PCIe 5 x16: ~50); separate placement's staged sends")
    p.add_argument("--round-latency-us", type=float, default=50.0, help="one all_to_all's fixed cost, microseconds")
    p.add_argument("--bucket-mb", type=float, default=None, help="reshard.bucket_mb (default: the recipe's)")
    p.add_argument("--world", type=int, default=None,
                   help="training ranks (default: the recipe's '# world_size:' line, else 16)")
    return p.parse_args(argv)


def recipe_layout(path: str, world: int | None):
    """(config, Megatron shape at the recipe's TP/EP, training ranks)."""
    from mcpo_megatron.config import load_config

    file = Path(path) if Path(path).is_absolute() else REPO / path
    cfg = load_config(str(file), [])
    if world is None:
        first = file.read_text().splitlines()[0]
        world = int(first.split(":")[1]) if first.startswith("# world_size:") else 16
    return cfg, shape_of(cfg), world


def shape_of(cfg):
    """The recipe's model as a MegatronShape at its TP/EP (from the public config facts)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from mcpo_megatron.config import model_shape
    from mcpo_megatron.models.registry import megatron_shape

    m = model_shape(cfg)
    common = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                  num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                  head_dim=m.head_dim, intermediate_size=m.ffn_hidden_size,
                  tie_word_embeddings=m.tie_word_embeddings)
    if m.num_experts:
        hf = Qwen3MoeConfig(num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                            moe_intermediate_size=m.moe_ffn_hidden_size, **common)
        hf.architectures = ["Qwen3MoeForCausalLM"]
    else:
        hf = Qwen3Config(**common)
        hf.architectures = ["Qwen3ForCausalLM"]
    p = cfg.parallelism
    return megatron_shape(hf, p.tensor_model_parallel_size, p.expert_model_parallel_size)


def trainer_ranks(tp: int, pp: int, cp: int, ep: int, world: int):
    """Megatron's rank order: dense tp-cp-dp-pp, experts tp-ep-edp-pp."""
    from mcpo_megatron.rollout.weights.layouts import TrainerRank

    dp = world // (tp * pp * cp)
    per_stage = tp * cp * dp
    out = []
    for rank in range(world):
        stage, i = divmod(rank, per_stage)
        t, rest = i % tp, i // tp
        out.append(TrainerRank(rank, stage, t, dp=rest // cp, cp=rest % cp, ep=(i // tp) % ep, edp=i // (tp * ep)))
    return tuple(out)


def model(args, path: str, placement: str) -> dict:
    from mcpo_megatron.rollout.weights import layouts as L, plan as P

    cfg, shape, world = recipe_layout(path, args.world)
    p = cfg.parallelism
    pp, cp = p.pipeline_model_parallel_size, p.context_parallel_size
    per_layer = shape.num_layers // pp
    trainer = L.TrainerLayout(shape, True, tuple(layer // per_layer for layer in range(shape.num_layers)),
                              trainer_ranks(shape.tp, pp, cp, shape.ep, world))
    r = int(cfg.rollout.tensor_parallel_size)
    vocab = -(-shape.vocab_size // 64) * 64
    if placement == "colocated":
        engines = [L.EngineLayout("vllm", "bfloat16", tp=r, tp_rank=d % r, vocab_padded=vocab, replica=d // r)
                   for d in range(world)]
    else:
        n = args.engine_nodes * args.gpus_per_node
        engines = [None] * world + [L.EngineLayout("vllm", "bfloat16", tp=r, tp_rank=e % r, vocab_padded=vocab,
                                                   replica=e // r) for e in range(n)]
    prefer = P.preferences(trainer, engines)
    bucket = int((args.bucket_mb or cfg.reshard.bucket_mb) * 2**20)
    t0 = time.perf_counter()
    pairs = {me: P.rank_pieces(trainer, engines, me, prefer) for me in range(len(engines))}
    fanout = max(P.peer_count(pairs[me], me) for me in pairs)
    plans = {me: P.assign_rounds(pairs[me], me, len(engines), bucket, fanout) for me in pairs}
    rounds = max(pl.num_rounds for pl in plans.values())
    compile_s = (time.perf_counter() - t0) / len(engines)
    node = lambda rank: rank // args.gpus_per_node  # noqa: E731
    worst, worst_rank, per = 0.0, 0, {}
    for me, pl in plans.items():
        local = sum(pc.nbytes for pc in pl.local)
        out_nv = out_ib = in_nv = in_ib = 0
        for rd in pl.rounds:
            for peer, size in rd.send_sizes.items():
                out_nv, out_ib = (out_nv + size, out_ib) if node(peer) == node(me) else (out_nv, out_ib + size)
            for peer, size in rd.recv_sizes.items():
                in_nv, in_ib = (in_nv + size, in_ib) if node(peer) == node(me) else (in_nv, in_ib + size)
        nv, ib = max(out_nv, in_nv), max(out_ib, in_ib)
        staged = out_nv + out_ib if placement == "separate" and me < world else 0
        seconds = (local / (args.hbm_gbps * 1e9) + nv / (args.nvlink_gbps * 1e9) + ib / (args.ib_gbps * 1e9)
                   + staged / (args.pcie_gbps * 1e9) + rounds * args.round_latency_us * 1e-6)
        per[me] = dict(local=local, nvlink=nv, ib=ib, staged=staged, seconds=seconds)
        if seconds > worst:
            worst, worst_rank = seconds, me
    w = per[worst_rank]
    return dict(recipe=Path(path).stem, placement=placement, world=len(engines), rollout_tp=r, rounds=rounds,
                fanout=fanout, seconds=worst, local_gb=w["local"] / 1e9, nvlink_gb=w["nvlink"] / 1e9,
                ib_gb=w["ib"] / 1e9, staged_gb=w["staged"] / 1e9, compile_s=compile_s,
                layout=f"TP{shape.tp} PP{pp} CP{cp} EP{shape.ep}")


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"Weight update model: bf16, HBM {args.hbm_gbps:g} GB/s, NVLink {args.nvlink_gbps:g} GB/s, IB "
          f"{args.ib_gbps:g} GB/s, PCIe {args.pcie_gbps:g} GB/s per GPU, {args.round_latency_us:g} us per round; "
          f"{args.gpus_per_node} GPUs per node; separate: {args.engine_nodes} engine node(s)")
    print(f"{'recipe':20s}  {'placement':10s}  {'training':16s}  {'vLLM TP':>7s}  {'ranks':>5s}  {'rounds':>6s}  "
          f"{'local GB':>8s}  {'NVLink GB':>9s}  {'IB GB':>6s}  {'uploaded GB':>11s}  {'seconds':>8s}")
    for path in args.recipes:
        for placement in args.placements.split(","):
            m = model(args, path, placement)
            print(f"{m['recipe']:20s}  {placement:10s}  {m['layout']:16s}  {m['rollout_tp']:7d}  {m['world']:5d}  "
                  f"{m['rounds']:6d}  {m['local_gb']:8.2f}  {m['nvlink_gb']:9.2f}  {m['ib_gb']:6.2f}  "
                  f"{m['staged_gb']:11.2f}  {m['seconds']:8.3f}")
    print("GB: the slowest rank's bytes on each path (copied on its GPU; NVLink: sent or received within its node; "
          "IB: to or from other nodes; uploaded: separate placement's host-to-device copies of its staged sends)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The reshard plan, pure: every destination of every engine rank gets exactly the right values.

Many ranks are simulated in one process: Megatron shards are cut from random HF tensors with the models package's
own mapping (``hf_to_megatron_shard``), each rank's plan is compiled and run (:class:`PlanTransfer`), and the
exchange moves each sender's packed slot into its receiver's buffer. The engines' tensors are then compared, bit
for bit, with references built independently of the plan: the HF tensors themselves (the PyTorch engine, experts
stacked as transformers fuses them) and vLLM's shards cut with ``torch.chunk`` / ``torch.cat`` as its loaders do
(query heads, then KV heads, replicated when its TP exceeds them; gate then up rows; column shards; padded
vocabulary). Layouts: TP, PP, DP, CP, EP, query-group padding, tied and untied heads, biases, the Transformer
Engine names, engine ranks of their own (separate placement), vLLM TP 1 to 8, and buckets small enough to cut
pieces and need many rounds.
"""

from __future__ import annotations

import pytest
import torch

from mcpo_megatron.models import weights
from mcpo_megatron.models.registry import megatron_shape
from mcpo_megatron.models.shard_views import View, contiguous_view, source_key
from mcpo_megatron.models.tiny import tiny_hf_config
from mcpo_megatron.rollout.weights import layouts as L, plan as P
from mcpo_megatron.rollout.weights.transfer import TORCH_DTYPES, PlanTransfer


def random_hf(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for rule in weights.param_rules(shape):
        for name, full in zip(rule.hf, weights.hf_tensor_shapes(shape, rule)):
            out[name] = torch.randn(full, generator=gen)
    return out


def trainer_ranks(tp, pp, dp, cp=1, ep=1):
    """Megatron's rank order: dense tp-cp-dp-pp, experts tp-ep-edp-pp."""
    ranks = []
    per_stage = tp * cp * dp
    for rank in range(tp * cp * dp * pp):
        pp_r, i = divmod(rank, per_stage)
        t, rest = i % tp, i // tp
        c, d = rest % cp, rest // cp
        e, edp = (i // tp) % ep, i // (tp * ep)
        ranks.append(L.TrainerRank(rank, pp_r, t, dp=d, cp=c, ep=e, edp=edp))
    return tuple(ranks)


def layer_stages(num_layers, pp, vpp=1):
    """Megatron's interleaved assignment: virtual chunk v of stage s holds layers ((v * pp + s) * per ...)."""
    per = num_layers // (pp * vpp)
    out = [0] * num_layers
    for v in range(vpp):
        for s in range(pp):
            for k in range(per):
                out[(v * pp + s) * per + k] = s
    return tuple(out)


def sources_for(shape, te, rank, stages, hf):
    """The Megatron shards a trainer rank holds, by plan key (rules with TE names when ``te``)."""
    out = {}
    experts = range(rank.ep * shape.num_local_experts, (rank.ep + 1) * shape.num_local_experts) if shape.is_moe \
        else None
    for rule in weights.param_rules(shape, te=te, experts=experts):
        stage = stages[rule.layer] if rule.layer is not None else (0 if rule.mcore.startswith("embedding") else
                                                                    max(stages))
        if stage != rank.pp:
            continue
        out[source_key(rule)] = weights.hf_to_megatron_shard(rule, hf, shape, rank.tp)
    return out


def run_plans(trainer, engines, prefer, bucket_bytes, sources, dtype=torch.float32):
    """Compile and run every rank's plan in one process; returns (destinations by rank, plans)."""
    world = len(engines)
    pairs = {me: P.rank_pieces(trainer, engines, me, prefer) for me in range(world)}
    fanout = max(P.peer_count(pairs[me], me) for me in range(world))
    plans = {me: P.assign_rounds(pairs[me], me, world, bucket_bytes, fanout) for me in range(world)}
    rounds = max(p.num_rounds for p in plans.values())
    for p in plans.values():
        P.pad_rounds(p, rounds)
    dests = {}
    for d, layout in enumerate(engines):
        if layout is None:
            continue
        shapes = L.engine_tensor_shapes(trainer.shape, layout)
        dests[d] = {k: torch.full(s, float("nan"), dtype=TORCH_DTYPES[layout.dtype]) for k, s in shapes.items()}
    runs = {me: PlanTransfer(plans[me], sources=sources.get(me), destinations=dests.get(me), device="cpu")
            for me in range(world)}
    for run in runs.values():
        run.copy_local()
    for k in range(rounds):
        sent = {}
        for me, run in runs.items():
            buf, sizes = run.pack(k)
            sent[me] = (buf.clone(), sizes)
        for me, run in runs.items():
            recv, sizes = run.receive_buffer(k)
            parts = []
            for s in range(world):
                buf, ssizes = sent[s]
                assert ssizes[me] == sizes[s], (k, s, me)
                start = sum(ssizes[:me])
                parts.append(buf[start:start + ssizes[me]])
            if parts:
                recv.copy_(torch.cat(parts))
            run.unpack(k)
    return dests, plans


def hf_reference(shape, hf, fused):
    out = dict(hf)
    if shape.is_moe and fused:
        for layer in range(shape.num_layers):
            pre = f"model.layers.{layer}.mlp.experts."
            out[pre + "gate_up_proj"] = torch.stack([torch.cat([hf[f"{pre}{e}.gate_proj.weight"],
                                                                hf[f"{pre}{e}.up_proj.weight"]])
                                                     for e in range(shape.num_experts)])
            out[pre + "down_proj"] = torch.stack([hf[f"{pre}{e}.down_proj.weight"] for e in range(shape.num_experts)])
    return out


def vllm_reference(shape, hf, r, j, vocab_padded):
    """vLLM's TP rank ``j`` of ``r``, cut like its weight loaders cut checkpoint tensors."""
    out = {}
    hd = shape.head_dim

    def vocab(t):
        padded = torch.cat([t, t.new_full((vocab_padded - t.shape[0], t.shape[1]), float("nan"))])
        return padded.chunk(r)[j]

    def heads(t, n_heads, replicate):
        per_head = t.reshape(n_heads, hd, *t.shape[1:])
        if replicate:  # TP > KV heads: each rank holds one head, shared by r // n_heads ranks
            return per_head[j // (r // n_heads)].reshape(hd, *t.shape[1:])
        return per_head.chunk(r)[j].reshape(-1, *t.shape[1:])

    out["model.embed_tokens.weight"] = vocab(hf[weights.HF_EMBED])
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = vocab(hf[weights.HF_LM_HEAD])
    out["model.norm.weight"] = hf[weights.HF_FINAL_NORM]
    rep = r > shape.hf_kv_heads
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        for part in ("weight", "bias") if shape.arch.qkv_bias else ("weight",):
            q = heads(hf[p + f"self_attn.q_proj.{part}"], shape.hf_heads, False)
            k = heads(hf[p + f"self_attn.k_proj.{part}"], shape.hf_kv_heads, rep)
            v = heads(hf[p + f"self_attn.v_proj.{part}"], shape.hf_kv_heads, rep)
            out[p + f"self_attn.qkv_proj.{part}"] = torch.cat([q, k, v])
        out[p + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"].chunk(r, dim=1)[j]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = hf[p + norm + ".weight"]
        if shape.arch.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out[p + f"self_attn.{norm}.weight"] = hf[p + f"self_attn.{norm}.weight"]
        if shape.is_moe:
            out[p + "mlp.gate.weight"] = hf[p + "mlp.gate.weight"]
            e = range(shape.num_experts)
            out[p + L.VLLM_EXPERTS + ".w13_weight"] = torch.stack([torch.cat([
                hf[p + f"mlp.experts.{i}.gate_proj.weight"].chunk(r)[j],
                hf[p + f"mlp.experts.{i}.up_proj.weight"].chunk(r)[j]]) for i in e])
            out[p + L.VLLM_EXPERTS + ".w2_weight"] = torch.stack([
                hf[p + f"mlp.experts.{i}.down_proj.weight"].chunk(r, dim=1)[j] for i in e])
        else:
            out[p + "mlp.gate_up_proj.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"].chunk(r)[j],
                                                            hf[p + "mlp.up_proj.weight"].chunk(r)[j]])
            out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"].chunk(r, dim=1)[j]
    return out


def assert_equal_maps(got, ref, what):
    assert set(got) == set(ref), (what, sorted(set(got) ^ set(ref))[:6])
    for k in ref:
        assert got[k].shape == ref[k].shape, (what, k)
        assert torch.equal(torch.nan_to_num(got[k], nan=7.5), torch.nan_to_num(ref[k].to(got[k].dtype), nan=7.5)), \
            (what, k)


CONFIGS = {
    "qwen3": ("qwen3", {"num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4}),
    "qwen3-gqa1": ("qwen3", {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8}),
    "llama-tied-padded": ("llama-tied", {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48,
                                         "head_dim": 8, "intermediate_size": 96}),
    "qwen2-bias": ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    "moe": ("qwen3_moe", {"num_experts": 4, "moe_intermediate_size": 32}),
}

# (config, trainer tp, pp, dp, cp, ep, vpp, te)
TRAINER = [
    ("qwen3", 1, 1, 1, 1, 1, 1, False),
    ("qwen3", 2, 2, 2, 1, 1, 1, False),
    ("qwen3", 2, 2, 1, 1, 1, 2, True),
    ("qwen3", 1, 1, 2, 2, 1, 1, False),
    ("qwen3-gqa1", 2, 1, 2, 1, 1, 1, False),
    ("llama-tied-padded", 2, 2, 1, 1, 1, 1, False),
    ("qwen2-bias", 2, 1, 2, 1, 1, 1, True),
    ("moe", 2, 1, 2, 1, 2, 1, False),
    ("moe", 1, 2, 2, 1, 2, 1, True),
]


def _setup(name, tp, pp, dp, cp, ep, vpp, te, seed=0):
    family, overrides = CONFIGS[name]
    cfg = tiny_hf_config(family, **overrides)
    shape = megatron_shape(cfg, tp, ep)
    hf = random_hf(shape, seed)
    ranks = trainer_ranks(tp, pp, dp, cp, ep)
    trainer = L.TrainerLayout(shape, te, layer_stages(shape.num_layers, pp, vpp), ranks)
    sources = {r.rank: sources_for(shape, te, r, trainer.layer_stage, hf) for r in ranks}
    return cfg, shape, hf, trainer, sources


def _vllm_tps(shape):
    return [r for r in (1, 2, 3, 4, 8) if shape.hf_heads % r == 0
            and (shape.hf_kv_heads % r == 0 or r % shape.hf_kv_heads == 0)]


@pytest.mark.parametrize("case", TRAINER, ids=lambda c: "-".join(map(str, c)))
def test_colocated_engines_get_exact_weights(case):
    cfg, shape, hf, trainer, sources = _setup(*case)
    world = len(trainer.ranks)
    # the PyTorch engine on every rank
    engines = [L.EngineLayout("hf", "float32")] * world
    prefer = P.preferences(trainer, engines)
    for bucket in (1 << 30, 3000):
        dests, plans = run_plans(trainer, engines, prefer, bucket, sources)
        ref = hf_reference(shape, hf, True)
        if shape.tie_word_embeddings:
            ref.pop(weights.HF_LM_HEAD, None)
        for d in range(world):
            assert_equal_maps(dests[d], {k: v for k, v in ref.items() if k in dests[d]}, ("hf", d))
            assert set(dests[d]) == set(ref) - {f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight" for i in
                                                range(shape.num_layers) for e in range(shape.num_experts)
                                                for p in ("gate", "up", "down")}
        if world == 1:
            assert plans[0].num_rounds == 0  # one rank: everything is local, no collective
    # vLLM at every TP it can run, over the same ranks (replica = rank // r)
    for r in _vllm_tps(shape):
        if world % r:
            continue
        padded = -(-shape.vocab_size // 64) * 64
        engines = [L.EngineLayout("vllm", "float32", tp=r, tp_rank=d % r, vocab_padded=padded, replica=d // r)
                   for d in range(world)]
        dests, plans = run_plans(trainer, engines, P.preferences(trainer, engines), 5000, sources)
        for d in range(world):
            assert_equal_maps(dests[d], vllm_reference(shape, hf, r, d % r, padded), ("vllm", r, d))


def test_rollout_tp_equal_to_training_tp_moves_nothing():
    """Colocated vLLM at the trainer's TP, one pipeline stage: every piece is the rank's own (no collective); the
    fused q/k/v is one strided copy each for q, k and v per layer, not one per query group."""
    cfg, shape, hf, trainer, sources = _setup("qwen3", 2, 1, 2, 1, 1, 1, False)
    engines = [L.EngineLayout("vllm", "float32", tp=2, tp_rank=d % 2, vocab_padded=256, replica=d // 2)
               for d in range(4)]
    dests, plans = run_plans(trainer, engines, P.preferences(trainer, engines), 1 << 20, sources)
    for d, plan in plans.items():
        assert plan.num_rounds == 0 and plan.byte_counts()["sent"] == 0
        qkv = [p for p in plan.local if str(p.dst.key).endswith("qkv_proj.weight")]
        assert len(qkv) == 3 * shape.num_layers, len(qkv)
        assert_equal_maps(dests[d], vllm_reference(shape, hf, 2, d % 2, 256), d)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_separate_engine_ranks_receive_from_every_trainer_rank(dtype):
    """Engine ranks of their own (4..7: two vLLM replicas at TP 2): each gets its shard from the trainer ranks
    that hold it, its layers drawn from both trainer data-parallel replicas in turn, so every trainer rank sends a
    share; no trainer rank receives, no engine rank sends; values exact in the engine's dtype."""
    cfg, shape, hf, trainer, sources = _setup("qwen3", 2, 1, 2, 1, 1, 1, False)
    engines = [None] * 4 + [L.EngineLayout("vllm", dtype, tp=2, tp_rank=e % 2, vocab_padded=256, replica=e // 2)
                            for e in range(4)]
    dests, plans = run_plans(trainer, engines, P.preferences(trainer, engines), 4000, sources)
    for e in range(4, 8):
        ref = vllm_reference(shape, hf, 2, e % 2, 256)
        assert_equal_maps(dests[e], {k: v.to(TORCH_DTYPES[dtype]) for k, v in ref.items()}, e)
        assert plans[e].byte_counts()["sent"] == 0 and not plans[e].local
        senders = {s for rd in plans[e].rounds for s in rd.recvs}
        assert {trainer.ranks[s].dp for s in senders} == {0, 1}, (e, senders)
    sent = [plans[t].byte_counts()["sent"] for t in range(4)]
    for t in range(4):
        assert plans[t].byte_counts()["received"] == 0
    assert min(sent) > 0.6 * max(sent), sent  # the trainer ranks share the sending


def test_rounds_stay_within_one_bucket_and_every_rank_makes_the_same_calls():
    cfg, shape, hf, trainer, sources = _setup("moe", 1, 2, 2, 1, 2, 1, False)
    engines = [L.EngineLayout("hf", "float32")] * len(trainer.ranks)
    bucket = 4096
    dests, plans = run_plans(trainer, engines, P.preferences(trainer, engines), bucket, sources)
    counts = {p.num_rounds for p in plans.values()}
    assert len(counts) == 1 and counts.pop() > 4
    biggest_row = shape.hidden_size * 4  # a piece is cut along its outer dimension, never below one row
    for plan in plans.values():
        assert plan.max_send_bytes <= bucket + P.ALIGN * plan.fanout + biggest_row
        assert plan.max_recv_bytes <= bucket + P.ALIGN * plan.fanout + biggest_row


def test_views_and_merging():
    v = contiguous_view("t", (4, 6))
    sub = v.sub(((0, 4), (0, 6)), ((1, 3), (2, 5)))
    t = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(t.as_strided(sub.shape, sub.stride, sub.offset), t[1:3, 2:5])
    # three row blocks with constant steps merge into one 3-d view; contiguous steps fuse back to 2-d
    pieces = [P.Piece(0, 1, View("s", (2, 6), (6, 1), 18 * g), View("d", (2, 6), (6, 1), 12 * g), "float32")
              for g in range(3)]
    (m,) = P.merge_runs(pieces)
    assert m.src.shape == m.dst.shape == (3, 12) and m.src.stride == (18, 1) and m.dst.stride == (12, 1)
    src, dst = torch.arange(54.0), torch.zeros(36)
    dst.as_strided(m.dst.shape, m.dst.stride, m.dst.offset).copy_(src.as_strided(m.src.shape, m.src.stride))
    assert torch.equal(dst.view(3, 12), src.view(3, 18)[:, :12])
    # a piece over budget is cut along its outer dimension
    parts = P.split_piece(m, 13)
    assert [p.src.shape for p in parts] == [(1, 12)] * 3

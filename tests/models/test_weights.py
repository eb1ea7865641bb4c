"""Pure HF <-> Megatron mapping: exact round trips and the grouped QKV layout, no process groups."""

import pytest
import torch

from mcpo_megatron.models import weights
from mcpo_megatron.models.registry import megatron_shape
from mcpo_megatron.models.tiny import tiny_hf_config


def random_hf_tensors(shape, gen):
    out = {}
    for rule in weights.param_rules(shape):
        for name, full in zip(rule.hf, weights.hf_tensor_shapes(shape, rule)):
            out[name] = torch.randn(full, generator=gen, dtype=torch.float64)
    return out


CASES = [
    ("qwen3", {}, 1), ("qwen3", {}, 2),
    ("qwen2", {}, 2), ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2}, 2),
    ("llama-tied", {}, 2), ("llama", {}, 2),
    # query groups padded for TP: 3 groups at TP=2, 1 group at TP=2, 3 groups at TP=4
    ("qwen3", {"num_attention_heads": 6, "num_key_value_heads": 3}, 2),
    ("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 1}, 2),
    ("llama-tied", {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 72,
                    "head_dim": 8}, 4),
    ("qwen3_moe", {}, 1), ("qwen3_moe", {}, 2),
]


@pytest.mark.parametrize("family,overrides,tp", CASES)
def test_round_trip_exact(family, overrides, tp):
    shape = megatron_shape(tiny_hf_config(family, **overrides), tp)
    hf = random_hf_tensors(shape, torch.Generator().manual_seed(0))
    rules = weights.param_rules(shape)
    back = {}
    for rule in rules:
        shards = [weights.hf_to_megatron_shard(rule, hf, shape, r) for r in range(tp)]
        for s in shards:
            assert tuple(s.shape) == weights.megatron_shard_shape(shape, rule), rule.mcore
        back.update(weights.megatron_shards_to_hf(rule, shards, shape))
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize("family,overrides,tp", CASES)
def test_slice_reader_matches_full_tensors(family, overrides, tp):
    """A loader reading only row/column ranges gets the same shards as slicing full tensors."""
    shape = megatron_shape(tiny_hf_config(family, **overrides), tp)
    hf = random_hf_tensors(shape, torch.Generator().manual_seed(1))
    reads = []

    def reader(name, dim, start, stop):
        reads.append((name, dim, start, stop))
        return hf[name].narrow(dim, start, stop - start)

    for rule in weights.param_rules(shape):
        for r in range(tp):
            assert torch.equal(weights.hf_to_megatron_shard(rule, reader, shape, r),
                               weights.hf_to_megatron_shard(rule, hf, shape, r))
    assert all(stop > start for _, _, start, stop in reads)


def reference_qkv_rows(q, k, v, n_heads, n_kv, hd, tp):
    """Megatron's fused QKV written head by head: for each group g, its q heads, then k_g, then v_g;
    groups are padded with zeros to a multiple of tp and split over ranks in order."""
    per_group = n_heads // n_kv
    groups = -(-n_kv // tp) * tp
    rows = []
    for g in range(groups):
        if g < n_kv:
            for j in range(per_group):
                h = g * per_group + j
                rows.append(q[h * hd:(h + 1) * hd])
            rows.append(k[g * hd:(g + 1) * hd])
            rows.append(v[g * hd:(g + 1) * hd])
        else:
            rows.append(torch.zeros((per_group + 2) * hd, *q.shape[1:], dtype=q.dtype))
    full = torch.cat(rows)
    return list(full.chunk(tp))


@pytest.mark.parametrize("n_heads,n_kv,tp", [(4, 2, 1), (4, 2, 2), (8, 2, 2), (6, 3, 2), (4, 1, 2), (9, 3, 4)])
def test_qkv_layout_against_head_by_head_reference(n_heads, n_kv, tp):
    hd = 8
    cfg = tiny_hf_config("qwen2", num_attention_heads=n_heads, num_key_value_heads=n_kv,
                         hidden_size=n_heads * hd)
    shape = megatron_shape(cfg, tp)
    gen = torch.Generator().manual_seed(2)
    rule = next(r for r in weights.param_rules(shape) if r.mcore.endswith("linear_qkv.weight"))
    bias_rule = next(r for r in weights.param_rules(shape) if r.mcore.endswith("linear_qkv.bias"))
    for rl, tail in ((rule, (shape.hidden_size,)), (bias_rule, ())):
        q = torch.randn(n_heads * hd, *tail, generator=gen)
        k = torch.randn(n_kv * hd, *tail, generator=gen)
        v = torch.randn(n_kv * hd, *tail, generator=gen)
        tensors = dict(zip(rl.hf, (q, k, v)))
        expected = reference_qkv_rows(q, k, v, n_heads, n_kv, hd, tp)
        for r in range(tp):
            assert torch.equal(weights.hf_to_megatron_shard(rl, tensors, shape, r), expected[r])


def test_gate_up_and_row_parallel_layouts():
    shape = megatron_shape(tiny_hf_config("llama"), 2)
    gen = torch.Generator().manual_seed(3)
    rules = {r.mcore: r for r in weights.param_rules(shape, layers=[0])}
    gate = torch.randn(128, 64, generator=gen)
    up = torch.randn(128, 64, generator=gen)
    fc1 = rules["decoder.layers.{layer}.mlp.linear_fc1.weight"]
    tensors = dict(zip(fc1.hf, (gate, up)))
    shard1 = weights.hf_to_megatron_shard(fc1, tensors, shape, 1)
    assert torch.equal(shard1, torch.cat([gate[64:], up[64:]]))
    down = torch.randn(64, 128, generator=gen)
    fc2 = rules["decoder.layers.{layer}.mlp.linear_fc2.weight"]
    assert torch.equal(weights.hf_to_megatron_shard(fc2, {fc2.hf[0]: down}, shape, 1), down[:, 64:])


def test_padded_o_proj_columns_are_zero():
    shape = megatron_shape(tiny_hf_config("qwen3", num_attention_heads=6, num_key_value_heads=3), 2)
    assert (shape.num_query_groups, shape.num_attention_heads) == (4, 8)
    rule = next(r for r in weights.param_rules(shape) if r.mcore.endswith("linear_proj.weight"))
    o = torch.randn(64, 6 * 16)
    s0 = weights.hf_to_megatron_shard(rule, {rule.hf[0]: o}, shape, 0)
    s1 = weights.hf_to_megatron_shard(rule, {rule.hf[0]: o}, shape, 1)
    assert torch.equal(s0, o[:, :64])
    assert torch.equal(s1[:, :32], o[:, 64:]) and torch.count_nonzero(s1[:, 32:]) == 0


def test_te_norm_names_and_tied_output():
    shape = megatron_shape(tiny_hf_config("llama-tied"), 1)
    names = [r.mcore_name() for r in weights.param_rules(shape, te=True)]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)
    assert "output_layer.weight" not in names
    untied = megatron_shape(tiny_hf_config("qwen3"), 1)
    assert "output_layer.weight" in [r.mcore for r in weights.param_rules(untied)]


def test_stage_selection_uses_local_layer_names():
    shape = megatron_shape(tiny_hf_config("qwen3"), 1)
    rules = weights.param_rules(shape, layers=range(2, 4), pre_process=False, post_process=True)
    assert rules[0].layer == 2 and rules[0].mcore_name(layer_offset=2).startswith("decoder.layers.0.")
    assert rules[0].hf[0].startswith("model.layers.2.")
    assert rules[-1].mcore == "output_layer.weight"
    assert not any(r.mcore.startswith("embedding") for r in rules)


def test_moe_rules_names_and_expert_parallel_split():
    """Router and per-expert HF names; EP rank r holds experts [r*E/EP, (r+1)*E/EP) under local indices."""
    shape = megatron_shape(tiny_hf_config("qwen3_moe"), 2, 2)
    rules = weights.layer_rules(shape, 1)
    by_hf = {r.hf[0]: r for r in rules}
    router = by_hf["model.layers.1.mlp.gate.weight"]
    assert router.kind == "copy" and router.mcore_name(0) == "decoder.layers.1.mlp.router.weight"
    assert weights.hf_tensor_shapes(shape, router) == [(4, 64)]
    fc1 = by_hf["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert fc1.hf[1] == "model.layers.1.mlp.experts.3.up_proj.weight" and fc1.expert == 3
    # expert 3 is local expert 1 on EP rank 1; layer 1 is local layer 0 on a stage starting at layer 1
    assert fc1.mcore_name(1, 2) == "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    te = {r.hf[0]: r for r in weights.layer_rules(shape, 1, te=True)}
    assert te["model.layers.1.mlp.experts.3.down_proj.weight"].mcore_name(1, 2) == \
        "decoder.layers.0.mlp.experts.linear_fc2.weight1"
    assert te["model.layers.1.post_attention_layernorm.weight"].mcore == "decoder.layers.{layer}.pre_mlp_layernorm.weight"
    assert weights.megatron_shard_shape(shape, fc1) == (2 * 32 // 2, 64)  # [gate; up] of width 32 over TP=2
    assert list(weights.local_experts(shape, 1)) == [2, 3]
    local = weights.param_rules(shape, experts=weights.local_experts(shape, 1))
    assert {r.expert for r in local if r.expert is not None} == {2, 3}
    hf_names = weights.hf_names(megatron_shape(tiny_hf_config("qwen3_moe")))
    assert len(hf_names) == 2 + 4 * (1 + 4 + 2 + 1 + 1 + 4 * 3) + 1  # embed, lm_head; per layer; final norm

"""Qwen3.5's hybrid decoder in the registry and the weight rules, without megatron: every rule's TP shards
against the HF tensors both ways (the loader's and the exporter's functions, and the HF stream's strided views),
and the refusals that name the field.  The megatron model itself is checked against transformers in
test_hybrid_parity_mp.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from mcpo_megatron.models import shard_views, weights
from mcpo_megatron.models.registry import UnsupportedModelError, megatron_shape
from mcpo_megatron.models.tiny import tiny_hf_config

CASES = {
    "qwen3_5": {},
    # 3 query groups at TP=2 (one zero group padded in, gates included), GDN key/value ratio 3, wide conv
    "3groups-ratio3": dict(num_attention_heads=6, num_key_value_heads=3, linear_num_key_heads=2,
                           linear_num_value_heads=6, linear_key_head_dim=5, linear_value_head_dim=7,
                           linear_conv_kernel_dim=5, layer_types=["full_attention", "linear_attention"] * 2),
}


def _view_of(shards, owner, view):
    return shards[owner.tp or 0].contiguous().as_strided(view.shape, view.stride, view.offset)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_every_rule_round_trips_through_its_shards_and_views(case, tp):
    cfg = tiny_hf_config("qwen3_5", **CASES[case])
    torch.manual_seed(0)
    hf = {k: v.detach() for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    shape, rules = weights.rules_for(cfg, tp=tp)
    assert sorted(n for r in rules for n in r.hf) == sorted(hf)  # every HF tensor has exactly one rule
    kinds = {r.kind for r in rules}
    assert {"qkv_gated", "gdn_in", "gdn_conv", "gdn_heads"} <= kinds and "qkv" not in kinds
    for rule in rules:
        shards = [weights.hf_to_megatron_shard(rule, hf, shape, t) for t in range(tp)]
        assert all(tuple(s.shape) == weights.megatron_shard_shape(shape, rule) for s in shards), rule.mcore
        for name, tensor in weights.megatron_shards_to_hf(rule, shards, shape).items():
            assert torch.equal(tensor, hf[name]), (rule.mcore, name)
        for i, name in enumerate(rule.hf):
            rebuilt = torch.full_like(hf[name], float("nan"))
            for owner, view, part in shard_views.megatron_sources(shape, rule, i, 0,
                                                                  shard_views.rect_of(hf[name].shape)):
                rebuilt[tuple(slice(a, b) for a, b in part)] = _view_of(shards, owner, view)
            assert torch.equal(rebuilt, hf[name]), (rule.mcore, name)


def test_gated_query_rows_and_gdn_sections_land_where_megatron_reads_them():
    """One TP=2 rank's shards read by hand in megatron's layout (attention.py get_query_key_value_tensors with
    output_gate; gated_delta_net.py's in_proj split): group g's [q heads; gate heads; k; v], and each
    [q | k | v | z | beta | alpha] section's half."""
    cfg = tiny_hf_config("qwen3_5")
    shape, rules = weights.rules_for(cfg, tp=2)
    torch.manual_seed(1)
    hf = {k: v.detach() for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    by_kind = {r.kind: r for r in rules if r.layer in (2, 0)}
    hd, hpg = shape.head_dim, shape.heads_per_group  # 16, 2: rank 1 holds group 1 (heads 2 and 3)
    qkv = weights.hf_to_megatron_shard(by_kind["qkv_gated"], hf, shape, 1)
    q_proj = hf["model.layers.2.self_attn.q_proj.weight"].view(4, 2, hd, -1)  # [head, (query, gate), hd, h]
    assert torch.equal(qkv[:hd], q_proj[2, 0]) and torch.equal(qkv[hd:2 * hd], q_proj[3, 0])
    assert torch.equal(qkv[2 * hd:3 * hd], q_proj[2, 1]) and torch.equal(qkv[3 * hd:4 * hd], q_proj[3, 1])
    assert torch.equal(qkv[4 * hpg * hd // 2:], torch.cat([hf[f"model.layers.2.self_attn.{p}_proj.weight"][hd:]
                                                           for p in "kv"]))
    g = shape.gdn  # 2 key heads of 8, 4 value heads of 6: rank 1 holds key head 1, value heads 2 and 3
    in_proj = weights.hf_to_megatron_shard(by_kind["gdn_in"], hf, shape, 1)
    qkv_in = hf["model.layers.0.linear_attn.in_proj_qkv.weight"]
    want = torch.cat([qkv_in[8:16], qkv_in[16 + 8:32], qkv_in[32 + 12:56],
                      hf["model.layers.0.linear_attn.in_proj_z.weight"][12:],
                      hf["model.layers.0.linear_attn.in_proj_b.weight"][2:],
                      hf["model.layers.0.linear_attn.in_proj_a.weight"][2:]])
    assert (g.qk_dim, g.v_dim) == (16, 24) and torch.equal(in_proj, want)


@pytest.mark.parametrize("overrides, tp, match", [
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"]), 1,
     r"layer_types=\['sliding_attention'\]; each layer must be 'linear_attention' or 'full_attention'"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=6), 2,
     "linear_num_key_heads=3; must be divisible by the tensor-parallel size 2"),
    (dict(linear_num_key_heads=2, linear_num_value_heads=3), 1,
     "linear_num_value_heads=3; must be a multiple of linear_num_key_heads=2"),
    (dict(linear_conv_kernel_dim=0), 1, "linear_conv_kernel_dim=0; must be a positive integer"),
], ids=["layer-kind", "key-heads-tp", "value-key-ratio", "conv"])
def test_what_the_mapping_cannot_build_is_refused_naming_the_field(overrides, tp, match):
    with pytest.raises(UnsupportedModelError, match=match):
        megatron_shape(tiny_hf_config("qwen3_5", **overrides), tp=tp)


def test_shape_carries_the_pattern_and_the_rotated_fraction_and_other_families_still_refuse_partial_rope():
    shape = megatron_shape(tiny_hf_config("qwen3_5", partial_rotary_factor=0.5), tp=2)
    assert [shape.is_linear_attention(i) for i in range(4)] == [True, True, False, True]
    assert shape.rotary_percent == 0.5 and shape.gdn.num_value_heads == 4
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.5; must be 1.0"):
        megatron_shape(tiny_hf_config("qwen3", partial_rotary_factor=0.5))
    with pytest.raises(NotImplementedError, match="set model.transformer_impl=local"):
        weights.param_rules(shape, te=True)


def test_multi_token_prediction_tensors_are_the_ones_left_out():
    shape = megatron_shape(tiny_hf_config("qwen3_5"))
    names = weights.hf_names(shape) + ["mtp.fc.weight", "mtp.layers.0.mlp.gate_proj.weight", "mtp.norm.weight"]
    assert weights.dropped_mtp_tensors(shape, names) == ["mtp.fc.weight", "mtp.layers.0.mlp.gate_proj.weight",
                                                         "mtp.norm.weight"]
    assert weights.dropped_mtp_tensors(shape, weights.hf_names(shape)) == []

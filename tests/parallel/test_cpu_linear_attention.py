"""The CPU references of megatron's Gated DeltaNet kernels and the HF -> megatron GDN weight mapping.

Kernels (in this process: plain torch, no shim): float64 against transformers' Qwen3-Next fallbacks (chunked and
recurrent gated delta rule, l2norm, causal conv) and against the recurrence written out step by step here; varlen
``cu_seqlens`` against each sequence alone; autograd checked by gradcheck.  The megatron layer (a subprocess: the
CPU shim patches torch process-wide): megatron-core's GatedDeltaNet with the references installed, weights mapped
from transformers' Qwen3-Next and Qwen3.5 layers, forward and backward in float64.
"""

from pathlib import Path

import pytest
import torch

from float64_only import keep_float64
from mcpo_megatron.models.hybrid_weights import GDNDims, gdn_from_hf, in_proj_sections
from mcpo_megatron.parallel.cpu_linear_attention import causal_conv1d, chunk_gated_delta_rule, l2norm
from mcpo_megatron.parallel.mcore_compat import installed_version
from mp import run_json_worker

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

F64 = torch.float64


def inputs(batch, seq, heads, dk, dv, seed=0, states=None):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, seq, heads, dk, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(batch, seq, heads, dv, generator=g, dtype=F64)
    decay = -torch.rand(batch, seq, heads, generator=g, dtype=F64) * 0.7  # log decay <= 0
    beta = torch.rand(batch, seq, heads, generator=g, dtype=F64)
    h0 = torch.randn(states or batch, heads, dk, dv, generator=g, dtype=F64)
    return q, k, v, decay, beta, h0


def stepwise(q, k, v, decay, beta, h0, scale):
    """The gated delta rule one token at a time, in the paper's form with S [V, K] (one sequence: [T, H, ...])."""
    S = h0.transpose(-1, -2).clone()  # [H, V, K]
    eye = torch.eye(k.shape[-1], dtype=F64)
    out = []
    for t in range(q.shape[0]):
        kt, vt, bt = k[t], v[t], beta[t][:, None, None]
        S = S * decay[t].exp()[:, None, None] @ (eye - bt * kt[:, :, None] * kt[:, None, :]) \
            + bt * vt[:, :, None] * kt[:, None, :]
        out.append((S @ q[t][:, :, None]).squeeze(-1) * scale)
    return torch.stack(out), S.transpose(-1, -2)


@pytest.mark.parametrize("seq", [1, 63, 64, 65, 131])
def test_chunked_rule_matches_transformers_fallbacks(seq):
    q, k, v, decay, beta, h0 = inputs(2, seq, 3, 5, 7, seed=seq)
    ours, state = chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
    with keep_float64():  # transformers' fallbacks cast to float32 inside
        chunked, chunked_state = hf.torch_chunk_gated_delta_rule(
            q, k, v, decay, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        recurrent, recurrent_state = hf.torch_recurrent_gated_delta_rule(
            q, k, v, decay, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert ours.dtype == state.dtype == F64 and ours.shape == (2, seq, 3, 7) and state.shape == (2, 3, 5, 7)
    for ref, ref_state in ((chunked, chunked_state), (recurrent, recurrent_state)):
        assert (ours - ref).abs().max() < 1e-12
        assert (state - ref_state).abs().max() < 1e-12


def test_chunked_rule_matches_the_stepwise_recurrence():
    # Chunks of 4 over 11 steps (a partial last chunk), an explicit scale, q and k not normalised.
    q, k, v, decay, beta, h0 = inputs(1, 11, 2, 3, 5, seed=3)
    k = l2norm(k)  # keep (I - beta k k^T) a contraction, as the layers do
    ours, state = chunk_gated_delta_rule(q, k, v, decay, beta, scale=0.3, initial_state=h0,
                                         output_final_state=True, chunk_size=4)
    ref, ref_state = stepwise(q[0], k[0], v[0], decay[0], beta[0], h0[0], 0.3)
    assert (ours[0] - ref).abs().max() < 1e-13
    assert (state[0] - ref_state).abs().max() < 1e-13
    no_state, none = chunk_gated_delta_rule(q, k, v, decay, beta, scale=0.3, chunk_size=4)
    ref_zero, _ = stepwise(q[0], k[0], v[0], decay[0], beta[0], torch.zeros_like(h0[0]), 0.3)
    assert none is None and (no_state[0] - ref_zero).abs().max() < 1e-13


def test_varlen_runs_each_sequence_from_its_own_state():
    lengths = [5, 64, 1, 67]
    cu = torch.tensor([0, 5, 69, 70, 137])
    q, k, v, decay, beta, h0 = inputs(1, sum(lengths), 2, 6, 3, seed=5, states=len(lengths))
    packed, states = chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    assert packed.shape == (1, sum(lengths), 2, 3) and states.shape == (4, 2, 6, 3)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone, state = chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], decay[:, a:b], beta[:, a:b],
                                              initial_state=h0[i:i + 1], output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
        ref, ref_state = stepwise(l2norm(q[0, a:b]), l2norm(k[0, a:b]), v[0, a:b], decay[0, a:b], beta[0, a:b],
                                  h0[i], 6 ** -0.5)
        assert torch.equal(packed[:, a:b], alone) and torch.equal(states[i], state[0])
        assert (alone[0] - ref).abs().max() < 1e-12 and (state[0] - ref_state).abs().max() < 1e-12


def test_l2norm_and_low_precision_inputs():
    x = torch.randn(4, 3, 9, dtype=F64)
    assert (l2norm(x) - hf.l2norm(x)).abs().max() < 1e-15
    assert l2norm(x.to(torch.bfloat16)).dtype == torch.bfloat16
    assert l2norm(x, output_dtype=torch.float32).dtype == torch.float32
    # bf16 in, bf16 out, computed in float32 like the Triton kernels; the state comes back in float32.
    q, k, v, decay, beta, _ = (t.to(torch.bfloat16) for t in inputs(1, 20, 2, 4, 4, seed=9))
    out, state = chunk_gated_delta_rule(q, k, v, decay, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref, _ = chunk_gated_delta_rule(*(t.double() for t in (q, k, v, decay, beta)), use_qk_l2norm_in_kernel=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert (out.double() - ref).abs().max() < 2e-2


def test_gradcheck():
    q, k, v, decay, beta, h0 = (t.requires_grad_() for t in inputs(1, 5, 1, 3, 2, seed=11))

    def rule(q, k, v, decay, beta, h0):  # chunks of 2: gradients cross chunk boundaries and the padded tail
        out, state = chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, chunk_size=2)
        return out, state

    assert torch.autograd.gradcheck(rule, (q, k, v, decay, beta, h0))
    x = torch.randn(1, 6, 3, dtype=F64, requires_grad=True)
    w = torch.randn(3, 3, dtype=F64, requires_grad=True)
    b = torch.randn(3, dtype=F64, requires_grad=True)
    cu = torch.tensor([0, 2, 6])
    assert torch.autograd.gradcheck(lambda x, w, b: causal_conv1d(x, w, b, activation="silu", cu_seqlens=cu)[0],
                                    (x, w, b))
    assert torch.autograd.gradcheck(l2norm, (torch.randn(2, 5, dtype=F64, requires_grad=True),))


def test_causal_conv1d_matches_transformers_and_restarts_per_sequence():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, 13, 7, generator=gen, dtype=F64)
    w, b = torch.randn(7, 4, generator=gen, dtype=F64), torch.randn(7, generator=gen, dtype=F64)
    ours, state = causal_conv1d(x, w, b, activation="silu")
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), w, b, activation="silu").transpose(1, 2)
    assert state is None and (ours - ref).abs().max() < 1e-14
    assert (causal_conv1d(x, w)[0] - hf.causal_conv1d_fn(x.transpose(1, 2), w).transpose(1, 2)).abs().max() < 1e-14
    # The decode-time update (one token through a rolling state) reproduces the same outputs token by token.
    conv_state = torch.zeros(2, 7, 4, dtype=F64)
    steps = [hf.causal_conv1d_update(x[:, t:t + 1].transpose(1, 2), conv_state, w, b, "silu") for t in range(13)]
    assert (torch.cat(steps, dim=-1).transpose(1, 2) - ours).abs().max() < 1e-14
    cu = torch.tensor([0, 3, 13])
    packed, _ = causal_conv1d(x[:1], w, b, activation="silu", cu_seqlens=cu)
    for a, c in ((0, 3), (3, 13)):  # equal up to the vectorised silu's rounding, which depends on the length
        assert (packed[:, a:c] - causal_conv1d(x[:1, a:c], w, b, activation="silu")[0]).abs().max() < 1e-15


def test_kernel_refusals():
    q, k, v, decay, beta, h0 = inputs(2, 4, 2, 3, 3)
    with pytest.raises(ValueError, match="heads must equal v heads"):
        chunk_gated_delta_rule(q[:, :, :1], k[:, :, :1], v, decay, beta)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_gated_delta_rule(q, k, v, decay, beta, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=h0[:1])
    with pytest.raises(ValueError, match="head_first"):
        chunk_gated_delta_rule(q, k, v, decay, beta, head_first=True)
    with pytest.raises(NotImplementedError, match="initial_state"):
        causal_conv1d(q[..., 0], torch.ones(2, 3, dtype=F64), initial_state=torch.zeros(2, 2, 3))


DIMS = GDNDims(hidden_size=3, num_key_heads=2, num_value_heads=6, key_head_dim=2, value_head_dim=1, conv_kernel=2)


def labelled(rows):
    """A weight whose row i is (i, i, i): the mapping's row order reads off its first column."""
    return torch.arange(rows, dtype=F64)[:, None].expand(rows, DIMS.hidden_size).clone()


def common(d=DIMS):
    return {"conv1d.weight": torch.zeros(2 * d.qk_dim + d.v_dim, 1, d.conv_kernel), "A_log": torch.zeros(6),
            "dt_bias": torch.zeros(6), "norm.weight": torch.full((1,), 1.25), "out_proj.weight": torch.zeros(3, 6)}


def test_qwen3_next_fused_projections_are_deinterleaved():
    # Per key head g: [q_g (2) | k_g (2) | v_g (3 heads x 1) | z_g (3)] = 10 rows; ba: [b_g (3) | a_g (3)].
    mapped = gdn_from_hf({"in_proj_qkvz.weight": labelled(20), "in_proj_ba.weight": labelled(12), **common()},
                         DIMS, zero_centered_gamma=True)
    rows = mapped["in_proj.weight"][:, 0].long().tolist()
    assert in_proj_sections(DIMS) == [4, 4, 6, 6, 6, 6]
    assert rows == [0, 1, 10, 11,  2, 3, 12, 13,  4, 5, 6, 14, 15, 16,  7, 8, 9, 17, 18, 19,
                    0, 1, 2, 6, 7, 8,  3, 4, 5, 9, 10, 11]
    assert float(mapped["out_norm.weight"]) == 0.25  # zero-centred gamma stores weight - 1
    assert float(gdn_from_hf({"in_proj_qkvz.weight": labelled(20), "in_proj_ba.weight": labelled(12), **common()},
                             DIMS, zero_centered_gamma=False)["out_norm.weight"]) == 1.25


def test_qwen3_5_split_projections_are_concatenated():
    hf_state = {"in_proj_qkv.weight": labelled(14), "in_proj_z.weight": labelled(6) + 100,
                "in_proj_b.weight": labelled(6) + 200, "in_proj_a.weight": labelled(6) + 300, **common()}
    rows = gdn_from_hf(hf_state, DIMS, zero_centered_gamma=False)["in_proj.weight"][:, 0].long().tolist()
    assert rows == list(range(14)) + [100 + i for i in range(6)] + [200 + i for i in range(6)] + \
        [300 + i for i in range(6)]


def test_mapping_refusals():
    split = {"in_proj_qkv.weight": labelled(14), "in_proj_z.weight": labelled(6), "in_proj_b.weight": labelled(6),
             "in_proj_a.weight": labelled(6), **common()}
    with pytest.raises(ValueError, match=r"no megatron GatedDeltaNet tensor for \['in_proj_z.bias'\]"):
        gdn_from_hf({**split, "in_proj_z.bias": torch.zeros(6)}, DIMS, zero_centered_gamma=False)
    with pytest.raises(ValueError, match="mix the Qwen3-Next fused projections"):
        gdn_from_hf({**split, "in_proj_ba.weight": labelled(12)}, DIMS, zero_centered_gamma=False)
    with pytest.raises(ValueError, match=r"missing \['A_log'\]"):
        gdn_from_hf({k: v for k, v in split.items() if k != "A_log"}, DIMS, zero_centered_gamma=False)
    with pytest.raises(ValueError, match=r"in_proj_z.weight: shape \(5, 3\), expected \(6, 3\)"):
        gdn_from_hf({**split, "in_proj_z.weight": labelled(5)}, DIMS, zero_centered_gamma=False)
    with pytest.raises(ValueError, match="not a multiple of linear_num_key_heads=4"):
        GDNDims(hidden_size=3, num_key_heads=4, num_value_heads=6, key_head_dim=2, value_head_dim=1, conv_kernel=2)


@pytest.fixture(scope="module")
def megatron_gdn(tmp_path_factory):
    return run_json_worker(Path(__file__).parent / "workers" / "worker_gdn_layer.py",
                           tmp_path_factory.mktemp("gdn") / "gdn.json", timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU references are installed only without CUDA")
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_megatron_gdn_layer_matches_transformers(megatron_gdn, family):
    result = megatron_gdn[family]
    assert result["output_scale"] > 0.1  # a non-trivial output
    assert result["output"] < 1e-13
    assert result["input_grad"] < 1e-12
    assert set(result["param_grads"]) == {"in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "out_norm.weight",
                                          "out_proj.weight"}
    assert max(result["param_grads"].values()) < 1e-12
    if installed_version().startswith("0.16."):
        # megatron/core/ssm/gated_delta_net.py (0.16.1): forward raises on packed_seq_params.
        assert result["packed"] == {"refused": "GDN does not support packed sequence for now."}
    else:
        assert result["packed"]["max_diff"] < 1e-13  # 0.19: cu_seqlens reach the conv and the delta rule

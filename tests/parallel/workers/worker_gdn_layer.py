"""Worker (a world of one, started as a plain process): megatron-core's GatedDeltaNet on the CPU against transformers.

Usage: worker_gdn_layer.py OUT_JSON.  Runs in its own process because the CPU shim patches torch process-wide.
For a tiny random Qwen3-Next and Qwen3.5 Gated DeltaNet (transformers' modules, their plain-torch fallbacks), the
megatron layer is built with local (non-TE) submodules at TP=1, its weights mapped by
``models.hybrid_weights.gdn_from_hf``; both run the same float64 input forward and backward.  Writes the max |diff|
of the outputs, the input gradients and every parameter gradient (HF gradients mapped like the weights), and, on a
release whose GDN takes packed (THD) sequences, the packed forward against each sequence run alone; on one that
refuses them, the refusal's message.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: float64_only

from float64_only import keep_float64  # noqa: E402

# Head counts / sizes no other test uses: a key/value head ratio of 3 with odd sizes, and ratio 1 with a wide conv.
CASES = {
    "qwen3_next": dict(hidden_size=22, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=5,
                       linear_value_head_dim=3, linear_conv_kernel_dim=3),
    "qwen3_5": dict(hidden_size=18, linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=7,
                    linear_value_head_dim=4, linear_conv_kernel_dim=5),
}
SEQ, BATCH = 70, 2  # past one 64-step chunk, not a multiple of it
EPS = 1e-6
PACKED = (29, 67, 9)  # packed sequence lengths: one crosses a chunk boundary


def hf_layer(family: str, dims: dict):
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as Layer

        config = Qwen3NextConfig(num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=EPS,
                                 hidden_act="silu", **dims)
    else:
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as Layer

        config = Qwen3_5TextConfig(num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=EPS,
                                   hidden_act="silu", **dims)
    layer = Layer(config, layer_idx=0).double()
    with torch.no_grad():  # the norm and dt_bias start at ones: make every tensor matter
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.uniform_(-1.0, 1.0)
    return config, layer


def megatron_layer(dims: dict):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = TransformerConfig(
        num_layers=1, hidden_size=dims["hidden_size"], num_attention_heads=1, params_dtype=torch.float64,
        use_cpu_initialization=True, normalization="RMSNorm", layernorm_epsilon=EPS, add_bias_linear=False,
        gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, activation_func=F.silu,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1],
        linear_conv_kernel_dim=dims["linear_conv_kernel_dim"],
        linear_key_head_dim=dims["linear_key_head_dim"], linear_value_head_dim=dims["linear_value_head_dim"],
        linear_num_key_heads=dims["linear_num_key_heads"], linear_num_value_heads=dims["linear_num_value_heads"],
    )
    submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                         out_proj=RowParallelLinear)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    layer = GatedDeltaNet(cfg, submodules, layer_number=1, pg_collection=pg)
    return layer.double()  # WrappedTorchNorm builds its weight in the default dtype, not params_dtype


def max_diff(a, b) -> float:
    return float((a - b).detach().abs().max())


def compare(family: str) -> dict:
    from mcpo_megatron.models.hybrid_weights import GDNDims, gdn_from_hf

    dims = CASES[family]
    torch.manual_seed(7)
    config, hf = hf_layer(family, dims)
    gdims = GDNDims.from_hf_config(config)
    mg = megatron_layer(dims)
    hf_state = {k: v.detach() for k, v in hf.state_dict().items()}
    mapped = gdn_from_hf(hf_state, gdims, zero_centered_gamma=False)
    params = dict(mg.named_parameters())
    assert set(mapped) == set(params), (sorted(mapped), sorted(params))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(mapped[name])

    x = torch.randn(BATCH, SEQ, dims["hidden_size"], dtype=torch.float64)
    cotangent = torch.randn(BATCH, SEQ, dims["hidden_size"], dtype=torch.float64)
    x_hf, x_mg = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    with keep_float64():
        out_hf = hf(x_hf)
        out_mg, bias = mg(x_mg, attention_mask=None)
        (out_hf * cotangent).sum().backward()
        (out_mg * cotangent.transpose(0, 1)).sum().backward()
    assert bias is None and out_mg.dtype == torch.float64
    hf_grads = gdn_from_hf({k: p.grad for k, p in hf.named_parameters()}, gdims, zero_centered_gamma=False)
    result = {
        "output": max_diff(out_mg.transpose(0, 1), out_hf),
        "output_scale": float(out_hf.detach().abs().max()),
        "input_grad": max_diff(x_mg.grad.transpose(0, 1), x_hf.grad),
        "param_grads": {k: max_diff(p.grad, hf_grads[k]) for k, p in mg.named_parameters()},
    }
    result["packed"] = packed(mg, hf, dims)
    return result


def packed(mg, hf, dims) -> dict:
    """The GDN's packed (THD) path: megatron 0.19 takes it (cu_seqlens reach the kernels), 0.16.1 refuses it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(PACKED).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(PACKED),
                             max_seqlen_kv=max(PACKED))
    x = torch.randn(sum(PACKED), 1, dims["hidden_size"], dtype=torch.float64)
    with torch.no_grad(), keep_float64():
        try:
            out, _ = mg(x, attention_mask=None, packed_seq_params=params)
        except NotImplementedError as exc:
            return {"refused": str(exc)}
        alone = torch.cat([hf(x[a:b].transpose(0, 1)).transpose(0, 1) for a, b in zip(cu[:-1], cu[1:])])
    return {"max_diff": max_diff(out, alone)}


def main() -> None:
    from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed

    init_distributed(1, 1, seed=0)
    try:
        out = {family: compare(family) for family in CASES}
    finally:
        destroy_distributed()
    Path(sys.argv[1]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()

"""Weight mapping of one Gated DeltaNet layer: HF ``linear_attn`` tensors -> megatron-core's ``GatedDeltaNet``.

Owns the layout arithmetic only (pure functions on full, unsharded tensors; no megatron import).

megatron-core's ``GatedDeltaNet`` (0.16.1 and 0.19) holds
``in_proj.weight`` ``[2*Hk*Dk + 2*Hv*Dv + 2*Hv, hidden]`` whose rows are ``[q | k | v | z | beta | alpha]``, each
section head-major (q and k: ``Hk`` heads of ``Dk``; v and z: ``Hv`` heads of ``Dv``; beta and alpha: one row per
value head); ``conv1d.weight`` ``[2*Hk*Dk + Hv*Dv, 1, W]`` over the channels ``[q | k | v]``; ``A_log`` and
``dt_bias`` ``[Hv]``; ``out_norm.weight`` ``[Dv]`` (the gated RMSNorm shared by all heads) and ``out_proj.weight``
``[hidden, Hv*Dv]``.  Value head ``h`` reads key head ``h // (Hv / Hk)`` (megatron repeat-interleaves q and k).

The two HF layouts:

* Qwen3-Next (``Qwen3NextGatedDeltaNet``): ``in_proj_qkvz.weight`` groups its rows by key head: for each key head
  ``g`` the block ``[q_g (Dk) | k_g (Dk) | v_g (r*Dv) | z_g (r*Dv)]`` with ``r = Hv / Hk`` (the value heads
  ``g*r .. g*r + r - 1``); ``in_proj_ba.weight`` likewise ``[b_g (r) | a_g (r)]`` per key head.  Mapping them
  de-interleaves the groups into megatron's sections.
* Qwen3.5 (``Qwen3_5GatedDeltaNet``): separate ``in_proj_qkv`` (rows ``[q | k | v]``, already head-major),
  ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``: megatron's ``in_proj`` is their concatenation.

Both: ``conv1d.weight`` runs over ``cat(q, k, v)`` as in megatron and is copied; ``A_log``, ``dt_bias`` and
``out_proj.weight`` are copied.  HF's gated norm ``norm.weight`` multiplies as it is (``weight * x_hat``, not
``(1 + weight)`` like the decoder's other Qwen3-Next / Qwen3.5 norms); megatron builds ``out_norm`` from the same
config as every other norm, so with ``layernorm_zero_centered_gamma`` (the setting those other norms need) its
stored weight is ``norm.weight - 1``.

TP: megatron's in_proj is a ColumnParallelLinear whose rank-local rows are again ``[q | k | v | z | beta | alpha]``
(each section split over the ranks), and conv1d likewise per ``[q | k | v]`` section: shard with
:func:`in_proj_sections` / :func:`conv_sections`, never by cutting the full tensor into equal pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mcpo_megatron.models.registry import GDNHeads

QWEN3_NEXT_KEYS = ("in_proj_qkvz.weight", "in_proj_ba.weight")
QWEN3_5_KEYS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
COMMON_KEYS = ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")
OPTIONAL_KEYS = ("conv1d.bias",)


@dataclass(frozen=True)
class GDNDims(GDNHeads):
    """:class:`~mcpo_megatron.models.registry.GDNHeads` with the model's hidden size (HF config fields)."""

    hidden_size: int

    @classmethod
    def from_hf_config(cls, config) -> "GDNDims":
        return cls(hidden_size=config.hidden_size, num_key_heads=config.linear_num_key_heads,
                   num_value_heads=config.linear_num_value_heads, key_head_dim=config.linear_key_head_dim,
                   value_head_dim=config.linear_value_head_dim, conv_kernel=config.linear_conv_kernel_dim)

    def __post_init__(self):
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"Gated DeltaNet: linear_num_value_heads={self.num_value_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_key_heads} (megatron repeats each key head over a "
                             "whole number of value heads)")

    @property
    def ratio(self) -> int:
        return self.num_value_heads // self.num_key_heads


def in_proj_sections(dims: GDNDims) -> list[int]:
    """Row counts of megatron's ``in_proj.weight`` sections ``[q, k, v, z, beta, alpha]`` (full, TP=1)."""
    return [dims.qk_dim, dims.qk_dim, dims.v_dim, dims.v_dim, dims.num_value_heads, dims.num_value_heads]


def conv_sections(dims: GDNDims) -> list[int]:
    """Channel counts of megatron's ``conv1d`` sections ``[q, k, v]`` (full, TP=1)."""
    return [dims.qk_dim, dims.qk_dim, dims.v_dim]


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"Gated DeltaNet weight {name}: shape {tuple(tensor.shape)}, expected {shape} from the "
                         "config's linear_* head counts and sizes")


def _qwen3_next_in_proj(hf: Mapping[str, torch.Tensor], d: GDNDims) -> torch.Tensor:
    qkvz, ba = hf["in_proj_qkvz.weight"], hf["in_proj_ba.weight"]
    group = 2 * d.key_head_dim + 2 * d.ratio * d.value_head_dim
    _expect("in_proj_qkvz.weight", qkvz, (d.num_key_heads * group, d.hidden_size))
    _expect("in_proj_ba.weight", ba, (2 * d.num_value_heads, d.hidden_size))
    q, k, v, z = qkvz.reshape(d.num_key_heads, group, d.hidden_size).split(
        [d.key_head_dim, d.key_head_dim, d.ratio * d.value_head_dim, d.ratio * d.value_head_dim], dim=1)
    b, a = ba.reshape(d.num_key_heads, 2 * d.ratio, d.hidden_size).split([d.ratio, d.ratio], dim=1)
    # [Hk, rows per key head, hidden] -> head-major sections (key head g's value heads are g*r .. g*r + r - 1).
    return torch.cat([x.reshape(-1, d.hidden_size) for x in (q, k, v, z, b, a)])


def _qwen3_5_in_proj(hf: Mapping[str, torch.Tensor], d: GDNDims) -> torch.Tensor:
    _expect("in_proj_qkv.weight", hf["in_proj_qkv.weight"], (2 * d.qk_dim + d.v_dim, d.hidden_size))
    _expect("in_proj_z.weight", hf["in_proj_z.weight"], (d.v_dim, d.hidden_size))
    _expect("in_proj_b.weight", hf["in_proj_b.weight"], (d.num_value_heads, d.hidden_size))
    _expect("in_proj_a.weight", hf["in_proj_a.weight"], (d.num_value_heads, d.hidden_size))
    return torch.cat([hf[k] for k in QWEN3_5_KEYS])


def gdn_from_hf(hf: Mapping[str, torch.Tensor], dims: GDNDims, *, zero_centered_gamma: bool) -> dict[str, torch.Tensor]:
    """HF ``linear_attn.*`` tensors (keys relative to that module) -> megatron ``GatedDeltaNet`` state-dict tensors.

    Accepts the Qwen3-Next layout (``in_proj_qkvz`` / ``in_proj_ba``) or the Qwen3.5 one (``in_proj_qkv`` /
    ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``), plus ``conv1d.weight`` (and ``conv1d.bias`` if the checkpoint
    has one: megatron then needs ``conv_bias=True``), ``A_log``, ``dt_bias``, ``norm.weight``, ``out_proj.weight``.
    ``zero_centered_gamma``: megatron's ``config.layernorm_zero_centered_gamma`` (its out_norm then stores
    ``weight - 1``).  Anything else (a bias on a projection, both layouts, a missing tensor, a shape that does not
    follow from ``dims``) is refused with ValueError naming it.  Returns full (TP=1) tensors, the inputs' dtype.
    """
    keys = set(hf)
    next_layout, split_layout = keys & set(QWEN3_NEXT_KEYS), keys & set(QWEN3_5_KEYS)
    if next_layout and split_layout:
        raise ValueError(f"Gated DeltaNet weights mix the Qwen3-Next fused projections {sorted(next_layout)} and the "
                         f"Qwen3.5 split ones {sorted(split_layout)}")
    layout = QWEN3_NEXT_KEYS if next_layout else QWEN3_5_KEYS
    missing = [k for k in (*layout, *COMMON_KEYS) if k not in keys]
    if missing:
        raise ValueError(f"Gated DeltaNet weights: missing {missing} (have {sorted(keys)})")
    unknown = sorted(keys - set(layout) - set(COMMON_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise ValueError(f"Gated DeltaNet weights: no megatron GatedDeltaNet tensor for {unknown} (megatron's GDN "
                         "projections have no bias)")

    in_proj = _qwen3_next_in_proj(hf, dims) if layout is QWEN3_NEXT_KEYS else _qwen3_5_in_proj(hf, dims)
    conv_dim = 2 * dims.qk_dim + dims.v_dim
    _expect("conv1d.weight", hf["conv1d.weight"], (conv_dim, 1, dims.conv_kernel))
    for name in ("A_log", "dt_bias"):
        _expect(name, hf[name], (dims.num_value_heads,))
    _expect("norm.weight", hf["norm.weight"], (dims.value_head_dim,))
    _expect("out_proj.weight", hf["out_proj.weight"], (dims.hidden_size, dims.v_dim))
    out = {
        "in_proj.weight": in_proj,
        "conv1d.weight": hf["conv1d.weight"].clone(),
        "A_log": hf["A_log"].clone(),
        "dt_bias": hf["dt_bias"].clone(),
        "out_norm.weight": hf["norm.weight"] - 1 if zero_centered_gamma else hf["norm.weight"].clone(),
        "out_proj.weight": hf["out_proj.weight"].clone(),
    }
    if "conv1d.bias" in keys:
        _expect("conv1d.bias", hf["conv1d.bias"], (conv_dim,))
        out["conv1d.bias"] = hf["conv1d.bias"].clone()
    return out

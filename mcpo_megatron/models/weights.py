"""Table-driven Hugging Face <-> megatron-core parameter mapping (Qwen3, Qwen3-MoE, Qwen2, Llama, Qwen3.5).

One :class:`ParamRule` per megatron parameter says which HF tensors it is made
of and how (its ``kind``).  Two pure functions convert in both directions:

* :func:`hf_to_megatron_shard` - full HF tensors (or a slice reader) -> this TP
  rank's shard of one megatron parameter;
* :func:`megatron_shards_to_hf` - the TP shards of one megatron parameter (in TP
  rank order) -> the full HF tensors.

Kinds and layouts (megatron-core 0.16.1 to 0.19, ``SelfAttention`` / ``MLP``):

``copy``
    Replicated on every TP rank (RMSNorm weights, q/k norms which megatron
    shares over heads exactly like HF's ``q_norm``/``k_norm`` of size head_dim).
``vocab``
    Vocab-parallel rows: rank r holds rows ``[r*V/tp, (r+1)*V/tp)`` (embedding,
    output layer).  V must be divisible by TP (see registry).
``qkv``
    ``linear_qkv`` (weight or bias) is grouped per query group:
    ``[q_g (heads_per_group*head_dim); k_g (head_dim); v_g (head_dim)]`` for
    g = 0..groups-1, and TP rank r holds groups ``[r*G, (r+1)*G)``.  Groups
    beyond HF's ``num_key_value_heads`` are TP padding (all zeros).
``proj``
    ``linear_proj`` (o_proj) is row-parallel: columns split over TP; padded
    query heads add zero columns at the end.
``gate_up``
    ``linear_fc1`` = ``[gate_shard_r; up_shard_r]`` on rank r (megatron splits
    the fused GLU output in two halves per rank).
``row``
    Row-parallel (``linear_fc2`` = down_proj): columns split over TP.

``qkv_gated``
    ``linear_qkv`` of a gated full-attention layer (Qwen3.5): per query group
    ``[q_g (hpg*head_dim); gate_g (hpg*head_dim); k_g; v_g]`` (megatron-core 0.16.1
    ``SelfAttention.get_query_key_value_tensors`` with ``output_gate``), from HF's
    ``q_proj`` whose rows are ``[q_h (head_dim); gate_h (head_dim)]`` per head, and
    ``k_proj`` / ``v_proj``; TP as ``qkv``.
``gdn_in`` / ``gdn_conv`` / ``gdn_heads``
    A Gated DeltaNet layer's ``in_proj`` (sections ``[q | k | v | z | beta | alpha]``
    from HF's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``),
    ``conv1d`` (channel sections ``[q | k | v]``) and ``A_log`` / ``dt_bias`` (one
    row per value head): TP rank r holds the r-th 1/TP of *every section*, in
    section order (:func:`gdn_sections`; :mod:`~mcpo_megatron.models.hybrid_weights`
    states megatron's layout).  Its ``out_proj`` is a ``row`` rule of width
    ``linear_num_value_heads * linear_value_head_dim`` and its gated ``out_norm``
    a ``copy``: the local spec builds it as a plain RMSNorm, which is HF's
    ``Qwen3_5RMSNormGated`` (``weight * x_hat``, not zero-centered).

With the Transformer Engine layer spec the pre-attention and pre-MLP norms live
inside the fused linear as ``linear_qkv.layer_norm_weight`` and
``linear_fc1.layer_norm_weight``; :func:`param_rules` takes ``te=True`` for that.

Mixture-of-experts layers (Qwen3-MoE) replace the MLP by a router and experts.
HF names are the checkpoint's (what safetensors files and vLLM's loader use):
``mlp.gate.weight`` [E, h] and, per expert e, ``mlp.experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj``.  Megatron: the router ``mlp.router.weight``
(``copy``: replicated) and per *local* expert k (global e = ep_rank * E/EP + k)
``mlp.experts.local_experts.{k}.linear_fc1/linear_fc2.weight`` on the local spec
(``SequentialMLP``) or ``mlp.experts.linear_fc1/linear_fc2.weight{k}`` with TE
(``TEGroupedMLP``), of kinds ``gate_up`` / ``row`` over expert-TP (= TP) with
width ``moe_intermediate_size``.  The pre-MLP norm of a MoE layer is a separate
``pre_mlp_layernorm`` in both specs.  A rule's ``expert`` is the global index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from mcpo_megatron.models.registry import MegatronShape, megatron_shape

# reader(hf_name, dim, start, stop) -> the HF tensor narrowed to [start, stop) along dim
SliceReader = Callable[[str, int, int, int], torch.Tensor]

HF_EMBED = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class ParamRule:
    """How one megatron parameter is made of HF tensors.

    ``mcore`` is the megatron name with ``{layer}`` standing for the layer index
    *within the pipeline stage* (megatron numbers ``decoder.layers.N`` locally);
    ``layer`` is the global layer index (None for embeddings / final norm /
    output layer); ``hf`` the HF names (global layer index filled in).
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str
    layer: int | None = None
    expert: int | None = None

    def mcore_name(self, layer_offset: int = 0, expert_offset: int = 0) -> str:
        """Megatron name on a stage whose first layer has global index ``layer_offset`` (and, for an
        expert, on the expert-parallel rank whose first expert has global index ``expert_offset``)."""
        if self.layer is None:
            return self.mcore
        if self.expert is None:
            return self.mcore.format(layer=self.layer - layer_offset)
        return self.mcore.format(layer=self.layer - layer_offset, expert=self.expert - expert_offset)


KINDS = ("copy", "vocab", "qkv", "proj", "gate_up", "row", "qkv_gated", "gdn_in", "gdn_conv", "gdn_heads")
SECTION_KINDS = ("gdn_in", "gdn_conv", "gdn_heads")


def expert_rules(shape: MegatronShape, layer: int, expert: int, *, te: bool = False) -> list[ParamRule]:
    """Rules for one expert (global indices ``layer``, ``expert``) of a MoE layer, in HF order."""
    hf = f"model.layers.{layer}.mlp.experts.{expert}."
    if te:  # TEGroupedMLP: one grouped linear per projection, weight{k} per local expert
        fc1, fc2 = "decoder.layers.{layer}.mlp.experts.linear_fc1.weight{expert}", \
            "decoder.layers.{layer}.mlp.experts.linear_fc2.weight{expert}"
    else:  # SequentialMLP: one MLP module per local expert
        fc1, fc2 = "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight", \
            "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight"
    return [
        ParamRule(fc1, (hf + "gate_proj.weight", hf + "up_proj.weight"), "gate_up", layer, expert),
        ParamRule(fc2, (hf + "down_proj.weight",), "row", layer, expert),
    ]


def layer_rules(shape: MegatronShape, layer: int, *, te: bool = False,
                experts: Iterable[int] | None = None) -> list[ParamRule]:
    """Rules for one decoder layer (global index ``layer``), in HF order.

    For a MoE layer ``experts`` selects the experts (global indices; default all).
    """
    hf = f"model.layers.{layer}."
    mc = "decoder.layers.{layer}."
    if shape.is_linear_attention(layer):
        return _gdn_layer_rules(shape, layer, te=te)
    attn_norm = mc + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight")
    mlp_norm = mc + ("mlp.linear_fc1.layer_norm_weight" if te and not shape.is_moe else "pre_mlp_layernorm.weight")
    rules = [
        ParamRule(attn_norm, (hf + "input_layernorm.weight",), "copy", layer),
        ParamRule(mc + "self_attention.linear_qkv.weight",
                  tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"),
                  "qkv_gated" if shape.is_hybrid else "qkv", layer),
    ]
    if shape.arch.qkv_bias:
        rules.append(ParamRule(mc + "self_attention.linear_qkv.bias",
                               tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv", layer))
    if shape.arch.qk_norm:
        rules += [
            ParamRule(mc + "self_attention.q_layernorm.weight", (hf + "self_attn.q_norm.weight",), "copy", layer),
            ParamRule(mc + "self_attention.k_layernorm.weight", (hf + "self_attn.k_norm.weight",), "copy", layer),
        ]
    rules += [
        ParamRule(mc + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "proj", layer),
        ParamRule(mlp_norm, (hf + "post_attention_layernorm.weight",), "copy", layer),
    ]
    if shape.is_moe:
        rules.append(ParamRule(mc + "mlp.router.weight", (hf + "mlp.gate.weight",), "copy", layer))
        for e in range(shape.num_experts) if experts is None else experts:
            rules += expert_rules(shape, layer, e, te=te)
        return rules
    return rules + _dense_mlp_rules(layer)


def _dense_mlp_rules(layer: int) -> list[ParamRule]:
    hf, mc = f"model.layers.{layer}.", "decoder.layers.{layer}."
    return [
        ParamRule(mc + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                  "gate_up", layer),
        ParamRule(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "row", layer),
    ]


def _gdn_layer_rules(shape: MegatronShape, layer: int, *, te: bool) -> list[ParamRule]:
    """A Gated DeltaNet layer of a hybrid decoder (local spec names), in HF order."""
    if te:
        raise NotImplementedError("hybrid models on the Transformer Engine layer spec: the weight mapping covers "
                                  "the local spec only; set model.transformer_impl=local")
    hf, mc = f"model.layers.{layer}.", "decoder.layers.{layer}."
    la, sa = hf + "linear_attn.", mc + "self_attention."
    return [
        ParamRule(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), "copy", layer),
        ParamRule(sa + "in_proj.weight", tuple(la + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
                  "gdn_in", layer),
        ParamRule(sa + "conv1d.weight", (la + "conv1d.weight",), "gdn_conv", layer),
        ParamRule(sa + "A_log", (la + "A_log",), "gdn_heads", layer),
        ParamRule(sa + "dt_bias", (la + "dt_bias",), "gdn_heads", layer),
        ParamRule(sa + "out_norm.weight", (la + "norm.weight",), "copy", layer),
        ParamRule(sa + "out_proj.weight", (la + "out_proj.weight",), "row", layer),
        ParamRule(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "copy", layer),
    ] + _dense_mlp_rules(layer)


def gdn_sections(shape: MegatronShape, rule: ParamRule) -> list[tuple[int, int, int]]:
    """The sections of a ``gdn_*`` rule's megatron parameter, in megatron's order: (index of the HF tensor in
    ``rule.hf``, first HF row, rows).  TP rank r holds rows ``[r*n/tp, (r+1)*n/tp)`` of each section of n rows."""
    g = shape.gdn
    qk, v, hv = g.qk_dim, g.v_dim, g.num_value_heads
    if rule.kind == "gdn_in":
        return [(0, 0, qk), (0, qk, qk), (0, 2 * qk, v), (1, 0, v), (2, 0, hv), (3, 0, hv)]
    if rule.kind == "gdn_conv":
        return [(0, 0, qk), (0, qk, qk), (0, 2 * qk, v)]
    if rule.kind == "gdn_heads":
        return [(0, 0, hv)]
    raise ValueError(f"{rule.kind!r} is not a Gated DeltaNet section rule")


def param_rules(
    shape: MegatronShape,
    *,
    te: bool = False,
    layers: Iterable[int] | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    experts: Iterable[int] | None = None,
) -> list[ParamRule]:
    """All rules of a (stage of a) model in HF order: embeddings, layers, final norm, lm_head.

    ``layers`` (global indices), ``pre_process`` and ``post_process`` select one
    pipeline stage, ``experts`` (global indices) one expert-parallel rank's experts;
    the defaults give the whole model.  A tied model has no
    output-layer rule (megatron ties ``output_layer`` to the embedding; HF
    checkpoints of tied models usually omit ``lm_head.weight``).
    """
    rules: list[ParamRule] = []
    if pre_process:
        rules.append(ParamRule("embedding.word_embeddings.weight", (HF_EMBED,), "vocab"))
    experts = None if experts is None else list(experts)
    for layer in range(shape.num_layers) if layers is None else layers:
        rules += layer_rules(shape, layer, te=te, experts=experts)
    if post_process:
        rules.append(ParamRule("decoder.final_layernorm.weight", (HF_FINAL_NORM,), "copy"))
        if not shape.tie_word_embeddings:
            rules.append(ParamRule("output_layer.weight", (HF_LM_HEAD,), "vocab"))
    return rules


def rules_for(hf_config: Any, tp: int = 1, ep: int = 1, **kwargs) -> tuple[MegatronShape, list[ParamRule]]:
    """Convenience: ``(megatron_shape(hf_config, tp, ep), param_rules(shape, **kwargs))``."""
    shape = megatron_shape(hf_config, tp, ep)
    return shape, param_rules(shape, **kwargs)


def local_experts(shape: MegatronShape, ep_rank: int) -> range:
    """Global indices of the experts held by expert-parallel rank ``ep_rank``."""
    n = shape.num_local_experts
    return range(ep_rank * n, (ep_rank + 1) * n)


def ffn_width(shape: MegatronShape, rule: ParamRule) -> int:
    """The width a ``gate_up`` / ``row`` rule is split along (an expert's, the dense MLP's, or a Gated DeltaNet
    ``out_proj``'s value dimension)."""
    if rule.expert is not None:
        return shape.moe_ffn_hidden_size
    if ".linear_attn." in rule.hf[0]:
        return shape.gdn.v_dim
    return shape.ffn_hidden_size


def hf_tensor_shapes(shape: MegatronShape, rule: ParamRule) -> list[tuple[int, ...]]:
    """The full HF shapes of ``rule.hf`` (used to validate checkpoints before slicing)."""
    h, hd = shape.hidden_size, shape.head_dim
    out = []
    for name in rule.hf:
        leaf = name.rsplit(".", 2)[-2:]
        key = ".".join(leaf)
        if ".linear_attn." in name:
            out.append(_gdn_hf_shape(shape, name.rsplit(".linear_attn.", 1)[1]))
        elif name in (HF_EMBED, HF_LM_HEAD):
            out.append((shape.vocab_size, h))
        elif key in ("q_proj.weight",):  # a gated attention's q_proj holds each head's gate after its query
            out.append((shape.hf_heads * hd * (2 if shape.is_hybrid else 1), h))
        elif key in ("k_proj.weight", "v_proj.weight"):
            out.append((shape.hf_kv_heads * hd, h))
        elif key == "q_proj.bias":
            out.append((shape.hf_heads * hd,))
        elif key in ("k_proj.bias", "v_proj.bias"):
            out.append((shape.hf_kv_heads * hd,))
        elif key in ("q_norm.weight", "k_norm.weight"):
            out.append((hd,))
        elif key == "o_proj.weight":
            out.append((h, shape.hf_heads * hd))
        elif key in ("gate_proj.weight", "up_proj.weight"):
            out.append((ffn_width(shape, rule), h))
        elif key == "down_proj.weight":
            out.append((h, ffn_width(shape, rule)))
        elif key == "gate.weight":  # MoE router
            out.append((shape.num_experts, h))
        else:  # norms
            out.append((h,))
    return out


def _gdn_hf_shape(shape: MegatronShape, leaf: str) -> tuple[int, ...]:
    g, h = shape.gdn, shape.hidden_size
    shapes = {
        "in_proj_qkv.weight": (2 * g.qk_dim + g.v_dim, h), "in_proj_z.weight": (g.v_dim, h),
        "in_proj_b.weight": (g.num_value_heads, h), "in_proj_a.weight": (g.num_value_heads, h),
        "conv1d.weight": (2 * g.qk_dim + g.v_dim, 1, g.conv_kernel), "A_log": (g.num_value_heads,),
        "dt_bias": (g.num_value_heads,), "norm.weight": (g.value_head_dim,), "out_proj.weight": (h, g.v_dim),
    }
    if leaf not in shapes:
        raise ValueError(f"no Gated DeltaNet tensor linear_attn.{leaf}")
    return shapes[leaf]


def megatron_shard_shape(shape: MegatronShape, rule: ParamRule) -> tuple[int, ...]:
    """Shape of one TP rank's shard of ``rule``'s megatron parameter."""
    tp, hd, h = shape.tp, shape.head_dim, shape.hidden_size
    full = hf_tensor_shapes(shape, rule)[0]
    if rule.kind == "copy":
        return full
    if rule.kind == "vocab":
        return (shape.vocab_size // tp, h)
    if rule.kind in ("qkv", "qkv_gated"):
        per_group = (2 * shape.heads_per_group + 2 if rule.kind == "qkv_gated" else shape.heads_per_group + 2) * hd
        return (shape.num_query_groups // tp * per_group,) + tuple(full[1:])
    if rule.kind in SECTION_KINDS:
        return (sum(n for _, _, n in gdn_sections(shape, rule)) // tp,) + tuple(full[1:])
    if rule.kind == "proj":
        return (h, shape.num_attention_heads // tp * hd)
    if rule.kind == "gate_up":
        return (2 * ffn_width(shape, rule) // tp, h)
    if rule.kind == "row":
        return (h, ffn_width(shape, rule) // tp)
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def _mem_reader(tensors: Mapping[str, torch.Tensor]) -> SliceReader:
    def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name not in tensors:
            raise KeyError(f"HF tensor {name!r} is missing")
        return tensors[name].narrow(dim, start, stop - start)

    return read




def hf_to_megatron_shard(
    rule: ParamRule,
    hf_tensors: Mapping[str, torch.Tensor] | SliceReader,
    shape: MegatronShape,
    tp_rank: int,
) -> torch.Tensor:
    """This TP rank's shard of ``rule``'s megatron parameter, built from HF tensors.

    ``hf_tensors`` is either a mapping ``hf_name -> full tensor`` or a slice
    reader ``(name, dim, start, stop) -> tensor`` (so a loader can read only the
    rows/columns this rank needs from safetensors).  Pure: no process groups.
    """
    read = hf_tensors if callable(hf_tensors) else _mem_reader(hf_tensors)
    tp = shape.tp
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank={tp_rank} out of range for tp={tp}")
    full_shapes = hf_tensor_shapes(shape, rule)
    kind = rule.kind
    if kind == "copy":
        (name,) = rule.hf
        return read(name, 0, 0, full_shapes[0][0]).clone()
    if kind == "vocab":
        rows = shape.vocab_size // tp
        return read(rule.hf[0], 0, tp_rank * rows, (tp_rank + 1) * rows).clone()
    if kind == "gate_up":
        f = ffn_width(shape, rule) // tp
        gate = read(rule.hf[0], 0, tp_rank * f, (tp_rank + 1) * f)
        up = read(rule.hf[1], 0, tp_rank * f, (tp_rank + 1) * f)
        return torch.cat([gate, up], dim=0)
    if kind == "row":
        f = ffn_width(shape, rule) // tp
        return read(rule.hf[0], 1, tp_rank * f, (tp_rank + 1) * f).clone()
    if kind == "proj":
        hd = shape.head_dim
        per_rank = shape.num_attention_heads // tp * hd
        start, stop = tp_rank * per_rank, (tp_rank + 1) * per_rank
        real_stop = min(stop, shape.hf_heads * hd)
        parts = []
        if real_stop > start:
            parts.append(read(rule.hf[0], 1, start, real_stop))
        if stop > max(start, real_stop):
            ref = parts[0] if parts else read(rule.hf[0], 1, 0, 1)
            parts.append(ref.new_zeros(shape.hidden_size, stop - max(start, real_stop)))
        return torch.cat(parts, dim=1)
    if kind in ("qkv", "qkv_gated"):
        return _qkv_shard(rule, read, shape, tp_rank)
    if kind in SECTION_KINDS:
        return torch.cat([read(rule.hf[i], 0, start + tp_rank * (n // tp), start + (tp_rank + 1) * (n // tp))
                          for i, start, n in gdn_sections(shape, rule)]).clone()
    raise ValueError(f"unknown rule kind {kind!r}")


def _qkv_shard(rule: ParamRule, read: SliceReader, shape: MegatronShape, tp_rank: int) -> torch.Tensor:
    hd, hpg = shape.head_dim, shape.heads_per_group
    gated = rule.kind == "qkv_gated"
    q_rows = (2 if gated else 1) * hpg * hd  # a gated group's query rows hold its heads' gates too
    per_rank = shape.num_query_groups // shape.tp
    g0, g1 = tp_rank * per_rank, (tp_rank + 1) * per_rank
    real1 = min(g1, shape.hf_kv_heads)
    q_name, k_name, v_name = rule.hf
    blocks = []
    if real1 > g0:
        n = real1 - g0
        q = read(q_name, 0, g0 * q_rows, real1 * q_rows)
        k = read(k_name, 0, g0 * hd, real1 * hd)
        v = read(v_name, 0, g0 * hd, real1 * hd)
        tail = tuple(q.shape[1:])
        if gated:  # HF: [q_h; gate_h] per head -> megatron: [q heads; gate heads] per group
            q = q.reshape(n, hpg, 2, hd, *tail).transpose(1, 2)
        fused = torch.cat(
            [q.reshape(n, q_rows, *tail), k.reshape(n, hd, *tail), v.reshape(n, hd, *tail)], dim=1
        )
        blocks.append(fused.reshape(n * (q_rows + 2 * hd), *tail))
    n_pad = g1 - max(g0, real1)
    if n_pad > 0:
        ref = blocks[0] if blocks else read(k_name, 0, 0, 1)
        blocks.append(ref.new_zeros(n_pad * (q_rows + 2 * hd), *ref.shape[1:]))
    return torch.cat(blocks, dim=0)


def megatron_shards_to_hf(
    rule: ParamRule, shards: Sequence[torch.Tensor], shape: MegatronShape
) -> dict[str, torch.Tensor]:
    """Full HF tensors ``{hf_name: tensor}`` from the TP shards of one megatron parameter.

    ``shards`` are in TP-rank order (``len(shards) == shape.tp``); for ``copy``
    parameters any rank's copy is used (they are identical).  TP padding (zero
    query groups / o_proj columns) is stripped.  Pure: no process groups.
    """
    if len(shards) != shape.tp:
        raise ValueError(f"{rule.mcore}: got {len(shards)} shards for tp={shape.tp}")
    kind = rule.kind
    if kind == "copy":
        return {rule.hf[0]: shards[0]}
    if kind == "vocab":
        return {rule.hf[0]: torch.cat(list(shards), dim=0)}
    if kind == "row":
        return {rule.hf[0]: torch.cat(list(shards), dim=1)}
    if kind == "proj":
        full = torch.cat(list(shards), dim=1)
        return {rule.hf[0]: full[:, : shape.hf_heads * shape.head_dim].contiguous()}
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return {
            rule.hf[0]: torch.cat([h[0] for h in halves], dim=0),
            rule.hf[1]: torch.cat([h[1] for h in halves], dim=0),
        }
    if kind in SECTION_KINDS:
        sections = gdn_sections(shape, rule)
        cut = [n // shape.tp for _, _, n in sections]
        per_rank = [s.split(cut, dim=0) for s in shards]
        parts: dict[int, list[torch.Tensor]] = {}
        for j, (i, _, _) in enumerate(sections):  # sections of one HF tensor are consecutive, in row order
            parts.setdefault(i, []).append(torch.cat([r[j] for r in per_rank], dim=0))
        return {rule.hf[i]: torch.cat(p, dim=0) for i, p in sorted(parts.items())}
    if kind in ("qkv", "qkv_gated"):
        hd, hpg, kv = shape.head_dim, shape.heads_per_group, shape.hf_kv_heads
        q_rows = (2 if kind == "qkv_gated" else 1) * hpg * hd
        full = torch.cat(list(shards), dim=0)
        tail = tuple(full.shape[1:])
        grouped = full.reshape(shape.num_query_groups, q_rows + 2 * hd, *tail)[:kv]
        q, k, v = torch.split(grouped, [q_rows, hd, hd], dim=1)
        if kind == "qkv_gated":  # megatron: [q heads; gate heads] per group -> HF: [q_h; gate_h] per head
            q = q.reshape(kv, 2, hpg, hd, *tail).transpose(1, 2)
        return {
            rule.hf[0]: q.reshape(kv * q_rows, *tail).contiguous(),
            rule.hf[1]: k.reshape(kv * hd, *tail).contiguous(),
            rule.hf[2]: v.reshape(kv * hd, *tail).contiguous(),
        }
    raise ValueError(f"unknown rule kind {kind!r}")


MTP_PREFIX = "mtp."  # Qwen3.5 / Qwen3-Next checkpoints' multi-token-prediction layers


def dropped_mtp_tensors(shape: MegatronShape, checkpoint_names: Iterable[str]) -> list[str]:
    """The checkpoint's multi-token-prediction tensors (``mtp.*``), which the policy does not load: it trains the
    next-token model only (RL samples with it; speculative decoding with MTP is the engine's business)."""
    mapped = set(hf_names(shape))
    return sorted(n for n in checkpoint_names if n.startswith(MTP_PREFIX) and n not in mapped)


def hf_names(shape: MegatronShape) -> list[str]:
    """Every HF tensor name of the model, in export order."""
    return [n for r in param_rules(shape) for n in r.hf]

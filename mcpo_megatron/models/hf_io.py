"""Hugging Face safetensors <-> megatron-core model chunks (this rank's TP/PP slices only).

* :func:`load_hf_weights` reads the checkpoint's safetensors shards directly
  (``safe_open`` + ``get_slice``) and materialises only the rows/columns of the
  parameters this rank holds (its pipeline stage's layers, its TP shard).
* :func:`iter_hf_buckets` / :func:`iter_hf_tensors` stream full HF-named tensors to
  every rank in buckets: the stage that owns a bucket all-gathers its TP shards
  (one collective per bucket, into reused buffers), and the bucket is broadcast
  over the expert-parallel and pipeline groups.  Used by export and by engines
  the reshard plan does not cover.

Writing a checkpoint directory from the stream (:func:`~mcpo_megatron.models.hf_export.export_hf`) is
:mod:`~mcpo_megatron.models.hf_export`'s.

Every function here takes ``model_chunks``: a model or a list of models built by
:func:`~mcpo_megatron.models.builder.build_gpt_model` (DDP / Float16Module
wrappers are unwrapped): one chunk per virtual pipeline stage of this rank.
Mixture-of-experts layers: each rank loads only its expert-parallel rank's
experts; the stream gathers an expert's TP shards on its owner, broadcasts it
over the expert-parallel group, then over the pipeline group.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from mcpo_megatron.parallel.distributed import all_gather_into, broadcast

from mcpo_megatron.models import weights
from mcpo_megatron.models.builder import unwrap
from mcpo_megatron.models.multimodal import checkpoint_name, is_multimodal_dir
from mcpo_megatron.models.registry import MegatronShape, megatron_shape
from mcpo_megatron.models.shard_views import contiguous_view, megatron_sources, rect_of, source_key

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"


def chunks_of(model_chunks) -> list:
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not chunks:
        raise ValueError("expected at least one model chunk")
    return [unwrap(c) for c in chunks]


def _load_rules(model) -> list[tuple[weights.ParamRule, str]]:
    """(rule, local megatron name) for every parameter of this chunk, including a tied output copy."""
    from mcpo_megatron.models.builder import expert_offset, stage_layers

    shape, te = model.mcpo_shape, model.mcpo_transformer_impl == "transformer_engine"
    layers, first_expert = stage_layers(model), expert_offset(model)
    experts = range(first_expert, first_expert + shape.num_local_experts) if shape.is_moe else None
    rules = weights.param_rules(shape, te=te, layers=layers, pre_process=model.pre_process,
                                post_process=model.post_process, experts=experts)
    out = [(r, r.mcore_name(layers.start, first_expert)) for r in rules]
    if shape.tie_word_embeddings and model.post_process and not model.pre_process:
        # megatron keeps a copy of the embedding as the last stage's output layer
        out.append((weights.ParamRule("output_layer.weight", (weights.HF_EMBED,), "vocab"),
                    "output_layer.weight"))
    return out


class SafetensorsReader:
    """Lazy access to the tensors of a HF checkpoint directory (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        index = self.dir / SAFE_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SAFE_SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(str(self.dir / SAFE_SINGLE), framework="pt") as f:
                weight_map = {k: SAFE_SINGLE for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.dir} has neither {SAFE_INDEX} nor {SAFE_SINGLE}; convert the checkpoint to "
                "safetensors (save_pretrained(..., safe_serialization=True))"
            )
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, Any] = {}

    def _handle(self, name: str):
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.dir / file), framework="pt")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) ``[start, stop)`` of ``name``, reading only that range."""
        sl = self._handle(name).get_slice(name)
        if dim == 0:
            return sl[start:stop]
        if dim == 1:
            return sl[:, start:stop]
        raise ValueError(f"dim={dim} must be 0 or 1")

    def full(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


@torch.no_grad()
def load_hf_weights(model_chunks, hf_dir: str | os.PathLike) -> None:
    """Copy a HF checkpoint into this rank's parameters (only its TP/PP slices are read).

    Raises if a parameter of the model has no mapping, or a checkpoint tensor
    has an unexpected shape (names the tensor, its shape and the expected one).
    Multi-token-prediction layers (``mtp.*``) are not loaded, and rank 0 says how many were left. A multimodal
    checkpoint (``...ForConditionalGeneration``) gives its language model's tensors (``model.language_model.*``)
    and never its vision tower (:mod:`~mcpo_megatron.models.multimodal`).
    """
    reader = SafetensorsReader(hf_dir)
    multimodal = is_multimodal_dir(hf_dir)

    def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return reader.read(checkpoint_name(name, multimodal), dim, start, stop)

    try:
        dropped = weights.dropped_mtp_tensors(chunks_of(model_chunks)[0].mcpo_shape, reader.weight_map)
        if dropped and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            print(f"[mcpo] {hf_dir}: {len(dropped)} multi-token-prediction tensors (mtp.*) not loaded: the policy "
                  "trains the next-token model only", flush=True)
        for model in chunks_of(model_chunks):
            shape = model.mcpo_shape
            params = dict(model.named_parameters())
            loaded = set()
            for rule, name in _load_rules(model):
                for hf_name, expected in zip(rule.hf, weights.hf_tensor_shapes(shape, rule)):
                    hf_name = checkpoint_name(hf_name, multimodal)
                    got = reader.shape(hf_name)
                    if got != expected:
                        raise ValueError(
                            f"checkpoint tensor {hf_name} has shape {list(got)}, expected {list(expected)} "
                            f"from config.json in {hf_dir}; the config and the weights do not match"
                        )
                if name not in params:
                    raise KeyError(f"megatron model has no parameter {name!r} (mapping for {rule.hf})")
                shard = weights.hf_to_megatron_shard(rule, read, shape, _tp_rank(expert=rule.expert is not None))
                param = params[name]
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: shard shape {list(shard.shape)} != parameter {list(param.shape)}")
                param.copy_(shard.to(param.dtype))
                loaded.add(name)
            missing = sorted(set(params) - loaded)
            if missing:
                raise KeyError(f"parameters without a HF mapping (not loaded): {missing}")
    finally:
        reader.close()


def _tp_rank(expert: bool = False) -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()


def layer_stages(config) -> list[int]:
    """The pipeline stage holding each global layer (virtual stages folded into their pipeline rank), from
    megatron's own layer assignment for ``config`` (a ``TransformerConfig``)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size or 1
    owner = {}
    for stage in range(pp):
        for v in range(vpp):
            vp = v if vpp > 1 else None
            start = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=stage)
            for layer in range(start, start + get_num_layers_to_build(config, vp_stage=vp, pp_rank=stage)):
                owner[layer] = stage
    return [owner[layer] for layer in range(len(owner))]


def _model_stream_plan(shape: MegatronShape, config, te: bool) -> list[tuple[int, weights.ParamRule]]:
    """(owning pipeline rank, rule) for the whole model in HF order (virtual stages included)."""
    pp = config.pipeline_model_parallel_size
    owner = layer_stages(config)
    plan = []
    for rule in weights.param_rules(shape, te=te):
        if rule.layer is not None:
            plan.append((owner[rule.layer], rule))
        else:
            plan.append((0 if rule.mcore.startswith("embedding.") else pp - 1, rule))
    return plan


def source_tensors(model_chunks) -> dict[tuple[str, int | None, int | None], torch.Tensor]:
    """This rank's parameters by rule, ``(rule.mcore, global layer, global expert)`` -> the (detached) parameter,
    over its model chunks (virtual stages) and its expert-parallel rank's experts."""
    from mcpo_megatron.models.builder import expert_offset, stage_layers

    chunks = chunks_of(model_chunks)
    shape = chunks[0].mcpo_shape
    te = chunks[0].mcpo_transformer_impl == "transformer_engine"
    first_expert = expert_offset(chunks[0])
    out = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        layers = stage_layers(chunk)
        experts = range(first_expert, first_expert + shape.num_local_experts) if shape.is_moe else None
        for rule in weights.param_rules(shape, te=te, layers=layers, pre_process=chunk.pre_process,
                                        post_process=chunk.post_process, experts=experts):
            out[(rule.mcore, rule.layer, rule.expert)] = params[rule.mcore_name(layers.start, first_expert)].detach()
    return out


STREAM_BUCKET_BYTES = 512 * 2**20
_ALIGN = 64  # byte offset of each tensor in a stream bucket (any dtype's view of it is aligned)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


class StreamBuffers:
    """The HF stream's reused buffers: the bucket every rank receives into, and the TP gather buffers. Kept by a
    caller that streams every iteration, so no update allocates them again."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._bufs[name] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        return buf[:nbytes]


def _view(buf: torch.Tensor, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    return buf[offset:offset + _nbytes(shape, dtype)].view(dtype).view(tuple(shape))


def _stream_buckets(shape: MegatronShape, config, te: bool, bucket_bytes: int, dtype: torch.dtype):
    """The stream's buckets: runs of rules in HF order with one owner (pipeline stage, expert-parallel rank) and at
    most ``bucket_bytes`` of HF tensors (a larger rule travels alone)."""
    buckets, cur, size, owner = [], [], 0, None
    for stage, rule in _model_stream_plan(shape, config, te):
        ep = rule.expert // shape.num_local_experts if rule.expert is not None else None
        nbytes = sum(_aligned(_nbytes(s, dtype)) for s in weights.hf_tensor_shapes(shape, rule))
        if cur and ((stage, ep) != owner or size + nbytes > bucket_bytes):
            buckets.append((owner, cur))
            cur, size = [], 0
        cur.append(rule)
        owner = (stage, ep)
        size += nbytes
    if cur:
        buckets.append((owner, cur))
    return buckets


@torch.no_grad()
def iter_hf_buckets(
    model_chunks, hf_config: Any = None, *, dtype: torch.dtype | None = None,
    bucket_bytes: int = STREAM_BUCKET_BYTES, buffers: StreamBuffers | None = None, counts: dict | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the whole model as lists of ``(hf_name, full_tensor)``, in HF order, on every rank.

    Order: embeddings, layers 0..L-1 (a MoE layer: router, then experts 0..E-1), final norm, lm_head (absent when
    tied). A collective: every rank must iterate it to the end, in step. A bucket holds the tensors of one owner
    (pipeline stage, and expert-parallel rank for experts) up to ``bucket_bytes``: its owner gathers the TP shards
    of all its sharded tensors with one all-gather (over the TP or expert-TP group), builds the HF tensors, and
    sends the bucket to the other stages (one PP broadcast) and expert ranks (one EP broadcast).

    Tensors are in ``dtype`` (default: the model's parameter dtype, ``config.params_dtype``, the same on every
    rank) on the model's device, and valid **until the next bucket is asked for**: they are views of reused
    buffers, or of the parameters themselves where a HF tensor is a view of one and no copy is needed (TP 1, one
    stage, the dtype unchanged: the q/k/v and gate/up parts of the fused parameters are strided views). Copy what
    you keep (``export_hf`` does). ``counts["collectives"]`` is increased by the collectives made.
    """
    from megatron.core import parallel_state as ps

    chunks = chunks_of(model_chunks)
    model = chunks[0]
    shape = model.mcpo_shape
    if hf_config is not None:
        shape = megatron_shape(hf_config, shape.tp, shape.ep)
    te = model.mcpo_transformer_impl == "transformer_engine"
    pp = ps.get_pipeline_model_parallel_world_size()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    my_stage = ps.get_pipeline_model_parallel_rank()
    groups = {False: (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()),
              True: (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size())}
    pp_group, ep_group = ps.get_pipeline_model_parallel_group(), ps.get_expert_model_parallel_group()
    local = source_tensors(chunks)
    out_dtype = dtype or model.config.params_dtype
    device = next(chunks[0].parameters()).device
    buffers = buffers or StreamBuffers()
    counts = counts if counts is not None else {}
    counts.setdefault("collectives", 0)

    for (stage, expert_rank), rules in _stream_buckets(shape, model.config, te, bucket_bytes, out_dtype):
        is_expert = expert_rank is not None
        mine = stage == my_stage and (not is_expert or expert_rank == ep_rank)
        needs_send = pp > 1 or (is_expert and ep > 1)
        layout, offset = [], 0  # (rule, index in the rule, name, shape, offset in the bucket buffer)
        for rule in rules:
            for i, (name, hf_shape) in enumerate(zip(rule.hf, weights.hf_tensor_shapes(shape, rule))):
                layout.append((rule, i, name, tuple(hf_shape), offset))
                offset += _aligned(_nbytes(hf_shape, out_dtype))
        bucket = buffers.get("bucket", offset, device)
        out = [(name, _view(bucket, off, hf_shape, out_dtype)) for _, _, name, hf_shape, off in layout]
        if mine:
            shards = _gathered_shards(rules, local, groups[is_expert], buffers, counts)
            _build_hf_tensors(out, layout, shards, shape, stage, zero_copy=not needs_send)
            del shards
        if is_expert and ep > 1 and stage == my_stage:
            broadcast(bucket, src=expert_rank, group=ep_group)
            counts["collectives"] += 1
        if pp > 1:
            broadcast(bucket, src=stage, group=pp_group)
            counts["collectives"] += 1
        yield out
        del out


def _build_hf_tensors(out: list, layout: list, shards: dict, shape: MegatronShape, stage: int, *,
                      zero_copy: bool) -> None:
    """Fill ``out`` (name, bucket view) with a bucket's HF tensors from the TP shards of its rules: each part of a
    tensor copied into its bucket view (:func:`~mcpo_megatron.models.shard_views.megatron_sources`), or, with
    ``zero_copy``, the shard's own view put in its place when one view of the right dtype is the whole tensor."""
    for k, (rule, i, name, hf_shape, _) in enumerate(layout):
        parts = megatron_sources(shape, rule, i, stage, rect_of(hf_shape))
        sources = shards[source_key(rule)]
        dest = out[k][1]
        if zero_copy and len(parts) == 1:
            owner, src, _ = parts[0]
            whole = _strided(sources[owner.tp or 0], src)
            if whole.dtype == dest.dtype and whole.shape == hf_shape:
                out[k] = (name, whole)  # a view of the parameter (or of its gathered shard): no copy
                continue
        full = contiguous_view(name, hf_shape)
        for owner, src, sub in parts:
            _strided(dest, full.sub(rect_of(hf_shape), sub)).copy_(_strided(sources[owner.tp or 0], src))


def _strided(tensor: torch.Tensor, view) -> torch.Tensor:
    return tensor.as_strided(view.shape, view.stride, tensor.storage_offset() + view.offset)


def _gathered_shards(rules, local, group_and_size, buffers: StreamBuffers, counts: dict) -> dict[tuple, list]:
    """Every TP shard of a bucket's rules on a rank of their owner, by rule key: this rank's parameter for
    replicated rules or at TP 1, else the shards gathered with one all-gather of the packed local shards."""
    group, n = group_and_size
    out = {source_key(r): [local[source_key(r)]] for r in rules}
    sharded = [r for r in rules if n > 1 and r.kind != "copy"]
    if not sharded:
        return out
    params = [local[source_key(r)] for r in sharded]
    sizes = [_aligned(p.numel() * p.element_size()) for p in params]
    total = sum(sizes)
    send = buffers.get("gather_send", total, params[0].device)
    offsets, off = [], 0
    for p, size in zip(params, sizes):
        _view(send, off, p.shape, p.dtype).copy_(p)
        offsets.append(off)
        off += size
    recv = buffers.get("gather_recv", total * n, params[0].device)
    all_gather_into(recv, send, group)
    counts["collectives"] += 1
    for r, p, off in zip(sharded, params, offsets):
        out[source_key(r)] = [_view(recv, k * total + off, p.shape, p.dtype) for k in range(n)]
    return out


def iter_hf_tensors(
    model_chunks, hf_config: Any = None, *, dtype: torch.dtype | None = None,
    bucket_bytes: int = STREAM_BUCKET_BYTES, counts: dict | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_hf_buckets`, one tensor at a time; a tensor is valid until the iteration leaves its bucket."""
    for bucket in iter_hf_buckets(model_chunks, hf_config, dtype=dtype, bucket_bytes=bucket_bytes, counts=counts):
        yield from bucket

"""Hugging Face safetensors <-> megatron-core model chunks (this rank's TP/PP slices only).

* :func:`load_hf_weights` reads the checkpoint's safetensors shards directly
  (``safe_open`` + ``get_slice``) and materialises only the rows/columns of the
  parameters this rank holds (its pipeline stage's layers, its TP shard).
* :func:`iter_hf_tensors` streams full HF-named tensors, one at a time, to every
  rank: TP shards are all-gathered per tensor on the stage that owns it, then
  the tensor is broadcast over the pipeline group.  Peak extra memory is about
  two copies of one tensor.  Used by export and by the rollout weight sync.
* :func:`export_hf` writes HF safetensors (sharded, with an index), config,
  generation config and tokenizer files, from rank 0, atomically.

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
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from mcpo_megatron.files import apply_umask
from mcpo_megatron.parallel.distributed import all_gather, barrier, broadcast

from mcpo_megatron.models import weights
from mcpo_megatron.models.builder import unwrap
from mcpo_megatron.models.registry import MegatronShape, megatron_shape

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


def _chunks(model_chunks) -> list:
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
    """
    reader = SafetensorsReader(hf_dir)
    try:
        for model in _chunks(model_chunks):
            shape = model.mcpo_shape
            params = dict(model.named_parameters())
            loaded = set()
            for rule, name in _load_rules(model):
                for hf_name, expected in zip(rule.hf, weights.hf_tensor_shapes(shape, rule)):
                    got = reader.shape(hf_name)
                    if got != expected:
                        raise ValueError(
                            f"checkpoint tensor {hf_name} has shape {list(got)}, expected {list(expected)} "
                            f"from config.json in {hf_dir}; the config and the weights do not match"
                        )
                if name not in params:
                    raise KeyError(f"megatron model has no parameter {name!r} (mapping for {rule.hf})")
                shard = weights.hf_to_megatron_shard(rule, reader.read, shape, _tp_rank(expert=rule.expert is not None))
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


def _model_stream_plan(shape: MegatronShape, config, te: bool) -> list[tuple[int, weights.ParamRule]]:
    """(owning pipeline rank, rule) for the whole model in HF order (virtual stages included)."""
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
    plan = []
    for rule in weights.param_rules(shape, te=te):
        if rule.layer is not None:
            plan.append((owner[rule.layer], rule))
        else:
            plan.append((0 if rule.mcore.startswith("embedding.") else pp - 1, rule))
    return plan


@torch.no_grad()
def iter_hf_tensors(
    model_chunks, hf_config: Any = None, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for the whole model, in HF order, on every rank.

    Order: embeddings, layers 0..L-1 (a MoE layer: router, then experts 0..E-1),
    final norm, lm_head (absent when tied).  A collective: every rank must iterate it
    to the end, in step.  Tensors are on the model's device, in ``dtype`` (default:
    the model's parameter dtype, ``config.params_dtype``: the same on every rank, whatever parameter a
    stage happens to hold first, so the broadcasts below pair tensors of one size); they are fresh
    tensors the caller may keep.
    """
    from megatron.core import parallel_state as ps

    from mcpo_megatron.models.builder import expert_offset, stage_layers

    chunks = _chunks(model_chunks)
    model = chunks[0]
    shape = model.mcpo_shape
    if hf_config is not None:
        shape = megatron_shape(hf_config, shape.tp, shape.ep)
    te = model.mcpo_transformer_impl == "transformer_engine"
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    my_stage = ps.get_pipeline_model_parallel_rank()
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    etp_group, ep_group = ps.get_expert_tensor_parallel_group(), ps.get_expert_model_parallel_group()
    first_expert = expert_offset(model)
    # local megatron name of every rule held by this rank -> parameter
    local: dict[tuple[str, int | None, int | None], torch.Tensor] = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        layers = stage_layers(chunk)
        experts = range(first_expert, first_expert + shape.num_local_experts) if shape.is_moe else None
        for rule in weights.param_rules(shape, te=te, layers=layers, pre_process=chunk.pre_process,
                                        post_process=chunk.post_process, experts=experts):
            local[(rule.mcore, rule.layer, rule.expert)] = params[rule.mcore_name(layers.start, first_expert)]
    out_dtype = dtype or model.config.params_dtype
    device = next(chunks[0].parameters()).device

    for stage, rule in _model_stream_plan(shape, model.config, te):
        full: dict[str, torch.Tensor] = {}
        is_expert = rule.expert is not None
        owner_ep = rule.expert // shape.num_local_experts if is_expert else ep_rank
        if stage == my_stage and owner_ep == ep_rank:
            param = local[(rule.mcore, rule.layer, rule.expert)].detach()
            group, n = (etp_group, ps.get_expert_tensor_parallel_world_size()) if is_expert else (tp_group, tp)
            # Shards and full tensors are on the model's device (NCCL on GPUs).
            shards = [param] * n if rule.kind == "copy" or n == 1 else all_gather(param, group)
            # copy=True: never hand out (a view of) the live parameter
            full = {k: v.to(out_dtype, copy=True).contiguous()
                    for k, v in weights.megatron_shards_to_hf(rule, shards, shape).items()}
            del shards
        for hf_name, hf_shape in zip(rule.hf, weights.hf_tensor_shapes(shape, rule)):
            tensor = full.get(hf_name)
            if is_expert and ep > 1 and stage == my_stage:
                if tensor is None:
                    tensor = torch.empty(hf_shape, dtype=out_dtype, device=device)
                broadcast(tensor, src=owner_ep, group=ep_group)
            if pp > 1:
                if tensor is None:
                    tensor = torch.empty(hf_shape, dtype=out_dtype, device=device)
                broadcast(tensor, src=stage, group=pp_group)
            yield hf_name, tensor
        full = {}


def _save_config(hf_config: Any, out: Path, dtype: torch.dtype) -> None:
    dtype_name = str(dtype).replace("torch.", "")
    if hasattr(hf_config, "save_pretrained"):
        cfg = hf_config.__class__.from_dict(hf_config.to_dict())
        # transformers 5.x calls it ``dtype`` (``torch_dtype`` is deprecated), 4.x ``torch_dtype``
        setattr(cfg, "dtype" if hasattr(cfg, "dtype") else "torch_dtype", dtype_name)
        cfg.save_pretrained(str(out))
    else:
        d = dict(hf_config)
        d["torch_dtype"] = dtype_name
        (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True))


def _save_generation_config(hf_config: Any, out: Path, source_dirs: Sequence[Path]) -> None:
    for d in source_dirs:
        if (d / "generation_config.json").is_file():
            shutil.copy2(d / "generation_config.json", out / "generation_config.json")
            return
    try:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(hf_config).save_pretrained(str(out))
    except Exception:  # noqa: BLE001 - a dict config or an old transformers: no generation config
        pass


def export_hf(
    model_chunks,
    hf_config: Any,
    out_dir: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> str | None:
    """Write the model as a HF checkpoint directory; a collective, rank 0 writes.

    Safetensors shards of at most ``max_shard_bytes`` (one ``model.safetensors``
    when everything fits, else ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``), ``config.json`` (dtype updated),
    ``generation_config.json`` and the tokenizer files found in
    ``tokenizer_dir``.  Written into a temporary sibling directory that is
    renamed to ``out_dir`` at the end (an existing ``out_dir`` is replaced).
    Returns ``out_dir`` on rank 0 and None elsewhere.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(out_dir)
    tmp = None
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    chunks = _chunks(model_chunks)
    out_dtype = dtype or chunks[0].config.params_dtype
    try:
        shards = _ShardWriter(tmp, max_shard_bytes) if rank == 0 else None
        for name, tensor in iter_hf_tensors(chunks, hf_config, dtype=out_dtype):  # collective: every rank iterates
            if shards is not None:
                shards.add(name, tensor)
        if rank == 0:
            shards.finish()
            _save_config(hf_config, tmp, out_dtype)
            _save_generation_config(hf_config, tmp, [Path(tokenizer_dir)] if tokenizer_dir else [])
            _copy_tokenizer(tokenizer_dir, tmp)
            apply_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600 would hide the export from colleagues
            _replace_dir(tmp, out)
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    return str(out) if rank == 0 else None


class _ShardWriter:
    """Safetensors shards of at most ``max_shard_bytes`` in ``directory``; :meth:`finish` gives them their final
    names: one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``."""

    def __init__(self, directory: Path, max_shard_bytes: int):
        self.dir, self.max_shard_bytes = directory, max_shard_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffer_bytes = 0
        self.files: list[list[str]] = []  # the tensor names of each shard written
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self.buffer[name] = tensor.cpu()
        self.buffer_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self.buffer:
            save_file(self.buffer, str(self.dir / f"part-{len(self.files):05d}.safetensors"), metadata={"format": "pt"})
            self.files.append(list(self.buffer))
            self.buffer, self.buffer_bytes = {}, 0

    def finish(self) -> None:
        self._flush()
        n = len(self.files)
        weight_map = {}
        for i, names in enumerate(self.files):
            final = SAFE_SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f"part-{i:05d}.safetensors", self.dir / final)
            weight_map.update({k: final for k in names})
        if n > 1:
            (self.dir / SAFE_INDEX).write_text(json.dumps(
                {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


def _copy_tokenizer(tokenizer_dir: str | os.PathLike | None, out: Path) -> None:
    if tokenizer_dir:
        for fname in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / fname).is_file():
                shutil.copy2(Path(tokenizer_dir) / fname, out / fname)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` is moved aside first and removed after."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

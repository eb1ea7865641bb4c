"""A megatron-core model written as a Hugging Face checkpoint directory: :func:`export_hf` streams the full HF
tensors (:func:`~mcpo_megatron.models.hf_io.iter_hf_tensors`, a collective) and rank 0 writes safetensors
shards (with an index when there are several), config, generation config and tokenizer files into a temporary
sibling directory that replaces ``out_dir`` at the end: an interrupted export never leaves a half-written one.
A model loaded from a multimodal checkpoint (``source_dir``, a ``...ForConditionalGeneration``) is written back in
that form (:mod:`~mcpo_megatron.models.multimodal`)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from mcpo_megatron.files import apply_umask
from mcpo_megatron.parallel.distributed import barrier

from mcpo_megatron.models.hf_io import SAFE_INDEX, SAFE_SINGLE, SafetensorsReader, chunks_of, iter_hf_tensors
from mcpo_megatron.models.multimodal import checkpoint_name, is_multimodal_dir, untrained_names

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
# What a multimodal checkpoint's processor reads besides the tokenizer (images and videos).
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


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


def _save_source_config(source: Path, out: Path, dtype: torch.dtype) -> None:
    """A multimodal checkpoint's own config.json, its dtype (and its language model's) set to the export's."""
    d = json.loads((source / "config.json").read_text())
    dtype_name = str(dtype).replace("torch.", "")
    for node in (d, d.get("text_config") or {}):
        node["dtype"] = dtype_name
        node.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True))


def _copy_untrained(source: Path, shards: "_ShardWriter") -> None:
    """Every tensor of the multimodal checkpoint at ``source`` outside its language model (the vision tower,
    ``mtp.*``) into ``shards``, as stored: same dtype, same bytes."""
    reader = SafetensorsReader(source)
    try:
        for name in untrained_names(reader.weight_map):
            shards.add(name, reader.full(name))
    finally:
        reader.close()


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
    source_dir: str | os.PathLike | None = None,
) -> str | None:
    """Write the model as a HF checkpoint directory; a collective, rank 0 writes.

    Safetensors shards of at most ``max_shard_bytes`` (one ``model.safetensors``
    when everything fits, else ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``), ``config.json`` (dtype updated),
    ``generation_config.json`` and the tokenizer files found in
    ``tokenizer_dir``.  Written into a temporary sibling directory that is
    renamed to ``out_dir`` at the end (an existing ``out_dir`` is replaced).
    Returns ``out_dir`` on rank 0 and None elsewhere.

    ``source_dir``: the checkpoint the model was loaded from. When it is multimodal, the language model's tensors
    take its names (``model.language_model.*``), its other tensors (vision tower, ``mtp.*``) are copied as they
    are, and its config.json and processor files come along.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(out_dir)
    tmp = None
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    chunks = chunks_of(model_chunks)
    out_dtype = dtype or chunks[0].config.params_dtype
    source = Path(source_dir) if source_dir is not None else None
    multimodal = source is not None and is_multimodal_dir(source)
    try:
        shards = _ShardWriter(tmp, max_shard_bytes) if rank == 0 else None
        for name, tensor in iter_hf_tensors(chunks, hf_config, dtype=out_dtype):  # collective: every rank iterates
            if shards is not None:
                shards.add(checkpoint_name(name, multimodal), tensor)
        if rank == 0:
            if multimodal:
                _copy_untrained(source, shards)
            shards.finish()
            if multimodal:
                _save_source_config(source, tmp, out_dtype)
                _copy_files(source, tmp, PROCESSOR_FILES)
            else:
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
        # the stream's tensors are views of reused buffers or of the parameters: keep a copy
        self.buffer[name] = tensor.to("cpu", copy=True)
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
        _copy_files(Path(tokenizer_dir), out, TOKENIZER_FILES)


def _copy_files(source: Path, out: Path, names: Sequence[str]) -> None:
    for fname in names:
        if (source / fname).is_file():
            shutil.copy2(source / fname, out / fname)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` is moved aside first and removed after."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

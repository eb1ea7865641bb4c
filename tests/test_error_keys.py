"""Error messages name only config keys that exist: every ``a.b.c`` word in the package's error and warning
messages that looks like a config key (its first part is a section of the schema, or its last part the name
of a schema field) must be a key of the schema. Lower layers name their own arguments, not config keys."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mcpo_megatron.config.loading import _schema_keys

PACKAGE = Path(__file__).resolve().parents[1] / "mcpo_megatron"
DOTTED = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?![\w/(-])")
MESSAGE_CALLS = {"error", "warn", "warning", "print"}   # Checks.error/warn, warnings.warn, log.warning, print
FILE_SUFFIXES = {"json", "jsonl", "yaml", "py", "pt", "parquet", "safetensors", "sh"}  # metrics.jsonl is a file


def _messages(tree: ast.AST):
    """The expressions that make an error or warning message: what a ``raise`` raises, and the arguments of the
    calls above."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            yield node.exc
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in MESSAGE_CALLS:
                yield node


def named_keys(source: str) -> list[tuple[str, int]]:
    """(dotted word, line) for every dotted word in the literal text of ``source``'s messages."""
    found = []
    for message in _messages(ast.parse(source)):
        for node in ast.walk(message):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [(word, node.lineno) for word in DOTTED.findall(node.value)]
    return found


def looks_like_a_config_key(word: str, keys: set[str]) -> bool:
    parts = word.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return False
    sections = {k for k in keys if "." not in k}
    fields = {k.rpartition(".")[2] for k in keys}
    return parts[0] in sections or parts[-1] in fields


def test_the_scan_finds_a_key_that_does_not_exist():
    keys = set(_schema_keys())
    source = 'raise ValueError(f"clip_low={x}: must be in (0, 1) (actor.clip_ratio_low); see config.json")'
    words = [w for w, _ in named_keys(source)]
    assert words == ["actor.clip_ratio_low", "config.json"]
    assert [w for w in words if looks_like_a_config_key(w, keys) and w not in keys] == ["actor.clip_ratio_low"]


def test_messages_name_only_existing_config_keys():
    keys = set(_schema_keys())
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for word, line in named_keys(path.read_text(encoding="utf-8")):
            if looks_like_a_config_key(word, keys) and word not in keys:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {word}")
    assert not wrong, "messages name config keys that do not exist:\n" + "\n".join(wrong)

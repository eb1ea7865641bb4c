"""Error messages name only config keys that exist: every ``a.b.c`` word in the package's error and warning
messages that looks like a config key (its first part is a section of the schema, or its last part the name
of a schema field) must be a key of the schema. Lower layers name their own arguments, not config keys."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import typing
from dataclasses import fields

from mcpo_megatron.config.loading import _dataclass_of, _field_types, _schema_keys
from mcpo_megatron.config.schema import Config

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


def mapping_keys(node=Config, prefix: str = "") -> set[str]:
    """The schema's free-form mapping fields (``rollout.engine_kwargs``): the keys beneath them are the user's."""
    out = set()
    for f in fields(node):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = _field_types(node)[f.name]
        if dict in (typing.get_origin(tp), *(typing.get_origin(a) for a in typing.get_args(tp))):
            out.add(key)
        sub = _dataclass_of(tp)
        if sub is not None:
            out |= mapping_keys(sub, key)
    return out


def is_a_key(word: str, keys: set[str], mappings: set[str]) -> bool:
    return word in keys or any(word.startswith(m + ".") for m in mappings)


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


def test_keys_beneath_a_mapping_field_are_the_users():
    keys, mappings = set(_schema_keys()), mapping_keys()
    assert "rollout.engine_kwargs" in mappings
    assert is_a_key("rollout.engine_kwargs.async_scheduling", keys, mappings)
    assert not is_a_key("rollout.engine_kwargs_x.async_scheduling", keys, mappings)
    assert not is_a_key("rollout.temperature.x", keys, mappings)


def test_messages_name_only_existing_config_keys():
    keys, mappings = set(_schema_keys()), mapping_keys()
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for word, line in named_keys(path.read_text(encoding="utf-8")):
            if looks_like_a_config_key(word, keys) and not is_a_key(word, keys, mappings):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {word}")
    assert not wrong, "messages name config keys that do not exist:\n" + "\n".join(wrong)

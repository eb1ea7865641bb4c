"""Loading a config: schema defaults <- algorithm preset <- YAML (with its ``_base_`` chain) <- ``key=value``
overrides, with every unknown key and every wrong type reported at once (with close matches)."""

from __future__ import annotations

import copy
import difflib
import functools
import os
import re
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mcpo_megatron.config import presets
from mcpo_megatron.config.errors import ConfigError
from mcpo_megatron.config.schema import Config

BASE_KEY = "_base_"
_WORLD_SIZE_RE = re.compile(r"^\s*#\s*world_size\s*:\s*(\d+)\s*$", re.MULTILINE)


def as_dictconfig(cfg: Any) -> DictConfig:
    if isinstance(cfg, DictConfig):
        return cfg
    if is_dataclass(cfg):
        return OmegaConf.structured(cfg)
    raise TypeError(f"expected a Config or DictConfig, got {type(cfg).__name__}")


def _nest(dotted: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


@functools.lru_cache(maxsize=None)
def _schema_keys(node: Any = Config, prefix: str = "") -> list[str]:
    """All dotted keys (sections and leaves) of the schema."""
    out = []
    for f in fields(node):
        key = f"{prefix}.{f.name}" if prefix else f.name
        out.append(key)
        sub = _dataclass_of(_field_types(node)[f.name])
        if sub is not None:
            out.extend(_schema_keys(sub, key))
    return out


def _dataclass_of(tp: Any) -> Any:
    """The dataclass a field annotation holds (``X`` or ``Optional[X]``), else None."""
    for candidate in (tp, *typing.get_args(tp)):
        if isinstance(candidate, type) and is_dataclass(candidate):
            return candidate
    return None


def _field_types(node: Any) -> dict[str, Any]:
    return typing.get_type_hints(node)  # resolves the string annotations of `from __future__ import annotations`


def _suggest(key: str) -> str:
    all_keys = _schema_keys()
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in all_keys if k.rpartition(".")[0] == parent]
    # The right name in the wrong section first, then near-misses among siblings, then anywhere.
    close = [k for k in all_keys if k.rpartition(".")[2] == leaf and k != key]
    close += [f"{parent}.{s}" if parent else s for s in difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)]
    if not close:
        close = [k for k in all_keys if k.rpartition(".")[2] in
                 difflib.get_close_matches(leaf, [a.rpartition(".")[2] for a in all_keys], n=3, cutoff=0.75)]
    if not close:
        close = difflib.get_close_matches(key, all_keys, n=3, cutoff=0.6)
    close = list(dict.fromkeys(close))[:3]
    if close:
        return "did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
    if parent and siblings:
        return f"keys of '{parent}' are: {', '.join(siblings)}"
    return "top-level sections are: " + ", ".join(f.name for f in fields(Config))


@functools.lru_cache(maxsize=None)
def _section_keys(node: Any = Config, prefix: str = "") -> dict[str, bool]:
    """Dotted keys of the schema's sections -> whether the section may be null (Optional)."""
    out = {}
    for f in fields(node):
        tp = _field_types(node)[f.name]
        sub = _dataclass_of(tp)
        if sub is not None:
            key = f"{prefix}.{f.name}" if prefix else f.name
            out[key] = type(None) in typing.get_args(tp)
            out.update(_section_keys(sub, key))
    return out


def _drop_empty_sections(data: dict, prefix: str = "") -> dict:
    """``rollout:`` with every entry commented out parses as null; treat it as an empty section."""
    sections = _section_keys()
    out = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if v is None and sections.get(key) is False:
            continue
        out[k] = _drop_empty_sections(v, key) if isinstance(v, dict) else v
    return out


def _readable(e: OmegaConfBaseException, key: str, value: Any, origin: str) -> str:
    full = key or getattr(e, "full_key", None) or "<top level>"
    msg = (getattr(e, "msg", None) or str(e)).splitlines()[0]
    if type(e).__name__ in ("ConfigKeyError", "ConfigAttributeError") or msg.startswith("Key '"):
        full = getattr(e, "full_key", None) or key
        return f"{full}: unknown key (from {origin}); {_suggest(full)}"
    if "is not a ListConfig" in msg:
        return f"{full}={value!r}: expected a list (from {origin}); write e.g. {full}=[a,b] or a YAML list"
    if full in _section_keys() or "is not a subclass of" in msg or "is not a DictConfig" in msg:
        return f"{full}={value!r}: expected a section of keys (from {origin}); see `mcpo config` for its structure"
    return f"{full}={value!r}: {msg} (from {origin}); give a value of the field's type"


def _deep_update(dst: dict, src: dict) -> None:
    """Merge plain nested dicts like OmegaConf does: mappings merge key by key, anything else replaces."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)


def _apply(cfg: DictConfig, data: Any, origin: str, problems: list[str], prefix: str = "") -> DictConfig:
    """Merge ``data`` (the value at dotted ``prefix``) into ``cfg``. A subtree that fails is split into its
    children, so that every bad key is reported while good subtrees cost one merge each."""
    try:
        return OmegaConf.merge(cfg, _nest(prefix, data) if prefix else data)
    except OmegaConfBaseException as e:
        if isinstance(data, dict) and data and (not prefix or prefix in _section_keys()):
            for k, v in data.items():
                cfg = _apply(cfg, v, origin, problems, f"{prefix}.{k}" if prefix else str(k))
        else:
            problems.append(_readable(e, prefix, data, origin))
    return cfg


def _read_yaml(path: str, chain: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """Return [(origin, dict)] for ``path`` and its ``_base_`` ancestors, ancestors first."""
    path = os.path.abspath(path)
    if path in chain:
        raise ConfigError(f"_base_ cycle: {' -> '.join(chain + (path,))}; remove one of the _base_ entries")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}; give the path to a YAML file (see configs/)")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # YAML syntax errors come from several libraries
        raise ConfigError(f"{path}: cannot parse YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    bases = data.pop(BASE_KEY, None)
    data = _drop_empty_sections(data)
    out: list[tuple[str, dict]] = []
    for base in [bases] if isinstance(bases, str) else (bases or []):
        out.extend(_read_yaml(os.path.join(os.path.dirname(path), base), chain + (path,)))
    out.append((path, data))
    return out


def parse_overrides(overrides: Iterable[str]) -> dict:
    """``["a.b=1", "c=[x,y]"]`` -> nested dict (values parsed as YAML, like OmegaConf's dotlist)."""
    bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
    if bad:
        raise ConfigError([f"override {o!r}: not of the form key=value; write e.g. rollout.n=8" for o in bad])
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=False)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot parse overrides {list(overrides)}: {e}") from None


def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> DictConfig:
    """Defaults <- preset of ``algorithm.name`` <- YAML at ``path`` (with its ``_base_`` chain) <- ``key=value``
    overrides. The preset (:mod:`~mcpo_megatron.config.presets`) is the one the YAML and overrides name, so
    explicit keys always override it.

    Returns a structured (typed, struct-mode) DictConfig of :class:`Config`: attribute access like
    ``cfg.rollout.n``; assigning a wrong type or reading an unknown key raises. Raises :class:`ConfigError`
    listing every unknown key (with close matches) and every value of the wrong type.
    """
    cfg = OmegaConf.structured(Config)
    problems: list[str] = []
    sources = _read_yaml(path) if path else []
    overrides = list(overrides)
    if overrides:
        sources.append(("overrides", parse_overrides(overrides)))
    combined: dict = {}
    for _, data in sources:
        _deep_update(combined, data)
    algorithm = combined.get("algorithm")
    name = algorithm.get("name", presets.DEFAULT_PRESET) if isinstance(algorithm, dict) else presets.DEFAULT_PRESET
    if name not in presets.PRESETS:
        raise ConfigError(f"algorithm.name={name!r}: not an algorithm preset; use one of "
                          f"{' | '.join(presets.PRESETS)} (explicit algorithm.* keys then override its defaults)",
                          header="cannot load config")
    cfg = OmegaConf.merge(cfg, presets.algorithm_defaults(name))
    try:
        cfg = OmegaConf.merge(cfg, combined)  # one merge: each OmegaConf merge copies the whole tree
    except OmegaConfBaseException:
        for origin, data in sources:  # slow path, only to report every problem with where it came from
            cfg = _apply(cfg, data, origin, problems)
        if not problems:  # pragma: no cover - the leaf-wise merge accepted what the single merge refused
            raise
    if problems:
        raise ConfigError(problems, header="cannot load config")
    try:
        OmegaConf.resolve(cfg)  # ${...} interpolations: fail here, not deep inside a run
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key + ': ' if key else ''}cannot resolve interpolation: {str(e).splitlines()[0]}; "
                          f"fix the ${{...}} reference", header="cannot load config") from None
    OmegaConf.set_readonly(cfg, False)
    OmegaConf.set_struct(cfg, True)
    _restore_boolean_words(cfg)
    _resolve_null_defaults(cfg)
    return cfg


def _resolve_null_defaults(cfg: DictConfig) -> None:
    """Keys whose null means "follow another key", resolved once so every reader (and the saved config.yaml)
    sees the value in force: ``algorithm.tis.enable`` null is on exactly when ``trainer.max_staleness > 0``
    (docs/algorithms.md §13: decoupled PPO's behaviour weight)."""
    if cfg.algorithm.tis.enable is None:
        cfg.algorithm.tis.enable = cfg.trainer.max_staleness > 0


# YAML 1.1 reads off/no/on/yes as booleans, which a str field then holds as "False"/"True"; a choice field that
# offers one of these words gets the word back (model.moe_routing_replay=off).
_BOOLEAN_WORDS = {"False": ("off", "no", "false"), "True": ("on", "yes", "true")}


def _restore_boolean_words(node: DictConfig) -> None:
    schema = OmegaConf.get_type(node)
    if not is_dataclass(schema):
        return
    for f in fields(schema):
        value = node[f.name]
        if isinstance(value, DictConfig):
            _restore_boolean_words(value)
        elif "choices" in f.metadata and value in _BOOLEAN_WORDS and value not in f.metadata["choices"]:
            words = [w for w in _BOOLEAN_WORDS[value] if w in f.metadata["choices"]]
            if words:
                node[f.name] = words[0]


def declared_world_size(path: str) -> Optional[int]:
    """The intended world size a YAML declares with a ``# world_size: N`` comment line (this file first,
    then its ``_base_`` chain, nearest first); None when none does."""
    for origin, _ in reversed(_read_yaml(path)):
        with open(origin) as f:
            m = _WORLD_SIZE_RE.search(f.read())
        if m:
            return int(m.group(1))
    return None


def to_dict(cfg: Any) -> dict:
    return OmegaConf.to_container(as_dictconfig(cfg), resolve=True)


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(as_dictconfig(cfg), resolve=True)


"""Algorithm presets: ``algorithm.name`` picks an algorithm, and the preset sets its defaults.

A config is built as ``schema defaults <- preset(algorithm.name) <- YAML <- key=value overrides``, so an
explicit key always overrides the preset. Some keys *define* an algorithm (DAPO has no hinge-KL, GSPO has
sequence-level ratios): overriding one of those to another value makes a different algorithm under the same
name, and :func:`contradictions` reports it (``validate`` rejects the config, naming both keys).

Values follow docs/algorithms.md (§2-§10); [R] marks a choice made here where the papers leave room.

=========  ==============  ========================  ============  =====  ========  ======  ===  =====
preset     adv_estimator   loss_agg_mode             clip low/high ratio  reweight  hinge   DS   GCPO
=========  ==============  ========================  ============  =====  ========  ======  ===  =====
mcpo       grpo            seq-mean-token-mean       0.2 / 0.28    token  on        on      off  off
dapo       grpo            seq-mean-token-mean [R]   0.2 / 0.28    token  off       off     on   off
grpo       grpo            seq-mean-token-mean       0.2 / 0.2     token  off       off     off  off
drgrpo     drgrpo          seq-mean-token-sum-norm   0.2 / 0.2     token  off       off     off  off
gspo       grpo            seq-mean-token-mean       3e-4 / 4e-4   seq    off       off     off  off
gcpo       grpo            seq-mean-token-mean       3e-4 / 4e-4   seq    off       off     off  on
=========  ==============  ========================  ============  =====  ========  ======  ===  =====

* ``dapo`` is DAPO as published, dynamic sampling (DS) included; the MCPO paper's comparison arm without it is
  ``algorithm.name=dapo algorithm.filter_groups.enable=false`` (docs/algorithms.md §2: both are run). Its loss aggregation
  is seq-mean-token-mean like MCPO's, not DAPO's token-mean, so the two arms differ only by MCPO's components
  (docs/algorithms.md §4 [R]).
* ``gcpo`` uses sequence-level ratios with GSPO's clip widths (docs/algorithms.md §5, §10 [R]) and needs
  ``algorithm.gcpo.references``.
* MCPO combines with GSPO's sequence ratios and with GCPO's injection (docs/algorithms.md §2, §5, §10), so ``mcpo`` fixes
  neither; it is contradicted only when both of its components are switched off (that is DAPO without DS).
"""

from __future__ import annotations

from typing import Any

# The keys (under ``algorithm.``) every preset sets; a preset's value for each.
PRESET_KEYS = ("adv_estimator", "loss_agg_mode", "clip_ratio_low", "clip_ratio_high", "ratio_level",
               "mcpo.reweight", "mcpo.hinge_kl.enable", "filter_groups.enable", "gcpo.enable")


# One row per preset, in the order of PRESET_KEYS.
_ROWS: dict[str, tuple] = {
    "mcpo": ("grpo", "seq-mean-token-mean", 0.2, 0.28, "token", True, True, False, False),
    "dapo": ("grpo", "seq-mean-token-mean", 0.2, 0.28, "token", False, False, True, False),
    "grpo": ("grpo", "seq-mean-token-mean", 0.2, 0.2, "token", False, False, False, False),
    "drgrpo": ("drgrpo", "seq-mean-token-sum-norm", 0.2, 0.2, "token", False, False, False, False),
    "gspo": ("grpo", "seq-mean-token-mean", 3e-4, 4e-4, "sequence", False, False, False, False),
    "gcpo": ("grpo", "seq-mean-token-mean", 3e-4, 4e-4, "sequence", False, False, False, True),
}
PRESETS: dict[str, dict[str, Any]] = {name: dict(zip(PRESET_KEYS, row, strict=True)) for name, row in _ROWS.items()}
DEFAULT_PRESET = "mcpo"

# Keys that define an algorithm: (value the preset fixes, why, which preset has the other value).
_MCPO_PARTS = "advantage reweighting and the hinge-KL are MCPO's components"
_DEFINING: dict[str, dict[str, tuple[Any, str, str]]] = {
    name: {
        "mcpo.reweight": (False, _MCPO_PARTS, "mcpo"),
        "mcpo.hinge_kl.enable": (False, _MCPO_PARTS, "mcpo"),
        "adv_estimator": (PRESETS[name]["adv_estimator"],
                          "Dr.GRPO is the estimator without std normalisation",
                          "grpo" if name == "drgrpo" else "drgrpo"),
        "ratio_level": (PRESETS[name]["ratio_level"],
                        "GSPO and GCPO use sequence-level ratios, the others token-level ones",
                        "grpo" if name in ("gspo", "gcpo") else "gspo"),
        "gcpo.enable": (PRESETS[name]["gcpo.enable"], "reference-answer injection is GCPO's",
                        "gspo" if name == "gcpo" else "gcpo"),
    }
    for name in PRESETS if name != "mcpo"
}


def algorithm_defaults(name: str) -> dict:
    """The nested ``{"algorithm": {...}}`` block preset ``name`` merges under the YAML and overrides."""
    out: dict = {"name": name}
    for dotted, value in PRESETS[name].items():
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return {"algorithm": out}


_MISSING = object()


def _value(algorithm: Any, dotted: str) -> Any:
    """``algorithm`` section (dataclass, DictConfig or flat dict with ``algorithm.`` keys) -> value at ``dotted``."""
    if isinstance(algorithm, dict):
        return algorithm.get(f"algorithm.{dotted}", _MISSING)
    node = algorithm
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _name(algorithm: Any) -> Any:
    return algorithm.get("algorithm.name") if isinstance(algorithm, dict) else algorithm.name


def overrides(algorithm: Any) -> dict[str, Any]:
    """``algorithm.<key>`` -> value, for the preset keys whose value differs from ``algorithm.name``'s preset
    (explicit overrides). Empty for an unknown name. Accepts the algorithm section or a flat config dict (where
    a key that is absent counts as not overridden)."""
    preset = PRESETS.get(_name(algorithm))
    if preset is None:
        return {}
    out = {}
    for key, want in preset.items():
        have = _value(algorithm, key)
        if have is not _MISSING and have != want:
            out[f"algorithm.{key}"] = have
    return out


def contradictions(algorithm: Any) -> list[tuple[str, Any, str, str]]:
    """Overrides that turn ``algorithm.name``'s preset into another algorithm: ``(key, value, rule, fix)``."""
    name = _name(algorithm)
    out = []
    if name == "mcpo":
        if not algorithm.mcpo.reweight and not algorithm.mcpo.hinge_kl.enable:
            out.append(("algorithm.mcpo.hinge_kl.enable", False,
                        "contradicts algorithm.name=mcpo together with algorithm.mcpo.reweight=False (with both of "
                        "MCPO's components off the run is DAPO without dynamic sampling)",
                        "use algorithm.name=dapo algorithm.filter_groups.enable=false, or keep one component on"))
        return out
    for key, (fixed, why, other) in _DEFINING.get(name, {}).items():
        value = _value(algorithm, key)
        if value != fixed:
            out.append((f"algorithm.{key}", value,
                        f"contradicts algorithm.name={name} (the {name} preset fixes {key}={fixed}: {why})",
                        f"use algorithm.name={other}, or drop the algorithm.{key} override"))
    return out


OWNED_KEYS = ("algorithm.name", *(f"algorithm.{k}" for k in PRESET_KEYS))  # what a preset label summarises


def label(flat_config: dict[str, Any]) -> str | None:
    """A run's algorithm as a report label, from its flattened config: ``dapo``, or with the preset keys it
    overrides, ``dapo (filter_groups.enable=False)``. None when the name is not a preset (older runs)."""
    name = flat_config.get("algorithm.name")
    if name not in PRESETS:
        return None
    changed = overrides(flat_config)
    if not changed:
        return name
    return f"{name} (" + ", ".join(f"{k.removeprefix('algorithm.')}={v}" for k, v in changed.items()) + ")"


def describe(algorithm: Any) -> str:
    """One line for ``mcpo config``: which preset applied and which of its keys the config overrides."""
    name = _name(algorithm)
    changed = overrides(algorithm)
    text = f"algorithm preset '{name}' (algorithm.name) sets " + ", ".join(
        f"{k}={v}" for k, v in PRESETS[name].items())
    if changed:
        text += "; overridden by explicit keys: " + ", ".join(f"{k}={v}" for k, v in changed.items())
    return text

"""``load_prompts``: one entry point for every prompt set (training and evaluation)."""

from __future__ import annotations

import random

from mcpo_megatron.data.hub import HUB_NAMES, load_file_set, load_hub_set
from mcpo_megatron.data.offline import load_arith, load_champ, load_reasoning_gym
from mcpo_megatron.data.records import LoadReport, PromptRecord
from mcpo_megatron.data.templates import TEMPLATES

SPECS = (*HUB_NAMES, "arith", "reasoning_gym:<task>[+<task>]", "champ", "champ:numeric", "jsonl", "parquet")


def load_prompts(
    spec: str,
    *,
    path: str | None = None,
    split: str = "train",
    num_samples: int | None = None,
    seed: int = 0,
    template: str = "dapo",
) -> tuple[list[PromptRecord], LoadReport]:
    """Load, dedupe and format a prompt set.

    Args:
        spec: ``dapo_math_17k``, ``aime_2024``, ``aime_2025``, ``amc_2023`` (hub sets; ``path``
            overrides the hub name with a local parquet/jsonl file or folder, or another hub
            name), ``jsonl`` / ``parquet`` (a local file in the hub schema, ``path`` required),
            ``arith[:ops=+-,digits=1]``, ``reasoning_gym:<task>[+<task>...]``, ``champ[:numeric]``.
        split: hub split / file-name filter; generated sets draw a separate stream for non-train.
        num_samples: keep a seeded subset of this many unique prompts (None: all; the generated
            sets use it as their size).
        seed: seed of the subset (and of the generators).
        template: prompt template name (``dapo``, ``boxed``, ``number``, ``raw``).

    Returns:
        ``(records, report)``; see :class:`LoadReport` for the dedupe counts.
    """
    if template not in TEMPLATES:
        raise ValueError(f"template={template!r} is not one of {sorted(TEMPLATES)}; pick one of those names")
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} must be >= 1 or None (all)")
    name = spec.partition(":")[0]
    kw = dict(split=split, template=template)
    if name in HUB_NAMES:
        records, report = load_hub_set(spec, path=path, **kw)
    elif name in ("jsonl", "parquet"):
        records, report = load_file_set(spec, path=path, **kw)
    elif name == "arith":
        return load_arith(spec, num_samples=num_samples, seed=seed, **kw)
    elif name == "reasoning_gym":
        records, report = load_reasoning_gym(spec, num_samples=num_samples, seed=seed, **kw)
        return records, report
    elif name == "champ":
        records, report = load_champ(spec, num_samples=num_samples, seed=seed, **kw)
    else:
        raise ValueError(f"spec={spec!r} is not a known prompt set; use one of {list(SPECS)}")
    if num_samples is not None and num_samples < len(records):
        keep = sorted(random.Random(seed).sample(range(len(records)), num_samples))
        records = [records[i] for i in keep]
    report.returned = len(records)
    return records, report

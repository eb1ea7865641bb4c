"""Loaders for the paper's data sets in the Hugging Face hub schema, with dedupe (spec section 7).

On a cluster the sets load by hub name through ``datasets.load_dataset``; offline they load
from a local parquet / jsonl file (or a folder of them) in the same schema. Two row schemas
are understood:

* verl / DAPO schema: ``prompt`` = chat messages ``[{"role": "user", "content": ...}]`` whose
  content is the DAPO template around the problem, ``reward_model.ground_truth``,
  ``data_source``, ``extra_info``;
* flat schema: ``problem`` (or ``question``) and ``answer`` (or ``ground_truth``), as many
  AIME-2025 / AMC-2023 uploads use.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Iterable

from mcpo_megatron.data.records import LoadReport, PromptRecord
from mcpo_megatron.data.templates import format_prompt, strip_dapo_template

#: Default hub names per spec. AIME-2025 and AMC-2023 have no canonical upload in the spec;
#: these are common ones in the flat schema; pass ``path=`` (a local file or another hub name)
#: to use a different copy.
HUB_NAMES: dict[str, str] = {
    "dapo_math_17k": "BytedTsinghua-SIA/DAPO-Math-17k",
    "aime_2024": "BytedTsinghua-SIA/AIME-2024",
    "aime_2025": "yentinglin/aime_2025",
    "amc_2023": "math-ai/amc23",
}

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_FLOAT_INTEGER = re.compile(r"^\s*([+-]?\d+)\.0+\s*$")


def canonical_answer(answer: Any) -> tuple[str, bool]:
    """``(canonical string, changed)``: integral floats lose their ``.0`` ("27.0" -> "27")."""
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer)), True
    text = str(answer).strip()
    m = _FLOAT_INTEGER.match(text)
    if m:
        return str(int(m.group(1))), True
    return text, text != str(answer)


def problem_uid(data_source: str, problem: str) -> str:
    """Stable id of a problem: the same text always gets the same id, across repeats and runs."""
    digest = hashlib.sha1(problem.strip().encode("utf-8")).hexdigest()[:16]
    return f"{data_source}-{digest}"


def _read_file(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json" and text.lstrip().startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    raise ValueError(f"path={str(path)!r}: unsupported file type {path.suffix!r}; use .parquet, .jsonl or .json")


def read_rows(path: str, split: str = "train") -> list[dict]:
    """Rows of a local file, a local folder (files whose name contains ``split``, else all), or a hub name."""
    p = Path(path)
    if p.is_file():
        return _read_file(p)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in (".parquet", ".jsonl", ".json"))
        chosen = [f for f in files if split in f.name] or files
        if not chosen:
            raise FileNotFoundError(f"path={path!r} holds no .parquet/.jsonl/.json files")
        return [row for f in chosen for row in _read_file(f)]
    if _HUB_NAME.fullmatch(path):
        return _load_hub(path, split)
    raise FileNotFoundError(f"path={path!r} is neither a local file/folder nor a hub name 'owner/name'")


def _load_hub(name: str, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a declared extra
        raise ImportError("loading from the hub needs the `datasets` package: pip install datasets") from e
    ds = datasets.load_dataset(name, split=split)
    return [dict(r) for r in ds]


def _row_problem_answer(row: dict, index: int) -> tuple[str, Any, str | None, dict]:
    """(problem, answer, data_source, extra) of one row in either schema."""
    extra: dict[str, Any] = {}
    if "prompt" in row and isinstance(row["prompt"], (list, tuple)) and "reward_model" in row:
        messages = list(row["prompt"])
        user = [m for m in messages if m.get("role") == "user"]
        if not user:
            raise ValueError(f"row {index}: 'prompt' has no user message: {messages!r}")
        problem = strip_dapo_template(user[-1]["content"])
        reward_model = row["reward_model"] or {}
        if "ground_truth" not in reward_model:
            raise ValueError(f"row {index}: reward_model has no 'ground_truth': {reward_model!r}")
        answer = reward_model["ground_truth"]
        if row.get("extra_info"):
            extra["extra_info"] = dict(row["extra_info"])
        return problem, answer, row.get("data_source"), extra
    problem = next((row[k] for k in ("problem", "question", "Problem", "Question") if k in row), None)
    answer = next((row[k] for k in ("answer", "ground_truth", "Answer", "final_answer") if k in row), None)
    if problem is None or answer is None:
        raise ValueError(
            f"row {index} has columns {sorted(row)}; expected the verl schema (prompt + reward_model.ground_truth) "
            "or a flat schema (problem/question + answer/ground_truth)"
        )
    for k in ("id", "ID", "url", "year"):
        if k in row:
            extra[k] = row[k]
    return str(problem), answer, row.get("data_source"), extra


def dedupe_rows(
    rows: Iterable[dict], source: str, *, default_data_source: str, template: str
) -> tuple[list[PromptRecord], LoadReport]:
    """Records of the unique problems in ``rows``, in first-seen order.

    Every row after the first of its problem counts as a duplicate; a problem whose rows
    disagree on the (canonical) answer is then dropped entirely and counted once, so
    ``rows_read == unique_prompts + duplicates_dropped + conflicting_dropped``.
    """
    report = LoadReport(source=source)
    first: dict[str, PromptRecord] = {}
    answers: dict[str, set[str]] = {}
    for i, row in enumerate(rows):
        report.rows_read += 1
        problem, answer, data_source, extra = _row_problem_answer(row, i)
        key = problem.strip()
        gt, changed = canonical_answer(answer)
        if key in first:
            answers[key].add(gt)
            report.duplicates_dropped += 1
            continue
        report.canonicalised += int(changed)
        if changed:
            extra["raw_answer"] = str(answer)
        ds = data_source or default_data_source
        extra["row"] = i
        first[key] = PromptRecord(
            uid=problem_uid(default_data_source, key), problem=key, prompt=format_prompt(key, template),
            ground_truth=gt, data_source=ds, extra=extra,
        )
        answers[key] = {gt}
    records = []
    for key, rec in first.items():
        if len(answers[key]) > 1:
            report.conflicting_dropped += 1
            continue
        records.append(rec)
    report.unique_prompts = len(records)
    return records, report


def load_hub_set(spec: str, *, path: str | None, split: str, template: str) -> tuple[list[PromptRecord], LoadReport]:
    """Load one of :data:`HUB_NAMES` from ``path`` (local file/folder or hub name) or its default hub name."""
    source = path or HUB_NAMES[spec]
    rows = read_rows(source, split)
    return dedupe_rows(rows, f"{spec} ({source})", default_data_source=spec, template=template)


def load_file_set(spec: str, *, path: str | None, split: str, template: str) -> tuple[list[PromptRecord], LoadReport]:
    """Generic ``jsonl`` / ``parquet`` specs: a local file in either schema."""
    if not path:
        raise ValueError(f"spec={spec!r} needs path= (a local .{spec} file in the hub schema)")
    if Path(path).is_file() and Path(path).suffix.lstrip(".") not in (spec, "json"):
        raise ValueError(f"spec={spec!r} but path={path!r} has suffix {Path(path).suffix!r}; use a matching spec")
    rows = read_rows(path, split)
    data_source = Path(path).stem
    return dedupe_rows(rows, f"{spec} ({path})", default_data_source=data_source, template=template)

"""Loaders for the paper's data sets in the Hugging Face hub schema, with dedupe (docs/algorithms.md §14).

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

import codecs
import hashlib
import json
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Iterable

from mcpo_megatron.data.records import LoadReport, PromptRecord
from mcpo_megatron.data.templates import format_prompt, strip_dapo_template

#: Default hub names. AIME-2025 and AMC-2023 have no canonical upload;
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
_MAX_EXPANDED_DIGITS = 1000  # an integral JSON number written with an exponent is written out up to this size


class JsonNumber(float):
    """A JSON number with a fraction or an exponent, read as a float that keeps the text it was written as: a
    float holds 17 significant digits, so a gold answer such as 123456789012345678901234567890.0 or 1.0e30
    would change its digits (JSON integers are exact already)."""

    literal: str

    def __new__(cls, literal: str) -> "JsonNumber":
        number = super().__new__(cls, literal)
        number.literal = literal
        return number


@dataclass(frozen=True)
class SourceRow:
    """One row of a prompt set and where it was read, for errors about it: ``file:line`` (JSON lines, lines
    counted from 1), ``file: item N`` (a JSON array), ``file: row N`` (parquet), ``name (split) row N`` (the
    hub)."""

    where: str
    data: Any


def canonical_answer(answer: Any) -> tuple[str, bool]:
    """``(canonical string, changed)``: integral numbers lose their ``.0`` ("27.0" -> "27"); a JSON number
    keeps its digits ("1.0e30" -> "1" and 30 zeros)."""
    if isinstance(answer, JsonNumber):
        return _canonical_literal(answer.literal)
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer)), True
    text = str(answer).strip()
    m = _FLOAT_INTEGER.match(text)
    if m:
        return str(int(m.group(1))), True
    return text, text != str(answer)


def _canonical_literal(literal: str) -> tuple[str, bool]:
    exact = Decimal(literal)
    if exact == exact.to_integral_value() and exact.adjusted() < _MAX_EXPANDED_DIGITS:
        return str(int(exact)), True
    return literal, False


def problem_uid(data_source: str, problem: str) -> str:
    """Stable id of a problem: the same text always gets the same id, across repeats and runs."""
    digest = hashlib.sha1(problem.strip().encode("utf-8")).hexdigest()[:16]
    return f"{data_source}-{digest}"


def _decode(path: Path) -> str:
    raw = path.read_bytes()
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}); save the file as UTF-8") from None


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text, parse_float=JsonNumber)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); write one JSON object per line, "
                         'e.g. {"problem": "...", "answer": "..."}') from None


def _read_json(path: Path) -> list[SourceRow]:
    """A JSON array of rows (a .json file that starts with ``[``), else one row per non-blank line."""
    text = _decode(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text, parse_float=JsonNumber)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(items, list):
            raise ValueError(f"{path}: not a JSON array of rows")
        return [SourceRow(f"{path}: item {i}", item) for i, item in enumerate(items, 1)]
    return [SourceRow(f"{path}:{n}", _parse_json(line, f"{path}:{n}"))
            for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def _read_file(path: Path) -> list[SourceRow]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return [SourceRow(f"{path}: row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist(), 1)]
    if path.suffix in (".jsonl", ".json"):
        return _read_json(path)
    raise ValueError(f"path={str(path)!r}: unsupported file type {path.suffix!r}; use .parquet, .jsonl or .json")


def read_rows(path: str, split: str = "train") -> list[SourceRow]:
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
    return [SourceRow(f"{name} ({split}) row {i}", dict(r)) for i, r in enumerate(ds, 1)]


def _verl_problem_answer(row: dict, where: str) -> tuple[str, Any]:
    """(problem, answer) of a row in the verl schema: the last user message, reward_model.ground_truth."""
    messages = list(row["prompt"])
    user = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not user or not isinstance(user[-1].get("content"), str):
        raise ValueError(f"{where}: 'prompt' has no user message with text content: {messages!r:.200}")
    reward_model = row["reward_model"] or {}
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(f"{where}: reward_model has no 'ground_truth': {reward_model!r:.200}")
    if reward_model["ground_truth"] is None:
        raise ValueError(f"{where}: reward_model.ground_truth is null: {_fill_in('gold answer')}")
    return strip_dapo_template(user[-1]["content"]), reward_model["ground_truth"]


def _fill_in(what: str) -> str:
    return f"every row needs its {what}: fill it in or remove the row"


def _flat_column(row: dict, names: tuple[str, ...], what: str, where: str) -> Any:
    """The value of the first of ``names`` the row has (None when it has none); a null value is an error."""
    name = next((k for k in names if k in row), None)
    if name is not None and row[name] is None:
        raise ValueError(f"{where}: {name} is null: {_fill_in(what)}")
    return None if name is None else row[name]


def _row_problem_answer(source_row: SourceRow) -> tuple[str, Any, str | None, dict]:
    """(problem, answer, data_source, extra) of one row in either schema."""
    row, where = source_row.data, source_row.where
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object (the problem and its answer), not "
                         f"{type(row).__name__}: {row!r:.200}")
    extra: dict[str, Any] = {}
    if "prompt" in row and isinstance(row["prompt"], (list, tuple)) and "reward_model" in row:
        problem, answer = _verl_problem_answer(row, where)
        if row.get("extra_info"):
            extra["extra_info"] = dict(row["extra_info"])
        return problem, answer, row.get("data_source"), extra
    problem = _flat_column(row, ("problem", "question", "Problem", "Question"), "problem", where)
    answer = _flat_column(row, ("answer", "ground_truth", "Answer", "final_answer"), "gold answer", where)
    if problem is None or answer is None:
        raise ValueError(
            f"{where}: the row has columns {sorted(row)}; expected the verl schema (prompt + "
            "reward_model.ground_truth) or a flat schema (problem/question + answer/ground_truth)"
        )
    for k in ("id", "ID", "url", "year"):
        if k in row:
            extra[k] = row[k]
    return str(problem), answer, row.get("data_source"), extra


def dedupe_rows(
    rows: Iterable[SourceRow], source: str, *, default_data_source: str, template: str
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
        problem, answer, data_source, extra = _row_problem_answer(row)
        key = problem.strip()
        gt, changed = canonical_answer(answer)
        if key in first:
            answers[key].add(gt)
            report.duplicates_dropped += 1
            continue
        report.canonicalised += int(changed)
        if changed:
            extra["raw_answer"] = answer.literal if isinstance(answer, JsonNumber) else str(answer)
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

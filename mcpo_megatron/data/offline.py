"""Offline prompt sets usable on any machine: ``arith`` (ours), reasoning-gym generators, CHAMP.

* ``arith``: seeded one/two-digit addition, subtraction (and optionally multiplication) questions
  such as "What is 7 + 5?". Made for the embedded CPU demo: SmolLM2-135M-Instruct answers
  about a third of "What is a + b?" (one digit) correctly with the ``number`` template, two-digit
  variants about 14% (DESIGN.md, "Offline material"), so groups of samples have reward variance.
  Spec string: ``arith[:key=value,...]`` with keys
    ``ops``    characters from ``+-*`` (default ``+``),
    ``digits`` ``1``, ``2`` or ``a/b`` per operand, e.g. ``digits=2/1`` (default ``1``); several sizes joined
              by ``|`` (``digits=1|2/1``) mix difficulties in equal shares: the problems of each size are
              shuffled separately and taken in turn, so a subset of n holds about n/k of each of the k sizes,
    ``negative`` ``0``/``1``: allow negative differences (default ``0``: a >= b for ``-``).
  Every distinct question appears once; ``num_samples`` picks a seeded subset.
* ``reasoning_gym:<task>[+<task>...]``: reasoning-gym 0.1.25 generators (offline, seeded),
  e.g. ``basic_arithmetic``, ``chain_sum``, ``gsm_symbolic``, ``leg_counting``.
* ``champ`` / ``champ:numeric``: the 270 CHAMP competition problems (``champ-dataset``); answers
  of the form "X, or equivalently Y" keep Y; ``numeric`` keeps problems whose answer is a number.
"""

from __future__ import annotations

import itertools
import random
import re

from mcpo_megatron.data.hub import SourceRow, canonical_answer, dedupe_rows, problem_uid
from mcpo_megatron.data.records import LoadReport, PromptRecord
from mcpo_megatron.data.templates import format_prompt

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_RANGES = {1: range(1, 10), 2: range(10, 100), 3: range(100, 1000)}
ARITH_DEFAULT_SAMPLES = 256
REASONING_GYM_DEFAULT_SAMPLES = 1000


def _parse_options(spec: str, allowed: dict[str, str]) -> dict[str, str]:
    name, _, rest = spec.partition(":")
    opts: dict[str, str] = {}
    for part in filter(None, re.split(r";|,(?=[a-z_]+=)", rest)):
        key, sep, value = part.partition("=")
        if not sep or key not in allowed:
            raise ValueError(
                f"spec={spec!r}: option {part!r} is not key=value with key in {sorted(allowed)}; "
                f"e.g. {name}:" + ",".join(f"{k}={v}" for k, v in allowed.items())
            )
        opts[key] = value
    return opts


def arith_problems(ops: str = "+", digits: tuple[int, int] = (1, 1), negative: bool = False) -> list[tuple[str, str]]:
    """All distinct ``(question, answer)`` pairs for the given operators and operand sizes."""
    out = []
    for op in ops:
        for a, b in itertools.product(_RANGES[digits[0]], _RANGES[digits[1]]):
            if op == "-" and not negative and a < b:
                continue
            out.append((f"What is {a} {op} {b}?", str(_OPS[op](a, b))))
    return out


def _digit_sizes(spec: str, text: str) -> list[tuple[int, int]]:
    """``1``, ``2/1`` or ``1|2/1`` -> operand sizes [(a, b), ...]."""
    sizes = []
    for part in text.split("|"):
        dig = re.split(r"[/x]", part)
        try:
            digits = (int(dig[0]), int(dig[-1]))
        except ValueError:
            digits = (0, 0)
        if len(dig) > 2 or any(d not in _RANGES for d in digits):
            raise ValueError(f"spec={spec!r}: digits={text!r} must be 1, 2, 3 or a/b such as 2/1, or several "
                             "joined by | such as 1|2/1")
        sizes.append(digits)
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"spec={spec!r}: digits={text!r} names a size twice")
    return sizes


def load_arith(spec: str, *, split: str, num_samples: int | None, seed: int, template: str):
    opts = _parse_options(spec, {"ops": "+-", "digits": "1", "negative": "0"})
    ops = opts.get("ops", "+")
    if not ops or any(c not in _OPS for c in ops) or len(set(ops)) != len(ops):
        raise ValueError(f"spec={spec!r}: ops={ops!r} must be distinct characters from '+-*'")
    sizes = _digit_sizes(spec, opts.get("digits", "1"))
    negative = opts.get("negative", "0") in ("1", "true", "yes")
    per_size = [arith_problems(ops, digits, negative) for digits in sizes]
    # Each size's problems in a seeded order; train and test draw disjoint ends of it when both are asked for.
    orders = []
    for i, pairs in enumerate(per_size):
        order = list(range(len(pairs)))
        random.Random(seed + i).shuffle(order)
        orders.append(order if split == "train" else order[::-1])
    total = sum(len(p) for p in per_size)
    n = min(num_samples or ARITH_DEFAULT_SAMPLES, total)
    chosen: list[tuple[int, int]] = []  # (size index, problem index), the sizes taken in turn
    for position in range(max(len(o) for o in orders)):
        chosen += [(i, o[position]) for i, o in enumerate(orders) if position < len(o)]
        if len(chosen) >= n:
            break
    records = [
        PromptRecord(uid=problem_uid("arith", q), problem=q, prompt=format_prompt(q, template), ground_truth=a,
                     data_source="arith", extra={"ops": ops, "digits": list(sizes[i])})
        for i, (q, a) in ((i, per_size[i][j]) for i, j in chosen[:n])
    ]
    report = LoadReport(source=spec, rows_read=total, unique_prompts=total, returned=len(records))
    return records, report


def load_reasoning_gym(spec: str, *, split: str, num_samples: int | None, seed: int, template: str):
    import reasoning_gym

    tasks = [t for t in re.split(r"[,+]", spec.partition(":")[2]) if t]
    if not tasks:
        raise ValueError(f"spec={spec!r}: name at least one task, e.g. reasoning_gym:basic_arithmetic")
    total = num_samples or REASONING_GYM_DEFAULT_SAMPLES
    # a different seed stream for evaluation splits keeps them apart from training prompts
    base_seed = seed if split == "train" else seed + 7919
    rows = []
    for t, task in enumerate(tasks):
        size = total // len(tasks) + (1 if t < total % len(tasks) else 0)
        try:
            ds = reasoning_gym.create_dataset(task, size=size, seed=base_seed + t)
        except Exception as e:  # noqa: BLE001  name the task and the fix
            raise ValueError(f"spec={spec!r}: reasoning_gym task {task!r} failed ({e}); check the task name") from e
        for i in range(size):
            item = ds[i]
            rows.append(SourceRow(f"reasoning_gym task {task} item {i + 1}", {
                "problem": item["question"], "answer": item["answer"], "data_source": f"reasoning_gym/{task}"}))
    records, report = dedupe_rows(rows, spec, default_data_source="reasoning_gym", template=template)
    for rec in records:
        rec.uid = problem_uid(rec.data_source, rec.problem)
    report.returned = len(records)
    return records, report


def champ_answer(raw: str) -> str:
    """The checkable part of a CHAMP answer: "C(10, 5), or equivalently 252" -> "252"."""
    text = raw.strip()
    m = re.search(r",?\s*or equivalently\s+(.*)$", text)
    if m:
        return m.group(1).strip()
    m = re.match(r"^(.*?),?\s*or approximately\s+.*$", text)
    if m:
        return m.group(1).strip()
    return text


_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?:/\d+)?$")


def load_champ(spec: str, *, split: str, num_samples: int | None, seed: int, template: str):
    import champ_dataset

    opts = spec.partition(":")[2]
    if opts not in ("", "numeric"):
        raise ValueError(f"spec={spec!r}: use 'champ' or 'champ:numeric'")
    ds = champ_dataset.load("v0")
    records = []
    report = LoadReport(source=spec)
    for pid, prob in ds.problems.items():
        report.rows_read += 1
        gt = champ_answer(prob.answer)
        gt, _ = canonical_answer(gt)
        if opts == "numeric" and not _NUMBER.match(gt):
            continue
        report.canonicalised += int(gt != prob.answer)
        records.append(PromptRecord(uid=f"champ-{pid}", problem=prob.text, prompt=format_prompt(prob.text, template),
                                    ground_truth=gt, data_source="champ",
                                    extra={"category": prob.category, "raw_answer": prob.answer}))
    report.unique_prompts = len(records)
    return records, report

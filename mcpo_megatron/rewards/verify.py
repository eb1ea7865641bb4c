"""Scoring of one (response, gold) pair with math-verify; runs inside a worker process.

Follows spec section 7 ("Using math-verify"): the gold is parsed as ``"$" + gold + "$"``;
for the ``dapo`` format the prediction is
``parse(resp[-1000:], [ExprExtractionConfig(), LatexExtractionConfig(boxed_match_priority=0)])``
(math-verify's own "answer:" anchors pick up the DAPO ``Answer:`` line, boxes come first);
``verify(gold, pred)`` is called in that order because it is asymmetric. math-verify's
internal ``signal.alarm`` timeouts are disabled (``parsing_timeout=None``,
``timeout_seconds=None``): they fail off the main thread and cannot interrupt C-level work,
so the parent process enforces the deadline by killing the worker.

This module imports math-verify lazily so that importing the package stays cheap.
"""

from __future__ import annotations

import logging
from functools import lru_cache

from mcpo_megatron.rewards.extract import ANSWER_FORMATS, last_boxed, last_number, response_tail

#: A numeric power whose exponent exceeds this (or a factorial of a larger number) is an
#: answer no benchmark gold has; sympy would try to build the integer and never return.
HUGE_EXPONENT = 100_000
_MAX_NODES = 5_000
_EXTRACTED_CHARS = 200


def _mv():
    import math_verify  # noqa: F401  (lazy: sympy + antlr take ~0.3 s to import)

    # math-verify warns once per process that its timeouts are disabled; we enforce our own.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


@lru_cache(maxsize=8192)
def parse_gold(gold: str):
    """``parse("$" + gold + "$")`` with internal timeouts disabled; cached (golds repeat n times)."""
    mv = _mv()
    return mv.parse("$" + gold + "$", parsing_timeout=None)


def parse_prediction(response: str, answer_format: str) -> list:
    """Extract and parse the answer of ``response`` according to ``answer_format``."""
    mv = _mv()
    tail = response_tail(response)
    if answer_format == "dapo":
        cfg = [mv.ExprExtractionConfig(), mv.LatexExtractionConfig(boxed_match_priority=0)]
        return mv.parse(tail, cfg, parsing_timeout=None)
    if answer_format == "boxed":
        content = last_boxed(tail)
    elif answer_format == "last_number":
        content = last_number(tail)
    else:
        raise ValueError(f"answer_format={answer_format!r} is not one of {ANSWER_FORMATS}")
    if not content:
        return []
    return mv.parse("$" + content + "$", parsing_timeout=None)


def _exponent_too_big(node) -> bool:
    """True when ``node`` is a numeric power or factorial whose value cannot be built in memory."""
    import sympy

    if isinstance(node, sympy.Pow):
        base, exp = node.args
        if not (base.is_number and exp.is_number) or base in (sympy.S.Zero, sympy.S.One, sympy.S.NegativeOne):
            return False
        arg = exp
    elif isinstance(node, sympy.factorial):
        arg = node.args[0]
        if not arg.is_number:
            return False
    else:
        return False
    if not arg.is_Number:
        if is_huge(arg):  # a tower: its exponent is itself huge
            return True
        try:
            arg = arg.evalf(15)
        except Exception:  # noqa: BLE001  unevaluable exponent: treat as dangerous
            return True
    try:
        return bool(abs(arg) > HUGE_EXPONENT)
    except TypeError:  # complex or otherwise unordered exponent
        return False


def is_huge(expr) -> bool:
    """True when ``expr`` contains a numeric power/factorial with an exponent > :data:`HUGE_EXPONENT`.

    Towers such as ``9^{9^{9^9}}`` make sympy compute integers with billions of digits in C,
    which no timeout inside the process can interrupt. Checking the structure first turns the
    common adversarial case into a fast "incorrect" instead of a worker kill.
    """
    import sympy

    if not isinstance(expr, sympy.Basic):
        return False
    for count, node in enumerate(sympy.preorder_traversal(expr)):
        if count > _MAX_NODES:
            return True  # absurdly large answer expression
        if _exponent_too_big(node):
            return True
    return False


def _describe(pred: list) -> str | None:
    if not pred:
        return None
    text = pred[-1] if isinstance(pred[-1], str) else str(pred[0])
    return text[:_EXTRACTED_CHARS]


def score_one(response: str, gold: str, answer_format: str = "dapo") -> tuple[int, str, str | None]:
    """Score one response: ``(correct, status, extracted)`` with status ``ok`` or ``no_answer``.

    Exceptions propagate (the worker reports them as ``crashed``); hangs are the parent's job.
    """
    mv = _mv()
    pred = parse_prediction(response, answer_format)
    if not pred:
        return 0, "no_answer", None
    extracted = _describe(pred)
    gold_parsed = parse_gold(gold)
    if any(is_huge(p) for p in pred) and not any(is_huge(g) for g in gold_parsed):
        return 0, "ok", extracted
    correct = mv.verify(gold_parsed, pred, timeout_seconds=None)
    return int(bool(correct)), "ok", extracted

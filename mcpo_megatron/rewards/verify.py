"""Scoring of one (response, gold) pair with math-verify; runs inside a worker process.

Follows docs/algorithms.md §14 (math-verify): the gold is parsed as ``"$" + gold + "$"``;
for the ``dapo`` format the prediction is the content of the last ``Answer:`` line parsed as LaTeX
(``parse("$" + content + "$")``), falling back to
``parse(resp[-1000:], [ExprExtractionConfig(), LatexExtractionConfig(boxed_match_priority=0)])``
(math-verify's own anchors, boxes first) for a reply without such a line;
``verify(gold, pred)`` is called in that order because it is asymmetric. math-verify's
internal ``signal.alarm`` timeouts are disabled (``parsing_timeout=None``,
``timeout_seconds=None``): they fail off the main thread and cannot interrupt C-level work,
so the parent process enforces the deadline by killing the worker.

This module imports math-verify lazily so that importing the package stays cheap.
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache

from mcpo_megatron.rewards.extract import ANSWER_FORMATS, answer_line, last_boxed, last_number, response_tail

#: An answer whose exact value would need more decimal digits than this is not a benchmark
#: answer; sympy would try to build it in C (GMP) and never return (Math-Verify issue #65).
MAX_DIGITS = 1_000_000
_MAX_NODES = 5_000
_EXTRACTED_CHARS = 200


_PATCHED = False


def _fast_parse_expr():
    """sympy's ``parse_expr`` with its default namespace built once instead of on every call.

    Without ``global_dict`` sympy runs ``exec("from sympy import *")`` per call, about a quarter
    of math-verify's time on typical answers. The namespace built here is the same one
    (sympy's names, Python's builtin functions, Max/Min for max/min); each call gets a copy,
    so results are unchanged.
    """
    import builtins
    import types

    import sympy
    from sympy.parsing.sympy_parser import parse_expr

    namespace: dict = {}
    exec("from sympy import *", namespace)  # noqa: S102  the namespace sympy itself builds
    for name, obj in vars(builtins).items():
        if isinstance(obj, types.BuiltinFunctionType):
            namespace[name] = obj
    namespace["max"], namespace["min"] = sympy.Max, sympy.Min

    def fast(s, local_dict=None, transformations=None, global_dict=None, evaluate=True):
        kwargs = {} if transformations is None else {"transformations": transformations}
        return parse_expr(s, local_dict=local_dict, global_dict=dict(namespace) if global_dict is None else global_dict,
                          evaluate=evaluate, **kwargs)

    return fast


def _mv():
    global _PATCHED
    import math_verify  # (lazy: sympy + antlr take ~0.3 s to import)

    if not _PATCHED:
        import math_verify.parser

        # math-verify warns once per process that its timeouts are disabled; we enforce our own.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        math_verify.parser.parse_expr = _fast_parse_expr()
        _PATCHED = True
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
        # The last "Answer:" line parsed as LaTeX; math-verify's own extraction reads only part of an undelimited
        # LaTeX answer ("Answer: 1/\\sqrt{2}" gives 1), so it is the fallback, for replies without such a line.
        content = answer_line(tail)
        pred = mv.parse("$" + content + "$", parsing_timeout=None) if content else []
        if pred:
            return pred
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


def _number(node) -> float | None:
    """|value| of a numeric node known to be small (at most ~15 digits), else None."""
    try:
        return abs(float(node.evalf(15)))
    except Exception:  # noqa: BLE001  complex, undefined or unevaluable
        return None


def size_digits(node, _depth: int = 0) -> float:
    """Upper bound on the decimal digits sympy needs to represent ``node`` exactly.

    Cheap and structural: never evaluates anything bigger than 15 digits. ``inf`` means
    "too big to build" (towers such as ``9^{9^{9^9}}``, ``(2^{99999})^{99999}``,
    ``(10^{10})!``, ``\\prod_{k=1}^{10^8} k``, ``\\binom{10^9}{10^8}``); the parent's deadline
    still catches whatever this bound misses.
    """
    import sympy

    inf = float("inf")
    if _depth > 60:
        return inf
    if isinstance(node, sympy.Integer):
        return max(int(node).bit_length() * 0.30103, 0.30103)  # >= log10|n|, and > 0
    if isinstance(node, sympy.Rational):
        return size_digits(sympy.Integer(node.p)) + size_digits(sympy.Integer(node.q))
    if not isinstance(node, sympy.Basic) or node.is_Atom:
        return 1.0
    kids = node.args
    if isinstance(node, sympy.Pow):
        base, exp = kids
        if base in (sympy.S.Zero, sympy.S.One, sympy.S.NegativeOne):
            return 1.0
        sb, se = size_digits(base, _depth + 1), size_digits(exp, _depth + 1)
        if not (base.is_number and exp.is_number):
            return sb + se  # symbolic powers stay symbolic: sympy handles x^{10^9} quickly
        if se > 15:
            return inf
        e = _number(exp)
        return inf if e is None else sb * max(e, 1.0)
    if isinstance(node, (sympy.factorial, sympy.binomial)):
        sizes = [size_digits(k, _depth + 1) for k in kids]
        if max(sizes) > 15:
            return inf
        if not all(k.is_number for k in kids):
            return sum(sizes)
        n = _number(kids[0])
        return inf if n is None else n * max(1.0, math.log10(n + 1)) + 1
    if isinstance(node, sympy.Product):
        total = size_digits(node.function, _depth + 1)
        for limit in node.limits:
            if len(limit) == 3 and limit[1].is_number and limit[2].is_number:
                span = _number(limit[2] - limit[1]) if max(size_digits(x, _depth + 1) for x in limit[1:]) <= 15 else None
                if span is None:
                    return inf
                total *= max(span, 1.0)
                total += span * size_digits(limit[2], _depth + 1)
        return total
    return sum(size_digits(k, _depth + 1) for k in kids) + 1


def is_huge(expr) -> bool:
    """True when ``expr`` is too large to evaluate (see :func:`size_digits`) or has > 5,000 nodes."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return False
    if sum(1 for _ in zip(range(_MAX_NODES + 1), sympy.preorder_traversal(expr))) > _MAX_NODES:
        return True
    return size_digits(expr) > MAX_DIGITS


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

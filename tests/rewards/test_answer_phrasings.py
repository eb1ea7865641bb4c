"""The ``dapo`` answer extraction on a labelled set of answer phrasings: false negatives and false positives.

math-verify's own extraction (the previous method, still the fallback) reads only part of an undelimited LaTeX
answer on an ``Answer:`` line: ``Answer: \\frac{1}{\\sqrt{2}}`` found no answer and ``Answer: 1/\\sqrt{2}`` read
``1``. The set is in ``answer_phrasings.py``; both methods are scored on it here, side by side.
"""

from __future__ import annotations

import pytest

from answer_phrasings import labelled_set
from mcpo_megatron.rewards.extract import response_tail
from mcpo_megatron.rewards.verify import _mv, parse_gold, score_one


def _mathverify_extraction_only(reply: str, gold: str) -> int:
    """The previous ``dapo`` method: math-verify's extraction over the reply's tail."""
    mv = _mv()
    pred = mv.parse(response_tail(reply), [mv.ExprExtractionConfig(), mv.LatexExtractionConfig(boxed_match_priority=0)],
                    parsing_timeout=None)
    return int(bool(pred) and mv.verify(parse_gold(gold), pred, timeout_seconds=None))


def _errors(score) -> tuple[list[str], list[str]]:
    fn, fp = [], []
    for reply, gold, label, what in labelled_set():
        got = score(reply, gold)
        if label and not got:
            fn.append(f"{what} (gold {gold})")
        elif got and not label:
            fp.append(f"{what} (gold {gold})")
    return fn, fp


@pytest.fixture(scope="module")
def counts():
    return {"answer line": _errors(lambda r, g: score_one(r, g, "dapo")[0]),
            "math-verify extraction": _errors(_mathverify_extraction_only)}


def test_labelled_set_has_every_category():
    import answer_phrasings as a

    items = labelled_set()
    positives = sum(len(forms) for _, forms, _, _ in a.VALUES) * len(a.WRAPPERS) + len(a.EXTRA)
    assert sum(label for _, _, label, _ in items) == positives
    assert len(items) == 2 * positives + len(a.PARTIAL_READINGS)


def test_answer_line_extraction_has_no_errors_on_the_set(counts):
    fn, fp = counts["answer line"]
    print(f"answer line: {len(fn)} false negatives, {len(fp)} false positives of {len(labelled_set())} items")
    assert fn == [] and fp == []


def test_the_previous_extraction_misses_undelimited_latex(counts):
    """The measured baseline: math-verify's own extraction misreads undelimited LaTeX answers."""
    fn, fp = counts["math-verify extraction"]
    print(f"math-verify extraction: {len(fn)} false negatives, {len(fp)} false positives")
    assert "radical: bare \\frac{1}{\\sqrt{2}} (gold \\frac{\\sqrt{2}}{2})" in fn
    assert "radical: bare 1/\\sqrt{2} (gold \\frac{\\sqrt{2}}{2})" in fn
    assert "partial reading 1 of Answer: 1/\\sqrt{2} (gold 1)" in fp
    assert len(fn) > 10

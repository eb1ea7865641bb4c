"""Cheap, linear-time answer extraction from response text (pure functions, no sympy).

``answer_line`` finds the DAPO format's ``Answer:`` line (math-verify's own extraction reads only part of an
undelimited LaTeX answer there: ``Answer: 1/\\sqrt{2}`` gives ``1``); ``last_boxed`` and ``last_number`` serve
the ``boxed`` and ``last_number`` formats; ``response_tail`` is the parent-side truncation of long responses.
"""

from __future__ import annotations

import re

#: Characters of the response tail the verifier sees (docs/algorithms.md §14: ``resp[-1000:]``).
TAIL_CHARS = 1000

#: Answer formats understood by the scorer.
ANSWER_FORMATS: tuple[str, ...] = ("dapo", "boxed", "last_number")

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "Answer:" anywhere in a line, as verl's DAPO reward reads it; the rest of that line is the answer.
_ANSWER_RE = re.compile(r"answer\s*\**\s*:\s*\**([^\n]*)", re.IGNORECASE)
# Math delimiters around a whole answer: $$..$$, $..$, \(..\), \[..\].
_DELIMITED_RE = re.compile(r"^(?:\$\$(.*)\$\$|\$(.*)\$|\\\((.*)\\\)|\\\[(.*)\\\])$", re.DOTALL)
# A number: optional sign, digits with optional thousands separators, optional decimals,
# optionally followed by "/digits" (a plain fraction such as 3/4).
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?")


def response_tail(text: str, chars: int = TAIL_CHARS) -> str:
    """The last ``chars`` characters of ``text`` (the part an answer extractor looks at)."""
    return text[-chars:] if len(text) > chars else text


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces.

    Returns None when there is no box or the last box is not closed.
    """
    matches = list(_BOXED_RE.finditer(text))
    for m in reversed(matches):
        depth = 1
        i = m.end()
        while i < len(text):
            c = text[i]
            if c == "\\" and i + 1 < len(text):  # skip escaped braces \{ \}
                i += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[m.end():i].strip()
            i += 1
    return None


def answer_line(text: str) -> str | None:
    """The answer on the last ``Answer:`` line of ``text`` as bare LaTeX, or None.

    The rest of the line after ``Answer:`` (markdown bold around the label allowed), with a trailing period, math
    delimiters (``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``) and a ``\\boxed{}`` around the whole answer
    removed: ``Answer: $\\boxed{\\frac{1}{2}}$.`` gives ``\\frac{1}{2}``. A line holding several ``$..$``
    segments gives its last segment.
    """
    content = None
    for m in _ANSWER_RE.finditer(text):
        if m.group(1).strip(" *"):
            content = m.group(1)
    if content is None:
        return None
    content = content.strip().strip("*").strip().rstrip(".").strip()
    m = _DELIMITED_RE.match(content)
    if m:
        content = next(g for g in m.groups() if g is not None).strip()
    elif content.count("$") >= 2:
        content = content.rsplit("$", 2)[1].strip()
    boxed = last_boxed(content)
    if boxed is not None and content.startswith(("\\boxed", "\\fbox")) and content.endswith("}"):
        content = boxed
    return content.rstrip(".").strip() or None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``-12``, ``3.5``, ``1,234``, ``3/4``), thousands commas removed.

    Lenient extraction for models that ignore format instructions.
    """
    last = None
    for m in _NUMBER_RE.finditer(text):
        last = m
    if last is None:
        return None
    return re.sub(r"\s+", "", last.group(0)).replace(",", "")

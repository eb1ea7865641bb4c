"""The ``python_block`` call syntax: the model writes a fenced block ```python ... ```, the tool's output is
appended after it as a fenced ```output ... ``` block, and the model goes on.

Pure text functions, for the episode code: :func:`find_code_block` finds the first complete block in the text a
turn has generated so far (a turn ends at the block's closing fence), :func:`format_output` is what is appended.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# An opening fence at the start of a line: ```python or ```py, then the end of that line.
_OPENING = re.compile(r"(?m)^[ \t]*```[ \t]*(?:python3?|py)[ \t]*\r?\n")
# A closing fence: ``` alone at the start of a line, at the end of the text or of its line.
_CLOSING = re.compile(r"(?m)^[ \t]*```[ \t]*(?:\r?\n|$)")


@dataclass(frozen=True)
class CodeBlock:
    code: str   # the code between the fences
    start: int  # index of the opening fence in the text
    end: int    # index just after the closing fence's backticks: the turn's text ends here


def find_code_block(text: str, start: int = 0) -> CodeBlock | None:
    """The first complete ```python block of ``text`` at or after ``start``, or None when there is none yet (no
    opening fence, or one without its closing fence). A block's code ends before its closing fence's line."""
    opening = _OPENING.search(text, start)
    if opening is None:
        return None
    closing = _CLOSING.search(text, opening.end())
    if closing is None:
        return None
    code = text[opening.end():closing.start()]
    if code.endswith("\n"):
        code = code[:-2] if code.endswith("\r\n") else code[:-1]
    return CodeBlock(code=code, start=opening.start(), end=text.index("```", closing.start()) + 3)


def format_output(text: str) -> str:
    """What follows a block's closing fence: the tool's output in an ```output block, on lines of its own."""
    body = text if not text or text.endswith("\n") else text + "\n"
    return f"\n```output\n{body}```\n"

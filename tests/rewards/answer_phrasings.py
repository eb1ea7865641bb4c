"""A labelled set of DAPO-format replies (``... Answer: <answer>``) for the ``dapo`` answer extraction.

Each answer value is written in several equivalent forms (integers, fractions, radicals, intervals, powers,
multiples of pi) and each form in several wrappers (bare, ``$..$``, ``\\boxed{}``, both, a trailing period,
markdown bold); every reply is paired once with a gold it equals (label 1) and once with a gold it does not
(label 0), and a few with a gold that equals only a part of the answer (label 0). A few replies have no ``Answer:`` line (the fallback) or a misleading number before it.
"""

from __future__ import annotations

# (category, forms of the answer, an equal gold, a different gold)
VALUES = [
    ("integer", ["42"], "42", "43"),
    ("negative integer", ["-7"], "-7", "7"),
    ("fraction", [r"\frac{3}{4}", "3/4", r"\dfrac{3}{4}", "0.75"], r"\frac{3}{4}", r"\frac{4}{3}"),
    ("radical", [r"\frac{1}{\sqrt{2}}", r"1/\sqrt{2}", r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2"], r"\frac{\sqrt{2}}{2}",
     r"\sqrt{2}"),
    ("radical multiple", [r"3\sqrt{2}", r"3 \sqrt 2", r"\sqrt{18}"], r"3\sqrt{2}", r"2\sqrt{3}"),
    ("interval", ["(1, 2]", "(1,2]"], "(1,2]", "[1,2]"),
    ("unbounded interval", [r"[-1, \infty)"], r"[-1,\infty)", r"(-1,\infty)"),
    ("power", ["2^{10}", "2^10"], "1024", "1023"),
    ("pi", [r"2\pi", r"\frac{4\pi}{2}"], r"2\pi", r"\pi"),
]

WRAPPERS = {
    "bare": "{}",
    "dollars": "${}$",
    "boxed": "\\boxed{{{}}}",
    "dollars+boxed": "$\\boxed{{{}}}$",
    "period": "{}.",
    "dollars+period": "${}$.",
    "bold label": "**Answer:** {}",
}

REASONING = "We add the pieces step by step: 12 + 30 = 42 and 3 x 5 = 15, so the result follows.\n"

# Replies whose last line is not a plain "Answer: x": (reply, gold it equals, a different gold).
EXTRA = [
    ("The final answer is $\\boxed{\\frac{1}{2}}$.", r"\frac{1}{2}", r"\frac{1}{3}"),          # no Answer: line
    ("Answer: 5\nWait, let me re-check. Answer: 6", "6", "5"),                                # the last line counts
    ("So x = 3.\nAnswer: x = 3", "3", "4"),                                                   # an equation
    ("Answer: 12 apples", "12", "13"),                                                        # units after it
]

# Replies whose answer has a part that equals the gold: reading only that part would be a false positive.
PARTIAL_READINGS = [
    (r"Answer: 1/\sqrt{2}", "1"),
    (r"Answer: 3\sqrt{2}", "3"),
    (r"Answer: 2^{10}", "2"),
    (r"Answer: (1, 2]", "2"),
    (r"Answer: \frac{3}{4}", "3"),
    (r"Answer: 2\pi", "2"),
]


def labelled_set() -> list[tuple[str, str, int, str]]:
    """``(reply, gold, label, description)``: label 1 when the reply's answer equals the gold."""
    items = []
    for category, forms, gold, wrong in VALUES:
        for form in forms:
            for wrapper_name, wrapper in WRAPPERS.items():
                line = wrapper.format(form) if wrapper.startswith("**") else "Answer: " + wrapper.format(form)
                reply = REASONING + line
                what = f"{category}: {wrapper_name} {form}"
                items.append((reply, gold, 1, what))
                items.append((reply, wrong, 0, what))
    for reply, gold, wrong in EXTRA:
        items.append((REASONING + reply, gold, 1, reply))
        items.append((REASONING + reply, wrong, 0, reply))
    for reply, partial in PARTIAL_READINGS:
        items.append((REASONING + reply, partial, 0, f"partial reading {partial} of {reply}"))
    return items

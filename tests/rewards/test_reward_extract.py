"""Pure extraction helpers (no worker processes)."""

from mcpo_megatron.rewards import last_boxed, last_number
from mcpo_megatron.rewards.extract import response_tail
from mcpo_megatron.rewards.types import RewardResult, status_counts


def test_last_boxed_balances_nested_braces_and_takes_the_last_box():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{\sqrt{4}}} done") == r"\frac{1}{\sqrt{4}}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"escaped \boxed{\{1, 2\}}") == r"\{1, 2\}"


def test_last_boxed_without_a_closed_box_is_none():
    assert last_boxed("no box here") is None
    assert last_boxed(r"\boxed{" + r"\frac{1}{" * 50) is None
    # an unclosed last box falls back to the previous closed one
    assert last_boxed(r"\boxed{3} and \boxed{4") == "3"


def test_last_number_variants():
    assert last_number("7 + 5 is 12.") == "12"
    assert last_number("It is -3 degrees") == "-3"
    assert last_number("about 1,234,567 stars") == "1234567"
    assert last_number("the ratio 3 / 4") == "3/4"
    assert last_number("pi is 3.14159") == "3.14159"
    assert last_number("no digits") is None
    assert last_number("") is None


def test_response_tail_keeps_the_last_thousand_characters():
    text = "a" * 5000 + "Answer: 9"
    assert response_tail(text) == text[-1000:]
    assert len(response_tail(text)) == 1000
    assert response_tail("short") == "short"


def test_status_counts_lists_every_status():
    rs = [
        RewardResult(1.0, 1, "ok", "1", False),
        RewardResult(-1.0, 0, "ok", "2", False),
        RewardResult(-1.0, 0, "timeout", None, True),
    ]
    assert status_counts(rs) == {"ok": 2, "no_answer": 0, "timeout": 1, "crashed": 0}
    assert status_counts([]) == {"ok": 0, "no_answer": 0, "timeout": 0, "crashed": 0}


def test_answer_line_takes_the_last_line_and_strips_wrappers():
    from mcpo_megatron.rewards.extract import answer_line

    assert answer_line(r"Answer: $\boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert answer_line(r"Answer: \frac{1}{\sqrt{2}}") == r"\frac{1}{\sqrt{2}}"
    assert answer_line("**Answer:** 5") == "5"
    assert answer_line(r"Answer: \(3\)") == "3"
    assert answer_line("The answer: 7\nAnswer: 8") == "8"
    assert answer_line("Answer: 5\nAnswer:") == "5"         # an empty label does not hide the previous one
    assert answer_line("no label here") is None

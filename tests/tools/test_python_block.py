"""The python_block call syntax and the token cap: pure functions, checked against texts and ids written out by
hand."""

import pytest

from mcpo_megatron.tools import find_code_block, format_output, truncate_tokens

REPLY = "Let me compute it.\n```python\nx = 6 * 7\nprint(x)\n```\nThe output will tell."


def test_the_first_complete_block_and_where_the_turn_ends():
    block = find_code_block(REPLY)
    assert block.code == "x = 6 * 7\nprint(x)"
    assert REPLY[block.start:block.end] == "```python\nx = 6 * 7\nprint(x)\n```"
    assert REPLY[:block.end].endswith("print(x)\n```")  # the turn stops at the closing fence


@pytest.mark.parametrize("partial", [
    "Let me compute it.",                              # no block
    "```python\nx = 6 * 7\nprint(x)\n",                # not closed yet
    "```python\nx = 6 * 7\nprint(x)\n``",              # closing fence still being generated
    "```python",                                       # the opening line not finished
    "```output\n42\n```\n",                            # an output block is not a call
    "Inline ```python print(1)``` is not a block.",
])
def test_no_block_until_one_is_complete(partial):
    assert find_code_block(partial) is None


def test_blocks_after_an_output_and_from_an_offset():
    turn = REPLY[:find_code_block(REPLY).end]
    episode = turn + format_output("42\n") + "So x is 42. Check:\n```py\nprint(x + 1)\n```"
    first = find_code_block(episode)
    assert first.code == "x = 6 * 7\nprint(x)"
    second = find_code_block(episode, start=first.end)
    assert second.code == "print(x + 1)" and episode[second.end:] == ""
    assert find_code_block(episode, start=second.end) is None


def test_fence_variants():
    assert find_code_block("```python3\na = 1\n```").code == "a = 1"
    assert find_code_block("  ```python  \r\na = 1\r\n  ```\r\n").code == "a = 1"
    assert find_code_block("```python\n```").code == ""
    # a fence inside a string literal of the code does not close it: it is not alone on its line
    assert find_code_block("```python\ns = '```'\nprint(s)\n```").code == "s = '```'\nprint(s)"


def test_output_format():
    assert format_output("42\n") == "\n```output\n42\n```\n"
    assert format_output("42") == "\n```output\n42\n```\n"  # the closing fence on a line of its own
    assert format_output("") == "\n```output\n```\n"
    assert format_output("a\nb\n") == "\n```output\na\nb\n```\n"


def test_truncate_tokens_keeps_head_and_tail_around_the_marker():
    ids = list(range(100, 120))  # 20 ids
    assert truncate_tokens(ids, 20) == (ids, False)
    assert truncate_tokens(ids, 25) == (ids, False)
    out, cut = truncate_tokens(ids, 10, marker=[7, 8])
    assert cut and out == [100, 101, 102, 103, 7, 8, 116, 117, 118, 119] and len(out) == 10
    out, cut = truncate_tokens(ids, 9, marker=[7, 8])  # 7 ids of room: 4 from the head, 3 from the tail
    assert out == [100, 101, 102, 103, 7, 8, 117, 118, 119]
    assert truncate_tokens(ids, 3, marker=[7, 8]) == ([100, 7, 8], True)  # one of room: the head's
    assert truncate_tokens(ids, 4) == ([100, 101, 118, 119], True)  # no marker


def test_truncate_tokens_refuses_what_cannot_fit():
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        truncate_tokens([1, 2], 0)
    with pytest.raises(ValueError, match="the marker's 3 ids leave no room within max_tokens=3"):
        truncate_tokens(list(range(10)), 3, marker=[7, 8, 9])

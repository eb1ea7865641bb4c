"""The chat_template call syntax (``tools/chat_calls.py``): which texts are calls, what a malformed call tells
the model, and what a chat template puts around a tool message, read from the template itself."""

import pytest

from mcpo_megatron.tools.chat_calls import CALL_END, PYTHON_TOOL, ToolResponseFormat, find_tool_call

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'


def test_a_complete_call_gives_its_code_and_where_it_ends():
    text = "Let me compute.\n" + CALL + "\ntrailing"
    call = find_tool_call(text)
    assert (call.code, call.error) == ("print(6 * 7)", None) and text[:call.end].endswith(CALL_END)
    assert find_tool_call(CALL[:-3]) is None and find_tool_call("no call here") is None
    string_args = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"x = 1\\\\nprint(x)\\"}"}</tool_call>'
    assert find_tool_call(string_args).code == "x = 1\nprint(x)"
    first = find_tool_call(CALL + CALL.replace("6 * 7", "1"))
    assert first.code == "print(6 * 7)"


@pytest.mark.parametrize("body,reason", [
    ("{not json}", "error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at "
                   "character 1)"),
    ('{"name": "search", "arguments": {"q": "x"}}', "error: there is no tool 'search'; the only tool is 'python'"),
    ('{"name": "python", "arguments": {"program": "1"}}',
     'error: the call needs a string argument "code": {"name": "python", "arguments": {"code": "..."}}'),
    ('[1, 2]', "error: there is no tool None; the only tool is 'python'"),
])
def test_a_malformed_call_is_not_run_and_says_why(body, reason):
    call = find_tool_call(f"<tool_call>{body}</tool_call>")
    assert call.code is None and call.error == reason


# A template of the Qwen form (written here: role markers, a tool message inside a user turn, the tools declared in
# a system turn), to read the text around a tool message from.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(template):
    """A transformers tokenizer whose chat template is ``template``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, "<unk>")))
    tok.chat_template = template
    return tok


def test_the_text_around_a_tool_message_comes_from_the_template():
    fmt = ToolResponseFormat(_tokenizer(QWEN_LIKE))
    assert fmt.before == "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
    assert fmt.after == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert fmt.text("42\n") == fmt.before + "42\n" + fmt.after
    declared = _tokenizer(QWEN_LIKE).apply_chat_template([{"role": "user", "content": "q"}], tools=[PYTHON_TOOL],
                                                         add_generation_prompt=True, tokenize=False)
    assert '"name": "python"' in declared and declared.endswith("<|im_start|>assistant\n")


def test_a_template_without_tool_messages_is_refused():
    refusing = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}" \
               "{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="cannot render a tool message .*no tools.*use tools.format=python_block"):
        ToolResponseFormat(_tokenizer(refusing))
    dropping = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="does not render a tool message after an assistant turn"):
        ToolResponseFormat(_tokenizer(dropping))

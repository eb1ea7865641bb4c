"""The ``chat_template`` call syntax: the model calls the tool the way its chat template declares tools (the
Hermes / Qwen form, which Qwen2.5, Qwen3 and Qwen3.5 templates render)::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    </tool_call>

and the tool's output comes back as the template renders a ``tool`` message after that assistant turn (Qwen3:
``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``).

Pure functions and one class, for the episode code: :func:`find_tool_call` finds the first complete call in the
text a turn has generated so far; :class:`ToolResponseFormat` reads, once, what the tokenizer's template puts
around a tool message (rendered with sentinels), so that an output is appended as exactly the text the template
would render; :data:`PYTHON_TOOL` is the tool's declaration for ``apply_chat_template(tools=[...])``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

#: The tool's name in calls and in its declaration.
TOOL_NAME = "python"
#: The tool as a chat template declares it (the OpenAI function-calling schema transformers passes to templates).
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run a Python program in a sandbox and return what it prints (stdout and stderr). Use it for "
                       "calculations; print the values you need.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python program to run."}},
            "required": ["code"],
        },
    },
}
#: What ends a turn that calls the tool (vLLM's stop string for the syntax).
CALL_END = "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_SENTINEL_ASSISTANT = "\u2063ASSISTANT\u2063"
_SENTINEL_TOOL = "\u2063TOOL\u2063"


@dataclass(frozen=True)
class ToolCall:
    """A complete call: its ``code``, or the reason it cannot run (``error``: not JSON, another tool, no code),
    which goes back to the model as the call's output; ``end`` is the index just after ``</tool_call>``."""

    code: str | None
    error: str | None
    end: int


def find_tool_call(text: str, start: int = 0) -> ToolCall | None:
    """The first complete ``<tool_call>...</tool_call>`` of ``text`` at or after ``start`` (None when there is
    none yet). Its body must be a JSON object naming the tool ``python`` with a string argument ``code`` (the
    arguments may also come as a JSON string, as some templates render them)."""
    m = _CALL.search(text, start)
    if m is None:
        return None
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError as e:
        return ToolCall(None, f"error: the tool call is not valid JSON ({e.msg} at character {e.pos})", m.end())
    if not isinstance(call, dict) or call.get("name") != TOOL_NAME:
        name = call.get("name") if isinstance(call, dict) else None
        return ToolCall(None, f"error: there is no tool {name!r}; the only tool is {TOOL_NAME!r}", m.end())
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    code = args.get("code") if isinstance(args, dict) else None
    if not isinstance(code, str):
        return ToolCall(None, f'error: the call needs a string argument "code": {{"name": "{TOOL_NAME}", '
                              '"arguments": {"code": "..."}}', m.end())
    return ToolCall(code, None, m.end())


def declared_tools(tools_cfg) -> list[dict] | None:
    """The tools a prompt declares through the chat template: the Python tool with ``tools.format=chat_template``
    (the model learns the call syntax from its template), none otherwise."""
    if tools_cfg.enabled and tools_cfg.format == "chat_template":
        return [PYTHON_TOOL]
    return None


class ToolResponseFormat:
    """What the tokenizer's chat template renders around a tool message that follows an assistant turn: the text
    between the assistant's content and the tool's content (``before``), and after the tool's content up to the
    next assistant turn's start (``after``, the generation prompt included). Read once by rendering a
    conversation with sentinel contents; a template that renders no tool message is refused."""

    def __init__(self, tokenizer):
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL_ASSISTANT},
                    {"role": "tool", "content": _SENTINEL_TOOL}]
        try:
            text = tokenizer.apply_chat_template(messages, tools=[PYTHON_TOOL], add_generation_prompt=True,
                                                 tokenize=False)
        except Exception as e:  # a template that raises on the tool role (jinja's TemplateError and others)
            raise ValueError(f"tools.format=chat_template: the tokenizer's chat template cannot render a tool "
                             f"message ({type(e).__name__}: {e}); use tools.format=python_block") from e
        a, t = text.find(_SENTINEL_ASSISTANT), text.find(_SENTINEL_TOOL)
        if a < 0 or t < a:
            raise ValueError("tools.format=chat_template: the tokenizer's chat template does not render a tool "
                             "message after an assistant turn; use tools.format=python_block")
        self.before = text[a + len(_SENTINEL_ASSISTANT):t]
        self.after = text[t + len(_SENTINEL_TOOL):]

    def text(self, output: str) -> str:
        """The text appended after a turn's ``</tool_call>``: the tool message with ``output`` as its content, and
        the next assistant turn's start."""
        return f"{self.before}{output}{self.after}"

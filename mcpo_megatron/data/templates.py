"""Prompt templates (docs/algorithms.md §14) and prompt tokenisation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mcpo_megatron.data.records import PromptRecord

#: The DAPO-Math-17k user message, verbatim (docs/algorithms.md §14); ``{problem}`` is the bare problem.
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

#: Available templates. ``dapo``: the paper's training and evaluation prompt; ``boxed``: the common
#: "final answer within \\boxed{}" instruction; ``number``: a short instruction for small models on
#: the arithmetic demo set (pair it with the ``last_number`` reward format); ``raw``: the problem alone;
#: ``python_tool``: ``boxed`` with the Python tool's call syntax (episodes with ``tools.enabled``).
TEMPLATES: dict[str, str] = {
    "dapo": DAPO_TEMPLATE,
    "boxed": "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "number": "{problem} Answer with just the number.",
    "raw": "{problem}",
    # tool-integrated reasoning (tools.enabled, tools.format=python_block): the call syntax rollout/episodes.py runs
    "python_tool": ("{problem}\n\nPlease reason step by step. You may run Python: write the code in a ```python "
                    "block; it runs when the block closes, and what it prints is shown to you in an ```output block. "
                    "Put your final answer within \\boxed{{}}."),
}

_DAPO_PREFIX, _DAPO_SUFFIX = DAPO_TEMPLATE.split("{problem}")


def format_prompt(problem: str, template: str = "dapo") -> str:
    """Fill ``template`` (a name in :data:`TEMPLATES`) with ``problem``."""
    if template not in TEMPLATES:
        raise ValueError(f"template={template!r} is not one of {sorted(TEMPLATES)}; pick one of those names")
    return TEMPLATES[template].format(problem=problem)


def strip_dapo_template(text: str) -> str:
    """The bare problem of a DAPO-formatted prompt (``text`` itself if it is not one)."""
    if text.startswith(_DAPO_PREFIX) and text.endswith(_DAPO_SUFFIX):
        return text[len(_DAPO_PREFIX): len(text) - len(_DAPO_SUFFIX)]
    return text


def prompt_messages(record: PromptRecord) -> list[dict]:
    """The record's prompt as chat messages (a plain-text prompt becomes one user message)."""
    if isinstance(record.prompt, str):
        return [{"role": "user", "content": record.prompt}]
    return [dict(m) for m in record.prompt]


def prompt_text(record: PromptRecord) -> str:
    """The record's prompt as plain text (message contents joined by blank lines)."""
    if isinstance(record.prompt, str):
        return record.prompt
    return "\n\n".join(m["content"] for m in record.prompt)


def _ids(out: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding (a Mapping) from apply_chat_template by default;
    # older versions return the list of ids.
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):  # batched form of a single conversation
        out = out[0]
    return [int(t) for t in out]


def build_prompt_token_ids(
    tokenizer, record: PromptRecord, *, apply_chat_template: bool, max_prompt_length: int | None,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of the record's prompt.

    With ``apply_chat_template`` the prompt goes through ``tokenizer.apply_chat_template`` with
    ``add_generation_prompt=True`` (instruct models), declaring ``tools`` (function schemas) to the model when
    given; otherwise the plain text is tokenised with
    the tokenizer's special tokens (e.g. BOS). A prompt longer than ``max_prompt_length`` is an
    error (truncating a math problem changes it): raise the limit or filter the data set.
    """
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"apply_chat_template=True but the tokenizer {type(tokenizer).__name__} has no chat_template; "
                "set data.apply_chat_template=false or use an instruct tokenizer"
            )
        extra = {"tools": tools} if tools else {}
        ids = _ids(tokenizer.apply_chat_template(prompt_messages(record), add_generation_prompt=True, tokenize=True,
                                                 **extra))
    else:
        ids = _ids(tokenizer(prompt_text(record), add_special_tokens=True)["input_ids"])
    if max_prompt_length is not None and len(ids) > max_prompt_length:
        raise ValueError(
            f"prompt of record uid={record.uid!r} has {len(ids)} tokens > max_prompt_length={max_prompt_length}; "
            "raise data.max_prompt_length or remove the record from the data set"
        )
    return ids

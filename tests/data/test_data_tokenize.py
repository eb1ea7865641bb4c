"""build_prompt_token_ids with a tiny word-level tokenizer built in the test (no downloads)."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mcpo_megatron.data import PromptRecord, build_prompt_token_ids, format_prompt

CHAT_TEMPLATE = (
    "{% for m in messages %}<start> {{ m['role'] }} {{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<start> assistant {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    words = ["<unk>", "<bos>", "<start>", "<end>", "user", "assistant", "What", "is", "2", "+", "?", "Answer",
             "with", "just", "the", "number", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _record(prompt):
    return PromptRecord(uid="r0", problem="What is 2 + 2 ?", prompt=prompt, ground_truth="4", data_source="t", extra={})


def test_chat_template_ids_match_the_rendered_text(tokenizer):
    rec = _record(format_prompt("What is 2 + 2 ?", "raw"))
    ids = build_prompt_token_ids(tokenizer, rec, apply_chat_template=True, max_prompt_length=64)
    vocab = tokenizer.get_vocab()
    expected = [vocab[w] for w in "<start> user What is 2 + 2 ? <end> <start> assistant".split()]
    assert ids == expected
    # chat messages give the same ids as the equivalent plain prompt
    msg = _record([{"role": "user", "content": "What is 2 + 2 ?"}])
    assert build_prompt_token_ids(tokenizer, msg, apply_chat_template=True, max_prompt_length=64) == expected


def test_plain_text_ids(tokenizer):
    rec = _record("What is 2 + 2 ?")
    ids = build_prompt_token_ids(tokenizer, rec, apply_chat_template=False, max_prompt_length=None)
    vocab = tokenizer.get_vocab()
    assert [i for i in ids if i != vocab["<bos>"]] == [vocab[w] for w in "What is 2 + 2 ?".split()]


def test_overlong_prompt_and_missing_chat_template(tokenizer):
    rec = _record("What is 2 + 2 ?")
    with pytest.raises(ValueError, match="uid='r0' has 11 tokens > max_prompt_length=5"):
        build_prompt_token_ids(tokenizer, rec, apply_chat_template=True, max_prompt_length=5)
    saved = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="no chat_template"):
            build_prompt_token_ids(tokenizer, rec, apply_chat_template=True, max_prompt_length=64)
    finally:
        tokenizer.chat_template = saved

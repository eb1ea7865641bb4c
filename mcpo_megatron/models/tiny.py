"""Tiny random models with a character-level tokenizer, built in code, for end-to-end runs on CPU.

They let the trainer, the engine and the reward pool run their real code paths (chat template, decode, answer
extraction) on a model of a few hundred thousand parameters, with no download: the tests' end-to-end runs, and
the built-in models ``builtin:tiny-qwen3`` / ``builtin:tiny-qwen3-moe`` of the recipes' CPU rehearsals
(configs/rehearsal/).
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


def char_vocab(multiple_of: int = 4) -> dict[str, int]:
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    tokens = SPECIALS + chars
    while len(tokens) % multiple_of:
        tokens.append(f"<unused{len(tokens)}>")
    return {t: i for i, t in enumerate(tokens)}


def save_char_tokenizer(out_dir: str | Path) -> int:
    """Write tokenizer files (fast tokenizer + chat template) to ``out_dir``; return the vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return len(vocab)


def make_tiny_model_with_tokenizer(out_dir: str | Path, family: str = "qwen3", seed: int = 0,
                                   num_hidden_layers: int = 2) -> str:
    """A tiny random model whose vocabulary is the character tokenizer's (ids 0/1/2 = pad/bos/eos)."""
    from mcpo_megatron.models.sources import make_tiny_hf_model

    vocab = char_vocab()
    path = make_tiny_hf_model(family, out_dir, seed=seed, vocab_size=len(vocab), num_hidden_layers=num_hidden_layers)
    _favour_digits(path, [vocab[c] for c in "0123456789"] + [vocab["<eos>"]])
    save_char_tokenizer(path)
    return path


def _favour_digits(path: str, token_ids: list[int], scale: float = 4.0) -> None:
    """Scale the output-layer rows of the digits and EOS so a random model mostly answers with a number:
    on arithmetic prompts its groups then mix right and wrong answers, and RL has a signal to follow."""
    import torch
    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    weights = load_file(str(file))
    weights["lm_head.weight"][token_ids] *= scale
    save_file(weights, str(file), metadata={"format": "pt"})

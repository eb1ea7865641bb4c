"""Tiny random models with a character-level tokenizer, built in code, for end-to-end runs on CPU.

They let the trainer, the engine and the reward pool run their real code paths (chat template, decode, answer
extraction) on a model of a few hundred thousand parameters, with no download: the tests' end-to-end runs, and
the built-in models ``builtin:tiny-qwen3`` / ``builtin:tiny-qwen3-moe`` of the recipes' CPU rehearsals
(configs/rehearsal/). ``make_tiny_hf_model(family, out_dir)`` writes a tiny random model of a supported family
(qwen3, qwen3_moe, qwen2, llama-tied, llama) with the HF test vocabulary, for parity and mapping tests.
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Any

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


# The long-tailed length workload (make_long_tail_model, write_length_prompts): a prompt ending in SHORT_MARKER
# gets short replies, one ending in LONG_MARKER replies that run to the response cap.
SHORT_MARKER, LONG_MARKER = "S", "L"
SHORT_DIGITS, LONG_DIGITS = "01234", "56789"
_FLOOR = -20.0  # log-probability of a transition the chain does not make (e^-20: never seen in practice)


def length_chain(short_stop: float, long_stop: float) -> dict[str, dict[str, float]]:
    """The transition probabilities of make_long_tail_model's replies, by regime: from the short marker or a short
    digit, a short digit (uniformly) or EOS with probability ``short_stop``; from the long marker or a long digit,
    a long digit or EOS with probability ``long_stop``. Any other character behaves like the short marker."""
    def regime(digits: str, stop: float) -> dict[str, float]:
        return {**{d: (1.0 - stop) / len(digits) for d in digits}, "<eos>": stop}

    return {"short": regime(SHORT_DIGITS, short_stop), "long": regime(LONG_DIGITS, long_stop)}


def make_long_tail_model(out_dir: str | Path, family: str = "qwen3", *, seed: int = 0, short_stop: float = 0.35,
                         long_stop: float = 0.0, num_hidden_layers: int = 2, layer_scale: float = 0.0) -> str:
    """A tiny model with the character tokenizer whose reply lengths are long-tailed and set by the prompt.

    Its layers start as the identity (attention and MLP output projections are zero, also every expert's with
    ``family="qwen3_moe"``, whose routers still route), the embedding is one-hot and the output layer holds the log
    transition probabilities of :func:`length_chain`: a reply is a Markov chain of digits, short after a prompt
    ending in "S" (a geometric length of mean 1 / short_stop) and as long as the cap after one ending in "L"
    (long_stop 0). Training moves every weight, so later versions drift from the chain as any policy does.
    ``layer_scale`` > 0 keeps the output projections random, times that factor: the layers (and with MoE the
    experts each token is routed to) then move the log-probs a little."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    vocab = char_vocab()
    hidden = 128
    if hidden < len(vocab):
        raise ValueError(f"make_long_tail_model: hidden size {hidden} must hold the {len(vocab)}-token vocabulary")
    config = tiny_hf_config(family, vocab_size=len(vocab), hidden_size=hidden, intermediate_size=128,
                            num_hidden_layers=num_hidden_layers, head_dim=32, max_position_embeddings=512)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    chain = length_chain(short_stop, long_stop)
    log_t = torch.full((len(vocab), len(vocab)), _FLOOR)  # [from, to]
    for token, t in vocab.items():
        probs = chain["long" if token == LONG_MARKER or token in LONG_DIGITS else "short"]
        for target, p in probs.items():
            log_t[t, vocab[target]] = max(math.log(p), _FLOOR) if p > 0 else _FLOOR
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(layer_scale)
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
        emb = model.model.embed_tokens.weight
        emb.zero_()
        # a large one-hot, so that what training adds to the residual stream moves the chain gradually
        emb[:, : len(vocab)] = 16.0 * torch.eye(len(vocab))
        head = model.lm_head.weight
        head.zero_()
        # the final norm maps the one-hot e_x to sqrt(hidden) e_x: the logits are log_t[x] exactly
        head[:, : len(vocab)] = log_t.t() / math.sqrt(hidden)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    save_char_tokenizer(out)
    return str(out)


def write_length_prompts(path: str | Path, num: int, *, long_frac: float = 0.2, seed: int = 0) -> str:
    """A JSONL prompt set for :func:`make_long_tail_model` (``data.train=jsonl``, ``data.prompt_template=raw``,
    ``data.apply_chat_template=false``): ``num`` problems "Item k: say d S" (answer d, a short digit) or, a
    ``long_frac`` share of them spread evenly, "Item k: say d L" (a long digit)."""
    import json
    import random

    rng = random.Random(seed)
    lines = []
    for k in range(num):
        long = int((k + 1) * long_frac) > int(k * long_frac)
        d = rng.choice(LONG_DIGITS if long else SHORT_DIGITS)
        lines.append(json.dumps({"problem": f"Item {k}: say {d} {LONG_MARKER if long else SHORT_MARKER}",
                                 "answer": d}))
    Path(path).write_text("\n".join(lines) + "\n")
    return str(path)


# --- tiny random models of the supported families (tests, the built-in tiny models) ---------------

TINY_FAMILIES = ("qwen3", "qwen3_moe", "qwen2", "llama-tied", "llama", "qwen3_5")


def tiny_hf_config(family: str, **overrides: Any):
    """A small transformers config of ``family`` (vocab 256, 4 layers, 4 heads / 2 KV heads, head_dim 16).

    ``qwen3_moe``: 4 experts of width 32, top-2 with renormalised weights (``norm_topk_prob``).
    """
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.1,  # larger than usual (logits std ~0.8), still contracting per layer
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "qwen3":
        cfg = dict(common, head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0)
        cls = Qwen3Config
    elif family == "qwen3_moe":
        cfg = dict(common, head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        cls = Qwen3MoeConfig
    elif family == "qwen2":
        cfg = dict(common, tie_word_embeddings=False, rope_theta=1000000.0)
        cls = Qwen2Config
    elif family == "qwen3_5":
        # A full-attention layer every third layer, GDN heads (2 key, 4 value heads of 8 and 6) no other test
        # uses, a quarter of each attention head rotated.
        cfg = dict(common, head_dim=16, tie_word_embeddings=False, rope_theta=10000.0,
                   layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=6, linear_conv_kernel_dim=3, partial_rotary_factor=0.25)
        from transformers import Qwen3_5TextConfig as cls
    elif family in ("llama-tied", "llama"):
        cfg = dict(common, head_dim=16, tie_word_embeddings=family == "llama-tied", rope_theta=10000.0)
        cls = LlamaConfig
    else:
        raise ValueError(f"tiny model family={family!r} must be one of {TINY_FAMILIES}")
    cfg.update(overrides)
    rope_theta = cfg.pop("rope_theta")
    config = cls(**cfg)
    # transformers 5.x keeps the rotary base in rope_parameters.
    if getattr(config, "rope_parameters", None) is not None:
        config.rope_parameters["rope_theta"] = rope_theta
    else:
        config.rope_theta = rope_theta
    config.architectures = [cls.__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]
    return config


def make_tiny_hf_model(family: str, out_dir: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random ``family`` model (fp32 safetensors + config) to ``out_dir``; return the path.

    Norm weights are randomised too (HF initialises them to 1, which would hide
    a mix-up of norm parameters in mapping tests).
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".dt_bias"):  # starts at ones
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def make_tiny_multimodal_qwen3_5(text_dir: str | os.PathLike, out_dir: str | os.PathLike, *, seed: int = 0) -> str:
    """The tiny text-only Qwen3.5 at ``text_dir`` (weights and tokenizer) as the form Qwen3.5 checkpoints ship in:
    a ``Qwen3_5ForConditionalGeneration`` with a tiny random vision tower, its language model's tensors under
    ``model.language_model.*``, and two bf16 multi-token-prediction tensors (``mtp.*``) as real checkpoints carry
    them. Returns ``out_dir``."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5VisionConfig

    text = AutoConfig.from_pretrained(str(text_dir))
    vision = Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                 out_hidden_size=text.hidden_size, patch_size=4, temporal_patch_size=2,
                                 spatial_merge_size=2)
    config = Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                           tie_word_embeddings=text.tie_word_embeddings)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config)
    trained = load_file(str(Path(text_dir) / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in trained.items()}
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing), (missing, unexpected)
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 2)
    h = text.hidden_size
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen).to(torch.bfloat16)
    tensors["mtp.norm.weight"] = torch.randn(h, generator=gen).to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in Path(text_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",):
            shutil.copy2(f, out / f.name)
    return str(out)

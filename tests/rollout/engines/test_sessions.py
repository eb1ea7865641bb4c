"""Generation sessions (rollout/engines/records.py): records decoded in segments, continued later (re-prefilled), with the
version of every token; the PyTorch engine against its own whole-batch generation and a float64 recomputation, the
vLLM session against fakes of vLLM's objects (the real engine: tests/rollout/engines/test_vllm_cpu.py)."""

from __future__ import annotations

import pytest
import torch

from mcpo_megatron.rollout.engines.interface import GenerationInterrupted, SamplingParams, sample_seed
from mcpo_megatron.rollout.engines.records import SequenceRecord, continuation_seed, extend_routing
from test_torch_engine import EOS, PROMPTS, fp64_recompute, hf_model, make_engine  # noqa: F401  (fixture)

SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)


def fresh_records(sampling=SAMPLING):
    """One record per (prompt, sample) of PROMPTS, seeded as generate() seeds them."""
    recs = [SequenceRecord(j, i, sample_seed(sampling.seed, j, i)) for j in range(len(PROMPTS))
            for i in range(sampling.n)]
    return [PROMPTS[r.prompt_index] for r in recs], recs


def continued(engine, prompts, records, segment_tokens, sampling=SAMPLING):
    """Every record to its end, one session per segment (each continuation re-prefilled); the version of a
    segment is its index."""
    records, segment = list(records), 0
    while not all(r.finished for r in records):
        todo = [k for k, r in enumerate(records) if not r.finished]
        session = engine.open_session([prompts[k] for k in todo], [records[k] for k in todo], sampling)
        session.step(segment_tokens, version=segment)
        for k, r in zip(todo, session.close()):
            records[k] = r
        segment += 1
    return records


def test_one_session_is_generate_bit_for_bit(hf_model):
    """A session decoded in one go, or in segments of 3 steps with its KV cache kept, gives exactly what
    generate() gives; each token records the segment that sampled it."""
    ref = make_engine(hf_model).generate(PROMPTS, SAMPLING)
    prompts, records = fresh_records()
    for segment_tokens in (SAMPLING.max_new_tokens, 3):
        session = make_engine(hf_model).open_session(prompts, records, SAMPLING)
        segments = 0
        while session.step(segment_tokens, version=segments):
            segments += 1
        out = session.close()
        assert [r.token_ids for r in out] == ref.token_ids and [r.logprobs for r in out] == ref.logprobs
        assert [r.finish_reason for r in out] == ref.finish_reasons
        for r in out:
            assert r.versions == [k // segment_tokens for k in range(len(r.token_ids))]
    assert all(not r.token_ids for r in records)  # the caller's records are not changed


def test_continued_records_sample_what_an_uninterrupted_call_would(hf_model):
    """Closed after every segment and re-prefilled, a record draws uniform k for its token k: the same tokens as
    generate(), log-probs equal to a float64 recomputation of the prefix the engine saw."""
    engine = make_engine(hf_model)
    check_continuations(engine, hf_model, engine.generate(PROMPTS, SAMPLING), (1, 4), tol=1e-5)


def check_continuations(engine, model, ref, segment_sizes, *, tol):
    """Records of PROMPTS continued after every segment of each size draw the tokens, and finish as, ``ref`` (an
    uninterrupted generate()); their log-probs are within ``tol`` of a float64 recomputation of ``model`` on the
    prefix, and each token records the segment that sampled it."""
    prompts, records = fresh_records()
    for segment_tokens in segment_sizes:
        out = continued(engine, prompts, records, segment_tokens)
        assert [r.token_ids for r in out] == ref.token_ids
        assert [r.finish_reason for r in out] == ref.finish_reasons
        for p, r in zip(prompts, out):
            want = fp64_recompute(model, p, r.token_ids, 1.0, 1.0, -1)
            assert (want - torch.tensor(r.logprobs, dtype=torch.float64)).abs().max() < tol
            assert r.versions == [k // segment_tokens for k in range(len(r.token_ids))]


def test_a_hybrid_models_continued_records_rebuild_their_recurrent_state(tmp_path):
    """A tiny Qwen3.5 (Gated DeltaNet layers: a convolution state and a delta-rule state per row, no KV cache):
    records closed after every segment and re-prefilled rebuild those states from the prefix, so they sample the
    tokens an uninterrupted generate() samples, with log-probs equal to a float64 recomputation of the prefix."""
    from transformers import AutoModelForCausalLM

    from mcpo_megatron.models.tiny import make_tiny_hf_model

    path = make_tiny_hf_model("qwen3_5", tmp_path / "q35", vocab_size=96)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(model, eos_token_ids=[EOS])
    ref = engine.generate(PROMPTS, SAMPLING)
    assert len({len(t) for t in ref.token_ids}) > 1   # rows of several lengths
    # fp32 Gated DeltaNet decode against float64: the chunked rule amplifies rounding (1e-4 bound)
    check_continuations(engine, model, ref, (1, 5), tol=1e-4)


def test_a_continuation_with_new_weights_keeps_its_history(hf_model):
    """A record continued after a weight update keeps its tokens, log-probs and versions; the new tokens follow
    the new weights (the same as a fresh record of that prefix under them) and record the new version."""
    engine = make_engine(hf_model)
    prompts, records = fresh_records()
    session = engine.open_session(prompts, records, SAMPLING)
    session.step(3, version=0)
    first = session.close()
    perturbed = {k: v + 0.05 * v.std() * torch.randn_like(v) for k, v in hf_model.state_dict().items()}
    engine.update_weights(perturbed.items())
    todo = [k for k, r in enumerate(first) if not r.finished]
    session = engine.open_session([prompts[k] for k in todo], [first[k] for k in todo], SAMPLING)
    session.step(SAMPLING.max_new_tokens, version=1)
    for k, r in zip(todo, session.close()):
        old = first[k]
        assert r.token_ids[:3] == old.token_ids and r.logprobs[:3] == old.logprobs and r.versions[:3] == [0] * 3
        assert r.versions[3:] == [1] * (len(r.token_ids) - 3) and r.finished
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32).eval()
        m.load_state_dict(perturbed)
        want = fp64_recompute(m, prompts[k], r.token_ids, 1.0, 1.0, -1)[3:]
        assert (want - torch.tensor(r.logprobs[3:], dtype=torch.float64)).abs().max() < 1e-5


def test_session_stops_between_decoding_steps(hf_model):
    prompts, records = fresh_records()
    session = make_engine(hf_model).open_session(prompts, records, SAMPLING)
    polls = []
    with pytest.raises(GenerationInterrupted):
        session.step(12, version=0, should_stop=lambda: polls.append(1) or len(polls) > 2)
    assert len(polls) == 3


def test_records_must_be_able_to_continue(hf_model):
    engine = make_engine(hf_model)
    done = SequenceRecord(0, 0, 1, [EOS], [-0.1], [0], "stop")
    with pytest.raises(ValueError, match="cannot continue"):
        engine.open_session([PROMPTS[0]], [done], SAMPLING)
    full = SequenceRecord(0, 0, 1, [7] * 12, [-0.1] * 12, [0] * 12)
    with pytest.raises(ValueError, match="12 of max_new_tokens=12"):
        engine.open_session([PROMPTS[0]], [full], SAMPLING)
    with pytest.raises(ValueError, match="1 prompts for 2 records"):
        engine.open_session([PROMPTS[0]], [SequenceRecord(0, 0, 1), SequenceRecord(0, 1, 2)], SAMPLING)
    with pytest.raises(ValueError, match="3 tokens, 2 log-probs and 3 versions"):
        SequenceRecord(0, 0, 1, [1, 2, 3], [0.0, 0.0], [0, 0, 0])


def test_record_state_round_trip():
    r = SequenceRecord(3, 1, 2**62 + 5, [4, 5], [-0.123456789012345678, -2.5], [0, 1], None,
                       torch.tensor([[[1, 2]], [[0, 3]]], dtype=torch.int16), restarts=2)
    back = SequenceRecord.from_state(r.state_dict())
    assert back.token_ids == r.token_ids and back.logprobs == r.logprobs and back.versions == r.versions
    assert back.seed == r.seed and back.restarts == 2 and torch.equal(back.routed_experts, r.routed_experts)
    assert r.restarted() == SequenceRecord(3, 1, 2**62 + 5, restarts=3)


def test_routing_of_a_continued_moe_record(tmp_path):
    """r3: a continued record keeps the routing of every position it had run (the routing under which its next
    token was sampled) and adds the positions run since: prompt + every token but the last, as generate()."""
    from mcpo_megatron.models.tiny import make_tiny_hf_model
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    engine = TorchRolloutEngine.from_pretrained(make_tiny_hf_model("qwen3_moe", tmp_path / "moe", seed=5),
                                                return_routed_experts=True)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=2)
    ref = engine.generate(PROMPTS, sampling)
    prompts, records = fresh_records(sampling)
    out = continued(engine, prompts, records, 2, sampling)
    assert [r.token_ids for r in out] == ref.token_ids
    for p, r, want in zip(prompts, out, ref.samples):
        assert r.routed_experts.shape == want.routed_experts.shape == (len(p) + len(r.token_ids) - 1, 4, 2)
        assert torch.equal(r.routed_experts, want.routed_experts)
    old = torch.zeros(3, 4, 2, dtype=torch.int16)
    run = torch.ones(5, 4, 2, dtype=torch.int16)
    assert torch.equal(extend_routing(old, run)[:3], old) and torch.equal(extend_routing(old, run)[3:], run[3:])


def test_continuation_seeds():
    assert continuation_seed(123, 0) == 123  # a response generated in one go keeps its sample seed
    seeds = {continuation_seed(s, k) for s in range(20) for k in range(1, 20)}
    assert len(seeds) == 19 * 20 and all(0 <= x < 2**63 for x in seeds)


# ----------------------------------------------------------------------------------------- vLLM with fakes
class FakeParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeOut:
    def __init__(self, request_id, tokens, finished, reason=None, first=1):
        from test_vllm_engine import FakeCompletion, FakeLogprob

        lps = [{t: FakeLogprob(-0.1 * (first + k))} for k, t in enumerate(tokens)]
        self.request_id, self.finished = request_id, finished
        self.outputs = [FakeCompletion(0, list(tokens), lps, reason)]


class StepEngine:
    """vLLM's engine as the session drives it: each step gives every running request one more token (a delta
    output); request r stops (EOS) after 2 + r tokens."""

    def __init__(self):
        self.requests, self.aborted, self.added, self.steps = {}, [], [], 0

    def add_request(self, request_id, prompt, params):
        self.added.append((request_id, prompt, params))
        self.requests[request_id] = (prompt, params, [])
        return f"{request_id}-internal"

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.steps += 1
        outs = []
        for rid, (prompt, params, tokens) in list(self.requests.items()):
            stop = len(tokens) + 1 == 2 + int(rid) or len(tokens) + 1 == params.max_tokens
            tokens.append(EOS if len(tokens) + 1 == 2 + int(rid) else 40 + len(tokens))
            reason = ("stop" if tokens[-1] == EOS else "length") if stop else None
            outs.append(FakeOut(rid, tokens[-1:], stop, reason, first=len(tokens)))
            if stop:
                del self.requests[rid]
        return outs

    def abort_request(self, ids, internal=False):
        assert internal and all(rid.endswith("-internal") for rid in ids)  # the ids add_request returned
        self.aborted += ids
        for rid in ids:
            self.requests.pop(rid.split("-")[0])


class FakeLLM:
    def __init__(self):
        import itertools

        self.llm_engine = StepEngine()
        self.request_counter = itertools.count()


def test_vllm_session_continues_records_as_new_seeded_requests():
    from mcpo_megatron.rollout.engines.vllm.engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine("/m", eos_token_ids=[EOS], llm=FakeLLM(), sampling_params_cls=FakeParams)
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=0, stop_token_ids=(9,))
    old = SequenceRecord(7, 1, 1234, [40, 41], [-0.5, -0.6], [3, 3])
    records = [SequenceRecord(0, 0, 99), old, SequenceRecord(2, 0, 55)]
    prompts = [[1, 2], [3], [4, 5, 6]]
    session = engine.open_session(prompts, records, sampling)
    from vllm.sampling_params import RequestOutputKind

    sent = engine.llm.llm_engine.added
    assert [rid for rid, _, _ in sent] == ["0", "1", "2"]  # the LLM's own request numbering
    assert [p["prompt_token_ids"] for _, p, _ in sent] == [[1, 2], [3, 40, 41], [4, 5, 6]]
    assert [sp.max_tokens for _, _, sp in sent] == [6, 4, 6]
    assert [sp.seed for _, _, sp in sent] == [99, continuation_seed(1234, 2), 55]
    assert all(sp.stop_token_ids == [EOS, 9] and sp.logprobs == 0 and sp.n == 1 for _, _, sp in sent)
    assert all(sp.output_kind == RequestOutputKind.DELTA for _, _, sp in sent)  # an unfinished record's tokens
    assert session.step(2, version=4) == 2  # request 0 stops after 2 tokens
    assert session.step(1, version=5) == 1  # request 1 stops after 3
    out = session.close()
    assert engine.llm.llm_engine.aborted == ["2-internal"]
    assert out[0].token_ids == [40, EOS] and out[0].finish_reason == "stop" and out[0].versions == [4, 4]
    assert out[1].token_ids == [40, 41, 40, 41, EOS] and out[1].versions == [3, 3, 4, 4, 5]
    assert out[1].logprobs[:2] == [-0.5, -0.6] and out[1].logprobs[2:] == pytest.approx([-0.1, -0.2, -0.3])
    assert out[2].token_ids == [40, 41, 42] and out[2].finish_reason is None and out[2].versions == [4, 4, 5]

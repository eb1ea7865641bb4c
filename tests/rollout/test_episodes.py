"""Episodes with the Python tool on the PyTorch engine and the real sandbox, with the scripted tool model
(``models/tool_model.py``): a reply writes a code block, the sandbox runs it, the output is appended as the tool's
tokens, and the model answers from it.

The contract of an episode, each asserted on the engine's output: the trainer's view (the HF model over the whole
episode) gives the engine's log-prob on every model token; the tool's tokens are exactly the formatted output,
masked, with log-prob 0; an episode without a call is the engine's plain reply, bit for bit; samples do not
depend on how prompts are split; a failed call comes back to the model as text; the budget counts tool tokens.
"""

from __future__ import annotations

import re

import pytest
import torch

from mcpo_megatron.models.tool_model import code_block, make_tool_model, question
from mcpo_megatron.rollout.engines.interface import SamplingParams, processed_logprobs
from mcpo_megatron.rollout.episodes import EpisodeEngine, EpisodeSettings, episode_metrics
from mcpo_megatron.tools import CallLimits, HttpSandbox, LocalSandbox, format_output

PAIRS = [(6, 7), (3, 4), (9, 9), (2, 8), (7, 5), (4, 4)]
T = 0.8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tool_model(tmp_path_factory.mktemp("tool_model") / "m", p_call=0.6, p_guess_right=0.2, p_quit=0.1)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    return TorchRolloutEngine.from_pretrained(model_dir, eos_token_ids=[tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def sandbox():
    with LocalSandbox(2, CallLimits(timeout_s=5, cpu_s=5, memory_mb=1024), preload=()) as box:
        yield box


def _prompts(tokenizer):
    return [tokenizer.encode(question(a, b), add_special_tokens=False) for a, b in PAIRS]


@pytest.fixture(scope="module")
def episodes(engine, sandbox, tokenizer):
    episodic = EpisodeEngine(engine, sandbox, tokenizer, EpisodeSettings(max_turns=4, max_output_tokens=64))
    sampling = SamplingParams(n=6, temperature=T, max_new_tokens=24, seed=3)
    return episodic, sampling, episodic.generate(_prompts(tokenizer), sampling)


def test_a_call_runs_and_the_model_answers_from_its_output(episodes, tokenizer):
    _, _, out = episodes
    called = [s for s in out.samples if s.episode.calls]
    direct = [s for s in out.samples if not s.episode.calls]
    assert len(called) >= 8 and len(direct) >= 8  # 36 samples at p_call 0.6
    for s in called:
        a, b = PAIRS[s.prompt_index]
        text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
        assert text.startswith(code_block(a, b) + format_output(f"{a * b}\n"))
        tool = tokenizer.encode(format_output(f"{a * b}\n"), add_special_tokens=False)
        first = len(tokenizer.encode(code_block(a, b), add_special_tokens=False))
        assert s.token_ids[first:first + len(tool)] == tool  # the output's own tokens, not re-encoded history
        assert s.model_mask == [True] * first + [False] * len(tool) + [True] * (len(s.token_ids) - first - len(tool))
        assert s.logprobs[first:first + len(tool)] == [0.0] * len(tool)
        assert (s.episode.turns, s.episode.calls, s.episode.errors) == (2, 1, 0) and s.episode.seconds > 0
        answered = re.search(r"\\boxed\{(\d+)\}", text)
        assert answered is None or int(answered.group(1)) == a * b  # the answer is the output's number
    assert all(s.model_mask == [True] * len(s.token_ids) and s.episode.turns == 1 for s in direct)
    m = episode_metrics(out.samples)
    assert m["tools/calls"] == len(called) and m["tools/errors"] == 0
    assert m["tools/episodes_with_call"] == pytest.approx(len(called) / len(out.samples))
    assert 0 < m["tools/tool_token_frac"] < 1 and m["tools/turns_mean"] == pytest.approx(1 + len(called) / 36)


def test_the_trainers_view_of_an_episode_gives_the_engines_logprobs(episodes, model_dir, tokenizer):
    """Token in, token out: the HF model over prompt + every episode token reproduces the engine's processed
    log-prob on each model token (the tool's are never sampled)."""
    from transformers import AutoModelForCausalLM

    _, _, out = episodes
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(tokenizer)
    worst, checked = 0.0, 0
    with torch.no_grad():
        for s in out.samples:
            p = prompts[s.prompt_index]
            logits = model(torch.tensor([p + s.token_ids])).logits[0, len(p) - 1:-1].double()
            lp = processed_logprobs(logits, T).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
            keep = torch.tensor(s.model_mask)
            worst = max(worst, float((lp[keep] - torch.tensor(s.logprobs, dtype=torch.float64)[keep]).abs().max()))
            checked += int(keep.sum())
    assert checked > 60 and worst < 1e-4


def test_an_episode_without_a_call_is_the_plain_reply(engine, sandbox, tokenizer, tmp_path):
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    path = make_tool_model(tmp_path / "never_calls", p_call=0.0, p_guess_right=0.4)
    plain = TorchRolloutEngine.from_pretrained(path, eos_token_ids=[tokenizer.eos_token_id])
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=5)
    want = plain.generate(_prompts(tokenizer), sampling)
    got = EpisodeEngine(plain, sandbox, tokenizer, EpisodeSettings()).generate(_prompts(tokenizer), sampling)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
    assert all(s.model_mask == [True] * len(s.token_ids) and s.episode.calls == 0 for s in got)


def test_episodes_do_not_depend_on_the_split(episodes, tokenizer):
    episodic, sampling, out = episodes
    prompts = _prompts(tokenizer)
    parts = [episodic.generate(prompts[:2], sampling, prompt_indices=[0, 1]),
             episodic.generate(prompts[2:], sampling, prompt_indices=[2, 3, 4, 5])]
    joined = [s for p in parts for s in p.samples]
    assert [(s.prompt_index, s.sample_index, s.token_ids, s.logprobs, s.model_mask) for s in joined] == \
        [(s.prompt_index, s.sample_index, s.token_ids, s.logprobs, s.model_mask) for s in out.samples]


def test_a_failed_call_is_text_for_the_model(engine, tokenizer, tmp_path):
    """A sandbox service that is not there: every call comes back ``unavailable`` with the reason as its output,
    the episode goes on (the scripted model reads no number and stops), nothing is raised."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = make_tool_model(tmp_path / "always_calls", p_call=1.0, p_guess_right=0.0)
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    always = TorchRolloutEngine.from_pretrained(path, eos_token_ids=[tokenizer.eos_token_id])
    with HttpSandbox(f"http://127.0.0.1:{port}/run", workers=2, timeout_s=2.0) as down:
        out = EpisodeEngine(always, down, tokenizer, EpisodeSettings()).generate(
            _prompts(tokenizer)[:2], SamplingParams(n=2, temperature=1.0, max_new_tokens=200, seed=0))
    for s in out.samples:
        text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
        assert "\\boxed" not in text and "```output\n" in text
        assert (s.episode.calls, s.episode.errors, s.episode.failures) == (1, 1, 0)  # the sandbox's failure
        assert s.finish_reason == "stop" and s.model_mask.count(False) > 5


def test_the_budget_counts_the_tools_tokens(engine, sandbox, tokenizer, tmp_path):
    """max_new_tokens bounds model and tool tokens together: an output that does not fit is cut to the room left
    and the episode ends with finish "length"; tools.max_output_tokens cuts an output on its own."""
    path = make_tool_model(tmp_path / "calls", p_call=1.0, p_guess_right=0.0)
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    always = TorchRolloutEngine.from_pretrained(path, eos_token_ids=[tokenizer.eos_token_id])
    prompts = _prompts(tokenizer)[:2]
    tight = EpisodeEngine(always, sandbox, tokenizer, EpisodeSettings()).generate(
        prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=2, seed=0))
    for s in tight.samples:
        assert len(s.token_ids) == 2 and s.model_mask == [True, False] and s.finish_reason == "length"
    capped = EpisodeEngine(always, sandbox, tokenizer, EpisodeSettings(max_output_tokens=1)).generate(
        prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=50, seed=0))
    for s in capped.samples:
        assert s.model_mask[:2] == [True, False] and s.model_mask.count(False) == 1


# ---------------------------------------------------------------------- partial rollouts: episodes in segments
def _in_segments(episodic, prompts, sampling, segment: int, *, through_checkpoint: bool = False):
    """Every sample of ``prompts`` as a sequence record, generated ``segment`` tokens a batch (a session opened and
    closed each time, as partial rollouts' batches do), stamped with the batch's number as its version; with
    ``through_checkpoint`` each record goes through a checkpoint's save and load between batches. Returns the
    finished records and how many boundaries found an episode mid-call (its code not run yet)."""
    import io

    from mcpo_megatron.rollout.engines.interface import sample_seed
    from mcpo_megatron.rollout.engines.records import SequenceRecord
    from mcpo_megatron.trainer.checkpoint import check_plain

    records = [SequenceRecord(j, i, sample_seed(sampling.seed, j, i)) for j in range(len(prompts))
               for i in range(sampling.n)]
    mid_call = 0
    for version in range(200):
        live = [k for k, r in enumerate(records) if not r.finished]
        if not live:
            return records, mid_call
        session = episodic.open_session([prompts[records[k].prompt_index] for k in live], [records[k] for k in live],
                                        sampling)
        session.step(segment, version=version)
        for k, r in zip(live, session.close()):
            if through_checkpoint:
                buf = io.BytesIO()
                check_plain(r.state_dict(), "record")
                torch.save(r.state_dict(), buf)
                buf.seek(0)
                r = SequenceRecord.from_state(torch.load(buf, weights_only=True))
            mid_call += bool(r.episode and r.episode["pending_code"] and not r.finished)
            records[k] = r
    raise AssertionError("episodes did not finish in 200 segments")


@pytest.fixture(scope="module")
def segmented(episodes, tokenizer):
    episodic, sampling, _ = episodes
    return _in_segments(episodic, _prompts(tokenizer), sampling, 2)


def test_episodes_in_segments_call_the_tool_and_carry_over_mid_call(segmented, tokenizer):
    """Partial rollouts: an episode generated two tokens a segment makes its calls across segment boundaries
    (many boundaries fall between a turn's code block and its call), its tool tokens are the formatted output,
    masked, log-prob 0, with the version of the turn that made the call; the answer is the output's number."""
    records, mid_call = segmented
    assert mid_call >= 8
    called = [r for r in records if r.episode["statuses"]]
    assert len(called) >= 8
    for r in called:
        a, b = PAIRS[r.prompt_index]
        tool = tokenizer.encode(format_output(f"{a * b}\n"), add_special_tokens=False)
        first = len(tokenizer.encode(code_block(a, b), add_special_tokens=False))
        assert r.token_ids[first:first + len(tool)] == tool and r.logprobs[first:first + len(tool)] == [0.0] * len(tool)
        assert r.model_mask == [True] * first + [False] * len(tool) + [True] * (len(r.token_ids) - first - len(tool))
        assert r.versions[first:first + len(tool)] == [r.versions[first - 1]] * len(tool)
        assert r.versions == sorted(r.versions)  # each segment's tokens carry its version
        answered = re.search(r"\\boxed\{(\d+)\}", tokenizer.decode(r.token_ids, skip_special_tokens=True))
        assert answered is None or int(answered.group(1)) == a * b
        assert r.episode["statuses"] == ["ok"] and r.episode["turns"] == 2
    assert all(r.model_mask == [True] * len(r.token_ids) for r in records if not r.episode["statuses"])


def test_episodes_resume_exactly_from_a_checkpoint_mid_call(segmented, episodes, tokenizer):
    """Records saved and loaded (weights_only, as trainer_state.pt is) after every segment, episodes mid-call
    among them, go on to the same tokens, log-probs, masks, versions and tool use as records never saved."""
    episodic, sampling, _ = episodes
    resumed, mid_call = _in_segments(episodic, _prompts(tokenizer), sampling, 2, through_checkpoint=True)
    want, _ = segmented
    assert mid_call >= 8

    def view(r):
        return (r.token_ids, r.logprobs, r.versions, r.model_mask, r.finish_reason, r.episode["statuses"],
                r.episode["turns"])
    assert [view(r) for r in resumed] == [view(r) for r in want]


def test_segmented_episodes_give_the_engines_logprobs_and_an_episode_without_a_call_is_the_plain_record(
        segmented, model_dir, tokenizer, sandbox, tmp_path):
    """The trainer's view of a segmented episode (HF over the whole of it) gives the engine's log-prob on every
    model token; with a model that never calls, the segmented episodes are the plain engine's segmented records
    bit for bit (the same seeds and draws)."""
    from transformers import AutoModelForCausalLM

    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    records, _ = segmented
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(tokenizer)
    worst = 0.0
    with torch.no_grad():
        for r in records:
            p = prompts[r.prompt_index]
            logits = model(torch.tensor([p + r.token_ids])).logits[0, len(p) - 1:-1].double()
            lp = processed_logprobs(logits, T).gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            keep = torch.tensor(r.model_mask)
            worst = max(worst, float((lp[keep] - torch.tensor(r.logprobs, dtype=torch.float64)[keep]).abs().max()))
    assert worst < 1e-4

    path = make_tool_model(tmp_path / "never_calls", p_call=0.0, p_guess_right=0.4)
    plain = TorchRolloutEngine.from_pretrained(path, eos_token_ids=[tokenizer.eos_token_id])
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=5)
    got, _ = _in_segments(EpisodeEngine(plain, sandbox, tokenizer, EpisodeSettings()), prompts, sampling, 3)
    want, _ = _in_segments(plain, prompts, sampling, 3)
    assert [(r.token_ids, r.logprobs, r.versions, r.finish_reason) for r in got] == \
        [(r.token_ids, r.logprobs, r.versions, r.finish_reason) for r in want]
    assert all(r.model_mask == [True] * len(r.token_ids) and r.episode["statuses"] == [] for r in got)


def test_an_episodes_routing_is_the_routing_of_its_whole_sequence(sandbox, tokenizer, tmp_path):
    """r3 on episodes, whole and in segments: the routing an episode carries covers every position but its last
    token's when it ends on a model token (the tool's tokens included: the next turn ran them), and at each one
    equals the experts the model's routers pick in one forward pass over the whole episode (transformers'
    router logits, top-k)."""
    from transformers import AutoModelForCausalLM

    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    path = make_tool_model(tmp_path / "moe", family="qwen3_moe", p_call=0.6, p_guess_right=0.2, p_quit=0.0,
                           p_again=0.5)
    engine = TorchRolloutEngine.from_pretrained(path, eos_token_ids=[tokenizer.eos_token_id],
                                                return_routed_experts=True)
    episodic = EpisodeEngine(engine, sandbox, tokenizer, EpisodeSettings(max_turns=4, max_output_tokens=64))
    prompts = _prompts(tokenizer)
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=1)
    whole = [(s.prompt_index, s.token_ids, s.model_mask, s.routed_experts)
             for s in episodic.generate(prompts, sampling).samples]
    records, _ = _in_segments(episodic, prompts, sampling, 2)
    segmented = [(r.prompt_index, r.token_ids, r.model_mask, r.routed_experts) for r in records]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    checked = 0
    for j, tokens, mask, routed in whole + segmented:
        ids = prompts[j] + tokens
        with torch.no_grad():
            logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
        want = torch.stack([x.reshape(len(ids), -1).topk(2, dim=-1).indices for x in logits], dim=1)  # [S, L, k]
        covered = routed.shape[0]
        assert covered == len(ids) - 1 or not mask[-1]  # short only when it ends on the tool's tokens
        assert torch.equal(routed.long(), want[:covered])
        checked += mask.count(False) > 0
    assert checked >= 8  # episodes with tool tokens among them


def test_chat_template_calls_run_and_their_outputs_are_the_templates_tool_messages(sandbox, tmp_path):
    """tools.format=chat_template with the scripted model speaking its template's tool calls: the prompt declares
    the tool through the template, each <tool_call> runs (in segments too), the output is appended as the
    template renders a tool message (masked, log-prob 0), the model answers from it, and the trainer's view gives
    the engine's log-probs. A malformed call is not run: the reason is its output, a failure of the code's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mcpo_megatron.data.templates import _ids
    from mcpo_megatron.models.tool_model import tool_call
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine
    from mcpo_megatron.rollout.episodes import Episode
    from mcpo_megatron.tools.chat_calls import PYTHON_TOOL, ToolResponseFormat

    path = make_tool_model(tmp_path / "chat", p_call=0.6, p_guess_right=0.2, p_quit=0.0, p_again=0.3,
                           syntax="chat_template")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [_ids(tok.apply_chat_template([{"role": "user", "content": question(a, b)}], tools=[PYTHON_TOOL],
                                            add_generation_prompt=True, tokenize=True)) for a, b in PAIRS]
    assert tok.decode(prompts[0]).startswith("Tools: python \n")
    engine = TorchRolloutEngine.from_pretrained(path, eos_token_ids=[tok.eos_token_id])
    episodic = EpisodeEngine(engine, sandbox, tok, EpisodeSettings(max_turns=4, max_output_tokens=64,
                                                                   format="chat_template"))
    sampling = SamplingParams(n=4, temperature=T, max_new_tokens=24, seed=2)
    whole = episodic.generate(prompts, sampling).samples
    segmented, _ = _in_segments(episodic, prompts, sampling, 2)
    response = ToolResponseFormat(tok)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    called = 0
    for s in list(whole) + segmented:
        a, b = PAIRS[s.prompt_index]
        text = tok.decode(s.token_ids, skip_special_tokens=True)
        if s.model_mask.count(False):
            called += 1
            first = len(tok.encode(tool_call(a, b), add_special_tokens=False))
            tool = tok.encode(response.text(f"{a * b}\n"), add_special_tokens=False)
            assert text.startswith(tool_call(a, b) + "<tool_response>\n" + f"{a * b}\n</tool_response>\n")
            assert s.token_ids[first:first + len(tool)] == tool and s.logprobs[first:first + len(tool)] == [0.0] * 2
            assert s.model_mask[first:first + len(tool)] == [False] * len(tool)
            assert "\\boxed{" not in text or f"\\boxed{{{a * b}}}" in text
        p = prompts[s.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([p + s.token_ids])).logits[0, len(p) - 1:-1].double()
        lp = processed_logprobs(logits, T).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        keep = torch.tensor(s.model_mask)
        assert float((lp[keep] - torch.tensor(s.logprobs, dtype=torch.float64)[keep]).abs().max()) < 1e-4
    assert called >= 10

    e = Episode(0, 0, prompts[0], [5], [-0.1], [True], turns=1, pending_error="error: the tool call is not valid JSON")
    episodic._run_calls([e], SamplingParams(max_new_tokens=200))
    assert tok.decode(e.token_ids[1:]) == response.text("error: the tool call is not valid JSON")
    assert e.model_mask == [True] + [False] * (len(e.token_ids) - 1) and not e.calling
    assert (e.stats().calls, e.stats().errors, e.stats().failures) == (1, 1, 1)

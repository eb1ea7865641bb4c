"""Multi-turn episodes with the Python tool (tool-integrated reasoning), generated turn by turn by any engine.

:class:`EpisodeEngine` wraps a rollout engine (the PyTorch reference or vLLM) and runs each sample of
``generate`` as an episode:

1. Turn 1 is the engine's own call on the prompts, with the same seeds: an episode that calls no tool is the
   reply the engine would have given without tools.
2. After every turn, the turn's text (its tokens decoded) is searched for a complete ```python block
   (``tools.python_block``). Found: the turn's tokens are cut just after the token that completes the block's
   closing fence; the tokens past it were sampled after the call as if it had no output, and are dropped. Every
   call of the turn runs in the sandbox as one batch (``Sandbox.run_batch``: concurrent, bounded in time, failures
   come back as text). Each output, formatted as an ```output block (``tools.format_output``) and cut to
   ``tools.max_output_tokens`` tokens, is tokenized on its own and appended: those are the tool's tokens
   (``RolloutSample.model_mask`` False, log-prob 0.0), which no term of the loss trains on.
3. The episode goes on from its prompt and all its tokens, until a turn calls no tool, ``tools.max_turns`` calls
   have run, or ``max_new_tokens`` is used up: the budget counts the model's and the tool's tokens, since both
   are context the trainer trains over. An episode cut by the budget ends with finish "length".

Token in, token out: the trainer trains the ids the engine sampled and the ids of the outputs as they were
appended; nothing earlier is decoded and encoded again. The engine's log-prob of each kept token is the one it
reported when it sampled that token, with the context it had.

Seeds: in the ``r``-th engine call (``r >= 2``; a call generates the next turn of every running episode),
episode ``(j, i)`` is a request of its own, seeded as sample 0 of prompt ``j * n + i`` under the base seed
:func:`turn_seed` ``(seed, r)``: repeatable, independent of the replica split.

Calls per episode: ``tools.max_turns``. The turn after the last call is generated, so that the model can state
its answer; a code block in it ends the episode there, not run.

The call syntax is ``tools.format``'s: ``python_block`` as above, or ``chat_template``, the model's chat template's
own tool calls (``<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>``, ``tools/chat_calls.py``)
with each output appended as the template renders a tool message and the next assistant turn's start; a
malformed call is not run, the reason is its output (status error).

Stopping a turn early: the calls carry the syntax's stop string (``"\\n```\\n"``, a closing fence on its own line,
or ``"</tool_call>"``), on which vLLM ends the request; the PyTorch engine, which does not read text, generates on to a stop token or the
cap, and the cut of step 2 gives both engines the same kept tokens. A stop string that closed another kind of
block (```text) ends a turn without a call: the episode then continues that turn (not counted as a turn).

Tensor parallelism: the ranks of one TP engine generate the same episodes; their tool outputs must be the same
tokens, so the engine's first rank runs the calls and :meth:`RolloutEngine.share_within_engine` hands its results
to the others (a call that reads the clock or times out would otherwise differ).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from mcpo_megatron.rollout.engines.interface import (FINISH_LENGTH, FINISH_STOP, EpisodeStats, RolloutEngine,
                                                     RolloutOutput, RolloutSample, SamplingParams, StopPoll)
from mcpo_megatron.rollout.engines.records import (GenerationSession, SequenceRecord, check_session_inputs,
                                                   continuation_seed, extend_routing)
from mcpo_megatron.tools.chat_calls import CALL_END, ToolResponseFormat, find_tool_call
from mcpo_megatron.tools.python_block import find_code_block, format_output
from mcpo_megatron.tools.tokens import truncate_tokens
from mcpo_megatron.tools.types import ToolResult

#: vLLM's stop string for a turn: a closing fence alone on its line (the opening one is ```python).
CLOSING_FENCE_STOP = "\n```\n"
#: What replaces the middle of a tool output cut to ``tools.max_output_tokens``.
TRUNCATION_NOTE = "\n[... output truncated ...]\n"
# Continuations of one turn after a stop string that closed no python block, at most (then the turn ends).
_MAX_RESUMES = 4


def turn_seed(seed: int, round_number: int) -> int:
    """The base seed of the ``round_number``-th engine call of a batch of episodes (>= 2; the first call uses
    ``seed`` itself): a 63-bit hash."""
    digest = hashlib.blake2b(f"turn/{int(seed)}/{int(round_number)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class Episode:
    """One sample being generated as an episode: its prompt, every token so far with the engine's log-prob
    (0.0 on the tool's) and whose it is, and its tool use."""

    prompt_index: int
    sample_index: int
    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    model_mask: list[bool] = field(default_factory=list)
    turns: int = 0
    statuses: list[str] = field(default_factory=list)
    tool_seconds: float = 0.0
    finish_reason: str | None = None
    resumes: int = 0               # continuations of the current turn (a stop string without a python block)
    turn_start: int | None = None  # index in token_ids of the current turn's first token; None between turns
    pending_code: str | None = None  # the code of the block the last turn ended with, not run yet
    pending_error: str | None = None  # or why that call cannot run (a malformed call): the call's output
    # partial rollouts: where the engine's record of the current turn starts (None: a new one at the next segment)
    record_start: int | None = None
    # r3: the experts each position was routed to when the engine ran it ([positions, layers, k], from the prompt's
    # first), each kept as first recorded; None without routing output
    routing: Any = None

    @property
    def calling(self) -> bool:
        """Its last turn ended with a call not run yet."""
        return self.pending_code is not None or self.pending_error is not None

    def stats(self) -> EpisodeStats:
        return EpisodeStats(turns=self.turns, calls=len(self.statuses), errors=sum(s != "ok" for s in self.statuses),
                            failures=sum(s not in ("ok", "unavailable") for s in self.statuses),
                            timeouts=sum(s == "timeout" for s in self.statuses), seconds=self.tool_seconds)

    def sample(self) -> RolloutSample:
        return RolloutSample(self.prompt_index, self.sample_index, list(self.token_ids), list(self.logprobs),
                             self.finish_reason or FINISH_LENGTH, routed_experts=self.final_routing(),
                             model_mask=list(self.model_mask), episode=self.stats())

    def add_routing(self, run) -> None:
        """r3: the routing of an engine call that ran this episode from its first position (``run``, [positions,
        layers, k]), after the call's kept tokens were appended. The positions up to the last kept token are
        valid whatever was dropped after it (a position's routing depends on the tokens up to it only); those
        already recorded keep their first routing. The tool's tokens are routed by the call after them, which
        runs them as its prompt; an episode that ends on tool tokens leaves them to the trainer's own routers."""
        if run is None:
            return
        keep = len(self.prompt) + len(self.token_ids)
        recorded = None if self.routing is None else self.routing[:keep]
        self.routing = extend_routing(recorded, torch.as_tensor(run)[:keep])

    def final_routing(self):
        """The routing of the positions the trainer replays (all but the last token's), as far as recorded."""
        return None if self.routing is None else self.routing[: len(self.prompt) + len(self.token_ids) - 1]

    # ------------------------------------------------------------------ as a sequence record (partial rollouts)
    def progress(self) -> dict:
        """The tool use so far as plain values (``SequenceRecord.episode``: checkpoints and engine ranks)."""
        return {"turns": self.turns, "statuses": list(self.statuses), "tool_seconds": float(self.tool_seconds),
                "resumes": self.resumes, "turn_start": self.turn_start, "pending_code": self.pending_code,
                "pending_error": self.pending_error, "record_start": self.record_start}

    @classmethod
    def from_record(cls, prompt: Sequence[int], record: SequenceRecord) -> "Episode":
        """A record's episode: a record that has none yet (new, or restarted) starts one. ``record.routed_experts``
        is the episode's routing as recorded (it may end before the last positions: tool tokens not run yet)."""
        p = record.episode or {}
        mask = [True] * len(record.token_ids) if record.model_mask is None else list(record.model_mask)
        return cls(record.prompt_index, record.sample_index, list(prompt), list(record.token_ids),
                   list(record.logprobs), mask, turns=int(p.get("turns", 0)), statuses=list(p.get("statuses", ())),
                   tool_seconds=float(p.get("tool_seconds", 0.0)), finish_reason=record.finish_reason,
                   resumes=int(p.get("resumes", 0)), turn_start=p.get("turn_start"),
                   pending_code=p.get("pending_code"), pending_error=p.get("pending_error"),
                   record_start=p.get("record_start"),
                   routing=record.routed_experts)


def record_stats(record: SequenceRecord) -> EpisodeStats | None:
    """The tool use of a record generated as an episode (None for a plain reply)."""
    return None if record.episode is None else Episode.from_record((), record).stats()


@dataclass(frozen=True)
class EpisodeSettings:
    """The ``tools`` keys an episode reads: calls per episode, the output's token cap, the call syntax."""

    max_turns: int = 8
    max_output_tokens: int = 1024
    format: str = "python_block"

    @classmethod
    def from_config(cls, tools) -> "EpisodeSettings":
        return cls(max_turns=int(tools.max_turns), max_output_tokens=int(tools.max_output_tokens),
                   format=str(tools.format))


class PythonBlockSyntax:
    """``tools.format=python_block``: a ```python block is a call; its output follows as an ```output block."""

    stop = CLOSING_FENCE_STOP

    def find(self, text: str) -> tuple[str | None, str | None] | None:
        block = find_code_block(text)
        return None if block is None else (block.code, None)

    def output(self, text: str) -> str:
        return format_output(text)


class ChatTemplateSyntax:
    """``tools.format=chat_template``: a ``<tool_call>`` of the model's chat template is a call
    (``tools/chat_calls.py``); its output follows as the template renders a tool message, with the next assistant
    turn's start. A malformed call (not JSON, another tool, no code) is not run: the reason is its output."""

    stop = CALL_END

    def __init__(self, tokenizer):
        self.response = ToolResponseFormat(tokenizer)

    def find(self, text: str) -> tuple[str | None, str | None] | None:
        call = find_tool_call(text)
        return None if call is None else (call.code, call.error)

    def output(self, text: str) -> str:
        return self.response.text(text)


def call_syntax(settings: EpisodeSettings, tokenizer):
    if settings.format == "python_block":
        return PythonBlockSyntax()
    if settings.format == "chat_template":
        return ChatTemplateSyntax(tokenizer)
    raise ValueError(f"tools.format={settings.format!r} must be python_block or chat_template")


class EpisodeEngine(RolloutEngine):
    """A rollout engine whose samples are episodes with the Python tool (module docstring). Weight updates,
    sleep and wake-up go to the wrapped engine; so does every attribute it does not define."""

    def __init__(self, engine: RolloutEngine, sandbox, tokenizer, settings: EpisodeSettings):
        """``sandbox``: a :class:`~mcpo_megatron.tools.sandbox.Sandbox` on the engine's first rank
        (:meth:`leads_engine`), None on its other ranks (they take the first rank's results)."""
        if tokenizer is None:
            raise ValueError("EpisodeEngine needs the run's tokenizer: it decodes each turn to find its code block "
                             "and encodes the tool's output")
        self.engine, self.sandbox, self.tokenizer, self.settings = engine, sandbox, tokenizer, settings
        self.syntax = call_syntax(settings, tokenizer)
        self._marker = list(tokenizer.encode(TRUNCATION_NOTE, add_special_tokens=False))

    def __getattr__(self, name: str) -> Any:  # only called for what EpisodeEngine itself lacks
        return getattr(self.__dict__["engine"], name)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts_token_ids, sampling: SamplingParams, *, prompt_indices: Sequence[int] | None = None,
                 should_stop: StopPoll | None = None) -> RolloutOutput:
        indices = list(range(len(prompts_token_ids)) if prompt_indices is None else prompt_indices)
        turn = dataclasses.replace(sampling, stop_strings=tuple(sampling.stop_strings) + (self.syntax.stop,))
        first = self.engine.generate(prompts_token_ids, turn, prompt_indices=indices, should_stop=should_stop)
        prompts = {j: list(p) for j, p in zip(indices, prompts_token_ids)}
        episodes = [Episode(x.prompt_index, x.sample_index, prompts[x.prompt_index]) for x in first.samples]
        self._absorb(episodes, first.samples, sampling)
        round_number = 1
        while True:
            self._run_calls([e for e in episodes if e.calling], sampling)
            running = [e for e in episodes if e.finish_reason is None]
            if not running:
                break
            round_number += 1
            left = max(sampling.max_new_tokens - len(e.token_ids) for e in running)
            params = dataclasses.replace(turn, n=1, max_new_tokens=left, seed=turn_seed(sampling.seed, round_number))
            out = self.engine.generate([e.prompt + e.token_ids for e in running], params,
                                       prompt_indices=[e.prompt_index * sampling.n + e.sample_index for e in running],
                                       should_stop=should_stop)
            self._absorb(running, out.samples, sampling)
        return RolloutOutput([e.sample() for e in episodes])

    def _absorb(self, episodes: list[Episode], samples: Sequence[RolloutSample], sampling: SamplingParams) -> None:
        """Append each episode's new tokens (up to the end of the turn's first code block), and decide whether it
        calls the tool next, continues its turn, or ends."""
        eos = set(getattr(self.engine, "eos_token_ids", ())) | set(sampling.stop_token_ids)
        for e, x in zip(episodes, samples):
            if e.turn_start is None:  # a new turn, not the continuation of one
                e.turns += 1
                e.turn_start = len(e.token_ids)
            room = sampling.max_new_tokens - len(e.token_ids)
            tokens, logprobs = list(x.token_ids[:room]), list(x.logprobs[:room])
            cut, call = self._block_end(e.token_ids[e.turn_start:], tokens)
            if cut is not None:
                tokens, logprobs = tokens[:cut], logprobs[:cut]
            e.token_ids += tokens
            e.logprobs += logprobs
            e.model_mask += [True] * len(tokens)
            e.add_routing(x.routed_experts)
            if cut is not None:
                e.resumes, e.turn_start = 0, None
                if len(e.statuses) >= self.settings.max_turns:
                    e.finish_reason = FINISH_STOP  # its calls are spent: a further block is not run
                elif len(e.token_ids) >= sampling.max_new_tokens:
                    e.finish_reason = FINISH_LENGTH  # no room for the output
                else:
                    e.pending_code, e.pending_error = call
            elif len(e.token_ids) >= sampling.max_new_tokens or x.finish_reason == FINISH_LENGTH:
                e.finish_reason = FINISH_LENGTH
            elif x.finish_reason is None:  # a segment of partial rollouts ended mid-turn: it goes on in the next
                pass
            elif not tokens or tokens[-1] in eos or e.resumes >= _MAX_RESUMES:
                e.finish_reason = FINISH_STOP
            else:  # vLLM stopped at a fence that closed no python block: the same turn goes on
                e.resumes += 1

    def _block_end(self, earlier: list[int], tokens: list[int]) -> tuple[int | None, tuple | None]:
        """How many of ``tokens`` (this turn's new tokens, after the ``earlier`` ones of the same turn) it takes to
        complete the turn's first call, and the call ((code, None), or (None, why it cannot run)); (None, None)
        when they complete none. A binary search over prefixes: whether a prefix's text holds a complete call only
        grows with the prefix."""
        def block(k: int):
            return self.syntax.find(self._decode(earlier + tokens[:k]))

        if not tokens or block(len(tokens)) is None:
            return None, None
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if block(mid) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo, block(lo)

    def _run_calls(self, episodes: list[Episode], sampling: SamplingParams) -> None:
        """Run the pending call of every episode of ``episodes`` as one sandbox batch (on the engine's first rank,
        shared with the others) and append the outputs; an episode the output fills ends with finish "length"."""
        if not episodes:
            return
        ran = iter(self.share_within_engine(self._call([e.pending_code for e in episodes
                                                         if e.pending_code is not None])))
        results = [next(ran) if e.pending_code is not None else ToolResult(e.pending_error, "error", 0.0)
                   for e in episodes]
        for e, result in zip(episodes, results):
            e.pending_code = e.pending_error = None
            e.statuses.append(result.status)
            e.tool_seconds += float(result.seconds)
            room = sampling.max_new_tokens - len(e.token_ids)
            ids = list(self.tokenizer.encode(self.syntax.output(result.text), add_special_tokens=False))
            cap = min(self.settings.max_output_tokens, room)
            ids, _ = truncate_tokens(ids, cap, self._marker if len(self._marker) < cap else ())
            e.token_ids += ids
            e.logprobs += [0.0] * len(ids)
            e.model_mask += [False] * len(ids)
            if len(e.token_ids) >= sampling.max_new_tokens:
                e.finish_reason = FINISH_LENGTH

    def _call(self, codes: list[str]) -> list[ToolResult] | None:
        """The sandbox's results, on the rank that runs the calls (None elsewhere)."""
        if not self.leads_engine():
            return None
        return self.sandbox.run_batch(codes) if codes else []

    def _decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ------------------------------------------------------------------ delegated
    def leads_engine(self) -> bool:
        return self.engine.leads_engine()

    def share_within_engine(self, obj):
        return self.engine.share_within_engine(obj)

    def weight_target(self):
        return self.engine.weight_target()

    def open_session(self, prompts_token_ids, records, sampling: SamplingParams):
        """Episodes generated in segments (partial rollouts): :class:`EpisodeSession`."""
        return EpisodeSession(self, prompts_token_ids, records, sampling)

    def begin_update(self) -> None:
        self.engine.begin_update()

    def update_weights(self, named_tensors) -> None:
        self.engine.update_weights(named_tensors)

    def finish_update(self) -> None:
        self.engine.finish_update()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        try:
            if self.sandbox is not None:
                self.sandbox.close()
        finally:
            self.engine.close()


@dataclass
class _SegmentTurn:
    """What one segment added to an episode's turn: the tokens, and the finish of the engine's record (None when it
    can go on)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    routed_experts: Any = None


@dataclass
class _Row:
    """An episode of a session, with what its record adds to it: the sample's seed and the version of each token."""

    episode: Episode
    seed: int
    versions: list[int]
    restarts: int

    def record(self) -> SequenceRecord:
        e = self.episode
        return SequenceRecord(e.prompt_index, e.sample_index, self.seed, list(e.token_ids), list(e.logprobs),
                              list(self.versions), e.finish_reason, e.final_routing(), self.restarts,
                              list(e.model_mask),
                              e.progress())


class EpisodeSession(GenerationSession):
    """Episodes generated in segments (partial rollouts, docs/algorithms.md §13 and §16): each record is an
    episode, carried from segment to segment, batch to batch and through checkpoints with its tool use
    (``SequenceRecord.model_mask`` and ``.episode``).

    A segment (:meth:`step`) first runs the call of every episode whose last turn ended with a code block (one
    sandbox batch, as in ``generate``) and appends the outputs, then decodes up to ``max_tokens`` tokens of every
    running episode's turn in one session of the wrapped engine. A turn that completes a code block is cut there;
    its call runs at the start of the next segment, so an episode makes at most one call per segment and may stop
    at a boundary mid-turn or mid-call (its code kept, not run yet). The tool's tokens take the version of the
    token that closed the block: the output is a function of that turn.

    The engine's record of a turn starts at the turn's first token (or where a turn goes on after a stop string
    that closed no python block) with the seed :func:`continuation_seed` (sample seed, that offset): the sample's
    own seed at offset 0, so an episode that calls no tool is the plain partial record, token for token; a turn
    carried over a boundary continues that record as the engine continues any record. The PyTorch engine draws a
    record's k-th token from the k-th uniform of its seed, so there an episode that calls no tool is the plain
    partial record token for token; vLLM's session keeps a request from segment to segment, this one asks again
    each segment (the same seed rule, continuation_seed of the turn's seed and its tokens so far), so there the two
    agree at batch boundaries and within a segment."""

    def __init__(self, owner: "EpisodeEngine", prompts: Sequence[Sequence[int]], records: Sequence[SequenceRecord],
                 sampling: SamplingParams):
        check_session_inputs(prompts, records, sampling)
        self.owner, self.sampling = owner, sampling
        self.turn_sampling = dataclasses.replace(sampling, stop_strings=tuple(sampling.stop_strings)
                                                 + (owner.syntax.stop,))
        self._rows = [_Row(Episode.from_record(p, r), r.seed, list(r.versions), r.restarts) for p, r in
                      zip(prompts, records)]

    @property
    def records(self) -> list[SequenceRecord]:
        return [row.record() for row in self._rows]

    def step(self, max_tokens: int, *, version: int, should_stop: StopPoll | None = None) -> int:
        calling = [row for row in self._rows if row.episode.finish_reason is None and row.episode.calling]
        self.owner._run_calls([row.episode for row in calling], self.sampling)
        for row in calling:  # the tool's tokens: the version of the turn that made the call
            row.versions += [row.versions[-1]] * (len(row.episode.token_ids) - len(row.versions))
        running = [row for row in self._rows if row.episode.finish_reason is None]
        if not running:
            return 0
        prompts, turns = [], []
        for row in running:
            e = row.episode
            if e.record_start is None:
                e.record_start = len(e.token_ids)
            k = e.record_start
            prompts.append(e.prompt + e.token_ids[:k])
            turns.append(SequenceRecord(e.prompt_index, e.sample_index, continuation_seed(row.seed, k),
                                        e.token_ids[k:], e.logprobs[k:], row.versions[k:]))
        session = self.owner.engine.open_session(prompts, turns, self.turn_sampling)
        try:
            session.step(max_tokens, version=version, should_stop=should_stop)
        finally:
            out = session.close()
        new = [_SegmentTurn(r.token_ids[len(t.token_ids):], r.logprobs[len(t.token_ids):], r.finish_reason,
                            r.routed_experts) for t, r in zip(turns, out)]
        before = [len(row.episode.token_ids) for row in running]
        self.owner._absorb([row.episode for row in running], new, self.sampling)
        for row, t, r, n in zip(running, turns, out, before):
            e = row.episode
            row.versions += r.versions[len(t.token_ids):][: len(e.token_ids) - n]
            if r.finished or e.calling or e.finish_reason is not None:
                e.record_start = None
        return self.running

    def close(self) -> list[SequenceRecord]:
        return self.records


def episode_metrics(samples: Sequence[RolloutSample]) -> dict[str, float]:
    """The step's tool use, for the metrics line: turns per episode, calls, errors and timeouts per episode and in
    all, tool seconds (summed over calls), and the share of response tokens that are the tool's. Empty when no
    sample is an episode."""
    stats = [x.episode for x in samples if x.episode is not None]
    if not stats:
        return {}
    n = len(stats)
    tool_tokens = sum(m.count(False) for m in (x.model_mask for x in samples) if m is not None)
    all_tokens = sum(len(x.token_ids) for x in samples)
    return {
        "tools/turns_mean": sum(s.turns for s in stats) / n,
        "tools/calls": float(sum(s.calls for s in stats)),
        "tools/calls_mean": sum(s.calls for s in stats) / n,
        "tools/errors": float(sum(s.errors for s in stats)),
        "tools/timeouts": float(sum(s.timeouts for s in stats)),
        "tools/seconds": sum(s.seconds for s in stats),
        "tools/episodes_with_call": sum(s.calls > 0 for s in stats) / n,
        "tools/tool_token_frac": tool_tokens / all_tokens if all_tokens else 0.0,
    }

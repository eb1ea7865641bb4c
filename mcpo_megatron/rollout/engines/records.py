"""Responses that outlive a generation call: sequence records, and the engines' sessions that generate them in
segments (partial rollouts, docs/algorithms.md §13 and docs/decisions.md, "Partial rollouts").

A :class:`SequenceRecord` is one sample (a prompt's ``sample_index``-th response) as far as it got: its tokens, the
engine's processed log-prob of each, the policy version that sampled each, and, for MoE models with routing replay
(``model.moe_routing_replay=r3``), the experts each position it ran was routed to. ``finish_reason`` is None while
it is unfinished. A record is all an engine needs to continue a response later, with newer weights, on any replica
or after a resume: the prompt, the tokens so far and the sample's ``seed``.

An engine generates records in a :class:`GenerationSession`::

    session = engine.open_session(prompts, records, sampling)   # one prompt per record
    session.step(segment_tokens, version=v)   # every running record: up to segment_tokens more tokens by version v
    ...                                       # (in-flight updates: new weights between two steps, records kept)
    records = session.close()                 # every record, finished or not, in the order given

Randomness. Token ``k`` of a sample is drawn as a pure function of (``seed``, k) and the logits, so a continued
record samples as a function of its history only: the PyTorch engine draws the k-th uniform of the generator
seeded by ``seed`` (the same uniform an uninterrupted call would use); a vLLM continuation is a new request whose
seed is :func:`continuation_seed` (``seed``, k), so it is repeatable, but not the sample an uninterrupted request
would have drawn.
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from mcpo_megatron.rollout.engines.interface import FINISH_LENGTH, FINISH_STOP, SamplingParams, StopPoll


@dataclass
class SequenceRecord:
    """One response so far (see the module docstring). ``prompt_index`` labels the prompt (the trainer uses the
    prompt's index in its data set); ``seed`` is the sample's own seed (``engine.sample_seed`` of the generation
    batch that first submitted it); ``versions[k]`` is the policy version that sampled ``token_ids[k]``."""

    prompt_index: int
    sample_index: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None     # None: unfinished; else "stop" | "length"
    # r3: [prompt_len + len(token_ids) - 1, num_layers, top-k] integer, the routing of every position the engine ran
    # (each kept as first recorded: the routing under which the next token was sampled); None without it
    routed_experts: Any = None
    restarts: int = 0                    # times its tokens were dropped for staleness (trainer.staleness_policy)
    # An episode with the Python tool (rollout/episodes.py): whose each token is (False: the tool's output, with
    # log-prob 0.0 and the version of the turn that made the call), and its progress as plain values (turns,
    # calls, a call not run yet); both None for a plain reply
    model_mask: list[bool] | None = None
    episode: dict | None = None

    def __post_init__(self):
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(f"SequenceRecord(prompt {self.prompt_index}, sample {self.sample_index}): "
                             f"{len(self.token_ids)} tokens, {len(self.logprobs)} log-probs and {len(self.versions)} "
                             "versions; every token needs one of each")
        if self.model_mask is not None and len(self.model_mask) != len(self.token_ids):
            raise ValueError(f"SequenceRecord(prompt {self.prompt_index}, sample {self.sample_index}): "
                             f"{len(self.model_mask)} model-mask entries for {len(self.token_ids)} tokens")
        if self.finish_reason not in (None, FINISH_STOP, FINISH_LENGTH):
            raise ValueError(f"finish_reason={self.finish_reason!r} must be None (unfinished), 'stop' or 'length'")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def oldest_version(self) -> int | None:
        """The version of its oldest token (what ``trainer.max_staleness`` bounds); None without tokens."""
        return min(self.versions) if self.versions else None

    def restarted(self) -> "SequenceRecord":
        """The same sample with its tokens (and an episode's tool use) dropped: it is generated again from the
        prompt, with the same seed."""
        return SequenceRecord(self.prompt_index, self.sample_index, self.seed, restarts=self.restarts + 1)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Tensors and plain values only (what a checkpoint's trainer_state.pt may hold); the log-probs in float64,
        so that a record comes back bit for bit."""
        return {"prompt_index": self.prompt_index, "sample_index": self.sample_index, "seed": self.seed,
                "token_ids": torch.tensor(self.token_ids, dtype=torch.int64),
                "logprobs": torch.tensor(self.logprobs, dtype=torch.float64),
                "versions": torch.tensor(self.versions, dtype=torch.int64), "finish_reason": self.finish_reason,
                "routed_experts": self.routed_experts, "restarts": self.restarts,
                "model_mask": None if self.model_mask is None else torch.tensor(self.model_mask, dtype=torch.bool),
                "episode": None if self.episode is None else dict(self.episode)}

    @classmethod
    def from_state(cls, state: dict) -> "SequenceRecord":
        return cls(int(state["prompt_index"]), int(state["sample_index"]), int(state["seed"]),
                   [int(t) for t in state["token_ids"].tolist()], [float(x) for x in state["logprobs"].tolist()],
                   [int(v) for v in state["versions"].tolist()], state["finish_reason"], state["routed_experts"],
                   int(state.get("restarts", 0)),
                   None if state.get("model_mask") is None else [bool(m) for m in state["model_mask"].tolist()],
                   None if state.get("episode") is None else dict(state["episode"]))


def continuation_seed(seed: int, offset: int) -> int:
    """The seed of a vLLM request that continues a sample at token ``offset``: the sample's own ``seed`` at offset
    0 (a response generated in one go is the same as without partial rollouts), else a 63-bit hash of both."""
    if offset == 0:
        return int(seed)
    digest = hashlib.blake2b(f"continue/{int(seed)}/{int(offset)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def remaining_tokens(record: SequenceRecord, sampling: SamplingParams) -> int:
    """How many tokens the record may still take before ``max_new_tokens`` (>= 1 for an unfinished record)."""
    left = sampling.max_new_tokens - len(record.token_ids)
    if left < 1 or record.finished:
        raise ValueError(f"record of prompt {record.prompt_index}, sample {record.sample_index} cannot continue: "
                         f"{len(record.token_ids)} of max_new_tokens={sampling.max_new_tokens} tokens, finish "
                         f"{record.finish_reason!r}")
    return left


def extend_routing(recorded: torch.Tensor | None, run: torch.Tensor) -> torch.Tensor:
    """A record's routing after a call that ran its positions again (a continuation re-prefills the prompt and the
    tokens so far): the positions already recorded keep their first routing, those beyond it are taken from
    ``run`` ([positions run, layers, k], from position 0)."""
    if recorded is None or recorded.shape[0] == 0:
        return run
    if run.shape[0] < recorded.shape[0]:
        raise ValueError(f"routing of {run.shape[0]} positions cannot extend a record of {recorded.shape[0]}")
    return torch.cat([torch.as_tensor(recorded), run[recorded.shape[0]:].to(torch.as_tensor(recorded).dtype)])


class GenerationSession(abc.ABC):
    """Records being generated by one engine (see the module docstring). ``records`` is their current state."""

    records: list[SequenceRecord]

    @abc.abstractmethod
    def step(self, max_tokens: int, *, version: int, should_stop: StopPoll | None = None) -> int:
        """Decode up to ``max_tokens`` more tokens of every running record (each stamped with ``version``); returns
        how many records are still running. ``should_stop`` is polled between decoding steps
        (:class:`~mcpo_megatron.rollout.engines.interface.GenerationInterrupted`)."""

    @abc.abstractmethod
    def close(self) -> list[SequenceRecord]:
        """Every record as it stands, in the order given; frees what the session held (KV cache, requests)."""

    @property
    def running(self) -> int:
        return sum(not r.finished for r in self.records)


def check_session_inputs(prompts: Sequence[Sequence[int]], records: Sequence[SequenceRecord],
                         sampling: SamplingParams) -> None:
    """One non-empty prompt per unfinished record that may still take a token."""
    if len(prompts) != len(records):
        raise ValueError(f"open_session: {len(prompts)} prompts for {len(records)} records; give one per record")
    for p, r in zip(prompts, records):
        if len(p) == 0:
            raise ValueError(f"open_session: the prompt of record (prompt {r.prompt_index}, sample "
                             f"{r.sample_index}) is empty; every prompt needs at least one token")
        remaining_tokens(r, sampling)

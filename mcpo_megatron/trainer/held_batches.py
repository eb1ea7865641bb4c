"""Generation batches the engines finished and the trainer has not trained yet, held so that a checkpoint can
keep them (``rollout.placement=separate``; docs/algorithms.md §13, docs/decisions.md "Exact resume with
separate placement").

With separate placement the engines generate the next steps' batches while a step trains, and a batch may take
a newer version in flight. A checkpoint that recorded such a batch as its prompts only would have it generated
again after a resume by the checkpoint's weights, a newer version than the uninterrupted run's, and the resumed
run would part from it. So the trainer never abandons a batch with separate placement: before a checkpoint it
waits for every batch in flight (:meth:`HeldBatches.finish`), a preemption signal during generation lets the
engines finish the batch it waits for, and the checkpoint holds the batches' samples. The resumed run trains
them as they were generated and, in a repeatable configuration, repeats the uninterrupted run exactly.

A held batch is a :class:`~mcpo_megatron.rollout.placement.GeneratedBatch`; in a checkpoint it is tensors and
plain values (:func:`batch_state`), log-probs in float64 so that it comes back bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable

import torch

from mcpo_megatron.rollout.engines.interface import RolloutOutput, RolloutSample, StopPoll
from mcpo_megatron.rollout.placement import GeneratedBatch, RolloutPlacement, WeightUpdate
from mcpo_megatron.rollout.engines.records import SequenceRecord
from mcpo_megatron.rollout.partial.segments import PartialOutput

STATE_KEY = "generated"  # in trainer_state.pt: the held batches, each with its key


class HeldBatches:
    """The results of generation batches, by key (``(step, index)``), from the time the engines return them until
    a later step no longer needs them. ``finishes`` (separate placement): a wait for a result is never cut short
    by a preemption signal and every result is held; colocated (a batch is generated when its result is asked for,
    so nothing is in flight at a checkpoint) a signal ends generation and only a checkpoint's batches are held."""

    def __init__(self, rollouts: RolloutPlacement, *, finishes: bool):
        self.rollouts = rollouts
        self.finishes = finishes
        self.batches: dict[Hashable, GeneratedBatch] = {}

    def holds(self, key) -> bool:
        return key in self.batches

    def result(self, key, *, should_stop: StopPoll | None = None) -> GeneratedBatch:
        """The batch submitted under ``key``: held, or from the engines."""
        if key in self.batches:
            return self.batches[key]
        if not self.finishes:
            return self.rollouts.result(key, should_stop=should_stop)
        self.batches[key] = self.rollouts.result(key)
        return self.batches[key]

    def finish(self, keys) -> None:
        """Before a checkpoint: wait for the batches ``keys`` (in submission order) and hold them; colocated,
        where nothing is in flight, nothing to do."""
        if not self.finishes:
            return
        for key in keys:
            if key not in self.batches:
                self.batches[key] = self.rollouts.result(key)

    def forget_before(self, step: int) -> None:
        """Drop the batches of steps before ``step`` (trained)."""
        self.batches = {k: b for k, b in self.batches.items() if k[0] >= step}

    def state_dict(self, step: int) -> dict:
        """The held batches of ``step`` and later (what a checkpoint of ``step`` needs)."""
        return {STATE_KEY: [{"key": key, **batch_state(b)} for key, b in self.batches.items() if key[0] >= step]}

    def load_state_dict(self, state: dict) -> None:
        self.batches = {tuple(row["key"]): batch_from_state(row) for row in state.get(STATE_KEY, [])}


# ---------------------------------------------------------------------------------------------------- as plain values
def batch_state(b: GeneratedBatch) -> dict:
    """``b`` as tensors and plain values (a copy)."""
    if isinstance(b.output, PartialOutput):
        output = {"members": [[r.state_dict() for r in group] for group in b.output.members],
                  "segments": b.output.segments, "versions": list(b.output.versions)}
    else:
        output = {"samples": [_sample_state(x) for x in b.output.samples]}
    return {"output": output, "version": b.version, "generate_s": b.generate_s, "idle_s": b.idle_s,
            "updates": [dataclasses.asdict(u) for u in b.updates], "partial": dict(b.partial)}


def batch_from_state(state: dict) -> GeneratedBatch:
    out = state["output"]
    if "members" in out:
        output: Any = PartialOutput([[SequenceRecord.from_state(r) for r in group] for group in out["members"]],
                                    int(out["segments"]), [int(v) for v in out["versions"]])
    else:
        output = RolloutOutput([_sample_from_state(x) for x in out["samples"]])
    return GeneratedBatch(output, int(state["version"]), generate_s=float(state["generate_s"]),
                          idle_s=float(state["idle_s"]), updates=[WeightUpdate(**u) for u in state["updates"]],
                          partial=dict(state["partial"]))


def _sample_state(x: RolloutSample) -> dict:
    # R3: the trainer leader (rank 0) writes the checkpoint and holds the batch's routing
    return {"prompt_index": x.prompt_index, "sample_index": x.sample_index,
            "token_ids": torch.tensor(x.token_ids, dtype=torch.int64),
            "logprobs": torch.tensor(x.logprobs, dtype=torch.float64), "finish_reason": x.finish_reason,
            "routed_experts": x.routed_experts,
            "versions": None if x.versions is None else torch.tensor(x.versions, dtype=torch.int64)}


def _sample_from_state(s: dict) -> RolloutSample:
    # Every rank read the routing (R3); rank 0 holds it as with a live batch from the engine ranks, so that a step
    # mixing held and new batches (dynamic sampling) fetches all of it the same way (step_data.fetch_routing).
    routed = s["routed_experts"]
    return RolloutSample(int(s["prompt_index"]), int(s["sample_index"]), [int(t) for t in s["token_ids"].tolist()],
                         [float(v) for v in s["logprobs"].tolist()], s["finish_reason"], routed_experts=routed,
                         routing_rank=-1 if routed is None else 0,
                         versions=None if s["versions"] is None else [int(v) for v in s["versions"].tolist()])

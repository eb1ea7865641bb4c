"""Which prompts each generation batch takes, and when it is submitted to the engines (docs/algorithms.md §13).

A global step trains on one or more generation batches (DAPO's dynamic sampling draws more until enough groups
vary). Batches are drawn from the prompt sampler in the order they are submitted. A step's batches are submitted
when the step asks for them, so with ``trainer.max_staleness`` 0 generation follows training exactly as when
colocated (the same draws, the same seeds); with ``max_staleness`` = η > 0 the first batch of each of the next η
steps is submitted too, so the engines generate them while this step trains, with weights at most η versions old
(``min_version = step - η``).

A step's further batches (dynamic sampling) are submitted during the step, for weights of at least that step's
version, which is published by then.

What was submitted but not yet taken is in flight: :meth:`GenerationSchedule.state_dict` records it with the
checkpoint, so a prompt is neither skipped nor drawn twice. With separate placement the trainer waits for the
batches in flight before a checkpoint and the checkpoint holds their samples (``held_batches.py``): the resumed run
trains them as generated and repeats the uninterrupted run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mcpo_megatron.rollout.engines.interface import SamplingParams, StopPoll, batch_seed
from mcpo_megatron.rollout.placement import GeneratedBatch, RolloutPlacement
from mcpo_megatron.trainer.held_batches import HeldBatches


@dataclass
class PlannedBatch:
    step: int             # the global step (0-based) that trains it
    index: int | str      # the step's generation batch: 0, 1, ... (dynamic sampling), or a name
    prompt_idx: list[int]

    @property
    def key(self) -> tuple:
        return (self.step, self.index)


def min_version(step: int, index, ahead: int) -> int:
    """The oldest weights generation batch ``index`` of ``step`` may be generated with: a step's first batch is
    submitted up to ``ahead`` steps early, so ``step - ahead``; its further batches (dynamic sampling) are submitted
    during the step, when the step's own version is published, and ask for it (whatever the engines held before,
    after a resume too)."""
    return step - ahead if index == 0 else step


class GenerationSchedule:
    def __init__(self, rollouts: RolloutPlacement, sampler, prompt_ids: list[list[int]], cfg, stop_token_ids):
        self.rollouts, self.sampler, self.prompt_ids = rollouts, sampler, prompt_ids
        self.rollout_cfg = cfg.rollout
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_staleness = int(cfg.trainer.max_staleness)
        self.total_steps = int(cfg.trainer.total_steps)
        self._planned: dict[tuple, PlannedBatch] = {}  # submitted, not yet taken, in submission order
        self.held = HeldBatches(rollouts, finishes=cfg.rollout.placement == "separate")

    def sampling(self, step: int, index) -> SamplingParams:
        return SamplingParams.from_config(self.rollout_cfg, stop_token_ids=self.stop_token_ids,
                                          seed=batch_seed(self.rollout_cfg.seed, step, index))

    def take(self, step: int, index: int, *, should_stop: StopPoll | None = None
             ) -> tuple[PlannedBatch, GeneratedBatch]:
        """The ``index``-th generation batch of ``step``: its prompts and samples (drawn and submitted now unless
        it was submitted ahead). Keeps the next ``max_staleness`` steps' first batches submitted."""
        self.held.forget_before(step)
        if (step, index) not in self._planned:
            self._submit(PlannedBatch(step, index, list(self.sampler.next_batch())))
        self.submit_ahead(step)
        generated = self.held.result((step, index), should_stop=should_stop)
        return self._planned.pop((step, index)), generated

    def submit_ahead(self, step: int) -> None:
        for ahead in range(step + 1, min(step + self.max_staleness, self.total_steps - 1) + 1):
            if (ahead, 0) not in self._planned:
                self._submit(PlannedBatch(ahead, 0, list(self.sampler.next_batch())))

    def _submit(self, b: PlannedBatch) -> None:
        if not self.held.holds(b.key):  # a checkpoint's batch, generated before it was saved
            self.rollouts.submit(b.key, [self.prompt_ids[i] for i in b.prompt_idx], self.sampling(b.step, b.index),
                                 min_version=min_version(b.step, b.index, self.max_staleness))
        self._planned[b.key] = b

    # ------------------------------------------------------------------ checkpoints
    def finish_in_flight(self) -> None:
        """Before a checkpoint: wait for the batches in flight (separate placement) and hold them."""
        self.held.finish(list(self._planned))

    def state_dict(self, step: int) -> dict:
        """The batches in flight, in submission order (``in_flight`` of trainer_state.pt), and those generated for
        ``step`` and later."""
        return {"in_flight": [asdict(b) for b in self._planned.values()], **self.held.state_dict(step)}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's in-flight batches: held when it holds their samples, else submitted again (before
        anything new is drawn)."""
        if state.get("rollout_pool", {}).get("groups") or state.get("rollout_pool", {}).get("backlog"):
            raise ValueError("the checkpoint holds a partial-rollout pool (unfinished responses and the prompts drawn "
                             "for them): it was saved with rollout.partial.enable=true; resume it with that setting")
        self.held.load_state_dict(state)
        for row in state.get("in_flight", []):
            self._submit(PlannedBatch(int(row["step"]), row["index"], [int(i) for i in row["prompt_idx"]]))

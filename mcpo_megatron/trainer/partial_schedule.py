"""Which groups each generation batch takes with partial rollouts (``rollout.partial``; docs/algorithms.md §13), and
when it is submitted: the partial counterpart of ``schedule.GenerationSchedule``, with the same interface.

The prompts drawn and not yet trained live in a :class:`~mcpo_megatron.rollout.partial.pool.RolloutPool`. A generation
batch (``(step, index)``, index > 0 for dynamic sampling's extra batches) is assembled from the pool and sent to
the engines, which end it at a segment boundary once enough of its groups are complete; :meth:`take` hands the
loop exactly ``data.train_batch_size`` complete groups, scored like any batch. Colocated, a batch is assembled
and generated when the loop takes it, with the weights of the step (version ``step``). With
``rollout.placement=separate`` the next step's first batch is assembled as soon as this step's batch is back, so
that the engines generate it (with version ``step``) while this step trains; its tokens are then one version old
when trained, which is why partial rollouts need ``trainer.max_staleness`` >= 2 there. While it runs the engines
take the version this step publishes (in-flight updates, ``rollout.partial.inflight_updates``), so the rest of its
tokens are of the version that trains them.

A step's further batches (dynamic sampling) are generated with the step's own version, published by then.

A checkpoint holds the pool (every unfinished record, with its tokens, log-probs and versions) and, with separate
placement, the batch in flight, generated to the end before the checkpoint was saved (``held_batches.py``), so
that a resumed run repeats the uninterrupted one exactly in both placements (colocated, nothing is in flight
between steps).
"""

from __future__ import annotations

from mcpo_megatron.config import spare_groups
from mcpo_megatron.rollout.engines.interface import RolloutOutput, RolloutSample, SamplingParams, StopPoll, batch_seed
from mcpo_megatron.rollout.episodes import record_stats
from mcpo_megatron.rollout.placement import GeneratedBatch, RolloutPlacement
from mcpo_megatron.rollout.partial.pool import PoolGroup, RolloutPool
from mcpo_megatron.rollout.partial.segments import PartialRequest
from mcpo_megatron.trainer.held_batches import HeldBatches
from mcpo_megatron.trainer.schedule import PlannedBatch, min_version

STATE_KEY = "rollout_pool"  # in trainer_state.pt


class PartialSchedule:
    def __init__(self, rollouts: RolloutPlacement, sampler, prompt_ids: list[list[int]], cfg, stop_token_ids):
        self.rollouts = rollouts
        self.rollout_cfg = cfg.rollout
        self.stop_token_ids = tuple(stop_token_ids)
        self.total_steps = int(cfg.trainer.total_steps)
        self.segment_tokens = int(cfg.rollout.partial.segment_tokens)
        # separate placement generates the next step's batch while a step trains: one version behind
        self.ahead = 1 if cfg.rollout.placement == "separate" else 0
        # A response may be generated in max_staleness - ahead + 1 batches: each runs at least that share of
        # the cap, so a long response progresses evenly instead of waiting until it is due (then every batch,
        # and the step with it, takes about the same time).
        batches = int(cfg.trainer.max_staleness) - self.ahead + 1
        self.min_steps = -(-int(cfg.rollout.max_new_tokens) // max(batches, 1))
        # In-flight updates (separate placement): a batch for step s takes version s while it runs, after
        # update_after segments in the repeatable mode (null: half the segments it runs at least).
        p = cfg.rollout.partial
        self.inflight = str(p.inflight_updates) if self.ahead else "off"
        self.update_after = int(p.update_after_segments or max(1, -(-self.min_steps // self.segment_tokens) // 2))
        self.held = HeldBatches(rollouts, finishes=bool(self.ahead))
        self.pool = RolloutPool(group_size=int(cfg.rollout.n), batch_groups=int(cfg.data.train_batch_size),
                                spare_groups=spare_groups(cfg),
                                max_staleness=int(cfg.trainer.max_staleness),
                                staleness_policy=str(cfg.trainer.staleness_policy),
                                draw=sampler.next_batch, prompt_of=lambda i: prompt_ids[i])

    def sampling(self, step: int, index) -> SamplingParams:
        return SamplingParams.from_config(self.rollout_cfg, stop_token_ids=self.stop_token_ids,
                                          seed=batch_seed(self.rollout_cfg.seed, step, index))

    def take(self, step: int, index: int, *, should_stop: StopPoll | None = None
             ) -> tuple[PlannedBatch, GeneratedBatch]:
        """The ``index``-th generation batch of ``step``: ``data.train_batch_size`` complete groups, as planned
        prompts and their samples (each token with its version). With separate placement the next step's first
        batch is submitted as soon as this one is back."""
        key = (step, index)
        self.held.forget_before(step)
        if key not in self.pool.batches:
            self._submit(step, index)
        generated = self.held.result(key, should_stop=should_stop)
        self.pool.absorb(key, generated.output)
        groups, figures = self.pool.take(key)
        if self.ahead and step + 1 < self.total_steps and (step + 1, 0) not in self.pool.batches:
            self._submit(step + 1, 0)
        out = _as_output(groups)
        partial = {"segments": generated.output.segments, "new_groups": figures.new_groups,
                   "due_groups": figures.due_groups, "dropped_sequences": figures.dropped_sequences,
                   "dropped_tokens": figures.dropped_tokens, "pool_groups": len(self.pool.groups),
                   "pool_unfinished": self.pool.unfinished_records}
        oldest = min(v for s in out.samples for v in s.versions)
        batch = GeneratedBatch(out, oldest, generate_s=generated.generate_s, idle_s=generated.idle_s,
                               updates=generated.updates, partial=partial)
        return PlannedBatch(step, index, [g.prompt_index for g in groups]), batch

    def _submit(self, step: int, index: int) -> None:
        key = (step, index)
        self.pool.assemble(key, step, batch_seed(self.rollout_cfg.seed, step, index))
        self._send(key, step)

    def _send(self, key, step: int) -> None:
        if self.held.holds(key):  # a checkpoint's batch, generated before it was saved
            return
        self.rollouts.submit_partial(PartialRequest(
            key, self.pool.work(key), self.pool.need(key), self.sampling(step, 0), self.segment_tokens,
            min_version=min_version(step, key[1], self.ahead), min_steps=self.min_steps, inflight=self.inflight,
            inflight_version=step, update_after=self.update_after))

    # ------------------------------------------------------------------ checkpoints
    def finish_in_flight(self) -> None:
        """Before a checkpoint: wait for the batches in flight (separate placement) and hold them."""
        self.held.finish(list(self.pool.batches))

    def state_dict(self, step: int) -> dict:
        """The pool: every group drawn and not trained, with its records, and the batches in flight; and the batches
        generated for ``step`` and later."""
        return {STATE_KEY: self.pool.state_dict(), **self.held.state_dict(step)}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's pool, and its batches in flight: held when it holds their samples, else submitted again
        (before anything new is drawn). A checkpoint saved without partial rollouts starts an empty pool, unless it
        had batches in flight (their prompts would be lost)."""
        if STATE_KEY not in state:
            if state.get("in_flight"):
                raise ValueError(f"the checkpoint has {len(state['in_flight'])} generation batches in flight, saved "
                                 "with rollout.partial.enable=false; resume it with that setting (a checkpoint "
                                 "without batches in flight can go on with partial rollouts)")
            return
        self.pool.load_state_dict(state[STATE_KEY])
        self.held.load_state_dict(state)
        for key, b in self.pool.batches.items():
            self._send(key, b.step)


def _as_output(groups: list[PoolGroup]) -> RolloutOutput:
    """The taken groups' records as samples, prompt-major; ``prompt_index`` is the group's position."""
    return RolloutOutput([RolloutSample(position, r.sample_index, list(r.token_ids), list(r.logprobs),
                                        r.finish_reason, routed_experts=r.routed_experts, versions=list(r.versions),
                                        model_mask=r.model_mask, episode=record_stats(r))
                          for position, g in enumerate(groups) for r in g.members])

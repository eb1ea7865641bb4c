"""Generation batches held for a checkpoint (trainer/held_batches.py): a batch comes back from trainer_state.pt bit
for bit, and with separate placement the schedule waits for the batches in flight before a checkpoint, never cuts a
wait short on a signal, and a resumed schedule trains the checkpoint's batches without submitting them again. With
fakes for the engines (no process group); end to end: tests/trainer/test_partial_e2e.py, test_separate_e2e.py."""

import io
from types import SimpleNamespace

import torch

from mcpo_megatron.config import load_config
from mcpo_megatron.rollout.engines.interface import RolloutOutput, RolloutSample
from mcpo_megatron.rollout.placement import GeneratedBatch, LocalRollouts, WeightUpdate
from mcpo_megatron.rollout.engines.records import SequenceRecord
from mcpo_megatron.rollout.partial.segments import PartialOutput
from mcpo_megatron.trainer.checkpoint import check_plain
from mcpo_megatron.trainer.held_batches import STATE_KEY, batch_from_state, batch_state
from mcpo_megatron.trainer.schedule import GenerationSchedule


def _through_a_file(state):
    check_plain(state, "trainer_state")
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same(a: GeneratedBatch, b: GeneratedBatch):
    """Field by field (routing tensors compared with torch.equal)."""
    assert (a.version, a.generate_s, a.idle_s, a.updates, a.partial) == (b.version, b.generate_s, b.idle_s,
                                                                          b.updates, b.partial)
    xs = [r for g in a.output.members for r in g] if isinstance(a.output, PartialOutput) else a.output.samples
    ys = [r for g in b.output.members for r in g] if isinstance(b.output, PartialOutput) else b.output.samples
    assert type(a.output) is type(b.output) and len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert (x.routed_experts is None) == (y.routed_experts is None)
        if x.routed_experts is not None:
            assert torch.equal(x.routed_experts, y.routed_experts)
        assert {k: v for k, v in vars(x).items() if k not in ("routed_experts", "routing_rank")} == \
            {k: v for k, v in vars(y).items() if k not in ("routed_experts", "routing_rank")}


def test_a_batch_comes_back_from_a_checkpoint_bit_for_bit():
    logp = [-0.1234567890123456789, -2.5e-9, -17.000000000000004]  # float64 values float32 would round
    routing = torch.randint(0, 64, (5, 3, 2), dtype=torch.int16)
    finished = SequenceRecord(3, 0, 11, [7, 8, 9], logp, [4, 4, 5], "stop", routing)
    unfinished = SequenceRecord(3, 1, 12, [7], logp[:1], [5])
    partial = GeneratedBatch(PartialOutput([[finished, unfinished], []], 6, [4, 4, 5, 5, 5, 5]), 4, generate_s=1.5,
                             idle_s=0.25, updates=[WeightUpdate(5, 1024, 0.5, 0.125, inflight=True)])
    samples = GeneratedBatch(RolloutOutput([RolloutSample(0, 0, [1, 2], logp[:2], "length", routing[:3]),
                                            RolloutSample(0, 1, [3], logp[2:], "stop", versions=[2])]), 2)
    for batch in (partial, samples):
        back = batch_from_state(_through_a_file(batch_state(batch)))
        _same(back, batch)
        assert [x.logprobs for x in (back.output.samples if batch is samples else back.output.members[0])] == \
            [x.logprobs for x in (batch.output.samples if batch is samples else batch.output.members[0])]
    # after a resume rank 0 holds the routing, as the trainer leader holds a live batch's
    assert [x.routing_rank for x in batch_from_state(batch_state(samples)).output.samples] == [0, -1]


class _Engine:
    """Colocated fake engine: one token per response, the batch's seed, so batches differ."""

    def generate(self, prompts, sampling, *, prompt_indices, should_stop=None):
        return RolloutOutput([RolloutSample(j, i, [sampling.seed % 997 + i], [-0.5], "stop") for j in prompt_indices
                              for i in range(sampling.n)])

    def wake_up(self):
        pass


class _Remote:
    """Engines on ranks of their own, as the schedule sees them: records each submission's min_version and each
    wait's should_stop."""

    engine_ranks = 1

    def __init__(self):
        self.local = LocalRollouts(_Engine())
        self.local.publish(SimpleNamespace(push=lambda engine: None), version=100)
        self.submitted, self.waits = [], []

    def submit(self, key, prompts, sampling, *, first_index=0, min_version=0):
        self.submitted.append((key, min_version))
        self.local.submit(key, prompts, sampling, first_index=first_index)

    def result(self, key, *, should_stop=None):
        self.waits.append((key, should_stop))
        return self.local.result(key)


class _Sampler:
    def __init__(self):
        self.drawn = 0

    def next_batch(self):
        self.drawn += 2
        return [self.drawn - 2, self.drawn - 1]


def _schedule(remote, sampler):
    cfg = load_config(None, ["rollout.placement=separate", "rollout.ranks=1", "trainer.max_staleness=1",
                             "rollout.n=2", "data.train_batch_size=2", "trainer.total_steps=5"])
    return GenerationSchedule(remote, sampler, [[1, 2, 3]] * 100, cfg, [0])


def test_a_separate_checkpoint_holds_its_batches_in_flight_and_the_resumed_run_trains_them():
    remote, sampler = _Remote(), _Sampler()
    schedule = _schedule(remote, sampler)
    stop = lambda: True  # noqa: E731  a signal has arrived: the engines finish the batch all the same
    first, generated = schedule.take(0, 0, should_stop=stop)
    assert remote.submitted == [((0, 0), -1), ((1, 0), 0)] and remote.waits == [((0, 0), None)]
    _, extra = schedule.take(0, 1, should_stop=stop)  # dynamic sampling: the step's own version
    assert remote.submitted[-1] == ((0, 1), 0)
    # the end of step 0: its checkpoint waits for step 1's batch, submitted ahead, and holds it
    schedule.finish_in_flight()
    assert remote.waits[-1] == ((1, 0), None)
    state = _through_a_file({"step": 1, **schedule.state_dict(1)})
    assert [tuple(row["key"]) for row in state[STATE_KEY]] == [(1, 0)]  # step 0's batches are trained
    assert [(b["step"], b["index"]) for b in state["in_flight"]] == [(1, 0)]
    held = schedule.held.batches[(1, 0)]

    resumed_remote = _Remote()
    resumed = _schedule(resumed_remote, _Sampler())
    resumed.sampler.drawn = sampler.drawn
    resumed.load_state_dict(state)
    planned, batch = resumed.take(1, 0)
    assert resumed_remote.waits == [] and resumed_remote.submitted == [((2, 0), 1)]  # not generated again
    _same(batch, held)
    assert planned.prompt_idx == [2, 3] and batch.output.token_ids != generated.output.token_ids
    # a checkpoint of step 1 taken at its start, with what was generated since: step 1's batch, not step 0's
    assert [tuple(row["key"]) for row in resumed.held.state_dict(1)[STATE_KEY]] == [(1, 0)]
    assert first.prompt_idx == [0, 1] and extra.output.token_ids != generated.output.token_ids

"""The trainer <-> engine-rank protocol of separate placement, in one process: the trainer's RemoteRollouts and
WeightPublisher thread against a RolloutServer thread, over the real Bridge message code on an in-memory store
(the process-group parts, broadcasts, are a queue here; tests/trainer/test_separate_e2e.py runs them for real)."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from mcpo_megatron.parallel.bridge import Bridge
from mcpo_megatron.rollout.engine import RolloutOutput, RolloutSample, SamplingParams
from mcpo_megatron.rollout.remote import RemoteRollouts, RolloutServer, pack_bucket, unpack_bucket


class MemoryStore:
    """The few TCPStore calls the bridge makes, over a dict shared by clones."""

    def __init__(self, data=None):
        self.data = {} if data is None else data

    def set(self, key, value):
        self.data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def delete_key(self, key):
        return self.data.pop(key, None) is not None

    def clone(self):
        return MemoryStore(self.data)


def memory_bridges(engines: int = 1):
    """A bridge for the trainer leader and one per engine rank: one store, broadcasts through queues."""
    store, channels = MemoryStore(), [queue.Queue() for _ in range(engines)]
    bridges = []
    for rank in range(engines + 1):
        b = Bridge.__new__(Bridge)
        b.rank, b.size, b.store, b.gloo, b.nccl = rank, engines + 1, store.clone(), None, None

        def broadcast(tensor, rank=rank):
            if rank == 0:
                for ch in channels:
                    ch.put(tensor.clone())
            else:
                tensor.copy_(channels[rank - 1].get(timeout=30))
            return tensor

        b.broadcast = broadcast
        bridges.append(b)
    return bridges


class VersionedEngine:
    """Its weights are one tensor whose value is the policy version; every sample reports it as its log-prob."""

    def __init__(self):
        self.w = torch.tensor([-1.0])
        self.updates = []

    def begin_update(self):
        pass

    def update_weights(self, bucket):
        for name, t in bucket:
            assert name == "w"
            self.w.copy_(t)

    def finish_update(self):
        self.updates.append(int(self.w.item()))

    def generate(self, prompts, sampling, *, prompt_indices, should_stop=None):
        return RolloutOutput([RolloutSample(j, i, [7], [float(self.w.item())], "stop") for j in prompt_indices
                              for i in range(sampling.n)])


class Resharder:
    """push(target): the trainer's weights (version v) as one bucket."""

    def __init__(self):
        self.value = 0

    def push(self, target):
        target.begin_update()
        target.update_weights([("w", torch.tensor([float(self.value)]))])
        target.finish_update()
        return None


@pytest.fixture
def protocol():
    trainer_bridge, engine_bridge = memory_bridges(1)
    engine = VersionedEngine()
    server = RolloutServer(engine_bridge, engine, rank=0)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    rollouts = RemoteRollouts(trainer_bridge)
    yield rollouts, engine
    rollouts.close()
    thread.join(30)
    assert not thread.is_alive(), "the engine loop did not end at shutdown"


SAMPLING = SamplingParams(n=2, max_new_tokens=1)


class Sampler:
    def __init__(self):
        self.drawn = 0

    def next_batch(self):
        self.drawn += 1
        return [self.drawn % 4]


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_each_batch_gets_exactly_the_version_its_staleness_allows(protocol, eta):
    """The schedule submits the next eta steps' batches ahead; a step-s batch needs version >= s - eta: the engines
    keep newer weights, else load exactly s - eta (never a newer one that happens to exist by then), so the
    version never depends on timing."""
    from mcpo_megatron.config import load_config
    from mcpo_megatron.trainer.schedule import GenerationSchedule

    rollouts, engine = protocol
    steps = 6
    cfg = load_config(None, ["rollout.n=2", "rollout.max_new_tokens=1", "rollout.placement=separate",
                             "rollout.ranks=1", f"trainer.max_staleness={eta}", f"trainer.total_steps={steps}"])
    schedule = GenerationSchedule(rollouts, Sampler(), [[1], [2], [3], [4]], cfg, [0])
    resharder = Resharder()
    rollouts.publish(resharder, version=0)
    for step in range(steps):
        _, batch = schedule.take(step, 0)
        want = max(step - eta, 0)
        assert batch.version == want, (step, batch.version)
        assert {lp for s in batch.output.samples for lp in s.logprobs} == {float(want)}  # the weights it held
        assert len(schedule.state_dict()) == min(eta, steps - 1 - step)  # submitted ahead, in flight
        resharder.value = step + 1
        rollouts.publish(resharder, version=step + 1)
    # the engines loaded each version they used, once, in order
    assert engine.updates == list(range(0, steps - eta))


def test_generate_now_takes_the_newest_weights(protocol):
    rollouts, engine = protocol
    resharder = Resharder()
    rollouts.publish(resharder, version=0)
    rollouts.submit((0, 0), [[1]], SAMPLING, min_version=-1)
    assert rollouts.result((0, 0)).version == 0
    resharder.value = 1
    rollouts.publish(resharder, version=1)
    out = rollouts.generate([[1], [2]], SAMPLING)  # evaluation after a step: the weights just published
    assert [s.logprobs[0] for s in out.samples] == [1.0] * 4 and engine.updates == [0, 1]


def test_pack_and_unpack_round_trip_every_dtype_and_shape():
    bucket = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)),
              ("c", torch.randn(2, 3, dtype=torch.float64).t()), ("d", torch.randn(1).to(torch.bfloat16)),
              ("e", torch.tensor(3.5))]
    metas, flat = pack_bucket(bucket)
    assert flat.dtype == torch.uint8 and all(m.offset % 64 == 0 for m in metas)
    for (name, t), (name2, u) in zip(bucket, unpack_bucket(metas, flat)):
        assert name == name2 and u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
    again, reused = pack_bucket([(n, t * 2 if t.is_floating_point() else t) for n, t in bucket], flat)
    assert reused is flat  # a bucket of the same layout reuses the buffer

"""The trainer <-> engine-rank protocol of separate placement, in one process: the trainer's RemoteRollouts and
WeightPublisher against a RolloutServer thread, over the real Bridge message code on an in-memory store
(the process-group parts, broadcasts, are a queue here; tests/trainer/test_separate_e2e.py runs them for real).
The waits on the engines (heartbeats, limits) are in tests/rollout/separate/test_liveness.py."""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import pytest
import torch

from mcpo_megatron.parallel.bridge import Bridge, split_roles
from mcpo_megatron.rollout.engines.interface import RolloutOutput, RolloutSample, SamplingParams
from mcpo_megatron.rollout.separate.liveness import Heartbeat, Waits
from mcpo_megatron.rollout.placement import LocalRollouts, RolloutPlacement
from mcpo_megatron.rollout.separate.remote import RemoteRollouts
from mcpo_megatron.rollout.separate.messages import pack_bucket, unpack_bucket
from mcpo_megatron.rollout.separate.server import RolloutServer


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

    def add(self, key, amount):
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def clone(self):
        return MemoryStore(self.data)


def memory_bridges(engines: int = 1):
    """A bridge for the trainer leader and one per engine rank: one store, broadcasts through queues."""
    store, channels = MemoryStore(), [queue.Queue() for _ in range(engines)]
    bridges = []
    for rank in range(engines + 1):
        b = Bridge.__new__(Bridge)
        b.rank, b.size, b.store, b.gloo, b.nccl = rank, engines + 1, store.clone(), None, None
        b.roles = split_roles(rank, engines + 1, engines)  # the trainer leader, then the engine ranks

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

    def push(self, target, *, stream=False):
        target.begin_update()
        target.update_weights([("w", torch.tensor([float(self.value)]))])
        target.finish_update()
        return None


WAITS = Waits(batch_s=60.0, heartbeat_s=10.0, batches_queued=2, slack_s=10.0)


@pytest.fixture
def protocol():
    trainer_bridge, engine_bridge = memory_bridges(1)
    engine = VersionedEngine()
    heartbeat = Heartbeat(engine_bridge.store.clone(), engine_bridge.rank, WAITS.beat_period_s)
    # Both sides compile the weight plan together at start-up: the engine's side on its own thread.
    thread = threading.Thread(target=lambda: RolloutServer(engine_bridge, engine, rank=0, heartbeat=heartbeat).serve(),
                              daemon=True)
    thread.start()
    rollouts = RemoteRollouts(trainer_bridge, engine_ranks=1, waits=WAITS)
    yield rollouts, engine
    rollouts.close()
    thread.join(30)
    heartbeat.close()
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
        assert len(schedule.state_dict(step + 1)["in_flight"]) == min(eta, steps - 1 - step)  # submitted ahead, in flight
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


def test_both_placements_offer_what_the_trainer_asks(protocol):
    """The trainer reads only RolloutPlacement's members, so each must exist on both placements."""
    members = {name for name in vars(RolloutPlacement) if not name.startswith("_")} | set(
        RolloutPlacement.__annotations__)
    assert {"submit", "result", "publish", "generation_metrics", "engine_ranks", "generation_time_key"} <= members
    local, (remote, _) = LocalRollouts(VersionedEngine()), protocol
    for placement in (local, remote):
        assert [name for name in sorted(members) if not hasattr(placement, name)] == [], type(placement).__name__
    assert local.engine_ranks == 0 and local.generation_time_key == "time/rollout"
    assert local.generation_metrics([]) == {}  # the trainer's own timer measures a colocated engine


def test_the_engines_account_for_their_time_and_the_weights_they_took(protocol):
    rollouts, _ = protocol
    assert rollouts.engine_ranks == 1 and rollouts.generation_time_key == "time/engine_generate"
    resharder = Resharder()
    rollouts.publish(resharder, version=0)
    batches = []
    for step in range(2):  # each batch needs the version of its step: one update of one float32 (4 bytes) each
        rollouts.submit((step, 0), [[1]], SAMPLING, min_version=step)
        batches.append(rollouts.result((step, 0)))
        resharder.value = step + 1
        rollouts.publish(resharder, version=step + 1)
    m = rollouts.generation_metrics(batches)
    assert m["async/weight_updates"] == 2 and m["async/weight_bytes"] == 8
    assert m["time/engine_generate"] == sum(b.generate_s for b in batches) > 0
    assert m["reshard/transfer_s"] == sum(u.transfer_s for b in batches for u in b.updates)
    assert m["reshard/transfer_gbps"] == pytest.approx(8 / m["reshard/transfer_s"] / 1e9)
    assert m["time/publish_wait"] == rollouts.publish_wait_s >= 0
    assert m["async/inflight_updates"] == 0  # whole batches: versions are taken between them only
    assert set(m) == {"time/engine_generate", "time/engine_idle", "time/engine_weight_wait", "time/publish_wait",
                      "async/weight_updates", "async/weight_bytes", "async/inflight_updates", "reshard/transfer_s",
                      "reshard/transfer_gbps"}


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


# --------------------------------------------------------------------------- the publisher's CUDA stream (mocked)
class StreamLog:
    """Mocked torch.cuda streams and events, and the host-to-device copies of the publisher, in one log."""

    def __init__(self, monkeypatch):
        self.log, self.active, self.streams = [], None, []
        log = self

        class Stream:
            def __init__(self, device=None, priority=0):
                self.device = device
                log.streams.append(self)

            def synchronize(self):
                log.log.append(("stream_synchronize", self))

        class Event:
            def record(self, stream=None):
                log.log.append(("record", self, stream or log.active))

            def synchronize(self):
                time.sleep(0.05)  # a copy still in flight: whatever waits on it comes after
                log.log.append(("synchronize", self))

            def wait(self, stream=None):
                log.log.append(("wait", self, stream or log.active))

        @contextlib.contextmanager
        def stream(s):
            before, self.active = self.active, s
            self.log.append(("enter", s))
            try:
                yield s
            finally:
                self.active = before
                self.log.append(("exit", s))

        real_to = torch.Tensor.to

        def to(tensor, *args, **kwargs):
            target = args[0] if args else kwargs.get("device")
            if isinstance(target, torch.device) and target.type == "cuda":
                out = tensor.clone()
                self.log.append(("copy", self.active, kwargs.get("non_blocking", False), target, out))
                return out
            return real_to(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "default stream")
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.log.append(("device_synchronize",
                                                                                             device)))
        monkeypatch.setattr(torch.Tensor, "to", to)

    def entries(self, kind):
        return [e for e in self.log if e[0] == kind]


class FakeLeaderBridge:
    """The trainer leader's bridge with an NCCL group: asks come from a queue, broadcasts are logged."""

    def __init__(self, log: StreamLog, *, nccl: bool = True):
        self.nccl = object() if nccl else None
        self.asks, self.posts, self.log = queue.Queue(), queue.Queue(), log

    def ready(self, key):
        return not self.asks.empty()

    def take(self, key, should_stop=None, check=None):
        return self.asks.get(timeout=30)

    def post(self, key, obj):
        self.posts.put((key, obj))

    def set_flag(self, name):
        pass

    def broadcast(self, tensor):
        self.log.log.append(("broadcast", self.log.active, tensor))
        return tensor


def staged_publisher(monkeypatch, comm_device, *, nccl=True):
    from mcpo_megatron.rollout.separate import publisher as weight_publisher

    stream_log = StreamLog(monkeypatch)
    pinned = []
    real_pack = weight_publisher.pack_bucket

    def pack_bucket(bucket, out=None, *, pin_memory=False):  # no pinned memory without CUDA: note the request
        pinned.append(pin_memory)
        return real_pack(bucket, out)

    monkeypatch.setattr(weight_publisher, "pack_bucket", pack_bucket)
    bridge = FakeLeaderBridge(stream_log, nccl=nccl)
    publisher = weight_publisher.WeightPublisher(bridge, comm_device=comm_device)
    publisher.begin_update()
    publisher.update_weights([("a", torch.arange(6, dtype=torch.float32))])
    publisher.update_weights([("b", torch.ones(3, dtype=torch.bfloat16))])
    publisher.finish_update()
    publisher.staged(0)
    publisher.expect(0)
    bridge.asks.put((-1, 0))  # the engines hold nothing and need version 0: it is sent
    offer = publisher.answer_asks()
    key, posted = bridge.posts.get(timeout=30)
    assert key == "offer/0" and posted is offer and offer.version == 0 and len(offer.buckets) == 2
    staged = [flat for _, flat in publisher._buckets]
    publisher.send_buckets()
    stream_log.log.append(("next push may rewrite the host copy",))
    publisher.begin_update()  # the next push
    publisher.finish_update()
    bridge.asks.put("bye")
    publisher.close(timeout_s=30)
    assert publisher.goodbye
    return stream_log, staged, pinned


def test_publisher_sends_on_a_side_stream_of_the_leaders_gpu(monkeypatch):
    """With CUDA the publisher's copies and broadcasts run on a stream of their own (not the default stream, where
    they would serialise with training), the broadcast after its copy, after every kernel issued before on the GPU
    (the bridge's NCCL communicator in an epoch of its own), and the host copy is rewritten only after every copy
    from it completed, and the side stream before training goes on."""
    cuda0 = torch.device("cuda", 0)
    stream_log, staged, pinned = staged_publisher(monkeypatch, cuda0)
    assert pinned == [True, True]
    assert len(stream_log.streams) == 1 and stream_log.streams[0].device == cuda0, "no side stream on the GPU"
    side = stream_log.streams[0]
    copies, broadcasts = stream_log.entries("copy"), stream_log.entries("broadcast")
    assert [c[1] for c in copies] == [side, side], "a host-to-device copy was issued outside the side stream"
    assert all(c[2] is True and c[3] == cuda0 for c in copies)  # asynchronous, to the leader's GPU
    assert [b[1] for b in broadcasts] == [side, side], "a broadcast was issued outside the side stream"
    assert all(b[2] is c[4] for b, c in zip(broadcasts, copies))  # each broadcast sends its copy ...
    assert [bytes(b[2].numpy()) for b in broadcasts] == [bytes(f.numpy()) for f in staged]  # ... of the host bytes
    def at(entry):  # by identity: entries hold tensors
        return next(i for i, e in enumerate(stream_log.log) if e is entry)

    records = stream_log.entries("record")
    assert len(records) == 2 and all(r[2] is side for r in records)  # one event per copy, on the side stream
    syncs = stream_log.entries("synchronize")
    assert [s[1] for s in syncs] == [r[1] for r in records], "the copies' events were not waited on"
    released = next(i for i, e in enumerate(stream_log.log) if e == ("next push may rewrite the host copy",))
    device_sync = stream_log.entries("device_synchronize")
    assert len(device_sync) == 1 and device_sync[0][1] == cuda0 and at(device_sync[0]) < at(copies[0])
    for copy, record, broadcast, sync in zip(copies, records, broadcasts, syncs):
        assert at(copy) < at(record) < at(broadcast)  # the event marks the copy's end
        assert at(sync) < released, "the next push could rewrite the host copy before the copy from it ended"
    side_sync = stream_log.entries("stream_synchronize")
    assert len(side_sync) == 1 and side_sync[0][1] is side and at(syncs[-1]) < at(side_sync[0]) < released


def test_publisher_on_cpu_broadcasts_the_host_copy_as_before(monkeypatch):
    """Without CUDA (or without NCCL on the bridge) no stream, no copy: the host buffer itself goes over gloo."""
    for device, nccl in ((torch.device("cpu"), False), (torch.device("cuda", 0), False)):
        stream_log, staged, pinned = staged_publisher(monkeypatch, device, nccl=nccl)
        assert stream_log.streams == [] and stream_log.entries("copy") == [] and stream_log.entries("record") == []
        sent = [b[2] for b in stream_log.entries("broadcast")]
        assert len(sent) == 2 and all(b is flat for b, flat in zip(sent, staged))  # the very buffers
        assert [b[1] for b in stream_log.entries("broadcast")] == [None, None]
        assert pinned == [device.type == "cuda"] * 2


def test_bridge_broadcast_waits_on_its_work_before_the_buffer_is_read():
    """The engine reads a received bucket right after Bridge.broadcast returns: the broadcast's work must have been
    waited on (for NCCL that makes the reading stream wait for it), from the trainer leader (bridge rank 0)."""
    calls = []

    class Work:
        def wait(self):
            calls.append("wait")
            return True

    class Group:
        def broadcast(self, tensors, opts):
            calls.append(("broadcast", opts.rootRank, tensors[0].dtype))
            return Work()

    bridge = Bridge.__new__(Bridge)
    bridge.gloo, bridge.nccl = Group(), None
    flat = torch.zeros(8, dtype=torch.uint8)
    assert bridge.broadcast(flat) is flat and calls == [("broadcast", 0, torch.uint8), "wait"]


# --------------------------------------------------------------------------- the rule for the bridge's collectives
def engine_thread(engine_bridge, engine):
    heartbeat = Heartbeat(engine_bridge.store.clone(), engine_bridge.rank, WAITS.beat_period_s)
    thread = threading.Thread(target=lambda: RolloutServer(engine_bridge, engine, rank=0, heartbeat=heartbeat).serve(),
                              daemon=True)
    thread.start()
    return thread, heartbeat


class SlowEngine(VersionedEngine):
    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s, self.started = delay_s, []

    def generate(self, prompts, sampling, *, prompt_indices, should_stop=None):
        self.started.append(time.monotonic())
        time.sleep(self.delay_s)
        return super().generate(prompts, sampling, prompt_indices=prompt_indices)


def test_weights_leave_from_the_trainers_main_thread_never_while_it_trains():
    """Every bridge collective of the trainer (here the leader's bucket broadcasts) is issued by its main thread
    inside a RemoteRollouts call, a fixed point (rollout/separate/remote.py), never while the trainer trains between them:
    so on GPUs the bridge's NCCL communicator and the training's are used in different epochs, in the same order
    on every trainer rank."""
    trainer_bridge, engine_bridge = memory_bridges(1)
    training, sent = threading.Event(), []
    broadcast = trainer_bridge.broadcast

    def logged(tensor):
        sent.append((threading.current_thread().name, training.is_set()))
        return broadcast(tensor)

    trainer_bridge.broadcast = logged
    engine = SlowEngine(0.2)
    thread, heartbeat = engine_thread(engine_bridge, engine)
    rollouts = RemoteRollouts(trainer_bridge, engine_ranks=1, waits=WAITS)
    resharder = Resharder()
    try:
        rollouts.publish(resharder, version=0)
        rollouts.submit((0, 0), [[1]], SAMPLING, min_version=0)
        for step in range(3):  # max_staleness 1: the next step's batch is submitted before this one is taken
            rollouts.submit((step + 1, 0), [[1]], SAMPLING, min_version=step)
            assert rollouts.result((step, 0)).version == max(step - 1, 0)
            training.set()
            time.sleep(0.4)  # the step trains; the engines generate the next batch meanwhile
            training.clear()
            resharder.value = step + 1
            rollouts.publish(resharder, version=step + 1)
        assert rollouts.result((3, 0)).version == 2
    finally:
        rollouts.close()
        thread.join(30)
        heartbeat.close()
    assert engine.updates == [0, 1, 2] and len(sent) == 3
    assert sent == [("MainThread", False)] * 3, sent


def test_a_batch_submitted_ahead_is_generated_while_the_trainer_trains():
    """max_staleness 1: the engines ask for the next batch's weights as soon as they report this one (here 0.3 s
    later: reading the request, the engine world's barrier), and the leader waits for that ask at the end of its
    wait for this one, so the next batch (1 s of generation) is generated while the trainer trains (2 s), not after
    the next publish: the trainer then finds it done."""
    trainer_bridge, engine_bridge = memory_bridges(1)
    read = engine_bridge.read

    def slow_read(key, *args, **kwargs):
        if key.startswith("req/"):
            time.sleep(0.3)
        return read(key, *args, **kwargs)

    engine_bridge.read = slow_read
    engine = SlowEngine(1.0)
    thread, heartbeat = engine_thread(engine_bridge, engine)
    rollouts = RemoteRollouts(trainer_bridge, engine_ranks=1, waits=WAITS)
    resharder = Resharder()
    try:
        rollouts.publish(resharder, version=0)
        rollouts.submit((0, 0), [[1]], SAMPLING, min_version=0)
        rollouts.submit((1, 0), [[1]], SAMPLING, min_version=0)
        rollouts.result((0, 0))
        trained = time.monotonic()
        time.sleep(2.0)  # step 0 trains
        resharder.value = 1
        rollouts.publish(resharder, version=1)
        t0 = time.monotonic()
        batch = rollouts.result((1, 0))
        waited = time.monotonic() - t0
    finally:
        rollouts.close()
        thread.join(30)
        heartbeat.close()
    # after the next publish instead, it would start 2 s after the training did and be waited for 1 s
    assert batch.version == 0 and engine.started[1] < trained + 1.0, (engine.started, trained)
    assert waited < 0.5 and rollouts.publish_wait_s < 0.5, (waited, rollouts.publish_wait_s)


class CudaCalls:
    """torch.cuda mocked: every call with the thread that made it, page-locked ranges, copies to a GPU."""

    def __init__(self, monkeypatch):
        self.calls, self.registered, self.unregistered = [], [], []
        calls = self

        def note(name):
            calls.calls.append((name, threading.current_thread().name))

        class Stream:
            def __init__(self, device=None, priority=0):
                note("Stream")

            def synchronize(self):
                note("Stream.synchronize")

        class Event:
            def record(self, stream=None):
                note("Event.record")

            def synchronize(self):
                note("Event.synchronize")

        @contextlib.contextmanager
        def stream(s):
            note("stream")
            yield s

        class Cudart:
            def cudaHostRegister(self, ptr, nbytes, flags):
                note("cudaHostRegister")
                calls.registered.append((ptr, nbytes))
                return 0

            def cudaHostUnregister(self, ptr):
                note("cudaHostUnregister")
                calls.unregistered.append(ptr)
                return 0

        real_to = torch.Tensor.to

        def to(tensor, *args, **kwargs):
            target = args[0] if args else kwargs.get("device")
            if isinstance(target, torch.device) and target.type == "cuda":
                note("Tensor.to(cuda)")
                return tensor.clone()
            return real_to(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: note("current_stream"))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: note("synchronize"))
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: note("set_device"))
        monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
        monkeypatch.setattr(torch.Tensor, "to", to)


def test_no_thread_of_the_trainer_touches_cuda(monkeypatch):
    """A new thread starts on GPU 0, and leaving ``torch.cuda.stream`` there restores a stream of GPU 0 through
    ``cudaSetDevice(0)``, which opens a context on GPU 0 (torch/cuda/__init__.py 800-811, 842-857). With CUDA mocked
    and the leader on GPU 1, a run of the protocol (HF buckets copied to the GPU on a side stream, pinned host
    copies) starts no thread on the trainer's side, and every CUDA call it makes comes from the main thread, whose
    device is the rank's (parallel/gpu_binding.bind_this_rank)."""
    cuda = CudaCalls(monkeypatch)
    trainer_bridge, engine_bridge = memory_bridges(1)
    trainer_bridge.nccl = object()  # the leader's GPU buckets go over the bridge's NCCL group (a queue here)
    engine = VersionedEngine()
    thread, heartbeat = engine_thread(engine_bridge, engine)
    before = set(threading.enumerate())
    rollouts = RemoteRollouts(trainer_bridge, engine_ranks=1, waits=WAITS, comm_device=torch.device("cuda", 1))
    started = set(threading.enumerate()) - before
    resharder = Resharder()
    try:
        rollouts.publish(resharder, version=0)
        rollouts.submit((0, 0), [[1]], SAMPLING, min_version=0)
        assert rollouts.result((0, 0)).version == 0
        resharder.value = 1
        rollouts.publish(resharder, version=1)
        assert [s.logprobs[0] for s in rollouts.generate([[1]], SAMPLING).samples] == [1.0, 1.0]
    finally:
        rollouts.close()
        thread.join(30)
        heartbeat.close()
    names = {name for name, _ in cuda.calls}
    assert {"Stream", "stream", "Tensor.to(cuda)"} <= names, names  # the GPU path ran
    assert {thread for _, thread in cuda.calls} == {"MainThread"}, cuda.calls
    assert started == set(), started
    assert {"synchronize", "cudaHostRegister"} <= names, names
    assert [n for _, n in cuda.registered] == [64]  # the one bucket of one float32, packed at 64 bytes

"""The training step's hot paths make the host wait for the device no more than they must (single process, on the
meta device or with the reads counted, tests/host_syncs.py): the non-finite gradient check reads one flag, routing
replay copies a micro-batch's record to the device once and reads its counts once per pass. Their values are
checked here on the CPU and, end to end, by test_policy_parity.py and test_routing_replay_mp.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from host_syncs import DeviceCopies, HostReads
from mcpo_megatron.models import policy, routing_replay
from mcpo_megatron.models.policy import MegatronPolicy, grad_stats_groups
from mcpo_megatron.models.routing_replay import RoutingReplay, _LayerReplay

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------------- non-finite grads
class _Part:
    def __init__(self, group):
        self.group = group

    def get_grad_stats_parallel_group(self):
        return self.group


def _fake_policy(buffers, optimizer):
    """What MegatronPolicy._grads_finite reads: the DDP chunks' buffers, the optimizer, the training device."""
    wrap = lambda ts: [SimpleNamespace(grad_data=t) for t in ts]  # noqa: E731
    ddps = [SimpleNamespace(buffers=wrap(buffers[:2]), expert_parallel_buffers=wrap(buffers[2:3])),
            SimpleNamespace(buffers=wrap(buffers[3:]), expert_parallel_buffers=[])]
    return SimpleNamespace(ddps=ddps, optimizer=optimizer, info=SimpleNamespace(device=CPU))


@pytest.mark.parametrize("poison,finite", [(None, True), (float("nan"), False), (float("inf"), False),
                                           (-float("inf"), False), (3.0e38, True)])
def test_non_finite_check_is_one_flag_one_all_reduce_over_megatrons_group_one_read(monkeypatch, poison, finite):
    group = object()  # megatron's grad-stats group of the distributed optimizer (the intra-instance group)
    reduced = []
    monkeypatch.setattr(policy, "all_reduce_max",
                        lambda t, group=None: reduced.append((group, t.device, t.dtype, tuple(t.shape))) or t)
    g = torch.Generator().manual_seed(0)
    buffers = [torch.randn(n, generator=g) for n in (5, 7, 3, 4)] + [torch.randn(6, generator=g).bfloat16()]
    if poison is not None:
        buffers[2][1] = poison  # an expert buffer: the poison must not hide among the others
    optimizer = SimpleNamespace(chained_optimizers=[_Part(group), _Part(group)])  # dense and experts share it
    with HostReads() as host:
        assert MegatronPolicy._grads_finite(_fake_policy(buffers, optimizer)) is finite
    assert host.reads == ["item"]
    assert reduced == [(group, CPU, torch.float32, (1,))]


def test_grad_stats_groups_are_megatrons_distinct_groups_in_order():
    dense, experts = object(), object()
    assert grad_stats_groups(_Part(dense)) == [dense]
    assert grad_stats_groups(SimpleNamespace(chained_optimizers=[_Part(dense), _Part(dense)])) == [dense]
    # Without the distributed optimizer: the model-parallel group, and the experts' own.
    assert grad_stats_groups(SimpleNamespace(chained_optimizers=[_Part(dense), _Part(experts)])) == [dense, experts]


# ---------------------------------------------------------------------------------------------------- routing replay
B, S, LAYERS, TOPK, EXPERTS = 2, 3, 4, 2, 6


def _replay(record: bool):
    """A RoutingReplay over a stand-in chunk whose four modules carry routers' replay hooks."""
    replay = RoutingReplay([], num_layers=LAYERS, num_experts=EXPERTS, topk=TOPK, record=record)
    chunk = torch.nn.Module()
    chunk.layers = torch.nn.ModuleList()
    for i in range(LAYERS):
        router = SimpleNamespace(layer_number=i + 1, training=False,
                                 config=SimpleNamespace(recompute_granularity=None))
        holder = torch.nn.Module()
        holder.router_replay = _LayerReplay(replay, router)
        chunk.layers.append(holder)
    return replay, chunk


def _micro_batch(device, routing):
    lens = torch.tensor([S, S - 1], device=device)
    mask = torch.arange(S, device=device)[None, :] < lens[:, None]
    return SimpleNamespace(input_ids=torch.zeros(B, S, dtype=torch.long, device=device), token_mask=lambda: mask,
                           routing=routing, filler=False, indices=[0, 1])


def _scores(device):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(S * B, EXPERTS, generator=g).to(device) for _ in range(LAYERS)]


def _topk(scores, k, num_groups=None, group_topk=None):
    return torch.topk(scores, k, dim=-1)


def _forward(chunk, scores):
    """What each router's top-k returns in a forward: [S * b, k] experts, sequence-major tokens."""
    return [holder.router_replay.get_replay_topk(s, TOPK, default_compute_topk=_topk)[1]
            for holder, s in zip(chunk.layers, scores)]


def _record():
    """[b, S, layers, k] int16 experts, -1 ("not known") at sequence 0's position 1 in layer 2."""
    g = torch.Generator().manual_seed(4)
    routing = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(B * S * LAYERS)])
    routing = routing.view(B, S, LAYERS, TOPK).to(torch.int16)
    routing[0, 1, 2] = -1
    return routing


def test_replay_copies_the_record_once_per_micro_batch_and_never_reads_the_device():
    replay, chunk = _replay(record=False)
    routing = _record()
    replay.begin(SimpleNamespace(routing=[routing[0], routing[1]], input_ids=[None, None]), may_record=False)
    scores = _scores("meta")
    with HostReads() as host, DeviceCopies() as copies:
        with replay.micro_batch(chunk, _micro_batch(torch.device("meta"), routing)):
            _forward(chunk, scores)
    assert host.reads == [] and copies.to_host == []
    assert copies.to_device == [(S, B, LAYERS, TOPK)]  # the chunk's layers of the record, in one copy
    with HostReads() as host, DeviceCopies() as copies:
        replay.finish(SimpleNamespace(routing=[routing[0], routing[1]]))
    assert copies.to_host == [(2,)] and host.reads == ["tolist"]  # the pass's counts, read once at its end


def test_recording_brings_a_micro_batch_back_in_one_copy():
    replay, chunk = _replay(record=True)
    batch = SimpleNamespace(routing=None, input_ids=[torch.zeros(S, dtype=torch.long),
                                                     torch.zeros(S - 1, dtype=torch.long)])
    replay.begin(batch, may_record=True)
    scores = _scores("meta")
    with HostReads() as host, DeviceCopies() as copies:
        with replay.micro_batch(chunk, _micro_batch(torch.device("meta"), None)):
            _forward(chunk, scores)
    assert host.reads == [] and copies.to_device == []
    assert copies.to_host == [(LAYERS, S * B, TOPK)]


def test_replayed_and_recorded_experts_and_the_mismatch_on_the_cpu():
    """The values behind the copies above: the replayed experts are the record's where it knows them, the recorded
    ones what the routers chose, per sequence and position, and the mismatch fraction counts the real tokens."""
    scores = _scores(CPU)
    chosen = [torch.topk(s, TOPK, dim=-1).indices for s in scores]  # [S * b, k], token s * b + row

    replay, chunk = _replay(record=True)
    batch = SimpleNamespace(routing=None, input_ids=[torch.zeros(S, dtype=torch.long),
                                                     torch.zeros(S - 1, dtype=torch.long)])
    replay.begin(batch, may_record=True)
    with replay.micro_batch(chunk, _micro_batch(CPU, None)):
        _forward(chunk, scores)
    replay.finish(batch)
    for row, n in enumerate((S, S - 1)):
        for pos in range(n):
            for layer in range(LAYERS):
                assert batch.routing[row][pos, layer].tolist() == chosen[layer][pos * B + row].tolist()

    routing = _record()
    replay, chunk = _replay(record=False)
    replay.begin(SimpleNamespace(routing=[routing[0], routing[1]], input_ids=[None, None]), may_record=False)
    with replay.micro_batch(chunk, _micro_batch(CPU, routing)):
        replayed = _forward(chunk, scores)
    metrics = replay.finish(SimpleNamespace(routing=[routing[0], routing[1]]))
    mismatched = decisions = 0
    for layer in range(LAYERS):
        for row, n in enumerate((S, S - 1)):
            for pos in range(S):
                target, got = routing[row, pos, layer].long(), replayed[layer][pos * B + row]
                known = bool((target >= 0).all())
                assert got.tolist() == (target if known else chosen[layer][pos * B + row]).tolist()
                if known and pos < n:
                    decisions += 1
                    mismatched += set(target.tolist()) != set(chosen[layer][pos * B + row].tolist())
    assert metrics == {"moe/routing_mismatch_frac": mismatched / decisions} and 0 < mismatched < decisions


def test_a_copy_to_a_gpu_goes_from_pinned_memory_without_waiting(monkeypatch):
    """CUDA mocked: the host copy is pinned first, then copied with non_blocking (a pageable source would make the
    copy wait for the stream's work)."""
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin_memory") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(("to", a, k)) or self)
    host = torch.zeros(2, 3, dtype=torch.int16)
    routing_replay.to_device(host, torch.device("cuda", 0))
    assert calls == ["pin_memory", ("to", (torch.device("cuda", 0),), {"non_blocking": True})]
    calls.clear()
    routing_replay.to_device(host, CPU)
    assert calls == [("to", (CPU,), {"non_blocking": True})]

"""The reshard plan's GPU paths without a GPU: the device of every buffer handed to an exchange, the streams and
events of separate placement's staging and sends (CUDA mocked), and which vLLM layers are written in place.

* every tensor on the meta device: a plan's local copies, packs, exchanges and unpacks all stay on the device the
  transfer was built for (a CPU tensor anywhere would raise or show here);
* ``StagedShards`` with CUDA mocked: the staging copies wait for the training stream, run on a side stream into
  page-locked memory, asynchronously, and end with an event that the next training waits on (not the host); each
  round is copied to the GPU on the side stream and exchanged from there, once every kernel issued before on the
  GPU (the staging, training) has finished; a rank sends only the version it staged;
* ``vllm_target.classify``: on GPUs unquantized linear, embedding, norm and Triton-expert weights are written in
  place, other expert kernels and quantized layers refused; on the CPU build linear weights are staged.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from mcpo_megatron.rollout.weights import layouts as L, plan as P
from mcpo_megatron.rollout.weights import transfer as reshard_transfer
from mcpo_megatron.rollout.weights.transfer import PlanTransfer

from test_reshard_plan import _setup


def two_trainers_two_engines():
    """A TP=2 trainer (ranks 0-1) and two PyTorch-engine ranks of their own (2-3), with every rank's plan."""
    cfg, shape, hf, trainer, sources = _setup("qwen3", 2, 1, 1, 1, 1, 1, False)
    engines = [None, None, L.EngineLayout("hf", "bfloat16", replica=0), L.EngineLayout("hf", "bfloat16", replica=1)]
    prefer = P.preferences(trainer, engines)
    pairs = {me: P.rank_pieces(trainer, engines, me, prefer) for me in range(4)}
    fanout = max(P.peer_count(pairs[me], me) for me in range(4))
    plans = {me: P.assign_rounds(pairs[me], me, 4, 4000, fanout) for me in range(4)}
    for plan in plans.values():
        P.pad_rounds(plan, max(p.num_rounds for p in plans.values()))
    return shape, sources, engines, plans


def test_every_buffer_and_copy_stays_on_the_transfer_device():
    cfg, shape, hf, trainer, sources = _setup("qwen3", 2, 2, 1, 1, 1, 1, False)
    engines = [L.EngineLayout("hf", "float32")] * 4
    pairs = {me: P.rank_pieces(trainer, engines, me, P.preferences(trainer, engines)) for me in range(4)}
    fanout = max(P.peer_count(pairs[me], me) for me in range(4))
    meta = torch.device("meta")
    for me in range(4):
        plan = P.assign_rounds(pairs[me], me, 4, 3000, fanout)
        assert plan.num_rounds > 1
        src = {k: torch.empty(t.shape, device=meta) for k, t in sources[me].items()}
        dst = {k: torch.empty(s, device=meta) for k, s in L.engine_tensor_shapes(shape, engines[me]).items()}
        transfer = PlanTransfer(plan, sources=src, destinations=dst, device=meta)
        calls = []

        def exchange(recv, send, recv_sizes, send_sizes):
            assert recv.device == send.device == meta and recv.dtype == send.dtype == torch.uint8
            assert recv.numel() == sum(recv_sizes) and send.numel() == sum(send_sizes) and len(send_sizes) == 4
            calls.append((recv.numel(), send.numel()))

        stats = transfer.run(exchange)
        assert len(calls) == plan.num_rounds == stats.rounds
        assert stats.bytes == sum(p.nbytes for p in plan.local) + sum(
            p.nbytes for rd in plan.rounds for items in rd.recvs.values() for _, p in items)


class CudaLog:
    """Mocked torch.cuda streams and events, and the copies and exchanges of the staged shards, in one log."""

    def __init__(self, monkeypatch):
        self.log, self.active, self.streams, self.pinned = [], None, [], []
        log = self

        class Stream:
            def __init__(self, device=None, priority=0):
                self.device = device
                log.streams.append(self)

            def wait_stream(self, other):
                log.log.append(("wait_stream", self, other))

            def synchronize(self):
                log.log.append(("stream_synchronize", self))

        class Event:
            def record(self, stream=None):
                log.log.append(("record", self, stream))

            def synchronize(self):
                log.log.append(("event_synchronize", self))

        class CurrentStream:
            def wait_event(self, event):
                log.log.append(("current_waits", event))

        @contextlib.contextmanager
        def stream(s):
            before, log.active = log.active, s
            try:
                yield s
            finally:
                log.active = before

        real_copy_all = reshard_transfer._copy_all

        def copy_all(pairs, non_blocking=False):
            log.log.append(("stage_copies", log.active, non_blocking, len(pairs)))
            real_copy_all(pairs)

        def byte_buffer(nbytes, device, *, pin_memory=False):
            if pin_memory:
                log.pinned.append(nbytes)
            buf = torch.empty(nbytes, dtype=torch.uint8)
            buf.fake_device = torch.device(device)
            return buf

        real_copy = torch.Tensor.copy_

        def copy_(tensor, src, non_blocking=False):
            if getattr(tensor, "fake_device", None) is not None or getattr(tensor._base, "fake_device", None):
                log.log.append(("to_device", log.active, non_blocking))
            return real_copy(tensor, src)

        from mcpo_megatron.rollout.separate import plan as remote_plan

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: CurrentStream())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.log.append(("device_synchronize",
                                                                                            device)))
        monkeypatch.setattr(reshard_transfer, "_copy_all", copy_all)
        monkeypatch.setattr(reshard_transfer, "byte_buffer", byte_buffer)
        monkeypatch.setattr(remote_plan, "byte_buffer", byte_buffer)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)

    def kinds(self):
        return [e[0] for e in self.log]


class FakeBridge:
    def __init__(self, log: CudaLog, rank: int = 0):
        self.log, self.sent, self.rank = log, [], rank

    def all_to_all(self, recv, send, recv_sizes, send_sizes):
        device = getattr(send._base if send._base is not None else send, "fake_device", send.device)
        self.log.log.append(("all_to_all", self.log.active, device))
        self.sent.append(bytes(send.numpy()))


def test_staged_shards_copy_on_a_side_stream_and_send_from_the_gpu(monkeypatch):
    from mcpo_megatron.rollout.separate.plan import StagedShards

    shape, sources, engines, plans = two_trainers_two_engines()
    log = CudaLog(monkeypatch)
    bridge = FakeBridge(log)
    cuda0 = torch.device("cuda", 0)
    shards = StagedShards(plans[0], sources[0], bridge, cuda0)
    assert len(log.streams) == 1 and log.streams[0].device == cuda0
    side = log.streams[0]

    nbytes, _ = shards.stage(0)
    assert log.pinned == [sum(rd.send_bytes for rd in plans[0].rounds)] == [nbytes]  # every round, pinned
    stage = log.log[:]
    assert stage[0][0] == "wait_stream" and stage[0][1] is side  # the weights are final before they are copied
    copies = [e for e in stage if e[0] == "stage_copies"]
    assert copies and all(c[1] is side and c[2] is True for c in copies)  # asynchronous, on the side stream
    assert stage[-1][0] == "record" and stage[-1][2] is side  # the event marks the copies' end
    event = stage[-1][1]

    shards.before_training()
    assert log.log[-1] == ("current_waits", event)  # training waits on the device, the host does not

    log.log.clear()
    shards.send(0)
    kinds = log.kinds()
    # every kernel issued before on the GPU (the staging copies, any training collective) has finished before
    # anything leaves: the bridge's NCCL communicator is used in an epoch of its own
    assert log.log[0] == ("device_synchronize", cuda0)
    exchanges = [e for e in log.log if e[0] == "all_to_all"]
    uploads = [e for e in log.log if e[0] == "to_device"]
    assert len(exchanges) == len(uploads) == plans[0].num_rounds
    assert all(e[1] is side and e[2] == cuda0 for e in exchanges)  # NCCL from the GPU buffer, on the side stream
    assert all(u[1] is side and u[2] is True for u in uploads)
    staged = shards.transfer
    assert bridge.sent == [bytes(staged.send_buffer(k)[0].numpy()) for k in range(plans[0].num_rounds)]
    assert kinds[-1] == "stream_synchronize" and kinds.count("device_synchronize") == 1


def test_a_rank_sends_only_the_version_it_staged(monkeypatch):
    """The engines' offer names a version; a trainer rank that staged another one (or none yet) refuses to send,
    before any exchange, instead of handing the engines a mix of two versions."""
    from mcpo_megatron.rollout.separate.plan import StagedShards

    shape, sources, engines, plans = two_trainers_two_engines()
    bridge = FakeBridge(CudaLog(monkeypatch), rank=1)
    shards = StagedShards(plans[1], sources[1], bridge, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"^trainer rank 1 was asked to send version 0 to the engines but has "
                                           r"staged nothing yet"):
        shards.send(0)
    shards.stage(0)
    with pytest.raises(RuntimeError, match=r"asked to send version 1 to the engines but has staged version 0"):
        shards.send(1)
    assert bridge.sent == []
    shards.send(0)
    assert bridge.sent == [bytes(shards.transfer.send_buffer(k)[0].numpy()) for k in range(plans[1].num_rounds)]


def test_vllm_layers_written_in_place_on_gpus_and_staged_on_cpu():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import QKVParallelLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    from mcpo_megatron.rollout.engines.vllm.target import IN_PLACE, STAGED_EXPERTS, STAGED_LINEAR, classify

    def bare(cls, **attrs):
        obj = object.__new__(cls)
        torch.nn.Module.__init__(obj) if isinstance(obj, torch.nn.Module) else None
        for k, v in attrs.items():
            object.__setattr__(obj, k, v)
        return obj

    class Backend:
        def __init__(self, name):
            self.name = name

    class Quantized(QuantizeMethodBase):
        def create_weights(self, *a, **k):
            pass

        def apply(self, *a, **k):
            pass

    linear = bare(QKVParallelLinear, quant_method=bare(UnquantizedLinearMethod))
    head = bare(ParallelLMHead, quant_method=bare(UnquantizedEmbeddingMethod), num_added_embeddings=0)
    norm = bare(RMSNorm)
    triton = bare(RoutedExperts, quant_method=bare(UnquantizedFusedMoEMethod, unquantized_backend=Backend("TRITON")),
                  _expert_map=None)
    cutlass = bare(RoutedExperts, quant_method=bare(UnquantizedFusedMoEMethod,
                                                    unquantized_backend=Backend("FLASHINFER_CUTLASS")),
                   _expert_map=None)
    quantized = bare(QKVParallelLinear, quant_method=bare(Quantized))
    gpu = {name: classify(m, p, cpu=False) for name, (m, p) in {
        "linear": (linear, "weight"), "bias": (linear, "bias"), "head": (head, "weight"), "norm": (norm, "weight"),
        "triton": (triton, "w13_weight"), "cutlass": (cutlass, "w13_weight"), "fp8": (quantized, "weight")}.items()}
    assert gpu == {"linear": IN_PLACE, "bias": IN_PLACE, "head": IN_PLACE, "norm": IN_PLACE, "triton": IN_PLACE,
                   "cutlass": None, "fp8": None}
    cpu = {name: classify(m, p, cpu=True) for name, (m, p) in {
        "linear": (linear, "weight"), "bias": (linear, "bias"), "head": (head, "weight"),
        "experts": (triton, "w2_weight")}.items()}
    assert cpu == {"linear": STAGED_LINEAR, "bias": IN_PLACE, "head": IN_PLACE, "experts": STAGED_EXPERTS}


def test_gpu_buffers_are_taken_for_the_update_only(monkeypatch):
    """On a GPU the packed buffers come from the caching allocator for the update and are let go after it (nothing
    stays beside the engine's KV cache and the training state); in host memory they are kept for the next update."""
    shape, sources, engines, plans = two_trainers_two_engines()
    made = []

    def byte_buffer(nbytes, device, *, pin_memory=False):
        made.append(torch.device(device).type)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(reshard_transfer, "byte_buffer", byte_buffer)
    dst = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in L.engine_tensor_shapes(shape, engines[2]).items()}
    for device, kept in ((torch.device("cuda", 0), False), (torch.device("cpu"), True)):
        made.clear()
        transfer = PlanTransfer(plans[2], sources=None, destinations=dst, device=device)
        for _ in range(2):
            transfer.run(lambda recv, send, recv_sizes, send_sizes: None)
            assert (transfer._recv_buf is not None) == kept
        assert made == [device.type] * (2 if kept else 4)  # send and receive buffers, once or per update

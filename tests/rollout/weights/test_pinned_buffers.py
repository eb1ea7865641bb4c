"""Page-locked host memory with CUDA mocked (``parallel/pinned.py``): torch's pinned allocator rounds every block up
to a power of two (a 9 GiB staging buffer would take 16 GiB), so every pinned buffer of the project is ordinary
host memory registered with ``cudaHostRegister`` at exactly its size, and unregistered once its last view is gone.

* the helper: page-aligned, registered at the bytes asked for, unregistered with its last view, a refusal naming
  the buffer;
* every pinned buffer of the project goes through it, none through ``pin_memory=True``: separate placement's
  staged shards and the trainer leader's HF buckets, and trainer.offload's host copies;
* ``mcpo plan``'s host figure for separate placement is what the busiest training rank registers, for layouts
  with tensor, pipeline (virtual stages included), data and expert parallelism, and engines with a TP of their own.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from omegaconf import OmegaConf

from mcpo_megatron.parallel.pinned import PAGE, host_buffer
from mcpo_megatron.rollout.weights import layouts as L, plan as P

from test_reshard_plan import CONFIGS, _setup


class FakeCudart:
    """The two calls of ``torch.cuda.cudart()`` the project makes."""

    def __init__(self, error: int = 0):
        self.error, self.registered, self.unregistered = error, [], []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered.append((ptr, nbytes))
        return self.error

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def cudart(monkeypatch):
    """CUDA's runtime mocked, GPU buffers on the CPU; torch's pinned allocator refused (the CPU build has none;
    here any use is a failure), so a buffer pinned the other way would show."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    real_empty = torch.empty

    def empty(*args, pin_memory=False, device=None, **kwargs):
        assert not pin_memory, "a buffer pinned by torch's power-of-two pinned allocator"
        if device is not None and torch.device(device).type == "cuda":
            device = None  # a GPU buffer (the sends' device buffer) stands on the CPU
        return real_empty(*args, device=device, **kwargs)

    def pin_memory(self, *args, **kwargs):
        raise AssertionError("a buffer pinned by torch's power-of-two pinned allocator")

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return fake


def test_a_pinned_buffer_is_registered_at_its_size_and_unregistered_with_its_last_view(cudart):
    nbytes = 9 * 2**20 + 5
    buf = host_buffer(nbytes, pinned=True, what="a test buffer")
    ptr = buf.data_ptr()
    assert buf.dtype == torch.uint8 and buf.device.type == "cpu" and buf.numel() == nbytes
    assert cudart.registered == [(ptr, nbytes)] and ptr % PAGE == 0  # exactly its bytes, from a page of its own
    buf.fill_(7)
    view = buf[nbytes - 10:]
    del buf
    gc.collect()
    assert cudart.unregistered == []  # a view still uses it
    assert bytes(view.numpy()) == b"\x07" * 10
    del view
    gc.collect()
    assert cudart.unregistered == [ptr]
    assert host_buffer(64, pinned=False, what="x").numel() == 64 and len(cudart.registered) == 1  # CPU: plain memory


def test_a_failed_registration_names_the_buffer_and_the_limit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(error=2))
    with pytest.raises(RuntimeError, match=r"^page-locking 0\.50 GiB of host memory for the staged weights failed "
                                           r"with CUDA error 2; the node's RAM \(or its locked-memory limit, "
                                           r"ulimit -l\) cannot hold it: see mcpo plan's host memory lines, or x$"):
        host_buffer(2**29, pinned=True, what="the staged weights", remedy=", or x")


class CudaStreams:
    """torch.cuda's streams and events mocked, for code that stages on a side stream."""

    def __init__(self, monkeypatch):
        class Stream:
            def __init__(self, device=None, priority=0):
                pass

            def wait_stream(self, other):
                pass

            def synchronize(self):
                pass

        class Event:
            def record(self, stream=None):
                pass

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)


def staged_bytes(monkeypatch, cudart, layout, engines: int, engine_tp: int = 1) -> list[int]:
    """Every trainer rank's staged shards with CUDA (mocked), for ``engines`` engine ranks of their own: the bytes
    each registers (once per rank, at its buffer's size)."""
    from mcpo_megatron.rollout.separate.plan import StagedShards

    CudaStreams(monkeypatch)
    cfg, shape, hf, trainer, sources = _setup(*layout)
    world = len(trainer.ranks)
    padded = -(-shape.vocab_size // 64) * 64
    layouts = [None] * world + [L.EngineLayout("vllm", "bfloat16", tp=engine_tp, tp_rank=e % engine_tp,
                                               vocab_padded=padded, replica=e // engine_tp) if engine_tp > 1
                                else L.EngineLayout("hf", "bfloat16", replica=e) for e in range(engines)]
    prefer = P.preferences(trainer, layouts)
    registered = []
    for me in range(world):
        plan = P.assign_rounds(P.rank_pieces(trainer, layouts, me, prefer), me, len(layouts), 1 << 20, 1)
        before = len(cudart.registered)
        shards = StagedShards(plan, sources[me], None, torch.device("cuda", 0))
        nbytes, _ = shards.stage(0)
        new = [n for _, n in cudart.registered[before:]]
        assert new == [nbytes] == [sum(rd.send_bytes for rd in plan.rounds)]  # every round, exactly, pinned once
        shards.stage(1)
        assert len(cudart.registered) == before + 1  # kept for the next version
        registered.append(nbytes)
    return registered


def test_every_pinned_buffer_of_the_project_is_registered_at_its_size(monkeypatch, cudart):
    from mcpo_megatron.models.offload import StorageOffload
    from mcpo_megatron.rollout.separate.messages import ALIGN, pack_bucket

    # separate placement: each trainer rank's staged shards
    assert all(n > 0 for n in staged_bytes(monkeypatch, cudart, ("qwen3", 2, 1, 1, 1, 1, 1, False), 2))
    # the trainer leader's HF buckets, for engines the plan does not cover
    before = len(cudart.registered)
    bucket = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64))]
    metas, flat = pack_bucket(bucket, pin_memory=True)
    assert cudart.registered[before:] == [(flat.data_ptr(), flat.numel())] and flat.numel() == 64 + ALIGN
    # trainer.offload: one host buffer per offload, exactly the bytes of the storages it copies
    monkeypatch.setattr(StorageOffload, "_on_device", lambda self, t: True)  # the CPU tensors stand for GPU ones
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    off = StorageOffload(torch.device("cuda", 0))
    before = len(cudart.registered)
    off.offload([torch.randn(64), torch.randn(32)])
    assert [n for _, n in cudart.registered[before:]] == [384] == [off.host_bytes]
    off.onload()


def planner_arch(hf_cfg, family: str) -> dict:
    """``model.arch`` of the HF config a layout was built from (the planner's view of the same model)."""
    return dict(num_layers=hf_cfg.num_hidden_layers, hidden_size=hf_cfg.hidden_size,
                num_attention_heads=hf_cfg.num_attention_heads, num_key_value_heads=hf_cfg.num_key_value_heads,
                ffn_hidden_size=hf_cfg.intermediate_size, vocab_size=hf_cfg.vocab_size, head_dim=hf_cfg.head_dim,
                tie_word_embeddings=bool(hf_cfg.tie_word_embeddings), family=family.removesuffix("-tied"),
                num_experts=getattr(hf_cfg, "num_experts", 0), num_experts_per_tok=getattr(hf_cfg,
                                                                                          "num_experts_per_tok", 0),
                moe_ffn_hidden_size=getattr(hf_cfg, "moe_intermediate_size", 0))


# (config, trainer tp, pp, dp, cp, ep, vpp, te), engine ranks, engine TP
LAYOUTS = [
    (("qwen3", 2, 1, 1, 1, 1, 1, False), 2, 1),
    (("qwen3", 1, 4, 1, 1, 1, 1, False), 1, 1),          # the end stages hold the embedding and the head
    (("qwen3", 1, 2, 1, 1, 1, 2, False), 1, 1),          # virtual stages
    (("qwen3", 1, 1, 2, 1, 1, 1, False), 1, 1),          # one replica over two trainer replicas: uneven
    (("qwen3", 2, 2, 2, 1, 1, 1, False), 2, 1),
    (("qwen3", 2, 1, 1, 1, 1, 1, False), 4, 2),          # vLLM at TP 2
    (("llama-tied-padded", 2, 2, 1, 1, 1, 1, False), 2, 1),
    (("moe", 1, 1, 2, 1, 2, 1, False), 2, 1),            # experts over the expert-data-parallel replicas
]


@pytest.mark.parametrize("layout,engines,engine_tp", LAYOUTS, ids=lambda x: "-".join(map(str, x))
                         if isinstance(x, tuple) else str(x))
def test_the_plan_counts_the_host_memory_the_busiest_training_rank_registers(monkeypatch, cudart, layout, engines,
                                                                              engine_tp):
    """``mcpo plan``'s line "host: each training rank stages ..." is the busiest training rank's registered bytes,
    less the 64-byte alignment of each piece (under 0.5% here, less on real models)."""
    from mcpo_megatron import config as C
    from mcpo_megatron.planner.phases import staged_weights_bytes

    name, tp, pp, dp, cp, ep, vpp, _ = layout
    registered = staged_bytes(monkeypatch, cudart, layout, engines, engine_tp)
    cfg = OmegaConf.create({"model": {"arch": planner_arch(_setup(*layout)[0], CONFIGS[name][0]), "path": ""},
                            "parallelism": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                            "expert_model_parallel_size": ep, "context_parallel_size": cp,
                                            "virtual_pipeline_model_parallel_size": vpp},
                            "rollout": {"tensor_parallel_size": engine_tp},
                            "trainer": {"max_tokens_per_microbatch": 64, "logprob_chunk_size": 64}})
    planned = staged_weights_bytes(C.model_shape(cfg), cfg, len(registered), engines)
    assert max(registered) * 0.995 <= planned <= max(registered), (planned, registered)

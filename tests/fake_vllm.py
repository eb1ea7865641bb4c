"""vLLM's CUDA build faked on CPU: a ``vllm.LLM`` that behaves as the CUDA build does for what the project relies on
(the engine arguments it is built with, scheduling, the prefix cache, vLLM's start-up checks of the launcher's
GPUs) and mocked CUDA devices, for the engines a command or a rank builds.

What the fake takes from vLLM 0.32's CUDA build (paths inside the ``vllm`` package):

* asynchronous scheduling, on unless the arguments turn it off (:func:`async_scheduling`, the default rule of
  ``config/vllm.py`` 1585-1644; the CPU build forces it off, ``platforms/cpu.py`` 329-331), and then the engine
  core's batch queue of two (``config/vllm.py`` 575-585): a step schedules a batch and returns the outputs of the
  batch scheduled one step earlier, nothing when the queue is not full yet (``v1/engine/core.py`` 698-812); a
  request is not scheduled past its ``max_tokens`` (``v1/core/sched/scheduler.py`` 664-677). A batch is computed
  with the weights of the moment it is scheduled (its kernels are launched then, ``v1/executor/uniproc_executor.py``
  90-132);
* ``reset_prefix_cache()`` fails (False) while a request holds cache blocks (``v1/core/block_pool.py`` 837-844);
* the worker's device, ``cuda:LOCAL_RANK`` among the visible devices (``v1/worker/gpu_worker.py`` 491-499), and
  custom all-reduce's peer-access check at start (vLLM's own ``_can_p2p``, ``distributed/device_communicators/
  custom_all_reduce.py`` 86-100, called at 280-289 for a TP group of 2, 4, 6, 8 or 16 ranks on one node unless
  ``disable_custom_all_reduce``).

A token of the fake is a function of its request's seed, its position and the weights' version, and its log-prob
is ``-(1 + version)``: a test reads from a record's log-probs which weights computed each token.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from dataclasses import dataclass, field

import torch

def _speculative_methods_with_async_scheduling() -> set[str]:
    """The speculative methods that keep asynchronous scheduling on (``config/vllm.py`` 1597-1610)."""
    from typing import get_args

    from vllm.config.speculative import EagleModelTypes, NgramGPUTypes

    def names(literal) -> set[str]:
        return {n for a in get_args(literal) for n in (names(a) if get_args(a) else {a})}

    return names(EagleModelTypes) | names(NgramGPUTypes) | {"draft_model", "dspark", "dflash"}


def async_scheduling(kwargs: dict, platform: str = "cuda") -> bool:
    """Whether vLLM 0.32 schedules asynchronously with these ``vllm.LLM`` arguments on ``platform``: an explicit
    value, else on unless a pooling runner, a speculative method outside EAGLE's family, an executor without
    support (Ray's: ``v1/executor/abstract.py`` 441-444) or pipeline parallelism on the V1 model runner
    (``VLLM_USE_V2_MODEL_RUNNER=0``; V2 is the default with Triton, 703-739) turns it off (``config/vllm.py``
    1585-1644); never on CPU (``platforms/cpu.py`` 329-331)."""
    if platform == "cpu":
        return False
    if kwargs.get("async_scheduling") is not None:
        return bool(kwargs["async_scheduling"])
    spec = kwargs.get("speculative_config") or {}
    v1_runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
    return not (kwargs.get("runner") == "pooling"
                or (spec and spec.get("method") not in _speculative_methods_with_async_scheduling())
                or spec.get("disable_padded_drafter_batch")
                or kwargs.get("distributed_executor_backend") == "ray"
                or (int(kwargs.get("pipeline_parallel_size", 1)) > 1 and v1_runner))


@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeCompletion:
    token_ids: list
    logprobs: list
    finish_reason: str | None
    index: int = 0


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list
    finished: bool


@dataclass
class _Request:
    external: str
    prompt: list[int]
    params: object
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    in_flight: int = 0            # tokens scheduled whose output has not come back (vLLM's output placeholders)
    finished: str | None = None   # the finish reason once finished

    def stop_after(self) -> int:
        """Tokens until this request samples its stop token: 2 to 8, from its seed."""
        return 2 + int(self.params.seed) % 7


class FakeEngine:
    """vLLM's ``LLMEngine`` and its in-process engine core (the external launcher runs without multiprocessing) as
    the project drives them: ``add_request`` / ``has_unfinished_requests`` / ``step`` / ``abort_request``."""

    def __init__(self, llm: "FakeCudaLLM"):
        self.llm = llm
        self.requests: dict[str, _Request] = {}  # internal id -> request
        self.queue: deque = deque()
        self.queue_size = 2 if llm.async_scheduling else 1
        self.steps = 0
        self.engine_core = self

    def add_request(self, request_id: str, prompt: dict, params) -> str:
        internal = f"{request_id}-{len(self.requests):04x}"  # vLLM appends a random suffix
        if self.llm.cached_versions - {self.llm.weights_version}:
            self.llm.stale_prefix_requests.append(request_id)  # prefix blocks of older weights could be hit
        self.requests[internal] = _Request(str(request_id), list(prompt["prompt_token_ids"]), params)
        return internal

    def has_unfinished_requests(self) -> bool:  # the output processor's count: exact whatever the queue holds
        return any(r.finished is None for r in self.requests.values())

    def abort_request(self, request_ids, internal: bool = False) -> None:
        assert internal, "the session and the offline loop abort vLLM's internal ids"
        for rid in request_ids:
            self.requests.pop(rid, None)

    def shutdown(self) -> None:
        pass

    def step(self) -> list:
        self.steps += 1
        running = [(rid, r) for rid, r in self.requests.items() if r.finished is None]
        if self.queue_size == 1:  # EngineCore.step: schedule, run, update
            return self._update(self._schedule(running)) if running else []
        if running:  # step_with_batch_queue: fill the queue first
            batch = self._schedule(running)
            self.queue.appendleft(batch)
            if len(self.queue) < self.queue_size:
                return []
        elif not self.queue:
            return []
        return self._update(self.queue.pop())

    def _schedule(self, running) -> list:
        """One token for every running request not already scheduled up to its max_tokens, computed now with the
        weights of this moment."""
        version, batch = self.llm.weights_version, []
        for rid, r in running:
            position = len(r.tokens) + r.in_flight
            if position >= r.params.max_tokens:
                continue
            r.in_flight += 1
            stop = list(r.params.stop_token_ids or [])
            if stop and position + 1 == r.stop_after():
                token = stop[0]
            else:
                token = 100 + (int(r.params.seed) + 7 * position + 31 * version) % 50
            batch.append((rid, token, -(1.0 + version)))
        if batch:
            self.llm.cached_versions.add(version)
        return batch

    def _update(self, batch) -> list:
        """The scheduler's update from a batch's output: tokens of requests still running are appended (a token
        scheduled after its request finished or was aborted is dropped), finished requests leave."""
        from vllm.sampling_params import RequestOutputKind

        outs = []
        for rid, token, logprob in batch:
            r = self.requests.get(rid)
            if r is None or r.finished is not None:
                continue
            r.in_flight -= 1
            r.tokens.append(token)
            r.logprobs.append(logprob)
            if token in (r.params.stop_token_ids or []):
                r.finished = "stop"
            elif len(r.tokens) == r.params.max_tokens:
                r.finished = "length"
            delta = getattr(r.params, "output_kind", None) == RequestOutputKind.DELTA
            if delta or r.finished:
                tokens, lps = (r.tokens[-1:], r.logprobs[-1:]) if delta else (r.tokens, r.logprobs)
                completion = FakeCompletion(list(tokens), [{t: FakeLogprob(lp)} for t, lp in zip(tokens, lps)],
                                            r.finished)
                outs.append(FakeRequestOutput(r.external, r.prompt, [completion], r.finished is not None))
            if r.finished:
                del self.requests[rid]
        return outs


class FakeCudaLLM:
    """Stands in for ``vllm.LLM`` on vLLM's CUDA build: records the engine arguments it is built with (``built``),
    runs vLLM's start-up checks of the launcher's GPUs, and generates as :class:`FakeEngine` does."""

    built: list[dict] = []

    def __init__(self, **kwargs):
        FakeCudaLLM.built.append(kwargs)
        self.kwargs = kwargs
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            _start_external_launcher_worker(kwargs)
        self.async_scheduling = async_scheduling(kwargs)
        self.weights_version = 0
        self.cached_versions: set[int] = set()      # weight versions of the blocks in the prefix cache
        self.stale_prefix_requests: list[str] = []  # requests added while blocks of older weights were cached
        self.resets: list[bool] = []
        self.request_counter = itertools.count()
        self.llm_engine = FakeEngine(self)

    def enqueue(self, prompts, params, use_tqdm=True) -> list[str]:
        return [self.llm_engine.add_request(str(next(self.request_counter)), p, sp) for p, sp in zip(prompts, params)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """vLLM's weight-transfer methods: the weights change when the update finishes."""
        assert method in ("start_weight_update", "update_weights", "finish_weight_update"), method
        if method == "finish_weight_update":
            self.weights_version += 1
        return [None]

    def apply_model(self, fn):
        return [None]  # a model the reshard plan cannot write: updates take vLLM's layerwise reload

    def reset_prefix_cache(self) -> bool:
        ok = not self.llm_engine.requests  # every block is free only when no request holds one
        if ok:
            self.cached_versions.clear()
        self.resets.append(ok)
        return ok

    def sleep(self, level=1):
        pass

    def wake_up(self, tags=None):
        return True


def _cuda_devices():
    """The part of vLLM's CUDA platform its start-up checks use: devices named by ``CUDA_VISIBLE_DEVICES``, through
    the methods of vLLM's own Platform class (``platforms/interface.py`` 288-363)."""
    from vllm.platforms.interface import Platform

    class CudaDevices(Platform):
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

    return CudaDevices


def _start_external_launcher_worker(kwargs: dict) -> None:
    """What an external-launcher worker does at start with the launcher's variables: take ``cuda:LOCAL_RANK`` of
    the visible devices (``v1/worker/gpu_worker.py`` 491-499), and unless custom all-reduce is disabled check peer
    access from its TP rank to the others with vLLM's own ``_can_p2p`` (``custom_all_reduce.py`` 213-221: TP sizes
    2, 4, 6, 8, 16; 280-289; one node, GPUs fully connected)."""
    from vllm.distributed.device_communicators import custom_all_reduce

    platform = _cuda_devices()
    local_rank = int(os.environ["LOCAL_RANK"])
    assert local_rank < torch.cuda.device_count(), (
        f"DP adjusted local rank {local_rank} is out of bounds for {torch.cuda.device_count()} devices.")
    platform.logical_device_id_to_visible_device_id(local_rank)
    tp = int(kwargs.get("tensor_parallel_size", 1))
    if tp in custom_all_reduce.CustomAllreduce._SUPPORTED_WORLD_SIZES and not kwargs.get("disable_custom_all_reduce"):
        previous = custom_all_reduce.current_platform
        custom_all_reduce.current_platform = platform
        try:
            custom_all_reduce._can_p2p(int(os.environ["RANK"]) % tp, tp)  # vLLM's [-1, pp, tp] rank layout
        finally:
            custom_all_reduce.current_platform = previous


def _can_device_access_peer(device: int, peer: int) -> bool:
    """torch.cuda.can_device_access_peer's own argument checks (``torch/cuda/__init__.py`` 744-753), on mocked
    devices that all reach each other."""
    if device < 0 or device >= torch.cuda.device_count():
        raise AssertionError("Invalid device id")
    if peer < 0 or peer >= torch.cuda.device_count():
        raise AssertionError("Invalid peer device id")
    return True


def fake_cuda_vllm(monkeypatch, gpus: int = 8, gpu_memory_bytes: int = 80 * 1024**3, capability=(9, 0)):
    """vLLM's CUDA platform and ``gpus`` CUDA devices of ``gpu_memory_bytes`` and compute ``capability``, with
    :class:`FakeCudaLLM` as ``vllm.LLM``. No launcher variables are set, as in a process started by hand, and those
    an engine sets for vLLM's external launcher are removed after the test. Returns the list of the arguments each
    engine was built with."""
    import vllm
    import vllm.envs as vllm_envs

    from mcpo_megatron.rollout.engines.vllm import engine as vllm_engine

    FakeCudaLLM.built = []
    monkeypatch.setattr(vllm, "LLM", FakeCudaLLM)
    monkeypatch.setattr(vllm_engine, "vllm_device", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: tuple(capability))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", _can_device_access_peer)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": gpu_memory_bytes,
                                                          "major": capability[0], "minor": capability[1]})())
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                "VLLM_BATCH_INVARIANT"):
        monkeypatch.setenv(var, "")  # remembered, so that teardown restores the variable's state before the test
        monkeypatch.delenv(var)
    # vllm.envs as in a process that has not started an engine yet (an engine's start caches every variable)
    monkeypatch.setattr(vllm_envs, "__getattr__", getattr(vllm_envs.__getattr__, "__wrapped__", vllm_envs.__getattr__))
    return FakeCudaLLM.built

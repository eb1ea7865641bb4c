"""What an engine rank runs with ``rollout.placement=separate``: build the configured engine (vLLM or PyTorch) on
this rank's device, with no weights of its own (the trainer's first update brings every weight), and serve
generation requests until the trainer says it is done (:class:`~mcpo_megatron.rollout.separate.server.RolloutServer`).

A preemption signal does not end an engine rank: the trainer decides. It lets the engines finish the batches it
needs for its checkpoint (``trainer/held_batches.py``), then tells them to stop and shuts them down, so the two
sides always end together.
"""

from __future__ import annotations

import time

import torch

from mcpo_megatron.config import Config
from mcpo_megatron.parallel.bridge import Bridge, Roles
from mcpo_megatron.parallel.gpu_binding import bind_this_rank
from mcpo_megatron.rollout.separate.liveness import Heartbeat, Waits
from mcpo_megatron.trainer.components import build_engine, resolve_model_dir
from mcpo_megatron.trainer.preemption import StopRequest


class EngineRank:
    """The little of :class:`~mcpo_megatron.parallel.distributed.ParallelInfo` an engine builder reads."""

    def __init__(self, roles: Roles):
        self.rank, self.world_size = roles.rank, roles.size
        self.device = bind_this_rank() if torch.cuda.is_available() else torch.device("cpu")


def serve_rollouts(cfg: Config, roles: Roles, bridge: Bridge) -> int:
    """Run this engine rank until the trainer's shutdown; returns the number of batches it generated. It beats
    from the start (building the engine takes minutes) to the end (``rollout/separate/liveness.py``)."""
    heartbeat = Heartbeat(bridge.store.clone(), bridge.rank, Waits.from_config(cfg).beat_period_s)
    try:
        return _serve(cfg, roles, bridge, heartbeat)
    finally:
        heartbeat.close()


def _serve(cfg: Config, roles: Roles, bridge: Bridge, heartbeat: Heartbeat) -> int:
    from mcpo_megatron.models.multimodal import load_language_model_config
    from mcpo_megatron.models.sources import load_tokenizer
    from mcpo_megatron.rollout.separate.server import RolloutServer

    info = EngineRank(roles)
    t0 = time.perf_counter()
    model_dir = resolve_model_dir(cfg, info)
    hf_config = load_language_model_config(model_dir)
    tokenizer = load_tokenizer(cfg.model.tokenizer or model_dir,
                               remedy="set model.tokenizer to a directory or hub id with the model's tokenizer")
    engine = build_engine(cfg, model_dir, hf_config, tokenizer, info, role="engine_rank")  # alone on its GPU
    stop = StopRequest(enabled=cfg.checkpoint.save_on_signal)  # the signal is the trainer's to act on
    if roles.rank == 0:
        print(f"[rollout] {roles.size} engine rank(s) ({cfg.rollout.engine}, rollout TP "
              f"{cfg.rollout.tensor_parallel_size}) ready in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        server = RolloutServer(bridge, engine, rank=roles.rank, rollout_tp=cfg.rollout.tensor_parallel_size,
                               device=info.device, heartbeat=heartbeat,
                               bucket_bytes=int(cfg.reshard.bucket_mb * 2**20))
        served = server.serve()
    finally:
        stop.close()
        engine.close()
    if roles.rank == 0:
        print(f"[rollout] served {served} generation batches", flush=True)
    return served

"""torchrun worker (4 ranks, gloo): the reshard plan with engines on ranks of their own.

Usage: worker_separate_reshard.py OUT_DIR HF_DIR

Ranks 0-1 train (TP=2), ranks 2-3 are engine ranks (two PyTorch-engine replicas), over the real role worlds and
bridge. The trainer ranks publish two versions (the loaded weights perturbed, then perturbed again), each followed
by a generation batch that makes the engines take it: every trainer rank sends its own shards. Trainer rank 1
stages each version STAGE_DELAY_S late (an injected delay: the leader submits the batch, and the engines ask for
the version, while rank 1 is still staging it), and between each submit and its result the trainer ranks run
training collectives of their own (TRAINING all-reduces over the trainer world). After each update the engine
ranks save their weights (OUT_DIR/engine{e}_v{v}.pt); the trainer ranks export the version through the HF export
(OUT_DIR/export_v{v}) and record the publish figures, and in order every bridge collective and training
collective they made with the thread that made it (OUT_DIR/trainer{r}.json).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from mcpo_megatron.parallel.bridge import ROLLOUT, split_roles, start_role_world
from mcpo_megatron.parallel.launcher import launcher_env
from mcpo_megatron.rollout.engines.interface import SamplingParams
from mcpo_megatron.rollout.separate.liveness import Heartbeat, Waits

WAITS = Waits(batch_s=300.0, heartbeat_s=120.0, batches_queued=2, slack_s=60.0)
BUCKET = 20_000  # bytes: many rounds
VERSIONS = 2
STAGE_DELAY_S = 1.5
TRAINING = 3  # the training collectives between a submit and its result


class RecordedEngine:
    """A PyTorch engine whose weights are saved after each update it takes."""

    def __init__(self, engine, out: Path, rank: int):
        self.engine, self.out, self.rank, self.updates = engine, out, rank, 0

    def weight_target(self):
        target = self.engine.weight_target()

        def finish():
            state = {k: v.clone() for k, v in self.engine.model.state_dict().items()}
            torch.save(state, self.out / f"engine{self.rank}_v{self.updates}.pt")
            self.updates += 1

        target.finish = finish
        return target

    def __getattr__(self, name):
        return getattr(self.engine, name)


def serve(bridge, roles, out: Path, hf_dir: str) -> None:
    from transformers import AutoConfig

    from mcpo_megatron.rollout.separate.server import RolloutServer
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    heartbeat = Heartbeat(bridge.store.clone(), bridge.rank, WAITS.beat_period_s)
    engine = RecordedEngine(TorchRolloutEngine(AutoConfig.from_pretrained(hf_dir)), out, roles.rank)
    try:
        server = RolloutServer(bridge, engine, rank=roles.rank, heartbeat=heartbeat, bucket_bytes=BUCKET)
        (out / f"engine{roles.rank}.json").write_text(json.dumps(
            {"planned": server.transfer is not None, "readers": server.readers}))
        server.serve()
    finally:
        heartbeat.close()


def train(bridge, roles, out: Path, hf_dir: str) -> None:
    import threading
    import time

    import torch.distributed as dist

    from mcpo_megatron.models.hf_export import export_hf
    from mcpo_megatron.models.policy import MegatronPolicy
    from mcpo_megatron.models.policy_settings import PolicySettings
    from mcpo_megatron.parallel.bridge import Bridge
    from mcpo_megatron.parallel.distributed import barrier, init_distributed
    from mcpo_megatron.rollout.separate.remote import RemoteRollouts
    from mcpo_megatron.rollout.separate.plan import StagedShards

    calls = []  # (what, thread) in the order this rank made them
    all_to_all = Bridge.all_to_all

    def logged_all_to_all(self, *args):
        calls.append(("bridge all_to_all", threading.current_thread().name))
        return all_to_all(self, *args)

    Bridge.all_to_all = logged_all_to_all
    info = init_distributed(2, 1, seed=0)
    if info.rank == 1:
        stage = StagedShards.stage

        def late_stage(self, version):
            time.sleep(STAGE_DELAY_S)
            return stage(self, version)

        StagedShards.stage = late_stage
    policy = MegatronPolicy(hf_dir, PolicySettings(dtype=torch.float32, transformer_impl="local"), parallel_info=info)
    rollouts = RemoteRollouts(bridge, engine_ranks=roles.rollout_ranks, waits=WAITS, comm_device=info.device,
                              model_chunks=policy.model_chunks, bucket_bytes=BUCKET)
    record = {"planned": rollouts.shards is not None, "publish": []}
    gen = torch.Generator().manual_seed(7 + info.rank)
    for version in range(VERSIONS):
        with torch.no_grad():  # a new version: every parameter moves
            for c in policy.model_chunks:
                for p in c.parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=gen))
        stats = rollouts.publish(None, version=version)
        record["publish"].append({"path": stats.path, "bytes": stats.bytes, "collectives": stats.collectives,
                                  "rounds": stats.buckets})
        rollouts.after_rollouts()
        # a batch for this version makes both engine replicas take it; the trainer trains meanwhile
        rollouts.submit(("v", version), [[3, 17, 42], [5, 6], [7], [100, 101]],
                        SamplingParams(n=2, max_new_tokens=3), min_version=version)
        for _ in range(TRAINING):
            calls.append(("training all_reduce", threading.current_thread().name))
            dist.all_reduce(torch.ones(1))
            time.sleep(0.2)
        got = rollouts.result(("v", version)).output
        record.setdefault("samples", []).append(len(got))
        export_hf(policy.model_chunks, policy.hf_config, out / f"export_v{version}")
    rollouts.close()
    record["calls"] = calls
    (out / f"trainer{info.rank}.json").write_text(json.dumps(record))
    barrier()


def main() -> int:
    out, hf_dir = Path(sys.argv[1]), sys.argv[2]
    rank, world, _ = launcher_env()
    roles = split_roles(rank, world, 2)
    bridge = start_role_world(roles, "gloo", timeout_s=300.0)
    if roles.role == ROLLOUT:
        serve(bridge, roles, out, hf_dir)
    else:
        train(bridge, roles, out, hf_dir)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)

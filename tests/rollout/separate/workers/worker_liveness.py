"""torchrun worker (3 ranks, gloo): separate placement's waits with 2 trainer ranks and 1 engine rank, no model.

Usage: worker_liveness.py OUT_DIR SCENARIO

The real role worlds over the launch's store, the bridge, the engine's heartbeat thread, RemoteRollouts and
RolloutServer, the weight broadcast; only the engine is a stand-in (its samples carry the version it holds). The
trainer world's collective timeout is the old fixed 1,800 s scaled down to OLD_TIMEOUT_S, and the limits are
WAITS. SCENARIO:

* ``slow``: each generation takes SLOW_S (longer than OLD_TIMEOUT_S, within the batch limit) while beating.
  Batch (0, 0) is awaited as the trainer does; then, as a control, batch (1, 0) with the trainer ranks waiting
  in the trainer world's group, where they waited before (its timeout is OLD_TIMEOUT_S);
* ``freeze``: the engine rank freezes in its first generation (heartbeat and main thread stop);
* a failure on the trainer leader alone (:data:`LEADER_FAULTS`, injected on trainer rank 0): ``staging_fails``
  (packing the leader's copy of version 0 raises, as when page-locking it fails), ``store_fails`` (a store error
  when the leader takes the first result), ``unpickle_fails`` (the first result cannot be unpickled).

Each trainer rank writes OUT_DIR/rank{r}.json after each batch: per batch what it got (or the error it raised)
and how long it waited (with a leader fault: from the first publish on), and the timeouts of the groups it waited in; a trainer rank that raised exits 1, as
``mcpo train`` does.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mcpo_megatron.parallel.bridge import ROLLOUT, split_roles, start_role_world
from mcpo_megatron.parallel.launcher import launcher_env
from mcpo_megatron.rollout.separate import remote
from mcpo_megatron.rollout.separate import server as rollout_server
from mcpo_megatron.rollout.engines.interface import SamplingParams
from mcpo_megatron.rollout.separate.liveness import Heartbeat, Waits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/rollout/separate: test_remote's fakes
from test_remote import Resharder, VersionedEngine  # noqa: E402

OLD_TIMEOUT_S = 2.0
WAITS = Waits(batch_s=6.0, heartbeat_s=1.0, batches_queued=2, slack_s=1.0)  # the wait group: 2 x 6 + 1 + 1 = 14 s
SLOW_S = 3.0
STARTUP_S = 60.0  # rendezvous and group creation on a loaded machine; the collectives' timeouts are set after
LEADER_FAULTS = ("staging_fails", "store_fails", "unpickle_fails")


def inject(scenario: str) -> None:
    """The trainer leader's fault of ``scenario`` (the real code around it)."""
    from mcpo_megatron.parallel.bridge import Bridge
    from mcpo_megatron.rollout.separate import publisher as weight_publisher

    if scenario == "staging_fails":
        def pack_bucket(*args, **kwargs):
            raise RuntimeError("injected: page-locking the leader's copy failed")

        weight_publisher.pack_bucket = pack_bucket
        return
    real_take, real_read = Bridge.take, Bridge.read

    def take(self, key, *args, **kwargs):
        if scenario == "store_fails" and key.startswith("res/"):
            raise dist.DistStoreError("injected: the store connection was lost")
        return real_take(self, key, *args, **kwargs)

    def read(self, key, *args, **kwargs):
        if scenario == "unpickle_fails" and key.startswith("res/"):
            raise pickle.UnpicklingError("injected: a result that cannot be read")
        return real_read(self, key, *args, **kwargs)

    Bridge.take, Bridge.read = take, read


class FakeEngine(VersionedEngine):
    def __init__(self, scenario: str, heartbeat: Heartbeat):
        super().__init__()
        self.scenario, self.heartbeat = scenario, heartbeat

    def generate(self, prompts, sampling, *, prompt_indices, should_stop=None):
        if self.scenario == "freeze":
            self.heartbeat.close()
            while True:  # a frozen rank: only the launcher ends it
                time.sleep(1)
        time.sleep(SLOW_S)
        return super().generate(prompts, sampling, prompt_indices=prompt_indices)


def group_timeout_s(group) -> float:
    return (group or dist.group.WORLD)._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def serve(scenario: str, bridge) -> None:
    heartbeat = Heartbeat(bridge.store.clone(), bridge.rank, WAITS.beat_period_s)
    try:
        rollout_server.RolloutServer(bridge, FakeEngine(scenario, heartbeat), rank=0, heartbeat=heartbeat).serve()
    finally:
        heartbeat.close()


def take(rollouts, step: int, publish: bool = False) -> dict:
    """Submit and wait for batch (step, 0) (after publishing version 0 with ``publish``): what this rank got, or the
    error it raised, and its wait."""
    t0 = time.monotonic()
    try:
        if publish:
            rollouts.publish(Resharder(), version=0)
        rollouts.submit((step, 0), [[1], [2]], SamplingParams(n=2, max_new_tokens=1), min_version=0)
        batch = rollouts.result((step, 0))
        got = {"version": batch.version, "samples": [[s.prompt_index, s.logprobs] for s in batch.output.samples]}
    except Exception as e:  # noqa: BLE001  recorded for the test, then this rank fails as the trainer would
        got = {"error": f"{type(e).__name__}: {e}"}
    return dict(got, waited_s=time.monotonic() - t0)


def train(scenario: str, bridge, rank: int, out: Path) -> int:
    # the trainer world's collectives time out after OLD_TIMEOUT_S from here on
    dist.group.WORLD._get_backend(torch.device("cpu")).set_timeout(timedelta(seconds=OLD_TIMEOUT_S))
    rollouts = remote.RemoteRollouts(bridge, engine_ranks=1, waits=WAITS)
    record = {"world_timeout_s": group_timeout_s(None), "wait_group_timeout_s": group_timeout_s(rollouts.wait_group),
              "wait_group_backend": dist.get_backend(rollouts.wait_group), "batches": []}
    if scenario in LEADER_FAULTS:
        if rank == 0:
            inject(scenario)
        record["batches"].append(take(rollouts, 0, publish=True))
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        rollouts.close()
        return 1 if "error" in record["batches"][0] else 0
    rollouts.publish(Resharder(), version=0)
    for step in range(2 if scenario == "slow" else 1):
        if step == 1:  # the control: wait where the trainer ranks waited before
            rollouts.wait_group = None
        record["batches"].append(take(rollouts, step))
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        if "error" in record["batches"][-1]:
            rollouts.close()
            return 1
    rollouts.close()
    return 0


def main() -> int:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    rank, world, _ = launcher_env()
    roles = split_roles(rank, world, 1)
    bridge = start_role_world(roles, "gloo", timeout_s=STARTUP_S)
    if roles.role == ROLLOUT:
        serve(scenario, bridge)
        return 0
    return train(scenario, bridge, roles.rank, out)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # no process-group teardown: a trainer rank that failed leaves the frozen engine rank to the launcher
    os._exit(code)

"""A complete checkpoint that cannot be loaded (a file truncated by a crash, damaged, forged): trainer.resume=auto
falls back to the previous complete checkpoint, saying why, and sets the bad one aside; an explicit
trainer.resume path fails naming the previous complete checkpoint. The trainer's own start_run, with a stand-in
for the model, engines and data."""

import contextlib
import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from mcpo_megatron.config import load_config
from mcpo_megatron.parallel.distributed import ParallelInfo
from mcpo_megatron.trainer import loop
from mcpo_megatron.trainer.checkpoint import CheckpointLoadError, CheckpointManager, find_latest, list_complete
from mcpo_megatron.trainer.startup import StartupClock

INFO = ParallelInfo(rank=0, world_size=1, local_rank=0, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0,
                    is_first_stage=True, is_last_stage=True, tp_group=None, pp_group=None, dp_group=None,
                    device=torch.device("cpu"))


class FakeSetup:
    """What start_run touches: the config, the policy's checkpoint load, the sampler, tracker, engines, schedule and
    start-up clock."""

    def __init__(self, broken_policy=(), cfg=None, info=INFO):
        self.cfg, self.info = cfg, info
        self.broken_policy = set(broken_policy)
        self.policy_loaded = []
        self.policy = SimpleNamespace(load_checkpoint=self._load_policy)
        self.sampler = SimpleNamespace(load_state_dict=lambda st: setattr(self, "sampler_state", st))
        self.tracker = SimpleNamespace(load_state_dict=lambda st: setattr(self, "tracker_state", st))
        self.rollouts = SimpleNamespace(publish=lambda resharder, version: None)
        self.resharder = None
        self.schedule = SimpleNamespace(load_state_dict=lambda rows: setattr(self, "in_flight", rows))
        self.startup = StartupClock()

    def _load_policy(self, path):
        if path.parent.name in self.broken_policy:
            raise RuntimeError(f"CheckpointingException: {path}/__0_0.distcp is truncated")
        self.policy_loaded.append(path.parent.name)


def _run_with_checkpoints(tmp_path, steps=(2, 4)):
    out = tmp_path / "run"
    mgr = CheckpointManager(out / "checkpoints", rank=0, keep_last=3)
    for step in steps:
        mgr.save(step, save_policy=lambda d: d.mkdir(), config_yaml="a: 1\n",
                 trainer_state={"step": step, "sampler": {"pos": step}, "tracker": {"version": 2, "last": {}},
                                "in_flight": []})
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps[-1] + 1)))
    return out, mgr


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _start(out, mgr, s, resume="auto"):
    cfg = load_config(None, [f"trainer.output_dir={out}", f"trainer.resume={resume}", "logging.tensorboard=false",
                             "trainer.total_steps=8"])
    s.cfg = cfg
    with contextlib.ExitStack() as closing:
        step, _ = loop.start_run(s, mgr, closing)
    return step


@pytest.mark.parametrize("damage", ["trainer_state", "policy"])
def test_auto_resume_falls_back_to_the_previous_checkpoint(tmp_path, capsys, damage):
    out, mgr = _run_with_checkpoints(tmp_path)
    newest = out / "checkpoints" / "step_000004"
    if damage == "trainer_state":
        _truncate(newest / "trainer_state.pt")
    s = FakeSetup(broken_policy={"step_000004"} if damage == "policy" else ())
    assert _start(out, mgr, s) == 2
    assert s.sampler_state == {"pos": 2} and s.policy_loaded == ["step_000002"]
    printed = capsys.readouterr().out
    reason = "trainer_state.pt: unreadable" if damage == "trainer_state" else "distcp is truncated"
    assert f"checkpoint {newest} cannot be loaded" in printed and reason in printed
    assert f"falling back to the previous complete checkpoint {out / 'checkpoints' / 'step_000002'}" in printed
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in printed
    # The bad one is kept for inspection, out of the way of pruning and `latest`.
    assert f"moved the checkpoint that cannot be loaded to {newest}.unloadable" in printed
    assert (newest.parent / "step_000004.unloadable").is_dir() and not newest.exists()
    assert [st for st, _ in list_complete(out / "checkpoints")] == [2]
    assert find_latest(out / "checkpoints").name == "step_000002"
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_an_explicit_resume_path_fails_naming_the_previous_checkpoint(tmp_path):
    out, mgr = _run_with_checkpoints(tmp_path)
    newest, previous = out / "checkpoints" / "step_000004", out / "checkpoints" / "step_000002"
    _truncate(newest / "rng" / "rank_00000.pt")
    with pytest.raises(CheckpointLoadError) as e:
        _start(out, mgr, FakeSetup(), resume=str(newest))
    msg = str(e.value)
    assert f"trainer.resume={newest}" in msg and "rank_00000.pt: unreadable" in msg
    assert f"the previous complete checkpoint is {previous}: pass trainer.resume={previous}" in msg
    assert newest.is_dir()  # an explicit choice is never set aside
    assert (out / "metrics.jsonl").read_text().count("step") == 4


def test_when_no_checkpoint_loads_every_failure_is_named_and_nothing_is_moved(tmp_path):
    out, mgr = _run_with_checkpoints(tmp_path)
    for step in ("step_000002", "step_000004"):
        _truncate(out / "checkpoints" / step / "trainer_state.pt")
    with pytest.raises(CheckpointLoadError) as e:
        _start(out, mgr, FakeSetup())
    msg = str(e.value)
    assert f"no complete checkpoint in {out / 'checkpoints'} can be loaded" in msg
    assert "step_000004/trainer_state.pt: unreadable" in msg and "step_000002/trainer_state.pt: unreadable" in msg
    assert [st for st, _ in list_complete(out / "checkpoints")] == [2, 4]


# ---------------------------------------------------------------------------------------------------- two ranks' views
class TwoRanks:
    """Two ranks run in turn in this process; the world's collectives are stood in for: rank 0's object broadcasts
    record what it sends and rank 1's receive them in the same order; every collective is counted, so that a test
    can check both ranks made the same ones (a rank that made more would wait forever in a real world)."""

    def __init__(self, monkeypatch):
        from mcpo_megatron.trainer import checkpoint, resume

        self.rank, self.sent, self.received = 0, [], 0
        self.calls = {0: [], 1: []}
        monkeypatch.setattr(checkpoint, "broadcast_object", self.broadcast_object, raising=False)
        monkeypatch.setattr(resume, "all_gather_objects", self.all_gather_objects)

    def broadcast_object(self, obj, src=0, group=None):
        assert src == 0 and group is None  # from rank 0, over the world
        self.calls[self.rank].append("broadcast")
        if self.rank == 0:
            self.sent.append(obj)
            return obj
        self.received += 1
        return self.sent[self.received - 1]

    def all_gather_objects(self, obj, group=None):
        self.calls[self.rank].append("all_gather")
        return [obj]


def _info(rank):
    return dataclasses.replace(INFO, rank=rank, world_size=2, local_rank=rank, dp=2, dp_rank=rank)


def _stale_copy(root, into):
    """``into`` as a node whose view of ``root`` has not caught up yet: it holds what ``root`` held before."""
    shutil.copytree(root, into)
    return into


def test_every_rank_resumes_from_the_checkpoint_rank_0_finds(tmp_path, monkeypatch):
    """Rank 1's view of the checkpoint directory lags (it sees step 2 as the latest, rank 0 sees step 4): both ranks
    resume step 4, and the preemption path's question "is this step already checkpointed?" gets rank 0's answer."""
    out, mgr0 = _run_with_checkpoints(tmp_path, steps=(2,))
    stale = _stale_copy(out / "checkpoints", tmp_path / "rank1_view")
    mgr0.save(4, save_policy=lambda d: d.mkdir(), config_yaml="a: 1\n",
              trainer_state={"step": 4, "sampler": {"pos": 4}, "tracker": {"version": 2, "last": {}}, "in_flight": []})
    mgr1 = CheckpointManager(stale, rank=1, keep_last=3)
    world = TwoRanks(monkeypatch)
    seen = {}
    for rank, mgr in ((0, mgr0), (1, mgr1)):
        world.rank = rank
        s = FakeSetup(info=_info(rank))
        seen[rank] = (_start(out, mgr, s), s.sampler_state, s.policy_loaded, mgr.latest_step())
    assert seen[0] == seen[1] == (4, {"pos": 4}, ["step_000004"], 4)
    assert world.calls[0] == world.calls[1] and world.received == len(world.sent)


def test_a_fallback_is_rank_0s_on_every_rank(tmp_path, monkeypatch):
    """Rank 0's newest checkpoint cannot be loaded and rank 1's view is stale: both fall back to the checkpoint
    rank 0 names, through the same collectives."""
    out, mgr0 = _run_with_checkpoints(tmp_path, steps=(2, 4))
    stale = _stale_copy(out / "checkpoints", tmp_path / "rank1_view")
    shutil.rmtree(stale / "step_000004")
    (stale / "latest").write_text("step_000002\n")
    _truncate(out / "checkpoints" / "step_000004" / "trainer_state.pt")
    mgr1 = CheckpointManager(stale, rank=1, keep_last=3)
    world = TwoRanks(monkeypatch)
    loaded = {}
    for rank, mgr in ((0, mgr0), (1, mgr1)):
        world.rank = rank
        s = FakeSetup(info=_info(rank))
        assert _start(out, mgr, s) == 2
        loaded[rank] = s.policy_loaded
    assert loaded[0] == loaded[1] == ["step_000002"]
    assert world.calls[0] == world.calls[1] and world.received == len(world.sent)


def test_rank_0s_error_is_raised_on_every_rank_and_the_others_do_not_read(tmp_path, monkeypatch):
    world = TwoRanks(monkeypatch)
    reads = []

    def read():
        reads.append(world.rank)
        raise FileNotFoundError(f"{tmp_path}/nowhere is neither a complete checkpoint nor a directory holding one")

    for rank in (0, 1):
        world.rank = rank
        with pytest.raises(FileNotFoundError, match="nowhere is neither a complete checkpoint"):
            CheckpointManager(tmp_path, rank=rank).on_rank0(read)
    assert reads == [0]

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("cannot pickle")

    def read_unpicklable():
        raise Unpicklable("a lock file holder that cannot cross the wire")

    world.rank = 0  # rank 0 raises its own error; the others a RuntimeError that names it
    with pytest.raises(Unpicklable, match="a lock file holder"):
        CheckpointManager(tmp_path, rank=0).on_rank0(read_unpicklable)
    world.rank = 1
    with pytest.raises(RuntimeError, match="Unpicklable: a lock file holder that cannot cross the wire"):
        CheckpointManager(tmp_path, rank=1).on_rank0(read_unpicklable)

"""A complete checkpoint that cannot be loaded (a file truncated by a crash, damaged, forged): trainer.resume=auto
falls back to the previous complete checkpoint, saying why, and sets the bad one aside; an explicit
trainer.resume path fails naming the previous complete checkpoint. The trainer's own start_run, with a stand-in
for the model, engines and data."""

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch

from mcpo_megatron.config import load_config
from mcpo_megatron.parallel.distributed import ParallelInfo
from mcpo_megatron.trainer import loop
from mcpo_megatron.trainer.checkpoint import CheckpointLoadError, CheckpointManager, find_latest, list_complete

INFO = ParallelInfo(rank=0, world_size=1, local_rank=0, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0,
                    is_first_stage=True, is_last_stage=True, tp_group=None, pp_group=None, dp_group=None,
                    device=torch.device("cpu"))


class FakeSetup:
    """What start_run touches: the config, the policy's checkpoint load, the sampler, tracker, engines and schedule."""

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

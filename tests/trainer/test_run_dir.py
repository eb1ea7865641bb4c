"""trainer.resume=never into a directory that holds a run: refused before any process starts, in the launcher and
in the trainer, unless trainer.overwrite=true moves the old run aside."""

import json

import pytest
import torch

from mcpo_megatron.config import ConfigError, load_config
from mcpo_megatron.parallel.distributed import ParallelInfo
from mcpo_megatron.trainer import loop, resume, run_dir
from mcpo_megatron.trainer.checkpoint import COMPLETE_MARKER, LATEST_FILE

INFO = ParallelInfo(rank=0, world_size=1, local_rank=0, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0,
                    is_first_stage=True, is_last_stage=True, tp_group=None, pp_group=None, dp_group=None,
                    device=torch.device("cpu"))


def _old_run(out, ckpt_root=None, steps=(2, 4)):
    """A finished run: two step records and complete checkpoints (the layout CheckpointManager writes)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    root = ckpt_root or out / "checkpoints"
    for s in steps:
        (root / f"step_{s:06d}").mkdir(parents=True)
        (root / f"step_{s:06d}" / COMPLETE_MARKER).write_text(json.dumps({"step": s}))
    (root / LATEST_FILE).write_text(f"step_{steps[-1]:06d}\n")


def _cfg(out, *overrides):
    return load_config(None, [f"trainer.output_dir={out}", *overrides])


def test_fresh_run_into_a_used_directory_is_refused_naming_what_it_holds(tmp_path):
    out = tmp_path / "run"
    _old_run(out)
    with pytest.raises(ConfigError) as e:
        run_dir.check_fresh_run_dir(_cfg(out, "trainer.resume=never"))
    msg = str(e.value)
    assert f"trainer.output_dir={out}: holds a run" in msg
    assert "(2 step records)" in msg and "2 checkpoint(s)" in msg and "steps 2, 4" in msg
    assert "trainer.resume=auto" in msg and "trainer.overwrite=true" in msg
    # resuming, an explicit overwrite, or an empty / new directory are fine
    run_dir.check_fresh_run_dir(_cfg(out, "trainer.resume=auto"))
    run_dir.check_fresh_run_dir(_cfg(out, "trainer.resume=never", "trainer.overwrite=true"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    run_dir.check_fresh_run_dir(_cfg(tmp_path / "empty", "trainer.resume=never"))
    run_dir.check_fresh_run_dir(_cfg(tmp_path / "new", "trainer.resume=never"))


def test_checkpoints_in_a_separate_checkpoint_dir_count(tmp_path):
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out.mkdir()
    _old_run(tmp_path / "elsewhere", ckpt_root=ckpt, steps=(3,))
    with pytest.raises(ConfigError, match=r"1 checkpoint\(s\) in .*ckpt \(steps 3\)"):
        run_dir.check_fresh_run_dir(_cfg(out, "trainer.resume=never", f"checkpoint.dir={ckpt}"))


def test_overwrite_moves_the_old_run_aside(tmp_path):
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    _old_run(out)
    _old_run(tmp_path / "x", ckpt_root=ckpt, steps=(5,))
    moved = run_dir.move_aside(_cfg(out, "trainer.resume=never", "trainer.overwrite=true", f"checkpoint.dir={ckpt}"))
    assert [old for old, _ in moved] == [out, ckpt]
    for old, new in moved:
        assert not old.exists() and new.parent == old.parent and new.name.startswith(old.name + ".replaced-")
    assert (moved[0][1] / "checkpoints" / "step_000004" / COMPLETE_MARKER).is_file()  # nothing deleted
    assert (moved[1][1] / "step_000005").is_dir()
    # only with resume=never and overwrite=true, and only a directory that holds a run
    _old_run(out)
    assert run_dir.move_aside(_cfg(out, "trainer.resume=auto", "trainer.overwrite=true")) == []
    assert run_dir.move_aside(_cfg(out, "trainer.resume=never")) == []
    assert out.exists()


def test_launcher_refuses_before_starting_torchrun(tmp_path, monkeypatch):
    from mcpo_megatron.cli import main
    from mcpo_megatron.parallel import distributed

    started = []
    monkeypatch.setattr(distributed, "run_under_torchrun", lambda *a, **k: started.append(a) or 0)
    for var in ("RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "run"
    _old_run(out)
    args = [f"trainer.output_dir={out}", "trainer.resume=never", "data.train_batch_size=64"]
    assert main(["train", *args]) == 1 and started == []
    assert main(["train", *args, "trainer.overwrite=true"]) == 0 and len(started) == 1


class Reached(Exception):
    pass


def test_trainer_refuses_on_rank_0_and_moves_aside_with_overwrite(tmp_path, monkeypatch):
    def reached(*_a, **_k):
        raise Reached

    monkeypatch.setattr(loop, "build_setup", reached)
    out = tmp_path / "run"
    _old_run(out)
    with pytest.raises(ConfigError, match="holds a run"):
        loop.train(_cfg(out, "trainer.resume=never"), INFO)
    assert (out / "metrics.jsonl").read_text().count("step") == 2  # untouched
    with pytest.raises(Reached):
        loop.train(_cfg(out, "trainer.resume=never", "trainer.overwrite=true"), INFO)
    # the old run moved aside; the new directory holds only the new run's lock file
    assert [p.name for p in out.iterdir()] == [run_dir.LOCK_FILE] and len(list(tmp_path.glob("run.replaced-*"))) == 1


# ---------------------------------------------------------------------------------------------- trainer.resume=PATH

def test_resume_path_must_name_a_complete_checkpoint(tmp_path):
    """Checked before any process group starts: the key, the path and what is missing."""
    out = tmp_path / "run"
    _old_run(tmp_path / "a", steps=(2, 4))
    root = tmp_path / "a" / "checkpoints"
    for good in (root / "step_000004", root, "auto", "never"):
        run_dir.check_run_dir(_cfg(out, f"trainer.resume={good}"))
    missing = tmp_path / "nope" / "step_000100"
    with pytest.raises(ConfigError) as e:
        run_dir.check_run_dir(_cfg(out, f"trainer.resume={missing}"))
    assert str(e.value).startswith(f"invalid config: trainer.resume={missing}: no such directory; ")
    assert "give a step_N checkpoint directory or a run's checkpoints directory, or trainer.resume=auto" in str(e.value)
    unfinished = root / "step_000006"       # a write that did not finish: no COMPLETE marker
    (unfinished / "policy").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        run_dir.check_run_dir(_cfg(out, f"trainer.resume={unfinished}"))
    assert (f"trainer.resume={unfinished}: not a complete checkpoint: it has no COMPLETE marker (a checkpoint whose "
            "writing did not finish, or no checkpoint at all) and holds no step_N directory that has one") \
        in str(e.value)
    a_file = root / "latest"
    with pytest.raises(ConfigError, match=f"trainer.resume={a_file}: a file, not a checkpoint directory"):
        run_dir.check_run_dir(_cfg(out, f"trainer.resume={a_file}"))


def test_resume_from_a_checkpoints_directory_takes_its_latest(tmp_path):
    from mcpo_megatron.trainer.checkpoint import CheckpointManager

    out = tmp_path / "run"
    _old_run(tmp_path / "a", steps=(2, 4))
    root = tmp_path / "a" / "checkpoints"
    ckpt = CheckpointManager(out / "checkpoints", rank=0)
    assert resume.resume_point(_cfg(out, f"trainer.resume={root}"), ckpt) == root / "step_000004"
    assert resume.resume_point(_cfg(out, f"trainer.resume={root / 'step_000002'}"), ckpt) == root / "step_000002"


def test_train_command_refuses_a_bad_resume_path_before_any_process_starts(tmp_path, monkeypatch):
    """Started by hand: before torchrun; under a launcher: on every rank, before the process group."""
    from mcpo_megatron.cli import main
    from mcpo_megatron.parallel import distributed

    started = []
    monkeypatch.setattr(distributed, "run_under_torchrun", lambda *a, **k: started.append(a) or 0)
    monkeypatch.setattr(distributed, "init_distributed", lambda *a, **k: started.append(a))
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    args = ["train", f"trainer.output_dir={tmp_path / 'run'}", f"trainer.resume={tmp_path / 'missing'}",
            "data.train_batch_size=64"]
    assert main(args) == 1 and started == []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(args) == 1 and started == []


def test_trainer_refuses_a_bad_resume_path_before_building_anything(tmp_path, monkeypatch):
    def reached(*_a, **_k):
        raise Reached

    monkeypatch.setattr(loop, "build_setup", reached)
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match=f"trainer.resume={missing}: no such directory"):
        loop.train(_cfg(tmp_path / "run", f"trainer.resume={missing}"), INFO)
    _old_run(tmp_path / "a")
    with pytest.raises(Reached):
        loop.train(_cfg(tmp_path / "run", f"trainer.resume={tmp_path / 'a' / 'checkpoints'}"), INFO)

"""Checkpoint directories: atomic writes, the latest pointer, pruning, and RNG capture."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mcpo_megatron.trainer.checkpoint import (COMPLETE_MARKER, LATEST_FILE, CheckpointLoadError, CheckpointManager,
                                              capture_rng_state, find_latest, is_complete, list_complete,
                                              restore_rng_state)


def _save(mgr, step, payload="w"):
    def save_policy(d):
        d.mkdir(parents=True, exist_ok=True)
        (d / "weights.txt").write_text(f"{payload}{step}")
        (d / "weights.txt").chmod(0o600)  # as safetensors and other writers create their files

    return mgr.save(step, save_policy=save_policy, trainer_state={"step": step, "sampler": {"pos": step}},
                    config_yaml="a: 1\n")


def test_save_writes_complete_checkpoint_and_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, keep_last=2)
    path = _save(mgr, 3)
    assert path == tmp_path / "step_000003"
    assert is_complete(path)
    assert (path / "policy" / "weights.txt").read_text() == "w3"
    assert (tmp_path / LATEST_FILE).read_text().strip() == "step_000003"
    assert find_latest(tmp_path) == path
    state, rng = mgr.read_state(path)
    assert state == {"step": 3, "sampler": {"pos": 3}} and set(rng) >= {"python", "numpy", "torch"}
    assert not list(tmp_path.glob("*.tmp"))


def test_checkpoint_permissions_follow_the_umask(tmp_path):
    """Colleagues on a shared cluster read checkpoints: modes are those a plain mkdir / open gives."""
    import os

    old = os.umask(0o027)
    try:
        path = _save(CheckpointManager(tmp_path, rank=0, keep_last=2), 1)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o750
    assert (path / "policy").stat().st_mode & 0o777 == 0o750
    assert (path / "policy" / "weights.txt").stat().st_mode & 0o777 == 0o640
    assert (path / "trainer_state.pt").stat().st_mode & 0o777 == 0o640


def test_apply_umask_keeps_execute_bits_and_leaves_links(tmp_path):
    import os

    from mcpo_megatron.files import apply_umask

    (tmp_path / "d").mkdir(mode=0o700)
    (tmp_path / "d" / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "d" / "run.sh").chmod(0o700)
    (tmp_path / "d" / "data").write_text("x")
    (tmp_path / "d" / "data").chmod(0o600)
    (tmp_path / "d" / "link").symlink_to("data")
    old = os.umask(0o022)
    try:
        apply_umask(tmp_path / "d")
    finally:
        os.umask(old)
    assert [(tmp_path / "d" / n).stat().st_mode & 0o777 for n in ("", "run.sh", "data")] == [0o755, 0o755, 0o644]
    assert (tmp_path / "d" / "link").is_symlink()


def test_keep_last_prunes_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, keep_last=2)
    for step in (1, 2, 3, 4):
        _save(mgr, step)
    assert [s for s, _ in list_complete(tmp_path)] == [3, 4]
    assert find_latest(tmp_path).name == "step_000004"


def test_truncated_checkpoint_is_never_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, keep_last=3)
    _save(mgr, 2)
    # A save of step 4 killed mid-write: the temporary directory exists without its marker ...
    tmp = tmp_path / "step_000004.tmp"
    (tmp / "policy").mkdir(parents=True)
    (tmp / "policy" / "weights.txt").write_text("half")
    # ... and a directory with the final name but no COMPLETE marker (e.g. copied by hand, truncated).
    (tmp_path / "step_000005" / "policy").mkdir(parents=True)
    assert find_latest(tmp_path).name == "step_000002"
    # A latest pointer naming an incomplete directory falls back to the newest complete checkpoint.
    (tmp_path / LATEST_FILE).write_text("step_000005\n")
    assert find_latest(tmp_path).name == "step_000002"
    # A corrupt marker is not complete either.
    (tmp_path / "step_000005" / COMPLETE_MARKER).write_text("{not json")
    assert not is_complete(tmp_path / "step_000005")
    assert find_latest(tmp_path).name == "step_000002"


def test_interrupted_save_is_replaced_by_next_save(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, keep_last=2)
    stale = tmp_path / "step_000001.tmp" / "policy"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("x")
    path = _save(mgr, 1)
    assert not (path / "policy" / "junk").exists()
    assert not (tmp_path / "step_000001.tmp").exists()


def test_empty_or_missing_root_has_no_latest(tmp_path):
    assert find_latest(tmp_path / "nothing") is None
    assert find_latest(tmp_path) is None


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last=0 must be >= 1"):
        CheckpointManager(tmp_path, rank=0, keep_last=0)


def test_rng_state_round_trip():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = capture_rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    restore_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_every_file_and_directory_is_synced_before_the_marker(tmp_path, monkeypatch):
    """After a node crash the COMPLETE marker must not stand over a file still in the page cache: every file
    and directory of the checkpoint (the policy, the trainer state, the RNG files, config.yaml) is fsynced before
    the marker is written, and the parent directory after the rename."""
    import os

    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    _save(CheckpointManager(tmp_path, rank=0, keep_last=2), 3)
    tmp = tmp_path / "step_000003.tmp"
    marker = next(i for i, p in enumerate(synced) if p.name.startswith(COMPLETE_MARKER))
    before = set(synced[:marker])
    wanted = {tmp / "policy" / "weights.txt", tmp / "trainer_state.pt", tmp / "rng" / "rank_00000.pt",
              tmp / "config.yaml", tmp / "policy", tmp / "rng", tmp}
    assert wanted <= before, sorted(map(str, wanted - before))
    assert synced[-1] == tmp_path  # the latest pointer's rename


@pytest.fixture
def no_extra_safe_globals():
    """torch's own weights-only allow-list alone (importing megatron.core adds numpy arrays and other types)."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.add_safe_globals(registered)


def test_rng_states_are_saved_in_a_form_that_loads_without_code(tmp_path, no_extra_safe_globals):
    """The RNG files hold plain lists and tensors (numpy's state was a pickled numpy array), so they load with
    torch.load(weights_only=True) and torch's own allow-list, and resume every generator exactly."""
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    path = _save(CheckpointManager(tmp_path, rank=0, keep_last=2), 1)
    expected = (random.random(), float(np.random.randn()), float(torch.rand(1)))
    state = torch.load(path / "rng" / "rank_00000.pt", weights_only=True)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(state)
    assert (random.random(), float(np.random.randn()), float(torch.rand(1))) == expected


# A stand-in for a payload: pickle calls this while loading when the loader allows arbitrary globals.
def _write_file(path):
    Path(path).write_text("code ran")


class _Forged:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (_write_file, (self.path,))


@pytest.mark.parametrize("forged_file", ["trainer_state.pt", "rng/rank_00000.pt"])
def test_a_forged_checkpoint_file_is_refused_without_running_its_code(tmp_path, forged_file):
    mgr = CheckpointManager(tmp_path / "ckpt", rank=0, keep_last=2)
    path = _save(mgr, 2)
    ran = tmp_path / "ran.txt"
    torch.save({"step": 2, "sampler": {"pos": 2}, "payload": _Forged(ran)}, path / forged_file)
    with pytest.raises(CheckpointLoadError) as e:
        mgr.read_state(path)
    assert not ran.exists()
    msg = str(e.value)
    assert str(path / forged_file) in msg and "_write_file" in msg
    assert "only tensors and plain Python values" in msg and "trusted source" in msg


def test_state_a_safe_load_could_not_read_is_refused_at_save(tmp_path):
    """A numpy value in the trainer state would make the checkpoint unloadable: the save says where it is."""
    mgr = CheckpointManager(tmp_path, rank=0, keep_last=2)
    state = {"step": 1, "tracker": {"last": {"u1": [np.float64(0.5), True, 1, 1]}}}
    with pytest.raises(TypeError, match=r"trainer_state\['tracker'\]\['last'\]\['u1'\]\[0\]: numpy.float64"):
        mgr.save(1, save_policy=lambda d: d.mkdir(), trainer_state=state, config_yaml="a: 1\n")
    assert list_complete(tmp_path) == []


def test_cuda_rng_states_go_through_a_safe_checkpoint(tmp_path, monkeypatch, no_extra_safe_globals):
    """With CUDA (mocked): every GPU's generator state is saved as a CPU tensor, loads with weights_only=True and is
    handed back to torch.cuda.set_rng_state_all unchanged."""
    gpu_states = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in gpu_states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    path = _save(CheckpointManager(tmp_path, rank=0, keep_last=2), 1)
    state = torch.load(path / "rng" / "rank_00000.pt", weights_only=True)
    restore_rng_state(state)
    assert [s.device.type for s in state["cuda"]] == ["cpu", "cpu"]
    assert all(torch.equal(a, b) for a, b in zip(restored, gpu_states, strict=True))


def test_rng_states_of_earlier_checkpoints_still_restore():
    """Checkpoints written before the plain form hold numpy's own state tuple (a numpy array inside)."""
    np.random.seed(5)
    legacy = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    expected = float(np.random.rand())
    np.random.seed(6)
    restore_rng_state(legacy)
    assert float(np.random.rand()) == expected

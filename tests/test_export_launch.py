"""`mcpo export`'s launch rule: one rank per GPU at the checkpoint's TP x PP. Under a launcher the world size must
be TP x PP; a single process starts TP x PP ranks itself, and only where as many GPUs are visible (CUDA mocked),
passing its options on; every rank exits with the parity verdict's code. No process group is started: the
command's launch decision and its verdict are all that runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mcpo_megatron import cli
from mcpo_megatron.config import load_config, to_yaml

REPO = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def fake_checkpoint(root: Path, tp: int, pp: int = 1) -> Path:
    """A complete step_N directory holding only what the launch decision reads: its config.yaml."""
    step = root / "checkpoints" / "step_000003"
    step.mkdir(parents=True)
    layout = [f"parallelism.tensor_model_parallel_size={tp}", f"parallelism.pipeline_model_parallel_size={pp}"]
    cfg = load_config(str(REPO / "configs/cpu_smollm2_arith.yaml"), layout)
    (step / "config.yaml").write_text(to_yaml(cfg))
    (step / "COMPLETE").write_text(json.dumps({"step": 3}))
    return step.parent


@pytest.fixture
def launch(monkeypatch):
    """No launcher variables; records a self-launch under torchrun and stops at the process-group start."""
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    calls = {"torchrun": [], "init": []}
    from mcpo_megatron.parallel import distributed

    def fake_torchrun(argv, nproc):
        calls["torchrun"].append((argv, nproc))
        return 0

    def fake_init(tp, pp, **kw):
        calls["init"].append((tp, pp))
        raise RuntimeError("stop: the export would start its ranks here")

    monkeypatch.setattr(distributed, "run_under_torchrun", fake_torchrun)
    monkeypatch.setattr(distributed, "init_distributed", fake_init)
    return calls


def mock_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def export(ckpt: Path, out: Path, *extra: str) -> int:
    return cli.main(["export", "--checkpoint", str(ckpt), "--out", str(out), *extra])


def test_launch_with_the_wrong_world_size_is_refused(tmp_path, monkeypatch, launch, capsys):
    ckpt = fake_checkpoint(tmp_path, tp=2)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert export(ckpt, tmp_path / "hf") == 1
    err = capsys.readouterr().err
    assert ("was trained at TP=2 x PP=1: `mcpo export` runs on 2 ranks, one per GPU, but this launch has 4; launch 2 "
            "ranks") in err
    assert launch == {"torchrun": [], "init": []}


def test_launch_with_tp_x_pp_ranks_runs_the_export(tmp_path, monkeypatch, launch):
    ckpt = fake_checkpoint(tmp_path, tp=2, pp=2)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="stop: the export would start its ranks here"):
        export(ckpt, tmp_path / "hf")
    assert launch == {"torchrun": [], "init": [(2, 2)]}


def test_one_process_starts_its_ranks_only_where_the_gpus_are(tmp_path, monkeypatch, launch, capsys):
    """One process (no launcher, or srun's single task) on one GPU: TP=2 ranks would share cuda:0 (NCCL refuses
    "Duplicate GPU detected"), so the command refuses before starting them; with 8 GPUs it starts torchrun."""
    ckpt = fake_checkpoint(tmp_path, tp=2)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    mock_gpus(monkeypatch, 1)
    assert export(ckpt, tmp_path / "hf") == 1
    err = capsys.readouterr().err
    assert "runs on 2 ranks, one per GPU, but this process sees 1 GPU(s)" in err
    assert launch == {"torchrun": [], "init": []}

    mock_gpus(monkeypatch, 8)
    assert export(ckpt, tmp_path / "hf") == 0
    assert [n for _, n in launch["torchrun"]] == [2] and launch["init"] == []
    mock_gpus(monkeypatch, 0)  # CPU: gloo ranks need no device of their own
    assert export(ckpt, tmp_path / "hf") == 0
    assert [n for _, n in launch["torchrun"]] == [2, 2]


def test_print_ranks_sizes_a_job_step(tmp_path, launch, capsys):
    ckpt = fake_checkpoint(tmp_path, tp=8)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("an earlier export")  # --print-ranks writes nothing, so checks no --out
    assert export(ckpt, tmp_path / "hf", "--print-ranks") == 0
    assert capsys.readouterr().out.strip() == "8"
    assert launch == {"torchrun": [], "init": []}


def test_options_reach_the_ranks_it_starts(tmp_path, monkeypatch, launch):
    ckpt = fake_checkpoint(tmp_path, tp=2)
    mock_gpus(monkeypatch, 2)
    assert export(ckpt, tmp_path / "hf", "--dtype", "bf16", "--tol", "1e-3", "--no-parity") == 0
    (argv, nproc), = launch["torchrun"]
    assert nproc == 2 and argv == ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), "--dtype",
                                   "bf16", "--tol", "0.001", "--no-parity"]


def test_every_rank_exits_with_the_verdicts_code(tmp_path, capsys):
    from mcpo_megatron.commands.export import report_parity

    out = tmp_path / "hf"
    for quiet in (False, True):  # rank 0 prints the verdict, the other ranks only return its code
        assert report_parity(3e-6, 1e-4, out, quiet=quiet) == 0
        assert report_parity(0.2, 1e-4, out, quiet=quiet) == 1
        assert report_parity(float("nan"), 1e-4, out, quiet=quiet) == 1
        assert report_parity(None, 1e-4, out, quiet=quiet) == 0  # --no-parity
    printed = capsys.readouterr()
    assert "= 3.000e-06 (fp32 on both sides, tolerance 0.0001)" in printed.out
    assert "error: exported model does not reproduce the checkpoint (max diff 2.000e-01 > 0.0001)" in printed.err
    assert "parity check skipped (--no-parity)" in printed.out

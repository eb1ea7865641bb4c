"""The job steps export.sbatch and eval.sbatch start, without a cluster: the script runs under bash with the
variables sbatch would set from its `#SBATCH` header and command line, and a fake `srun` that records its
arguments. (test_sbatch.py submits the scripts to a real cluster.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$SRUN_ARGS_FILE"
"""


def sbatch_options(script: str, sbatch_args: list[str]) -> dict[str, str]:
    """The script's `#SBATCH --key=value` lines, overridden by ``sbatch_args`` as sbatch does."""
    header = re.findall(r"^#SBATCH (--[\w-]+)=?(\S*)", (REPO / "slurm" / script).read_text(), re.MULTILINE)
    opts = dict(header)
    opts.update(arg.split("=", 1) for arg in sbatch_args)
    return opts


def run_batch_script(tmp_path: Path, script: str, sbatch_args: list[str], args: list[str]):
    """(exit code, srun's arguments or None when it was not called, the script's stderr)."""
    opts = sbatch_options(script, sbatch_args)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    record = tmp_path / "srun_args"
    record.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("GPUS_PER_NODE", "RANK",
                                                                                         "WORLD_SIZE")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SRUN_ARGS_FILE=str(record), MCPO_REPO=str(REPO), MCPO_VENV="none",
               MCPO_PYTHON=sys.executable, MASTER_ADDR="127.0.0.1", SLURM_JOB_ID="77",
               SLURM_JOB_NUM_NODES=opts.get("--nodes", "1"), SLURM_NTASKS_PER_NODE=opts.get("--ntasks-per-node", "1"),
               SLURM_GPUS_ON_NODE=opts.get("--gpus-per-node", "0"), SLURM_JOB_NODELIST="localhost")
    proc = subprocess.run(["bash", str(REPO / "slurm" / script), *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    srun = record.read_text().splitlines() if record.is_file() else None
    return proc.returncode, srun, proc.stderr


def step_shape(srun: list[str]) -> tuple[str, str, str]:
    """(--nodes, --ntasks-per-node, --ntasks) of an srun command line."""
    opts = dict(a.split("=", 1) for a in srun if a.startswith("--") and "=" in a)
    return opts["--nodes"], opts["--ntasks-per-node"], opts["--ntasks"]


def checkpoint(root: Path, tp: int, pp: int = 1) -> Path:
    from mcpo_megatron.config import load_config, to_yaml

    step = root / f"tp{tp}pp{pp}" / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    layout = [f"parallelism.tensor_model_parallel_size={tp}", f"parallelism.pipeline_model_parallel_size={pp}"]
    cfg = load_config(str(REPO / "configs/cpu_smollm2_arith.yaml"), layout)
    (step / "config.yaml").write_text(to_yaml(cfg))
    (step / "COMPLETE").write_text(json.dumps({"step": 4}))
    return step.parent


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {layout: checkpoint(root, *layout) for layout in ((8, 1), (2, 1), (4, 2))}


@pytest.mark.parametrize("sbatch_args,layout,want", [
    ([], (8, 1), ("1", "8", "8")),                                   # the 32B recipe: one node, a rank per GPU
    ([], (2, 1), ("1", "2", "2")),                                   # 8B: 2 ranks on the node's 8 GPUs
    (["--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4"], (4, 2), ("2", "4", "8")),
])
def test_export_step_has_a_rank_per_gpu_of_the_checkpoint_layout(tmp_path, checkpoints, sbatch_args, layout, want):
    ckpt = checkpoints[layout]
    rc, srun, err = run_batch_script(tmp_path, "export.sbatch", sbatch_args, ["--checkpoint", str(ckpt), "--out",
                                                                              str(tmp_path / "hf")])
    assert rc == 0, err
    assert step_shape(srun) == want, srun
    assert srun[-8:] == [str(REPO / "slurm" / "task.sh"), "-m", "mcpo_megatron.cli", "export", "--checkpoint",
                         str(ckpt), "--out", str(tmp_path / "hf")]
    tp, pp = layout
    assert f"trained at TP={tp} x PP={pp}: the export runs {tp * pp} rank(s), one per GPU" in err


@pytest.mark.parametrize("sbatch_args,message", [
    (["--ntasks-per-node=4", "--gpus-per-node=4"],
     "the export's 8 ranks need 2 node(s) of 4 GPUs and this job has 1; submit with --nodes=2"),
    (["--nodes=3", "--ntasks-per-node=3", "--gpus-per-node=3"],
     "the export's 8 ranks do not divide evenly over 3 node(s); submit with --ntasks-per-node and --gpus-per-node set "
     "to a divisor of 8"),
])
def test_export_step_the_job_cannot_hold_is_refused(tmp_path, checkpoints, sbatch_args, message):
    rc, srun, err = run_batch_script(tmp_path, "export.sbatch", sbatch_args,
                                     ["--checkpoint", str(checkpoints[(8, 1)]), "--out", str(tmp_path / "hf")])
    assert rc == 1 and srun is None
    assert "trained at TP=8 x PP=1: the export runs 8 rank(s), one per GPU" in err
    assert message in err


def test_export_step_of_a_missing_checkpoint_fails_before_srun(tmp_path):
    rc, srun, err = run_batch_script(tmp_path, "export.sbatch", [], ["--checkpoint", str(tmp_path / "none"), "--out",
                                                                     str(tmp_path / "hf")])
    assert rc == 1 and srun is None
    assert "is neither a complete checkpoint" in err


@pytest.mark.parametrize("sbatch_args", [[], ["--ntasks-per-node=8"], ["--nodes=2"]])
def test_eval_step_is_one_process_seeing_the_node_gpus(tmp_path, sbatch_args):
    """`mcpo eval` is one process whose engine spans the GPUs it needs: one task on one node, however the job
    was sized, with the arguments unchanged."""
    args = ["--model", "runs/x/hf", "--benchmarks", "aime_2024", "--k", "8"]
    rc, srun, err = run_batch_script(tmp_path, "eval.sbatch", sbatch_args, args)
    assert rc == 0, err
    assert step_shape(srun) == ("1", "1", "1"), srun
    assert srun[-len(args) - 4:] == [str(REPO / "slurm" / "task.sh"), "-m", "mcpo_megatron.cli", "eval", *args]

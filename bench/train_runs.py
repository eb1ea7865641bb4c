"""One training run of ``mcpo_megatron.cli train`` on two local processes, for the benchmarks that compare
whole-run configurations (bench_async, bench_partial): its log beside its run directory, its metrics read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_metrics(label: str, train_args: list[str], out: Path, nproc: int = 2) -> list[dict]:
    """Run ``train`` with ``train_args`` into ``out`` (one thread per process, so that ``nproc`` processes share
    the machine evenly) and return every step's metrics record; exit naming the log when the run fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "mcpo_megatron.cli", "train", *train_args, f"trainer.output_dir={out}", "trainer.resume=never",
           "trainer.overwrite=true"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    print(f"--- {label}: {' '.join(cmd[4:])}", flush=True)
    with open(f"{out}.log", "w") as log:
        rc = subprocess.call(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"{label} failed (exit {rc}); see {out}.log")
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]

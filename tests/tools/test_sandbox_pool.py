"""The local sandbox's pool: its arguments, its zygote's startup failures and death, a pool that hangs, callers on
several threads, closing, and the processes a trainer leaves when it exits or is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from mcpo_megatron.helper_processes import UNGUARDED_MAIN_EXIT
from mcpo_megatron.tools import CallLimits, LocalSandbox, SandboxError
from mcpo_megatron.tools.local import KILL_GRACE_S

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("make,message", [
    (lambda: LocalSandbox(workers=0), "LocalSandbox: workers=0 is invalid: must be an int >= 1"),
    (lambda: CallLimits(timeout_s=float("inf")),
     "CallLimits: timeout_s=inf is invalid: must be a finite number > 0 of seconds"),
    (lambda: CallLimits(cpu_s=0), "CallLimits: cpu_s=0 is invalid: must be a finite number > 0 of seconds"),
    (lambda: CallLimits(memory_mb=100), "CallLimits: memory_mb=100 is invalid: must be 0 \\(no cap\\) or >= 256"),
    (lambda: CallLimits(max_processes=0), "CallLimits: max_processes=0 is invalid: must be an int >= 1"),
    (lambda: CallLimits(max_output_bytes=0), "CallLimits: max_output_bytes=0 is invalid: must be an int >= 1"),
    (lambda: CallLimits(disk_mb=0), "CallLimits: disk_mb=0 is invalid: must be an int >= 1"),
    (lambda: LocalSandbox(isolation="docker"),
     "LocalSandbox: isolation='docker' is invalid: must be one of \\('auto', 'namespaces', 'plain'\\)"),
], ids=["workers", "timeout_s", "cpu_s", "memory_mb", "max_processes", "max_output_bytes", "disk_mb", "isolation"])
def test_arguments_are_checked_before_any_process_starts(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_zygote_that_cannot_start_says_why(tmp_path, monkeypatch):
    with pytest.raises(SandboxError, match="preload: the module 'no_such_module_xyz' cannot be imported in the "
                                           "sandbox \\(ModuleNotFoundError: No module named 'no_such_module_xyz'\\)"):
        LocalSandbox(preload=("no_such_module_xyz",))
    # a module that maps 300 MiB of address space when imported (found on this process's sys.path)
    (tmp_path / "big_on_import.py").write_text("import mmap\nKEPT = mmap.mmap(-1, 300 << 20)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SandboxError, match="memory_mb=256 leaves a call no room: the zygote takes 3[0-9][0-9] MiB "
                                           "of address space with its imports \\(preload: big_on_import\\); give "
                                           "at least [0-9]+, or 0 for no cap"):
        LocalSandbox(limits=CallLimits(memory_mb=256), preload=("big_on_import",))


def test_a_dead_zygote_is_replaced_and_its_calls_return_unavailable():
    with LocalSandbox(workers=2, limits=CallLimits(timeout_s=30), preload=()) as box:
        first = box._zygote.pid
        running = box.submit("import time\nprint('started', flush=True)\ntime.sleep(600)")
        deadline = time.monotonic() + 20
        while not psutil.Process(first).children() and time.monotonic() < deadline:
            time.sleep(0.02)
        calls = psutil.Process(first).children(recursive=True)
        os.kill(first, signal.SIGKILL)
        result = running.result(timeout=20)
        assert result.status == "unavailable"
        assert result.text.endswith("The sandbox could not run the code: its process pool stopped.")
        assert all(_gone(p.pid) for p in calls)  # the dead zygote's call was killed with it
        after = box.run("print('again')")
        assert (after.status, after.text) == ("ok", "again\n")
        assert box._zygote.pid != first


def test_a_hung_zygote_does_not_hold_the_caller():
    """A zygote that stops answering (here: SIGSTOP) cannot start the call: the call still returns at its
    deadline plus the kill's grace, and the call the zygote starts once it resumes is killed at once."""
    with LocalSandbox(workers=1, limits=CallLimits(timeout_s=1.0), preload=()) as box:
        zygote = box._zygote.pid
        os.kill(zygote, signal.SIGSTOP)
        try:
            start = time.monotonic()
            result = box.run("import time\ntime.sleep(600)")
            elapsed = time.monotonic() - start
        finally:
            os.kill(zygote, signal.SIGCONT)
        assert result.status == "timeout" and 1.0 + KILL_GRACE_S <= elapsed < 1.0 + KILL_GRACE_S + 3
        after = box.run("print('on')")
        assert (after.status, after.text) == ("ok", "on\n")
        deadline = time.monotonic() + 10
        while psutil.Process(zygote).children(recursive=True) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert psutil.Process(zygote).children(recursive=True) == []  # the late sleeper was killed


def test_callers_on_several_threads():
    with LocalSandbox(workers=2, limits=CallLimits(timeout_s=30), preload=()) as box:
        results = {}

        def caller(t):
            results[t] = [f.result(timeout=60) for f in [box.submit(f"print({t} * 100 + {i})") for i in range(5)]]

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert {t: [(r.status, r.text) for r in rs] for t, rs in results.items()} == {
            t: [("ok", f"{t * 100 + i}\n") for i in range(5)] for t in range(4)}


def test_close_leaves_nothing():
    box = LocalSandbox(workers=1, limits=CallLimits(timeout_s=30), preload=())
    zygote, base = box._zygote.pid, box._base
    pending = box.submit("import time\ntime.sleep(600)")
    time.sleep(0.5)
    calls = psutil.Process(zygote).children(recursive=True)
    box.close()
    box.close()  # idempotent
    assert pending.result(timeout=1).status == "unavailable"
    assert _gone(zygote) and all(_gone(p.pid) for p in calls) and not os.path.exists(base)
    with pytest.raises(RuntimeError, match="after close"):
        box.submit("print(1)")


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


def test_a_sandbox_left_open_does_not_hold_up_the_exit():
    proc = subprocess.run(_script("""
        from mcpo_megatron.tools import LocalSandbox
        box = LocalSandbox(workers=1, preload=())
        box.submit("import time; time.sleep(600)")
        print(box._zygote.pid, flush=True)
    """), capture_output=True, text=True, timeout=60, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    assert _gone(int(proc.stdout.split()[0]), within_s=5)


def test_the_zygote_and_its_calls_end_when_the_trainer_is_killed():
    trainer = subprocess.Popen(_script("""
        import time
        from mcpo_megatron.tools import LocalSandbox
        box = LocalSandbox(workers=1, preload=())
        box.submit("import time; time.sleep(600)")
        time.sleep(1)
        print(box._zygote.pid, flush=True)
        time.sleep(600)
    """), stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        zygote = int(trainer.stdout.readline())
        calls = psutil.Process(zygote).children(recursive=True)
        assert calls  # the sleeping call's supervisor and runner
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        assert _gone(zygote) and all(_gone(p.pid) for p in calls)
    finally:
        trainer.kill()


def _another_interpreter() -> str | None:
    """A Python of this one's version outside this environment, that does not see its packages by itself."""
    import shutil

    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
        for found in {shutil.which(name, path=d) for d in ("/usr/bin", "/usr/local/bin")} - {None}:
            probe = subprocess.run([found, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                   text=True)
            if probe.stdout.strip() == str(tuple(sys.version_info[:2])) and \
                    os.path.realpath(found) != os.path.realpath(sys.executable):
                return found
    return None


def test_a_trainer_whose_packages_come_from_pythonpath():
    """The zygote is started isolated from the environment (-I), so it is given this process's sys.path before
    its first import: a trainer that finds its packages through PYTHONPATH has a zygote that finds them too."""
    import sysconfig

    interpreter = _another_interpreter()
    if interpreter is None:
        pytest.skip("no Python of this version outside this environment to run a trainer with PYTHONPATH")
    packages = sysconfig.get_paths()["purelib"]
    proc = subprocess.run([interpreter, "-c", "from mcpo_megatron.tools import LocalSandbox\n"
                                              "with LocalSandbox(workers=1, preload=()) as box:\n"
                                              "    print(box.run('print(6 * 7)').text, end='')"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, packages])))
    assert (proc.returncode, proc.stdout) == (0, "42\n"), proc.stderr[-2000:]


UNPRIVILEGED = """
import json, os, sys
from mcpo_megatron.tools import CallLimits, LocalSandbox
with LocalSandbox(workers=1, limits=CallLimits(timeout_s=10, max_processes=8), preload=()) as box:
    results = [box.run(code) for code in sys.argv[1:]]
print(json.dumps({"uid": os.getuid(), "layers": box.isolation["layers"],
                  "results": [(r.status, r.text) for r in results]}))
"""


def test_an_unprivileged_user_gets_the_same_confinement():
    """A cluster user is not root: as uid 65534 (nobody) the trainer's calls get the namespaces through a user
    namespace, and the process watchdog stops a fork bomb (RLIMIT_NPROC, which root ignores, is not relied on)."""
    import json
    import shutil
    import sysconfig

    interpreter, setpriv = _another_interpreter(), shutil.which("setpriv")
    if os.geteuid() != 0 or interpreter is None or setpriv is None:
        pytest.skip("needs root (to run the trainer as nobody), setpriv and a Python readable by nobody")
    codes = ["import os\nprint(os.getuid())",
             "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
             "open('/tmp/x', 'w')"]
    proc = subprocess.run([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", interpreter, "-c",
                           UNPRIVILEGED, *codes], capture_output=True, text=True, timeout=120, cwd="/",
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, sysconfig.get_paths()["purelib"]])))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["uid"] == 65534
    if not report["layers"]["namespaces"]:
        pytest.skip(f"the kernel gives an unprivileged user no user namespace here: {report}")
    assert report["layers"] == {"namespaces": True, "user_namespace": True, "filesystem": True,
                                "private_proc": True}
    (uid, bomb, write) = report["results"]
    assert uid == ["ok", "0\n"]  # root of its own user namespace, nobody outside it
    assert bomb == ["killed", "Stopped: the code ran more than 8 processes at once."]
    assert write[0] == "refused" and "SandboxRefusal: the sandbox refuses writing outside" in write[1]


def test_a_script_without_main_guard_gets_a_clear_error(tmp_path):
    """A spawned child of a script that creates a sandbox on import exits at once, saying why, instead of
    starting a zygote of its own."""
    script = tmp_path / "unguarded.py"
    script.write_text("import multiprocessing as mp\nfrom mcpo_megatron.tools import LocalSandbox\n"
                      "box = LocalSandbox(workers=1, preload=())\n"
                      "child = mp.get_context('spawn').Process(target=print)\nchild.start()\nchild.join()\n"
                      "print('child exit code', child.exitcode)\nbox.close()\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=REPO))
    assert f"child exit code {UNGUARDED_MAIN_EXIT}" in proc.stdout, proc.stderr
    assert ("error: a sandbox cannot start in this process: this process was started with multiprocessing's "
            f"'spawn' method, which re-imports the main script ({script}) in every worker, and that script "
            "creates a LocalSandbox (or trains) when it is imported. Put the code that runs tools or trains under "
            f"`if __name__ == \"__main__\":` in {script}") in proc.stderr

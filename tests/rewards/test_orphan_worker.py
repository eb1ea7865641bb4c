"""A reward worker whose parent is killed outright exits by itself instead of lingering."""

import os
import signal
import subprocess
import sys
import time

PARENT = """
import os, sys, time
from mcpo_megatron.rewards import MathVerifyScorer
s = MathVerifyScorer(num_workers=1, timeout_s=5.0, spare=False)
s.wait_ready()
holder = os.fork()  # a forked helper keeps a copy of the pipe ends, as a checkpoint writer process may
if holder == 0:
    time.sleep(120)
    os._exit(0)
print(holder, " ".join(str(w.proc.pid) for w in s._workers), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split()[2] != "Z"


def test_worker_exits_when_parent_is_sigkilled():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        holder, *pids = [int(x) for x in parent.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.time() + 30
        while time.time() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        parent.kill()
        try:
            os.kill(holder, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass

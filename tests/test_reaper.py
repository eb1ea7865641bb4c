"""The reaper kills what a dead rank left behind and nothing else.

Under srun every task of a node joins task 0's process group, so when rank 0 finishes first its reaper must
not signal that group: rank 1 is still saving or shutting down there (a killpg did exactly that, and srun
reported "task 1: Killed"). Here a fake rank 0 leads a group, a fake rank 1 (not its descendant) joins it, and
rank 0 exits leaving a helper; the helper must die, rank 1 must live. (The end-to-end run with a SIGKILLed rank
is tests/trainer/test_no_leftovers.py.)
"""

import subprocess
import sys
import time

import psutil
import pytest

RANK0 = """
import subprocess, sys, time
from mcpo_megatron.reaper import start_reaper
start_reaper(interval_s=0.05)
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(helper.pid, flush=True)
time.sleep(float(sys.argv[1]))   # 0: exits before the reaper ever looks, so the helper is never noted
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _reaper_running(rank_pid: int) -> bool:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "mcpo_megatron.reaper" in cmd and str(rank_pid) in cmd:
            return True
    return False


@pytest.mark.parametrize("linger_s", [1.0, 0.0], ids=["helper-noted", "helper-never-noted"])
def test_rank0_exit_kills_its_helper_not_the_other_rank(linger_s):
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, str(linger_s)], stdout=subprocess.PIPE, text=True,
                             process_group=0)  # leads its group, as slurmstepd's task 0
    rank1 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=rank0.pid)
    try:
        helper = int(rank0.stdout.readline())
        time.sleep(1.5)  # rank 0 stays an unreaped zombie meanwhile (as under a launcher that reaps late)
        assert rank0.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while _alive(helper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(helper), "the dead rank's helper survived"
        while _reaper_running(rank0.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _reaper_running(rank0.pid)
        assert rank1.poll() is None, f"the other rank was killed (exit {rank1.returncode})"
    finally:
        rank1.kill()
        try:
            psutil.Process(helper).kill()
        except (psutil.Error, NameError):
            pass

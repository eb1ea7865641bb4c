"""The start-up clock: each phase gets the seconds since the previous mark, the first since the process began."""

import time

import pytest

from mcpo_megatron.trainer import startup
from mcpo_megatron.trainer.startup import StartupClock


class _Process:
    def create_time(self):
        return 990.0  # 10 s before the clock's creation (time.time() is 1000)


def test_phases_from_the_process_start(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(startup.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(startup.time, "time", lambda: 1000.0)
    monkeypatch.setattr(startup.psutil, "Process", _Process)
    clock = StartupClock()
    now[0] = 101.0
    clock.mark("imports")
    now[0] = 103.5
    clock.mark("process groups")
    now[0] = 104.0
    clock.mark("imports")  # a phase that ends twice adds up
    assert clock.seconds == {"imports": 11.5, "process groups": 2.5}
    assert clock.total() == 14.0
    assert clock.line() == "start-up 14.0 s: imports 11.5 | process groups 2.5"
    assert clock.metrics() == {"time/startup/imports": 11.5, "time/startup/process_groups": 2.5,
                               "time/startup": 14.0}


def test_the_first_phase_holds_this_process_life_so_far():
    import psutil

    lived = time.time() - psutil.Process().create_time()
    clock = StartupClock()
    clock.mark("imports")
    assert clock.seconds["imports"] == pytest.approx(lived, abs=0.5)
    assert lived > 0.1  # a pytest process has imported for longer than that

"""Preemption signals: what StopRequest does with them, and the lead-time warning."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from mcpo_megatron.trainer.preemption import StopRequest, lead_time_warning, signal_lead_s


def _run_signalled(enabled: bool, sig: signal.Signals) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import os, signal, time
        from mcpo_megatron.trainer.preemption import StopRequest
        stop = StopRequest(enabled={enabled})
        os.kill(os.getpid(), signal.{sig.name})
        time.sleep(0.2)
        print("still running; requested:", stop.requested(), stop.signal_name, flush=True)
        stop.close()
        print("default handler back:", signal.getsignal(signal.{sig.name}) == signal.SIG_DFL, flush=True)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_signals_are_caught_only_with_save_on_signal():
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        caught = _run_signalled(True, sig)
        assert caught.returncode == 0, caught.stderr
        assert f"still running; requested: True {sig.name}" in caught.stdout
        assert "default handler back: True" in caught.stdout  # close() restores the previous handler
        # checkpoint.save_on_signal=false: the signal keeps its default action and ends the process.
        ended = _run_signalled(False, sig)
        assert ended.returncode == -sig, (ended.returncode, ended.stdout)
        assert "still running" not in ended.stdout


def test_agreed_is_false_without_handlers():
    stop = StopRequest(enabled=False)
    assert not stop.requested() and not stop.agreed()


def test_lead_time_from_the_launcher_and_the_warning():
    assert signal_lead_s({"MCPO_SIGNAL_LEAD_S": "900"}) == 900.0
    assert signal_lead_s({}) is None and signal_lead_s({"MCPO_SIGNAL_LEAD_S": "soon"}) is None
    assert lead_time_warning(250.0, 300.0) is None and lead_time_warning(250.0, None) is None
    warning = lead_time_warning(1000.0, 300.0)
    assert "needs 1000 s" in warning and "the 300 s this job's signal leaves" in warning
    assert "SBATCH_SIGNAL=B:USR1@1310" in warning  # 1.25 x 1000 + 60

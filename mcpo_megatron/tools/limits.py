"""The limits of one tool call, checked when they are made (before any sandbox process starts), and how a call
that ended, by itself or at a limit, is reported to the model."""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass

from mcpo_megatron.config.sections.tools import MIN_TOOL_MEMORY_MB
from mcpo_megatron.tools import runner


def _check(name: str, value, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"CallLimits: {name}={value!r} is invalid: {rule}. Pass a value that satisfies it.")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class CallLimits:
    """What one call may use.

    timeout_s: wall-clock limit of a call from its start.
    cpu_s: CPU-time limit of each process of a call (whole seconds, rounded up); None: ``timeout_s``.
    memory_mb: address-space limit of each process of a call in MiB (0: none; else at least MIN_TOOL_MEMORY_MB
        and what the local sandbox's zygote takes with its imports plus 64).
    max_processes: processes of a call at once, its first included.
    max_output_bytes: output read from a call; past it the call is stopped and its text marked truncated.
    disk_mb: most a call may write in MiB (each file; with namespaces, its whole directory).
    """

    timeout_s: float = 10.0
    cpu_s: float | None = None
    memory_mb: int = 1024
    max_processes: int = 16
    max_output_bytes: int = 16384
    disk_mb: int = 64

    def __post_init__(self):
        cpu_s = self.timeout_s if self.cpu_s is None else self.cpu_s
        for name, value in (("timeout_s", self.timeout_s), ("cpu_s", cpu_s)):
            _check(name, value, isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
                   "must be a finite number > 0 of seconds")
        _check("memory_mb", self.memory_mb, isinstance(self.memory_mb, int) and (
            self.memory_mb == 0 or self.memory_mb >= MIN_TOOL_MEMORY_MB),
            f"must be 0 (no cap) or >= {MIN_TOOL_MEMORY_MB} (MiB of address space)")
        for name in ("max_processes", "max_output_bytes", "disk_mb"):
            _check(name, getattr(self, name), _positive_int(getattr(self, name)), "must be an int >= 1")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        object.__setattr__(self, "cpu_s", float(cpu_s))


def call_ending(stop_reason: str | None, exit_message: dict | None, limits: CallLimits) -> tuple[str, str]:
    """How a call ended: its status and the line its text ends with (or ""), from why the sandbox stopped it
    (``stop_reason``: timeout | output | lost | None) and its supervisor's exit message (None: none came)."""
    if stop_reason == "output":
        return "killed", (f"[output truncated: the code wrote more than {limits.max_output_bytes} bytes and was "
                          "stopped]")
    if stop_reason == "timeout":
        return "timeout", f"Timed out: the code ran longer than {limits.timeout_s:g} s and was stopped."
    if stop_reason == "lost":
        return "unavailable", "The sandbox could not run the code: its process pool stopped."
    report = (exit_message or {}).get("report")
    if report is None:
        return "killed", (f"Killed: the call's supervisor ended without a report (wait status "
                          f"{(exit_message or {}).get('status')}).")
    if report["setup_error"]:
        return "unavailable", ("The sandbox could not run the code: "
                               f"{report['setup_error'].strip().splitlines()[-1]}")
    if report["stopped"] == "processes":
        return "killed", f"Stopped: the code ran more than {limits.max_processes} processes at once."
    status, outcome = report["status"], report["outcome"]
    if status is None:
        return "killed", "Killed: the code's process was not seen to end."
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        # RLIMIT_CPU's SIGKILL; the CPU time the kernel reports afterwards may fall short of the limit by 1%
        cpu_limit_s = math.ceil(limits.cpu_s)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and exit_message["cpu_s"] >= 0.9 * cpu_limit_s):
            return "timeout", f"Timed out: the code used more than {cpu_limit_s} s of CPU time and was stopped."
        return "killed", f"Killed: the code's process died of signal {signal.Signals(sig).name}."
    code = os.WEXITSTATUS(status)
    if outcome is None and code == runner.SETUP_FAILED_EXIT:
        return "unavailable", "The sandbox could not run the code: its process could not be set up."
    if outcome == "ok" or (outcome is None and code == 0):
        return "ok", ""
    if outcome == "memory":
        return "memory", (f"Memory limit exceeded: the code may use {limits.memory_mb} MiB of address space."
                          if limits.memory_mb else "")
    if outcome == "refused":
        return "refused", ""
    if outcome == "exception":
        return "error", ""
    return "error", f"Exit status {code}."


def with_note(out: bytearray, note: str) -> str:
    """A call's output as text, ending with ``note`` on a line of its own."""
    text = out.decode("utf-8", errors="replace")
    if not note:
        return text
    return f"{text}\n{note}" if text and not text.endswith("\n") else text + note

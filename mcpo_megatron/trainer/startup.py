"""Where a rank's start-up goes, from its process's start to its first step, phase by phase.

The trainer marks the end of each phase (:meth:`StartupClock.mark`); the seconds since the previous mark go to that
phase. The first phase starts when the operating system created the process, so it holds the interpreter's start,
the imports and the config's validation. Rank 0 prints one line (``start-up 14.2 s: imports 6.1 | process groups
2.3 | ...``) and the first step's record carries every phase as ``time/startup/<phase>`` (``time/`` keys are
measurements: resume comparisons leave them out)."""

from __future__ import annotations

import time

import psutil


class StartupClock:
    """Seconds per start-up phase, in the order they ended."""

    def __init__(self) -> None:
        # perf_counter has no fixed origin: the process's creation is placed on it through the wall clock once.
        self._last = time.perf_counter() - max(0.0, time.time() - psutil.Process().create_time())
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """``phase`` ended now: it took the seconds since the previous mark (added to it if it ran before)."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def total(self) -> float:
        return sum(self.seconds.values())

    def line(self) -> str:
        phases = " | ".join(f"{name} {s:.1f}" for name, s in self.seconds.items())
        return f"start-up {self.total():.1f} s: {phases}"

    def metrics(self) -> dict[str, float]:
        out = {f"time/startup/{name.replace(' ', '_')}": s for name, s in self.seconds.items()}
        out["time/startup"] = self.total()
        return out

"""What every sandbox offers the episode code: submit one call, or run a batch within a bounded time.

:class:`~mcpo_megatron.tools.local.LocalSandbox` (the default, and the tested one) runs calls in killable
processes on this node; :class:`~mcpo_megatron.tools.remote.HttpSandbox` sends them to a service. Both return
every failure as a :class:`~mcpo_megatron.tools.types.ToolResult` (its text is what the model reads) and raise
only when they cannot be created.
"""

from __future__ import annotations

import abc
import math
from concurrent.futures import Future, wait
from typing import Sequence

from mcpo_megatron.tools.types import ToolResult

# What a call may take beyond its own deadline: stopping its processes and reading the rest of its output.
CALL_SLACK_S = 2.0
# What a batch may take beyond its calls: a restart of the local pool's zygote, or a retry of a request.
BATCH_SLACK_S = 10.0


class Sandbox(abc.ABC):
    """Runs Python code blocks. ``workers`` calls run at once, each within ``timeout_s`` of its own start."""

    workers: int
    timeout_s: float

    @abc.abstractmethod
    def submit(self, code: str) -> "Future[ToolResult]":
        """Queue one call; its future resolves to its result (it never raises for what the code does)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every call and free the sandbox (idempotent)."""

    def batch_budget_s(self, n: int) -> float:
        """The longest :meth:`run_batch` of ``n`` calls may take: the calls in ``ceil(n / workers)`` waves, each
        up to its deadline and the slack of stopping it, plus the batch's slack."""
        return math.ceil(n / self.workers) * (self.timeout_s + CALL_SLACK_S) + BATCH_SLACK_S

    def run_batch(self, codes: Sequence[str]) -> list[ToolResult]:
        """Run every code concurrently (``workers`` at a time); results in order. Returns within
        :meth:`batch_budget_s` whatever the code does: a call not back by then is ``unavailable``."""
        futures = [self.submit(code) for code in codes]
        budget = self.batch_budget_s(len(codes))
        wait(futures, timeout=budget)
        results = []
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is None:
                results.append(future.result())
            else:
                future.cancel()
                why = future.exception() if future.done() and not future.cancelled() else None
                text = f"The sandbox could not run the code: {why}" if why else \
                    f"The sandbox did not return this call within the batch's {budget:g} s."
                results.append(ToolResult(text=text, status="unavailable", seconds=budget))
        return results

    def run(self, code: str) -> ToolResult:
        return self.run_batch([code])[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


"""The result of one tool call and the sandbox's one exception."""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: Every status a :class:`ToolResult` can carry.
#: ``ok``: the code ran to its end (exit status 0);
#: ``error``: it raised (the text ends with the traceback) or exited with another status;
#: ``timeout``: it ran past its wall-clock deadline or its CPU time, and was stopped;
#: ``memory``: it ran out of its address space (MemoryError);
#: ``killed``: the sandbox stopped it for another limit (too many processes, too much output) or it died of a
#: signal;
#: ``refused``: it ended on an operation the sandbox refuses (network, starting programs, writing outside its
#: directory, signalling other processes);
#: ``unavailable``: the sandbox could not run it (its process pool or the remote service failed): not the code's
#: doing, so a penalty for failed calls should spare it.
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "memory", "killed", "refused", "unavailable")


@dataclass(frozen=True)
class ToolResult:
    """What one call returns to the model: ``text`` (its output, stdout and stderr in the order written, then a
    line saying why it stopped when it did not end by itself), how it ended (``status``, one of
    :data:`STATUSES`), its wall-clock ``seconds`` from its start (not its wait in the queue), and whether its
    output was cut at the byte cap (``truncated``)."""

    text: str
    status: str
    seconds: float
    truncated: bool = False

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"ToolResult: status {self.status!r} is not one of {STATUSES}")

    def to_dict(self) -> dict:
        return asdict(self)


class SandboxError(RuntimeError):
    """The sandbox cannot start (a preloaded module missing, too little memory for it, isolation required but
    unavailable). Raised when it is created, never for a call: a call's failures are results."""

"""``tools``: the Python tool a reply may call (tool-integrated reasoning): the sandbox that runs the calls
(mcpo_megatron/tools) and the episode settings (the call syntax, turns, the penalty of a failed call)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from mcpo_megatron.config.checks import Checks, at_least, choice

# The smallest address-space cap a call starts under: the sandbox's zygote (python with numpy and sympy
# imported) takes about 140 MiB, a call more; the sandbox refuses at start a cap below its zygote's size + 64 MiB.
MIN_TOOL_MEMORY_MB = 256
#: tools.isolation: auto (the kernel's namespaces where it allows them, else the plain layers with a warning),
#: namespaces (refuse to start without them), plain (rlimits, a process watchdog and an audit hook only).
ISOLATION_MODES = ("auto", "namespaces", "plain")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass
class ToolsConfig:
    enabled: bool = False
    backend: str = choice("local", "http")         # local: killable processes on this node; http: a service
    http_url: Optional[str] = None                  # backend=http: the endpoint the calls are POSTed to
    workers: int = at_least(4, 1)                   # calls that run at once
    timeout_s: float = 10.0                         # wall-clock limit of one call
    cpu_s: float = 10.0                             # CPU-time limit of each of its processes (RLIMIT_CPU)
    memory_mb: int = 1024                           # address space of each of its processes (RLIMIT_AS); 0: no cap
    max_processes: int = at_least(16, 1)            # processes of one call at once (its first included)
    max_output_bytes: int = at_least(16384, 1)      # output read from a call; the call is stopped past it
    max_output_tokens: int = at_least(1024, 1)      # a tool output's tokens appended to the episode
    disk_mb: int = at_least(64, 1)                  # most a call may write (each file; its directory's tmpfs)
    preload: list[str] = field(default_factory=lambda: ["numpy", "sympy"])  # imported once, in the zygote
    isolation: str = choice(*ISOLATION_MODES)
    format: str = choice("python_block", "chat_template")  # python_block: ```python ... ``` then ```output ... ```
    max_turns: int = at_least(8, 1)                 # tool calls of one episode, at most
    call_penalty: float = 0.0                       # subtracted from the reward of a reply per failed call

    def check(self, c: Checks) -> None:
        if self.enabled:
            self._check_use(c)
        for key, value, what in (("tools.timeout_s", self.timeout_s, "wall-clock limit of a call"),
                                 ("tools.cpu_s", self.cpu_s, "CPU-time limit of a call's process")):
            if not value > 0:
                c.error(key, value, f"must be > 0 ({what})", "use e.g. 10")
        if not (self.memory_mb == 0 or self.memory_mb >= MIN_TOOL_MEMORY_MB):
            c.error("tools.memory_mb", self.memory_mb,
                    f"must be 0 (no cap) or >= {MIN_TOOL_MEMORY_MB} (MiB of address space; python with the "
                    "preloaded modules takes about 140)", "use the default 1024")
        bad = [m for m in self.preload if not isinstance(m, str) or not _MODULE.fullmatch(m)]
        if bad:
            c.error("tools.preload", self.preload, f"must list module names; not one: {bad[0]!r}",
                    "give importable names such as numpy, sympy")
        if self.call_penalty < 0:
            c.error("tools.call_penalty", self.call_penalty, "must be >= 0 (it is subtracted from the reward)",
                    "use 0 for no penalty")

    def _check_use(self, c: Checks) -> None:
        """The rules of a run that calls the tool (the keys are inert while tools.enabled=false)."""
        if self.backend == "http" and not (self.http_url or "").startswith(("http://", "https://")):
            c.error("tools.http_url", self.http_url, "must be an http:// or https:// URL with tools.backend=http",
                    "give the sandbox service's endpoint, e.g. http://sandbox:8080/run")
        cfg = c.cfg
        if self.format == "chat_template" and not cfg.data.apply_chat_template:
            c.error("tools.format", self.format, "declares the tool and renders its outputs through the chat "
                    "template, so it needs data.apply_chat_template=true",
                    "set data.apply_chat_template=true, or tools.format=python_block")
        if self.format == "chat_template" and cfg.data.prompt_template == "python_tool":
            c.error("data.prompt_template", "python_tool", "describes the python_block call syntax; with "
                    "tools.format=chat_template the chat template declares the tool",
                    "use another data.prompt_template (e.g. boxed)")
        max_response = cfg.data.max_response_length
        if self.max_output_tokens > max_response:
            c.error("tools.max_output_tokens", self.max_output_tokens,
                    f"must be <= data.max_response_length={max_response} (a tool output is part of the response)",
                    "lower tools.max_output_tokens")

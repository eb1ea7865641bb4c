"""The Python tool of tool-integrated reasoning: a sandbox that runs a reply's code blocks and returns their
output as text, and the pure helpers of the call syntax.

``LocalSandbox`` (killable, confined processes on this node; the default) and ``HttpSandbox`` (a remote service)
share the :class:`Sandbox` interface: ``submit(code)`` and ``run_batch(codes)``, which returns
:class:`ToolResult` objects within a bounded time whatever the code does. ``from_config`` builds the one the
``tools`` config section names.
"""

from mcpo_megatron.tools.limits import CallLimits
from mcpo_megatron.tools.local import LocalSandbox
from mcpo_megatron.tools.python_block import CodeBlock, find_code_block, format_output
from mcpo_megatron.tools.remote import HttpSandbox, serve
from mcpo_megatron.tools.sandbox import Sandbox
from mcpo_megatron.tools.tokens import truncate_tokens
from mcpo_megatron.tools.types import STATUSES, SandboxError, ToolResult

__all__ = ["STATUSES", "CallLimits", "CodeBlock", "HttpSandbox", "LocalSandbox", "Sandbox", "SandboxError", "ToolResult",
           "find_code_block", "format_output", "from_config", "serve", "truncate_tokens"]


def from_config(tools) -> Sandbox:
    """The sandbox the ``tools`` config section names (a dataclass or a DictConfig of it)."""
    if tools.backend == "http":
        return HttpSandbox(tools.http_url, workers=tools.workers, timeout_s=tools.timeout_s,
                           max_output_bytes=tools.max_output_bytes)
    limits = CallLimits(timeout_s=tools.timeout_s, cpu_s=tools.cpu_s, memory_mb=tools.memory_mb,
                        max_processes=tools.max_processes, max_output_bytes=tools.max_output_bytes,
                        disk_mb=tools.disk_mb)
    return LocalSandbox(tools.workers, limits, preload=tuple(tools.preload), isolation=tools.isolation)

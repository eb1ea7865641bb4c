"""A remote sandbox: calls POSTed to a service that runs code (a cluster's own), and the reference service.

Protocol, one call per request, JSON both ways:

  request  ``{"code": str, "timeout_s": float, "max_output_bytes": int}`` (the limits the client will wait for;
           a service applies its own)
  response ``{"text": str, "status": str, "seconds": float, "truncated": bool}``, status one of
           :data:`~mcpo_megatron.tools.types.STATUSES`, seconds the call's own time (without them the result
           carries the request's round trip)

:class:`HttpSandbox` runs ``workers`` requests at once; a request that cannot connect, or gets 502/503/504, is
retried with back-off while the call's time lasts; whatever goes wrong is the call's result (``timeout`` when
the service does not answer within ``timeout_s`` plus a slack, ``unavailable`` otherwise), never an exception.
:func:`serve` is the service side over any :class:`~mcpo_megatron.tools.sandbox.Sandbox` (http.server, for a
node of its own or a test).
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mcpo_megatron.tools.sandbox import CALL_SLACK_S, Sandbox
from mcpo_megatron.tools.types import STATUSES, ToolResult

_RETRIED_HTTP = (502, 503, 504)


class HttpSandbox(Sandbox):
    """Run calls on a sandbox service at ``url`` (module docstring).

    Args:
        url: the endpoint (http:// or https://).
        workers: requests at once.
        timeout_s: the calls' wall-clock limit, sent to the service; the client waits ``timeout_s`` plus
            CALL_SLACK_S for an answer, retries included.
        max_output_bytes: the service is asked for at most this much output, and a longer text is cut here.
        retries: further attempts after a connection error or a 502/503/504.
    """

    def __init__(self, url: str, workers: int = 8, timeout_s: float = 10.0, max_output_bytes: int = 16384,
                 retries: int = 3):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpSandbox: url={url!r} is invalid: must be an http:// or https:// URL")
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"HttpSandbox: workers={workers!r} is invalid: must be an int >= 1")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"HttpSandbox: timeout_s={timeout_s!r} is invalid: must be a finite number > 0")
        self.url, self.workers, self.timeout_s = url, workers, float(timeout_s)
        self.max_output_bytes, self.retries = max_output_bytes, retries
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mcpo-tool-http")

    def submit(self, code: str) -> "Future[ToolResult]":
        return self._pool.submit(self._call, code)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _call(self, code: str) -> ToolResult:
        start = time.monotonic()
        end = start + self.timeout_s + CALL_SLACK_S
        body = json.dumps({"code": code, "timeout_s": self.timeout_s,
                           "max_output_bytes": self.max_output_bytes}).encode()
        why = "the sandbox service did not answer"
        for attempt in range(self.retries + 1):
            left = end - time.monotonic()
            if left <= 0:
                break
            request = urllib.request.Request(self.url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=left) as response:
                    return self._result(response.read(), time.monotonic() - start)
            except urllib.error.HTTPError as e:
                why = f"the sandbox service answered HTTP {e.code} {e.reason}"
                if e.code not in _RETRIED_HTTP:
                    return _unavailable(why, start)
            except OSError as e:  # URLError, a refused connection, a socket timeout
                reason = getattr(e, "reason", e)
                if isinstance(e, TimeoutError) or isinstance(reason, TimeoutError):
                    break
                why = f"the sandbox service cannot be reached ({reason})"
            time.sleep(min(0.1 * 2 ** attempt, max(0.0, end - time.monotonic())))
        else:
            return _unavailable(f"{why}, {self.retries + 1} attempts", start)
        return ToolResult(f"Timed out: the sandbox service did not answer within {self.timeout_s + CALL_SLACK_S:g} s.",
                          "timeout", round(time.monotonic() - start, 4))

    def _result(self, raw: bytes, round_trip_s: float) -> ToolResult:
        """The service's answer as a result; its ``seconds`` (the call's own time) when it gives them, else the
        request's round trip."""
        try:
            reply = json.loads(raw)
            text, status = reply["text"], reply["status"]
            if not isinstance(text, str):
                raise ValueError(f"text {type(text).__name__}")
            if status not in STATUSES:
                raise ValueError(f"status {status!r}")
        except (ValueError, KeyError, TypeError) as e:
            return ToolResult(f"The sandbox could not run the code: the service's answer is not a result ({e}).",
                              "unavailable", round(round_trip_s, 4))
        seconds = reply.get("seconds")
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            seconds = round_trip_s
        truncated = bool(reply.get("truncated", False))
        data = text.encode()
        if len(data) > self.max_output_bytes:
            text = data[:self.max_output_bytes].decode(errors="ignore") + \
                f"\n[output truncated: more than {self.max_output_bytes} bytes]"
            truncated = True
        return ToolResult(text, status, round(float(seconds), 4), truncated)


def _unavailable(why: str, start: float) -> ToolResult:
    return ToolResult(f"The sandbox could not run the code: {why}.", "unavailable", round(time.monotonic() - start, 4))


def serve(sandbox: Sandbox, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A running HTTP service of the protocol above over ``sandbox`` (its own limits apply), in a daemon thread;
    ``server.server_address`` is where it listens, ``server.shutdown()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802  http.server's name
            try:
                length = int(self.headers.get("Content-Length", 0))
                code = json.loads(self.rfile.read(length))["code"]
                if not isinstance(code, str):
                    raise TypeError("code must be a string")
            except (ValueError, KeyError, TypeError) as e:
                self.send_error(400, f"expected {{\"code\": str}}: {e}")
                return
            body = json.dumps(sandbox.run(code).to_dict()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet: a request per tool call
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="mcpo-tool-service", daemon=True).start()
    return server

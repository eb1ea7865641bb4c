"""The remote sandbox: HttpSandbox against the reference service (serve over a LocalSandbox) and against a
service that misbehaves, all on 127.0.0.1 (no network needed). Every failure is a result, never an exception."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mcpo_megatron.config import load_config
from mcpo_megatron.tools import CallLimits, HttpSandbox, LocalSandbox, from_config, serve
from mcpo_megatron.tools.sandbox import CALL_SLACK_S


@pytest.fixture(scope="module")
def service():
    local = LocalSandbox(workers=2, limits=CallLimits(timeout_s=2.0), preload=())
    server = serve(local)
    yield f"http://127.0.0.1:{server.server_address[1]}/run"
    server.shutdown()
    server.server_close()
    local.close()


def test_calls_through_the_service_are_the_local_sandboxs(service):
    with HttpSandbox(service, workers=2, timeout_s=2.0) as remote:
        ok, error, timeout = remote.run_batch(["print(6 * 7)", "1 / 0", "import time\ntime.sleep(600)"])
    assert (ok.status, ok.text, ok.truncated) == ("ok", "42\n", False)
    assert error.status == "error" and error.text.endswith("ZeroDivisionError: division by zero\n")
    assert (timeout.status, timeout.text) == ("timeout", "Timed out: the code ran longer than 2 s and was stopped.")
    assert 2.0 <= timeout.seconds < 2.0 + CALL_SLACK_S  # the call's own time, as the service measured it


class _Scripted:
    """A service whose answers the test writes: ``answers`` is a list of (HTTP status, body or None to hang)."""

    def __init__(self, answers):
        self.answers, self.requests = list(answers), []
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                scripted.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                status, body = scripted.answers.pop(0) if len(scripted.answers) > 1 else scripted.answers[0]
                if body is None:
                    time.sleep(30)
                    return
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    made = []

    def make(answers):
        made.append(_Scripted(answers))
        return made[-1]

    yield make
    for s in made:
        s.close()


GOOD = {"text": "7\n", "status": "ok", "seconds": 0.0123, "truncated": False}


def test_the_request_carries_the_code_and_limits_and_retries_on_503(scripted):
    service = scripted([(503, b"busy"), (502, b"bad gateway"), (200, GOOD)])
    result = HttpSandbox(service.url, timeout_s=2.0, max_output_bytes=100).run("print(7)")
    assert (result.status, result.text, result.seconds) == ("ok", "7\n", 0.0123)  # the service's seconds
    assert service.requests == [{"code": "print(7)", "timeout_s": 2.0, "max_output_bytes": 100}] * 3


@pytest.mark.parametrize("answer,text", [
    ((500, b"boom"), "The sandbox could not run the code: the sandbox service answered HTTP 500 Internal Server "
                     "Error."),
    ((404, b""), "The sandbox could not run the code: the sandbox service answered HTTP 404 Not Found."),
    ((200, b"not json"), "The sandbox could not run the code: the service's answer is not a result (Expecting "
                         "value: line 1 column 1 (char 0))."),
    ((200, {"text": "x", "status": "fine"}), "The sandbox could not run the code: the service's answer is not a "
                                             "result (status 'fine')."),
    ((200, {"text": 7, "status": "ok"}), "The sandbox could not run the code: the service's answer is not a result "
                                         "(text int)."),
    ((200, {"status": "ok"}), "The sandbox could not run the code: the service's answer is not a result ('text')."),
])
def test_a_bad_answer_is_unavailable_without_retries(scripted, answer, text):
    service = scripted([answer])
    result = HttpSandbox(service.url, timeout_s=2.0).run("print(1)")
    assert (result.status, result.text) == ("unavailable", text)
    assert len(service.requests) == 1


def test_a_long_text_is_cut_at_max_output_bytes(scripted):
    service = scripted([(200, dict(GOOD, text="z" * 500))])
    result = HttpSandbox(service.url, max_output_bytes=100).run("print('z' * 500)")
    assert result.status == "ok" and result.truncated
    assert result.text == "z" * 100 + "\n[output truncated: more than 100 bytes]"


def test_a_service_that_does_not_answer_is_a_timeout_within_the_bound(scripted):
    service = scripted([(200, None)])
    start = time.monotonic()
    result = HttpSandbox(service.url, timeout_s=0.5).run("print(1)")
    elapsed = time.monotonic() - start
    assert (result.status, result.text) == ("timeout", f"Timed out: the sandbox service did not answer within "
                                                       f"{0.5 + CALL_SLACK_S:g} s.")
    assert 0.5 + CALL_SLACK_S - 0.1 <= elapsed < 0.5 + CALL_SLACK_S + 1.0


def test_a_service_that_is_down_is_unavailable_after_retries():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens here once it is closed
    result = HttpSandbox(f"http://127.0.0.1:{port}/", timeout_s=5.0, retries=2).run("print(1)")
    assert result.status == "unavailable"
    assert result.text.startswith("The sandbox could not run the code: the sandbox service cannot be reached (")
    assert result.text.endswith(", 3 attempts.")


def test_the_config_names_the_backend():
    cfg = load_config(None, ["tools.backend=http", "tools.http_url=http://sandbox:8080/run", "tools.workers=3",
                             "tools.timeout_s=7", "tools.max_output_bytes=999"])
    remote = from_config(cfg.tools)
    assert isinstance(remote, HttpSandbox)
    assert (remote.url, remote.workers, remote.timeout_s, remote.max_output_bytes) == (
        "http://sandbox:8080/run", 3, 7.0, 999)
    remote.close()
    with pytest.raises(ValueError, match="HttpSandbox: url='ftp://x' is invalid: must be an http:// or https:// URL"):
        HttpSandbox("ftp://x")

"""The server against hostile or careless clients (issue 36): input that used to be a
500 with a traceback is a 400 naming its field; a local server is not exposed to web
pages (JSON bodies only, loopback or allowed Host, the request list behind the key);
429 says when to retry; a client hanging up mid-body is no error; SIGTERM during a
stream ends it with an error event and [DONE], answers the queued client 503 and
exits within 2 s."""
import http.client
import json
import signal
import socket
import threading
import time

import pytest

import spel_mlx  # noqa: F401
from bench.server_load import LiveServer
from conftest import require_or_skip, served_model_id
from test_server import KEY, PROMPT, raw_request, send_request, server_packages_missing, wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_or_skip(server_packages_missing() is None, server_packages_missing(), env="SPEL_REQUIRE_SERVER")
    srv = LiveServer("--api-key", KEY, "--no-warmup", log_dir=tmp_path_factory.mktemp("hostile"))
    yield srv
    srv.stop()


def _post_raw(server, path, text: str, headers=None):
    conn, resp = raw_request(server, path, text.encode("utf-8", "surrogatepass"), headers=headers)
    body = resp.read()
    conn.close()
    return resp.status, json.loads(body)


DEEP = 100_000
HUGE = "9" * 5000
CHAT = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '


HOSTILE = [
    ("completions", '{"prompt": ' + "[" * DEEP + "]" * DEEP + "}", "prompt"),
    ("chat/completions", '{"max_tokens": 2, "messages": ' + "[" * DEEP + "]" * DEEP + "}", "messages"),
    ("completions", '{"prompt": "x", "seed": ' + HUGE + "}", "seed"),
    ("completions", '{"prompt": "x", "max_tokens": ' + HUGE + "}", "max_tokens"),
    ("completions", '{"prompt": "x", "max_tokens": -' + HUGE + "}", "max_tokens"),
    ("completions", '{"prompt": "x", "temperature": ' + "9" * 4000 + "}", "temperature"),
    ("completions", '{"prompt": "x", "top_p": ' + "9" * 400 + "}", "top_p"),
    ("completions", '{"prompt": "x", "repetition_penalty": ' + "9" * 400 + "}", "repetition_penalty"),
    ("completions", '{"prompt": "x", "temperature": 1e999}', "temperature"),
    ("completions", '{"prompt": "x", "top_p": NaN}', "top_p"),
    ("completions", '{"prompt": "x", "top_k": ' + "9" * 30 + "}", "top_k"),
    ("completions", '{"prompt": "a\\ud800b"}', "prompt"),
    ("completions", '{"prompt": ["a\\udfffb"]}', "prompt"),
    ("completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
    ("chat/completions", CHAT[:1] + '"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages[0].content"),
    ("chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages[0].content"),
    ("chat/completions", '{"messages": [{"role": ["user"], "content": "hi"}]}', "messages[0].role"),
    ("chat/completions", '{"messages": [{"role": {"user": 1}, "content": "hi"}]}', "messages[0].role"),
    ("chat/completions", '{"messages": [{"role": "user", "content": {"text": "hi"}}]}', "messages[0].content"),
    ("chat/completions", '{"messages": [{"content": "hi"}]}', "messages[0].role"),
    ("chat/completions", '{"messages": []}', "messages"),
    ("chat/completions", CHAT + '"top_logprobs": 99, "logprobs": true}', "top_logprobs"),
    ("completions", '{"prompt": "x", "logprobs": 6}', "logprobs"),
    ("completions", '{"prompt": "x", "stream_options": {"include_usage": "yes"}}', "stream_options.include_usage"),
    ("completions", '{"prompt": [1, 2.5]}', "prompt"),
    ("completions", '{"prompt": [true]}', "prompt"),
    ("completions", '{"prompt": "x", "temperature": "0.5"}', "temperature"),
    ("completions", '{"prompt": "x", "max_tokens": 1.0}', "max_tokens"),
    ("completions", '{"prompt": "x", "stream": 1}', "stream"),
]


@pytest.mark.parametrize("path,text,param", HOSTILE, ids=[f"{i}-{c[2]}" for i, c in enumerate(HOSTILE)])
def test_hostile_input_is_400_naming_the_field(server, path, text, param):
    status, body = _post_raw(server, "/v1/" + path, text)
    assert status == 400 and body["error"]["param"] == param, body
    assert body["error"]["message"].startswith(param + ":") and len(body["error"]["message"]) < 300
    assert server.alive()


def test_no_traceback_in_the_log(server):
    """After every hostile request above (the module's server), the log has no traceback."""
    _post_raw(server, "/v1/completions", '{"prompt": "x", "seed": ' + HUGE + "}")
    log = server.log()
    assert "Traceback" not in log and "unexpected error" not in log


def test_json_content_type_required(server):
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        status, body = _post_raw(server, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}),
                                 headers={"Content-Type": ctype})
        assert status == 415 and body["error"]["code"] == "unsupported_media_type", ctype
    status, _ = _post_raw(server, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}),
                          headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert status == 200


def _get(server, path, headers):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def test_only_loopback_hosts(server):
    """A page on a rebound name (DNS rebinding) reaches the server with its own name in Host."""
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.nip.io", "192.168.1.10", "[2001:db8::1]:80"):
        for path in ("/", "/health", "/v1/models"):
            status, body = _get(server, path, {"Host": host, "Authorization": f"Bearer {KEY}"})
            assert status == 403 and json.loads(body)["error"]["code"] == "host_not_allowed", (host, path)
        status, body = _post_raw(server, "/v1/completions", json.dumps({"prompt": "x"}), headers={"Host": host})
        assert status == 403, host
    for host in ("localhost", f"localhost:{server.port}", "127.0.0.1", "127.0.0.2:80", "[::1]:8080",
                 "app.localhost"):
        assert _get(server, "/health", {"Host": host})[0] == 200, host


def test_health_without_the_key_lists_no_requests(server):
    _post_raw(server, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}))
    status, body = _get(server, "/health", {})
    public = json.loads(body)
    assert status == 200 and public["status"] == "ok"
    assert "recent" not in public and "counts" not in public
    assert set(public) == {"status", "model", "busy", "queue_depth", "queue_capacity"}
    assert server.health()["recent"]                      # with the key
    assert "recent" not in json.loads(_get(server, "/health", {"Authorization": "Bearer wrong"})[1])


def test_models_shows_no_path(server):
    status, body = _get(server, "/v1/models", {"Authorization": f"Bearer {KEY}"})
    spel = json.loads(body)["data"][0]["spel"]
    assert status == 200 and "spel-mlx-" + spel["source"] == served_model_id() and "/" not in spel["source"]


def test_bearer_scheme_is_case_insensitive(server):
    for scheme in ("bearer", "BEARER", "Bearer", "bEaReR"):
        status, _ = _get(server, "/v1/models", {"Authorization": f"{scheme} {KEY}"})
        assert status == 200, scheme
    for header in (f"Basic {KEY}", KEY, f"Bearer{KEY}", f"Bearer {KEY}x", "Bearer"):
        assert _get(server, "/v1/models", {"Authorization": header})[0] == 401, header


def test_hang_up_mid_body_is_no_error(server):
    """A client that sends half its declared body and hangs up: logged at info, no
    traceback, the server serves the next request."""
    body = json.dumps({"prompt": "x" * 2000, "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                  b"\r\n\r\n" + body[:len(body) // 2])
    wait_for(lambda: "hung up before its body was sent" in server.log(), "the hang-up to be logged")
    status, _ = _post_raw(server, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}))
    assert status == 200
    log = server.log()
    assert "Traceback" not in log and "unexpected error" not in log and "ERROR" not in log


def test_sigterm_during_a_stream(tmp_path):
    """SIGTERM while one client streams and another waits in the queue: the stream ends
    with an error event then [DONE], the queued client gets a 503 JSON error, decoding
    stops, and the process exits within 2 s (it takes ~0.2 s on an idle machine)."""
    require_or_skip(server_packages_missing() is None, server_packages_missing(), env="SPEL_REQUIRE_SERVER")
    srv = LiveServer("--queue-size", 2, "--no-warmup", log_dir=tmp_path)
    try:
        conn, resp = raw_request(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0,
                                                          "stream": True}, key=None)
        assert resp.status == 200 and resp.readline().startswith(b"data: {")
        queued = send_request(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8}, key=None)
        wait_for(lambda: srv.health()["queue_depth"] == 1, "the second request to queue")
        answer = {}

        def wait_for_answer():
            r = queued.getresponse()
            answer.update(status=r.status, body=r.read())

        waiting = threading.Thread(target=wait_for_answer, daemon=True)
        waiting.start()
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        events = [e.strip() for e in resp.read().decode().split("\n\n") if e.strip()]
        exit_code = srv.proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        waiting.join(30)
    finally:
        srv.stop()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    assert all(json.loads(e.removeprefix("data: "))["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert answer["status"] == 503 and json.loads(answer["body"])["error"]["code"] == "server_shutting_down"
    log = srv.log()
    assert "cancelled (server shutting down)" in log and "timeout graceful shutdown exceeded" not in log
    assert exit_code == -signal.SIGTERM and elapsed < 2.0, (exit_code, elapsed)
    tokens = sum(len(json.loads(e.removeprefix("data: "))["spel"]["tokens"]) for e in events[:-2])
    assert tokens < 4000


def test_ctrl_c_exits_cleanly(tmp_path):
    """Ctrl-C: the same shutdown, exit status 130, no KeyboardInterrupt traceback."""
    require_or_skip(server_packages_missing() is None, server_packages_missing(), env="SPEL_REQUIRE_SERVER")
    srv = LiveServer("--no-warmup", log_dir=tmp_path)
    assert srv.health()["status"] == "ok"
    assert srv.stop() == 130
    log = srv.log()
    assert "Application shutdown complete" in log and "Traceback" not in log and "KeyboardInterrupt" not in log


def test_a_ctrl_c_that_asyncio_swallows_still_exits_130(monkeypatch):
    """uvicorn raises the caught SIGINT again once it has shut down, but asyncio's runner
    may take it as a cancellation of a serve() already returning, so nothing is raised:
    the exit status still says Ctrl-C (130), and a plain return without a signal is 0."""
    require_or_skip(server_packages_missing() is None, server_packages_missing(), env="SPEL_REQUIRE_SERVER")
    import types

    import uvicorn

    from spel_mlx.server import serve
    app = types.SimpleNamespace(state=types.SimpleNamespace(worker=types.SimpleNamespace(begin_shutdown=lambda: None)))

    def swallowed(self, sockets=None):
        self.handle_exit(signal.SIGINT, None)      # the signal came; run() returns anyway

    monkeypatch.setattr(uvicorn.Server, "run", swallowed)
    assert serve.run(app, "127.0.0.1", 0, "warning") == 130
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    assert serve.run(app, "127.0.0.1", 0, "warning") == 0

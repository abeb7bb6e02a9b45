"""`python -m spel_mlx.server` on a free loopback port, driven by the official `openai`
client: completions and chat, streaming and not, the text equal to the Python API's,
stop strings, seeds, 400/401/429, a client that disconnects, and the server staying up."""
import http.client
import json
import socket
import threading
import time

import pytest

import spel_mlx  # noqa: F401
from conftest import require_or_skip
from bench.server_load import LiveServer, run_load

KEY = "test-key"
PROMPT = "Elizabeth was"
LONG = 4000          # tokens of a request meant to be cut short (the shipped max_seq is 4096)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_or_skip(server_packages_missing() is None, server_packages_missing(), env="SPEL_REQUIRE_SERVER")
    srv = LiveServer("--api-key", KEY, "--queue-size", 2, log_dir=tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference():
    from spel_mlx import load
    model, tok = load()
    yield model, tok
    model.close()


def server_packages_missing():
    try:
        import fastapi  # noqa: F401
        import openai  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return f"the server tests need the server and dev extras ({e}): pip install -e '.[dev,server]'"
    return None


def raw_request(server, path, body, key=KEY):
    """A POST on a plain socket, so the test can read part of the answer and hang up."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=body if isinstance(body, (bytes, str)) else json.dumps(body), headers=headers)
    return conn, conn.getresponse()


def wait_for(cond, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["spel-mlx-default"]


def test_completion_equals_the_python_api(client, reference):
    from spel_mlx import generate
    want = generate(*reference, PROMPT, max_tokens=24, temperature=0)
    r = client.completions.create(model="spel-mlx-default", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(reference[1].encode(PROMPT)), 24)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    spel = r.model_extra["spel"]
    assert spel["mode"] == "spec" and 0 <= spel["alpha"] <= 1 and spel["tok_s"] > 0 and spel["kv_cache"] == "float32"
    assert spel["tokens_per_round"] == pytest.approx(24 / spel["rounds"], abs=1e-3)


def test_streaming_completion(client):
    whole = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    chunks = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole
    rounds = [c.model_extra["spel"] for c in chunks[:-1]]
    assert rounds and all(len(s["tokens"]) == len(s["from_draft"]) == len(s["token_text"]) for s in rounds)
    assert sum(len(s["tokens"]) for s in rounds) == 24
    assert any(any(s["from_draft"]) for s in rounds)          # greedy on the shipped model: alpha is high
    assert all(s["from_draft"][-1] is False for s in rounds)   # each round ends with the target's token
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length" and last.usage.completion_tokens == 24


def test_stream_ends_with_done(server):
    conn, resp = raw_request(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "stream": True})
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])


def test_chat(client, reference):
    from spel_mlx import generate
    from spel_mlx.server.protocol import CHAT_STOP, chat_prompt
    messages = [{"role": "system", "content": "A conversation."}, {"role": "user", "content": "Who is Mr. Darcy?"}]
    assert chat_prompt(messages) == "A conversation.\n\nUser: Who is Mr. Darcy?\n\nAssistant:"
    want = generate(*reference, chat_prompt(messages), max_tokens=20, temperature=0, stop=[CHAT_STOP])
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_stop_strings(client):
    full = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[10:14]                       # a string inside the output, likely mid-token
    cut = full[:full.index(stop)]
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "zzz"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible(client):
    def sample(seed):
        return client.completions.create(model="m", prompt=PROMPT, max_tokens=32, temperature=0.9,
                                         seed=seed).choices[0].text
    a, b, c = sample(7), sample(7), sample(8)
    assert a == b
    assert a != c                             # 32 sampled tokens: equal only by an astronomic chance


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": -5}, "max_tokens"),
    ({"seed": -1}, "seed"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": "x" * 300}, "stop"),
    ({"n": 2}, "n"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"mode": "fast"}}, "mode"), ({"extra_body": {"k": 17}}, "k"),
    ({"extra_body": {"bogus": 1}}, "bogus"), ({"prompt": "a " * 5000}, "prompt"), ({"prompt": ""}, "prompt"),
])
def test_bad_parameters_are_400(client, kwargs, param):
    import openai
    kwargs = {"model": "m", "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert param in e.value.body["message"]


def test_bad_chat_and_json_are_400(server, client):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "hi"}])
    assert e.value.body["param"] == "messages[0]"
    for body in (b"{not json", b"[1, 2]", json.dumps({"max_tokens": 4})):
        conn, resp = raw_request(server, "/v1/completions", body)
        err = json.loads(resp.read())["error"]
        conn.close()
        assert resp.status == 400 and err["type"] == "invalid_request_error", body
        assert err["message"]


def test_oversized_body_is_413(server):
    conn, resp = raw_request(server, "/v1/completions", b'{"prompt": "' + b"a" * (2 << 20) + b'"}')
    assert resp.status == 413 and json.loads(resp.read())["error"]["message"].startswith("the body is larger")
    conn.close()
    assert server.alive()


def test_api_key(server):
    import openai
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        c.completions.create(model="m", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    conn, resp = raw_request(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                             key=None)
    assert resp.status == 401 and json.loads(resp.read())["error"]["code"] == "invalid_api_key"
    conn.close()
    assert server.health()["status"] == "ok"       # the page and health need no key


def _start_long(server):
    """A streaming request for LONG tokens, read until its first round arrived."""
    conn, resp = raw_request(server, "/v1/completions",
                             {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True})
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")
    return conn


def _hang_up(conn):
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def test_disconnect_stops_decoding(server, client):
    before = server.health()["counts"].get("cancelled", 0)
    conn = _start_long(server)
    _hang_up(conn)
    # the next request is served: the long one stopped instead of decoding LONG tokens
    r = client.completions.create(model="m", prompt="And God said", max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8
    h = server.health()
    assert h["counts"]["cancelled"] == before + 1
    rec = [x for x in h["recent"] if x["status"] == "cancelled"][-1]
    assert rec["reason"] == "client disconnected" and rec["tokens"] < LONG
    assert "cancelled (client disconnected)" in server.log()


def test_full_queue_is_429(server, client):
    import openai
    running = _start_long(server)
    wait_for(lambda: server.health()["busy"], "the long request to run")
    queued = []
    for _ in range(2):                              # --queue-size 2
        threading.Thread(target=lambda: queued.append(raw_request(server, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": LONG, "stream": True})), daemon=True).start()
    wait_for(lambda: server.health()["queue_depth"] == 2 and len(queued) == 2, "two queued requests")
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    for conn in [running] + [c for c, _ in queued]:
        _hang_up(conn)
    wait_for(lambda: not server.health()["busy"] and server.health()["queue_depth"] == 0, "the queue to drain")
    assert client.completions.create(model="m", prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4
    assert server.alive()


def test_load(server, tmp_path):
    """16 clients x 4 requests against a queue of 2: each completes or gets 429 at once,
    nothing hangs, the server stays up; latencies are recorded (bench/server_load.py)."""
    before = server.health()["counts"]
    res = run_load(server.url, KEY, clients=16, requests=4, max_tokens=16)
    (tmp_path / "server_load.json").write_text(json.dumps(res))
    assert res["sent"] == 64 and res["other"] == [], res["other"]
    assert res["completed"] + res["rejected_429"] == 64 and res["completed"] >= 3
    assert res["tokens"] == 16 * res["completed"]
    after = server.health()["counts"]
    assert after["completed"] - before.get("completed", 0) == res["completed"]
    assert after.get("rejected", 0) - before.get("rejected", 0) == res["rejected_429"]
    assert server.alive()


def test_a_server_with_a_float16_cache(tmp_path):
    """`--kv-cache float16`: the server's text is the Python API's with the same cache."""
    require_or_skip(server_packages_missing() is None, server_packages_missing(), env="SPEL_REQUIRE_SERVER")
    import openai
    from spel_mlx import generate, load
    model, tok = load(kv_cache="float16")
    try:
        want = generate(model, tok, PROMPT, max_tokens=24, temperature=0)
    finally:
        model.close()
    srv = LiveServer("--kv-cache", "float16", "--no-warmup", log_dir=tmp_path)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0)
        assert r.choices[0].text == want and r.model_extra["spel"]["kv_cache"] == "float16"
    finally:
        srv.stop()

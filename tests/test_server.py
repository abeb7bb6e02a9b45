"""`python -m spel_mlx.server` on a free loopback port, driven by the official `openai`
client: completions and chat, streaming and not, the text equal to the Python API's,
stop strings, seeds, include_usage, logprobs, /metrics, the OpenAPI docs, 400/401/429,
a client that disconnects, and the server staying up.  Hostile input, exposure and
shutdown: test_server_hostile.py; the fuzz test: test_server_fuzz.py."""
import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

import spel_mlx  # noqa: F401
from conftest import require_or_skip, served_model_id
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


def send_request(server, path, body, key=KEY, headers=None):
    """A POST on a plain socket, sent, its answer not read yet."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=body if isinstance(body, (bytes, str)) else json.dumps(body), headers=headers)
    return conn


def raw_request(server, path, body, key=KEY, headers=None):
    """A POST on a plain socket, so the test can read part of the answer and hang up."""
    conn = send_request(server, path, body, key, headers)
    return conn, conn.getresponse()


def wait_for(cond, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [served_model_id()]


def test_completion_equals_the_python_api(client, reference):
    from spel_mlx import generate
    want = generate(*reference, PROMPT, max_tokens=24, temperature=0)
    r = client.completions.create(model=served_model_id(), prompt=PROMPT, max_tokens=24, temperature=0)
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
    assert last.choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)                # no usage unless include_usage asks for it


def test_stream_ends_with_done(server):
    conn, resp = raw_request(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "stream": True})
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])


def test_chat(client, reference):
    from spel_mlx import generate
    from spel_mlx.server.chat import PLAIN_STOP, plain_prompt
    messages = [{"role": "system", "content": "A conversation."}, {"role": "user", "content": "Who is Mr. Darcy?"}]
    prompt = plain_prompt([(m["role"], m["content"]) for m in messages])
    assert prompt == "A conversation.\n\nUser: Who is Mr. Darcy?\n\nAssistant:"
    want = generate(*reference, prompt, max_tokens=20, temperature=0, stop=[PLAIN_STOP])
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
    assert e.value.body["param"] == "messages[0].role"
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
    assert server.health(key="none")["status"] == "ok"       # the page and health need no key


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
    queued = [send_request(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": LONG, "stream": True})
              for _ in range(2)]                   # --queue-size 2; no answer comes before they start
    wait_for(lambda: server.health()["queue_depth"] == 2, "two queued requests")
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    assert int(e.value.response.headers["retry-after"]) >= 1
    for conn in [running] + queued:
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


def test_include_usage(client):
    """stream_options.include_usage as OpenAI: every chunk has usage null but the last,
    which has no choices and the request's usage."""
    chunks = list(client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens > 0 and last.usage.total_tokens == last.usage.prompt_tokens + 12
    assert all(c.usage is None for c in body) and body[-1].choices[0].finish_reason == "length"
    chat = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=6, temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chat[:-1])


def _reference_logprobs(reference, prompt_ids, tokens):
    """log_softmax of the target's rows over prompt + tokens in one pass (float64)."""
    import numpy as np
    model = reference[0].model
    seq = prompt_ids + tokens
    state = model.new_state("target", ring=len(seq))
    state.reserve(len(seq))
    rows = np.array(model.forward(seq[:-1], state), dtype=np.float64)[len(prompt_ids) - 1:]
    rows -= rows.max(axis=1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))


def test_completion_logprobs(client, reference):
    """`logprobs: 3` at temperature 0: each token's log-probability is the best of its
    row (greedy picks the argmax), its alternatives follow in order, and the values
    are the target's (a pass of the whole text, within float32 rounding)."""
    from spel_mlx import stream_generate
    tokens = [r.token for r in stream_generate(*reference, PROMPT, max_tokens=16, temperature=0)]
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 16
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(16)]
    ref = _reference_logprobs(reference, reference[1].encode(PROMPT), tokens)
    for i, (tok, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        values = list(top.values())
        assert len(top) == 3 and values == sorted(values, reverse=True)
        assert list(top)[0] == lp.tokens[i] and values[0] == tok             # the argmax
        assert tok == pytest.approx(ref[i, tokens[i]], abs=2e-3)
    assert r.choices[0].text == client.completions.create(model="m", prompt=PROMPT, max_tokens=16,
                                                          temperature=0).choices[0].text


def test_chat_logprobs_streamed_and_whole(client):
    """Chat `logprobs` + `top_logprobs`: one entry per token, streamed or whole, the same
    tokens either way; sampling with them gives the text it gives without them."""
    messages = [{"role": "user", "content": "Who is Mr. Darcy?"}]
    kw = dict(model="m", messages=messages, max_tokens=12, temperature=0.9, seed=5)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    whole = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    assert whole.choices[0].message.content == plain
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 and c.bytes == list(c.token.encode()) for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)
    chunks = list(client.chat.completions.create(**kw, logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=messages, max_tokens=2, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def scrape(server) -> dict:
    """/metrics as {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/plain")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}


def test_metrics(server, client):
    """/metrics is Prometheus text; a completed and a refused request move its counters."""
    before = scrape(server)
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0)
    conn, resp = raw_request(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": -1})
    assert resp.status == 400
    conn.close()
    after = scrape(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    ok = ("spel_http_requests_total", {"route": "/v1/completions", "status": "200"})
    assert delta(ok[0], **ok[1]) == 1 and delta(ok[0], route="/v1/completions", status="400") == 1
    assert delta("spel_generations_total", outcome="completed") == 1
    assert delta("spel_generated_tokens_total") == 10
    assert delta("spel_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("spel_decode_tokens_per_second_count") == 1
    assert after[("spel_queue_depth", ())] == 0 and 0 <= after[("spel_alpha", ())] <= 1
    assert delta("spel_draft_accepted_tokens_total") == r.model_extra["spel"]["accepted"]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server.url + "/metrics", timeout=10)
    assert e.value.code == 401


def test_prompt_cache(server, client, reference):
    """A request whose prompt extends an earlier one's (a chat's next turn) resumes from
    the state that request left: fewer tokens prefilled (usage's cached_tokens, the
    cache counters), the text of the Python API without a cache."""
    from spel_mlx import generate
    first = "It is a truth universally acknowledged, that a single man in possession of a good fortune,"
    n = len(reference[1].encode(first))
    reply = client.completions.create(model="m", prompt=first, max_tokens=12, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    turn = first + reply.choices[0].text + " However"
    before = scrape(server)
    r = client.completions.create(model="m", prompt=turn, max_tokens=16, temperature=0)
    after = scrape(server)
    assert r.choices[0].text == generate(*reference, turn, max_tokens=16, temperature=0)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert (n - 1) // 16 * 16 <= cached < r.usage.prompt_tokens and cached >= 16
    assert after[("spel_prompt_cache_hits_total", ())] - before.get(("spel_prompt_cache_hits_total", ()), 0) == 1
    assert after[("spel_prompt_cache_tokens_total", ())] - before[("spel_prompt_cache_tokens_total", ())] == cached
    assert 0 < after[("spel_prompt_cache_entries", ())] <= 8 and after[("spel_prompt_cache_bytes", ())] > 0
    # requests in flight together take turns on the one decoding thread: each its own text
    from concurrent.futures import ThreadPoolExecutor
    prompts = [turn + " and", "Mr. Darcy said " + first]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: client.completions.create(model="m", prompt=p, max_tokens=12, temperature=0),
                            prompts))
    assert [g.choices[0].text for g in got] == [generate(*reference, p, max_tokens=12, temperature=0) for p in prompts]
    assert got[1].usage.prompt_tokens_details.cached_tokens == 0


def test_openapi_docs(server):
    with urllib.request.urlopen(server.url + "/openapi.json", timeout=10) as r:
        spec = json.load(r)
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    schemas = spec["components"]["schemas"]
    assert {"prompt", "max_tokens", "logprobs"} <= set(schemas["CompletionRequest"]["properties"])
    assert "messages" in schemas["ChatRequest"]["properties"] and "Message" in schemas
    with urllib.request.urlopen(server.url + "/docs", timeout=10) as r:
        assert r.status == 200 and b"swagger" in r.read().lower()

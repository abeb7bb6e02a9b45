"""A fuzz test of the HTTP layer, bounded by its case count (CASES, from a fixed seed):
valid requests of both endpoints mutated field by field (hostile JSON literals: huge
and non-finite numbers, lone surrogates, deep nesting, wrong types), in their headers
(content type, key, Host) and as bytes (cut, flipped, doubled), sent to the app under
uvicorn.  Every answer must be a 2xx with a well-formed body, or a 4xx with OpenAI's
JSON error; never a 5xx, never a log record at WARNING or above, and the server
answers /health at the end.  A failing case is printed with its number."""
import json
import random

import pytest

import spel_mlx  # noqa: F401
from conftest import require_or_skip
from inproc_server import InProcessServer
from test_server import server_packages_missing

CASES = 400
SEED = 20261203
KEY = "fuzz-key"
LIMIT = 4                  # the app's max_tokens limit: valid requests decode a few tokens


class Raw(str):
    """A JSON literal written as is (numbers json.dumps cannot write, NaN, nesting)."""


LITERALS = [Raw(x) for x in (
    "null", "true", "false", "0", "-1", "1", "2", "3.5", "-0.0", "1e999", "-1e999", "NaN", "Infinity", "-Infinity",
    "9" * 5000, "-" + "9" * 5000, "1" + "0" * 100, "9" * 400 + ".5", "1e-400", '""', '"x"', '"\\ud800"', '"a\\udfff"',
    '"\\u0000"', '"' + "a" * 3000 + '"', "[]", "{}", "[1, 2]", '[["a"]]', "[1.5]", "[true]", '{"role": "user"}',
    "[" * 3000 + "]" * 3000, '{"a":' * 3000 + "1" + "}" * 3000, '"user"', '"system"', '"wizard"',
    '[{"type": "text", "text": "hi"}]', '[{"type": "image_url"}]', '{"include_usage": true}',
    '{"include_usage": 1}', '"spec"', '"ar"', '"governed"', '"c"', '"ngram"', '"mlx"', "16", "17", "4096", "4097",
    "2147483648", "9223372036854775808", '["\\n", "x"]', '["a", "b", "c", "d", "e"]', '[{"role": "user"}]')]
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "repetition_penalty", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "mode", "draft", "k",
          "n", "echo", "model", "user", "logit_bias", "presence_penalty", "tools", "bogus", ""]
SEEDS = [
    ("/v1/completions", {"prompt": "It was", "max_tokens": 2, "temperature": 0}),
    ("/v1/completions", {"prompt": [10, 20, 30], "max_tokens": 3, "stream": True, "logprobs": 2, "seed": 4,
                         "temperature": 0.8}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "S"},
                                           {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                              "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2,
                              "logprobs": True, "top_logprobs": 1, "stop": ["\n"], "mode": "ar"}),
]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain", "",
                 "application/x-www-form-urlencoded"]
OK = {200}
REFUSED = {400, 401, 403, 404, 405, 413, 415}


def dump(v) -> str:
    """JSON text of `v`, Raw values written as they are."""
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {dump(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(dump(x) for x in v) + "]"
    return json.dumps(v)


def _mutate_body(rng: random.Random, body: dict):
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.55:
            body[rng.choice(FIELDS)] = rng.choice(LITERALS)
        elif roll < 0.7 and body:
            del body[rng.choice(list(body))]
        elif roll < 0.85 and isinstance(body.get("messages"), list) and body["messages"]:
            msg = rng.choice(body["messages"])
            if isinstance(msg, dict):
                msg[rng.choice(["role", "content", "name", "extra"])] = rng.choice(LITERALS)
        elif isinstance(body.get("prompt"), list):
            body["prompt"] = body["prompt"] + [rng.choice(LITERALS)]
        else:
            body[rng.choice(FIELDS)] = rng.choice([body.get(rng.choice(FIELDS)), rng.randint(-5, 5)])


def _mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    roll = rng.random()
    if roll < 0.4 and raw:
        return raw[:rng.randrange(len(raw))]
    if roll < 0.7 and raw:
        i = rng.randrange(len(raw))
        return raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]
    if roll < 0.85:
        return raw + raw
    return bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))


def make_case(rng: random.Random):
    """(method, path, body bytes, headers) of one case."""
    path, body = rng.choice(SEEDS)
    body = json.loads(json.dumps(body))
    if rng.random() < 0.85:
        _mutate_body(rng, body)
    raw = dump(body).encode("utf-8", "surrogatepass")
    if rng.random() < 0.12:
        raw = _mutate_bytes(rng, raw)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    if rng.random() < 0.1:
        headers["Content-Type"] = rng.choice(CONTENT_TYPES)
    if rng.random() < 0.08:
        headers["Authorization"] = rng.choice([f"bearer {KEY}", "Bearer wrong", KEY, ""])
    if rng.random() < 0.05:
        headers["Host"] = rng.choice(["evil.example", "localhost", "[::1]:1"])
    method = "POST"
    if rng.random() < 0.04:
        method, path = rng.choice([("GET", path), ("POST", "/v1/models"), ("POST", "/nope"), ("PUT", path)])
    return method, path, raw, headers


def check_answer(status: int, headers: dict, raw: bytes):
    """Raises AssertionError when the answer is not one the server may give."""
    assert status in OK | REFUSED, status
    if status in REFUSED:
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"], err
        return
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]", events[-3:]
        for e in events[:-1]:
            chunk = json.loads(e.removeprefix("data: "))
            assert "error" not in chunk and "id" in chunk, chunk
        return
    body = json.loads(raw)
    assert body["choices"] and body["usage"]["completion_tokens"] <= LIMIT, body


@pytest.fixture(scope="module")
def server():
    require_or_skip(server_packages_missing() is None, server_packages_missing(), env="SPEL_REQUIRE_SERVER")
    from spel_mlx import load
    loaded, tokenizer = load()
    srv = InProcessServer(loaded, tokenizer, api_key=KEY, max_tokens_limit=LIMIT)
    yield srv
    srv.stop()


def test_fuzz_http(server):
    rng = random.Random(SEED)
    seen = {}
    for case in range(CASES):
        method, path, raw, headers = make_case(rng)
        status, hdrs, answer = server.request(method, path, raw if method != "GET" else None, headers)
        try:
            check_answer(status, hdrs, answer)
        except (AssertionError, ValueError, KeyError) as e:
            pytest.fail(f"case {case}: {method} {path} {headers} {raw[:300]!r} -> {status} {answer[:500]!r}: {e!r}")
        seen[status] = seen.get(status, 0) + 1
    assert server.log.errors() == [], [r.getMessage() for r in server.log.errors()][:5]
    assert sum(seen.values()) == CASES and seen.get(200, 0) >= CASES // 10 and seen.get(400, 0) >= CASES // 4, seen
    status, _, body = server.request("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_the_fuzz_check_refuses_a_500():
    """Negative control: the answer check fails a server error and a stream cut short."""
    with pytest.raises(AssertionError):
        check_answer(500, {}, b'{"error": {"message": "internal error", "type": "server_error"}}')
    with pytest.raises(AssertionError):
        check_answer(200, {"content-type": "text/event-stream"}, b'data: {"id": "x"}\n\n')
    with pytest.raises(AssertionError):
        check_answer(200, {"content-type": "text/event-stream"},
                     b'data: {"error": {"message": "the server is shutting down"}}\n\ndata: [DONE]\n\n')

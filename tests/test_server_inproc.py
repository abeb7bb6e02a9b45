"""Server settings the tests build the app with (in process, under uvicorn): the model
folder's chat template, CORS origins, allowed Host names, a tokenizer's end-of-text
token ending a reply."""
import json

import pytest

import spel_mlx  # noqa: F401
from conftest import require_or_skip
from inproc_server import InProcessServer
from test_server import server_packages_missing

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def model():
    require_or_skip(server_packages_missing() is None, server_packages_missing(), env="SPEL_REQUIRE_SERVER")
    from spel_mlx import load
    loaded, tokenizer = load()
    yield loaded, tokenizer
    loaded.close()


def test_template_from_the_model_folder(tmp_path, model):
    from spel_mlx.server.chat import PLAIN_STOP, ChatFormat, TemplateError
    _, tok = model
    assert ChatFormat.for_model(str(tmp_path), tok).template is None            # none there: the plain format
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    fmt = ChatFormat.for_model(str(tmp_path / "model.spelw"), tok)              # a file: its folder
    assert fmt.source.endswith("tokenizer_config.json") and fmt.stop == []
    assert fmt.prompt([("user", "Hi")]) == "<user>Hi\n<assistant>"
    (tmp_path / "chat_template.jinja").write_text("[{{ messages[0].content }}]")  # the file wins
    assert ChatFormat.for_model(str(tmp_path), tok).prompt([("user", "Hi")]) == "[Hi]"
    assert ChatFormat().prompt([("user", "Hi")]) == "User: Hi\n\nAssistant:" and ChatFormat().stop == [PLAIN_STOP]
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(TemplateError, match="chat_template.jinja"):
        ChatFormat.for_model(str(tmp_path), tok)
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe")
    with pytest.raises(TemplateError, match="chat_template.jinja"):
        ChatFormat.for_model(str(tmp_path), tok)


def test_chat_with_a_template(tmp_path, model):
    """The reply is the Python API's text for the rendered prompt (no plain-format stop);
    a template's raise_exception is the client's 400."""
    from spel_mlx import generate
    from spel_mlx.server.chat import ChatFormat
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0].role == 'assistant' %}{{ raise_exception('start with a user turn') }}{% endif %}"
        + TEMPLATE)
    fmt = ChatFormat.for_model(str(tmp_path), model[1])
    srv = InProcessServer(*model, chat_format=fmt)
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Mr. Darcy?"}]
        status, _, raw = srv.post_json("/v1/chat/completions", {"messages": messages, "max_tokens": 16,
                                                                "temperature": 0})
        want = generate(*model, "<system>Be brief.\n<user>Who is Mr. Darcy?\n<assistant>", max_tokens=16,
                        temperature=0)
        assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == want
        status, _, raw = srv.post_json("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "messages" and "start with a user turn" in err["message"]
        status, _, raw = srv.request("GET", "/v1/models")
        assert json.loads(raw)["data"][0]["spel"]["chat_template"] is True
    finally:
        srv.stop()
    assert srv.log.errors() == []


def test_cors_and_allowed_hosts(model):
    """--allowed-origins: the preflight of a JSON POST from that origin passes, from another
    it does not; a server without origins sends no CORS header.  --allowed-hosts: that
    Host is served beside loopback; "*" serves any."""
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    srv = InProcessServer(*model, allowed_origins=["http://app.example"], allowed_hosts=["box.lan"])
    try:
        status, headers, _ = srv.request("OPTIONS", "/v1/completions", headers=preflight)
        assert status == 200 and headers["access-control-allow-origin"] == "http://app.example"
        assert "content-type" in headers["access-control-allow-headers"].lower()
        status, headers, _ = srv.request("OPTIONS", "/v1/completions", headers={**preflight,
                                                                                 "Origin": "http://evil.example"})
        assert status == 400 and "access-control-allow-origin" not in headers
        status, headers, _ = srv.request("GET", "/v1/models", headers={"Origin": "http://app.example"})
        assert status == 200 and headers["access-control-allow-origin"] == "http://app.example"
        assert srv.request("GET", "/health", headers={"Host": "box.lan:8080"})[0] == 200
        assert srv.request("GET", "/health", headers={"Host": "other.lan"})[0] == 403
    finally:
        srv.stop()
    srv = InProcessServer(*model, allowed_hosts=["*"])
    try:
        status, headers, _ = srv.request("OPTIONS", "/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in headers and status == 405
        status, headers, _ = srv.request("GET", "/v1/models", headers={"Origin": "http://app.example",
                                                                       "Host": "anything.example"})
        assert status == 200 and "access-control-allow-origin" not in headers
    finally:
        srv.stop()


class _EotTokenizer:
    """The shipped tokenizer with one of its ids standing in for the end-of-text piece."""

    def __init__(self, tok, eot_id):
        self._tok, self.eot_id = tok, eot_id

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_end_of_text_ends_a_reply(model):
    """The model's end-of-text token ends a completion: finish_reason "stop" and
    spel.stop_reason "end_of_text", streamed and whole, the text the Python API's."""
    from spel_mlx import stream_generate
    loaded, tok = model
    prompt = "Elizabeth was"
    free = [r.token for r in stream_generate(loaded, tok, prompt, 30, temperature=0)]
    eot = _EotTokenizer(tok, free[7])
    want = "".join(r.text for r in stream_generate(loaded, eot, prompt, 30, temperature=0))
    srv = InProcessServer(loaded, eot)
    try:
        body = {"prompt": prompt, "max_tokens": 30, "temperature": 0}
        status, _, raw = srv.post_json("/v1/completions", body)
        r = json.loads(raw)
        assert status == 200 and r["choices"][0]["text"] == want
        assert (r["choices"][0]["finish_reason"], r["spel"]["stop_reason"]) == ("stop", "end_of_text")
        assert r["usage"]["completion_tokens"] == free.index(free[7]) + 1
        status, _, raw = srv.post_json("/v1/completions", {**body, "stream": True})
        events = [e for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        last = chunks[-1]
        assert (last["choices"][0]["finish_reason"], last["spel"]["stop_reason"]) == ("stop", "end_of_text")
    finally:
        srv.stop()

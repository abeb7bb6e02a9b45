"""The OpenAI wire format: errors, the JSON body, and the response, chunk and error
bodies (the request fields are in schemas.py)."""
from __future__ import annotations

import json
import re
import time
import uuid

MAX_INT_DIGITS = 64       # longer integer literals are kept as a HugeNumber: no field takes one


class ApiError(Exception):
    """An error answered as OpenAI does: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error", code="server_shutting_down")


class HugeNumber:
    """An integer literal too long for any field; kept so the error can name its field
    (Python refuses to convert more than 4,300 digits, and no field needs 64)."""

    def __init__(self, literal: str):
        self.digits = len(literal.lstrip("-"))

    def __repr__(self):
        return f"<an integer of {self.digits} digits>"


def _int(literal: str):
    return int(literal) if len(literal) <= MAX_INT_DIGITS else HugeNumber(literal)


_DECODER = json.JSONDecoder(parse_int=_int)
_SPACE = re.compile(r"[ \t\n\r]*")


def _too_deep(text: str) -> str | None:
    """The top-level field whose value nests too deeply to parse (None: not found)."""
    at = _SPACE.match(text, 0).end()
    if text[at:at + 1] != "{":
        return None
    at += 1
    while True:
        at = _SPACE.match(text, at).end()
        try:
            key, at = _DECODER.raw_decode(text, at)
            at = _SPACE.match(text, at).end() + 1        # the colon
            _, at = _DECODER.raw_decode(text, _SPACE.match(text, at).end())
        except RecursionError:
            return key if isinstance(key, str) else None
        except ValueError:
            return None
        at = _SPACE.match(text, at).end() + 1            # the comma


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; a 400 naming the problem (and the field, where one
    nests too deeply to parse) otherwise."""
    try:
        text = raw.decode("utf-8")
        body = _DECODER.decode(text)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not UTF-8: {e}") from None
    except RecursionError:
        field = _too_deep(text)
        where = f"{field}: " if field else ""
        raise ApiError(400, f"{where}nested too deeply to parse", field) from None
    except ValueError as e:       # json.JSONDecodeError is one
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


# --- responses -------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def spel_summary(stats: dict, queued_s: float) -> dict:
    return {"alpha": stats.get("alpha", 0.0), "tokens_per_round": stats.get("tokens_per_round", 0.0),
            "tok_s": stats.get("tok_s", 0.0), "rounds": stats.get("rounds", 0),
            "proposed": stats.get("proposed", 0), "accepted": stats.get("accepted", 0),
            "mode": stats.get("mode"), "draft": stats.get("draft"), "k": stats.get("k"),
            "stop_reason": stats.get("stop_reason"), "kv_cache": stats.get("kv_cache"),
            "queued_s": round(queued_s, 4)}


def spel_round(r) -> dict:
    """A streamed round's `spel`: its tokens, where each came from, the running statistics."""
    return {"round": r.round, "tokens": r.tokens, "from_draft": r.from_draft, "token_text": r.token_text,
            "proposed": r.proposed, "alpha": r.alpha, "tokens_per_round": r.tokens_per_round, "tok_s": r.tok_s}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; `cached_tokens`: prompt tokens restored from the prompt cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def sse(body) -> str:
    return f"data: {json.dumps(body) if not isinstance(body, str) else body}\n\n"


class Shaper:
    """Bodies of one response: the whole one, and the streamed chunks.  `logprobs`
    arguments are lists of logprobs.TokenLogprob (None when the request asked none)."""

    def __init__(self, chat: bool, model_id: str, include_usage: bool = False):
        self.chat, self.model, self.include_usage = chat, model_id, include_usage
        self.id, self.created = new_id(chat), int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.started = False
        self.offset = 0           # completions' text_offset of the next token

    def _logprobs(self, lps):
        if lps is None:
            return None
        if self.chat:
            return {"content": [lp.chat() for lp in lps], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            out["tokens"].append(lp.text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({t.text: t.logprob for t in lp.top})
            out["text_offset"].append(self.offset)
            self.offset += len(lp.text)
        return out

    def _choice(self, text, finish, delta: bool, lps):
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": self._logprobs(lps), "finish_reason": finish}
        if not delta:
            return {"index": 0, "message": {"role": "assistant", "content": text},
                    "logprobs": self._logprobs(lps), "finish_reason": finish}
        d = {"content": text} if text or finish is None else {}
        if not self.started:
            d["role"] = "assistant"
            self.started = True
        return {"index": 0, "delta": d, "logprobs": self._logprobs(lps), "finish_reason": finish}

    def _head(self, obj):
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text, reason, usage_, spel, lps=None) -> dict:
        return {**self._head(self.object), "choices": [self._choice(text, finish_reason(reason), False, lps)],
                "usage": usage_, "spel": spel}

    def chunk(self, text, spel, lps=None, reason=None) -> dict:
        """A streamed chunk (`reason`: the last one, with the finish reason).  With
        include_usage every chunk has "usage": null, as OpenAI sends them."""
        body = {**self._head(self.chunk_object),
                "choices": [self._choice(text, None if reason is None else finish_reason(reason), True, lps or None)],
                "spel": spel}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage_) -> dict:
        """include_usage's closing chunk: no choices, the request's usage."""
        return {**self._head(self.chunk_object), "choices": [], "usage": usage_}

"""The OpenAI wire format: request bodies checked field by field (every error names
its field), the chat template, and the response, chunk and error bodies."""
from __future__ import annotations

import json
import math
import time
import uuid

from ..api import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P

# Chat messages become a plain-text prompt (the shipped model is not instruction-tuned):
# the system text, then one "Role: content" paragraph per message, then "Assistant:".
# The reply ends where the model starts the user's next turn.
CHAT_ROLES = {"system": None, "user": "User", "assistant": "Assistant"}
CHAT_STOP = "\nUser:"
MAX_STOPS = 4
MAX_STOP_CHARS = 256
MODES = ("spec", "ar", "governed")
DRAFTS = ("c", "mlx", "ngram", "auto")
# OpenAI fields accepted only at the value that means "off"
NEUTRAL = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
           "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": (None, {}),
           "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
           "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, False)}
IGNORED = ("model", "user", "metadata", "store", "stream_options", "service_tier")


class ApiError(Exception):
    """An error answered as OpenAI does: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", None) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", None)
    return body


def _number(body, name, default, lo, hi, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"must be a number, got {json.dumps(v)}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(name, f"{v} is outside {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def _integer(body, name, default, lo, hi):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"must be an integer, got {json.dumps(v)}")
    if not lo <= v <= hi:
        raise bad(name, f"{v} is outside [{lo}, {hi}]")
    return v


def _choice(body, name, default, allowed):
    v = body.get(name, default)
    if v is None:
        return default
    if v not in allowed:
        raise bad(name, f"{json.dumps(v)}: expected one of {', '.join(allowed)}")
    return v


def _stops(body, extra=()):
    v = body.get("stop")
    stops = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "a string or a list of non-empty strings")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
    return stops + list(extra)


def options(body: dict, known: tuple, max_tokens_limit: int) -> dict:
    """The generation options of a request body (fields shared by both endpoints)."""
    for name in body:
        if name in NEUTRAL:
            if body[name] not in NEUTRAL[name]:
                raise bad(name, f"{json.dumps(body[name])} is not supported here")
        elif name not in known and name not in IGNORED:
            raise bad(name, "unrecognized field")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be true or false")
    so = body.get("stream_options")
    if so is not None and not (isinstance(so, dict) and isinstance(so.get("include_usage", False), bool)):
        raise bad("stream_options", "must be an object like {\"include_usage\": true}")
    max_tokens = _integer(body, "max_tokens", None, 0, max_tokens_limit)
    if "max_completion_tokens" in known:
        max_tokens = _integer(body, "max_completion_tokens", max_tokens, 0, max_tokens_limit)
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0)
    penalty = _number(body, "repetition_penalty", None, 0.0, 10.0, lo_open=True)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise bad("seed", f"must be an integer in [0, 2^63), got {json.dumps(seed)}")
    opts = {
        "max_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "temperature": temperature,
        "top_p": _number(body, "top_p", DEFAULT_TOP_P, 0.0, 1.0, lo_open=True),
        "top_k": _integer(body, "top_k", 0, 0, 1 << 30),
        "repetition_penalty": penalty,
        "seed": seed,
        "mode": _choice(body, "mode", None, MODES),
        "draft": _choice(body, "draft", None, DRAFTS),
        "k": _integer(body, "k", None, 1, 16),
    }
    return {"stream": stream, "options": {k: v for k, v in opts.items() if v is not None}}


COMPLETION_FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty",
                     "seed", "stop", "stream", "mode", "draft", "k")
CHAT_FIELDS = COMPLETION_FIELDS[1:] + ("messages", "max_completion_tokens")


def completion_request(body: dict, max_tokens_limit: int) -> dict:
    req = options(body, COMPLETION_FIELDS, max_tokens_limit)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]          # a batch of one
    if isinstance(prompt, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("prompt", "a string, a list of token ids, or a list of one of them (one prompt per request)")
    elif not isinstance(prompt, str):
        raise bad("prompt", "required: a string or a list of token ids")
    req["prompt"] = prompt
    req["options"]["stop"] = _stops(body)
    return req


def chat_prompt(messages) -> str:
    """The plain-text prompt for a list of chat messages (see CHAT_ROLES)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "required: a non-empty list of {role, content} objects")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise bad(f"messages[{i}]", f"needs a role, one of {', '.join(CHAT_ROLES)}")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", "only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        label = CHAT_ROLES[m["role"]]
        parts.append(content.strip() if label is None else f"{label}: {content.strip()}")
    return "\n\n".join(parts) + "\n\nAssistant:"


def chat_request(body: dict, max_tokens_limit: int) -> dict:
    req = options(body, CHAT_FIELDS, max_tokens_limit)
    req["prompt"] = chat_prompt(body.get("messages"))
    req["options"]["stop"] = _stops(body, extra=(CHAT_STOP,))
    return req


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


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


class Shaper:
    """Bodies of one response: the whole one, and the streamed chunks."""

    def __init__(self, chat: bool, model_id: str):
        self.chat, self.model = chat, model_id
        self.id, self.created = new_id(chat), int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.started = False

    def _choice(self, text, finish, delta: bool):
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if not delta:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        d = {"content": text} if text or finish is None else {}
        if not self.started:
            d["role"] = "assistant"
            self.started = True
        return {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}

    def _head(self, obj):
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text, reason, usage_, spel) -> dict:
        return {**self._head(self.object), "choices": [self._choice(text, finish_reason(reason), False)],
                "usage": usage_, "spel": spel}

    def chunk(self, text, spel) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [self._choice(text, None, True)], "spel": spel}

    def last_chunk(self, text, reason, usage_, spel) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [self._choice(text, finish_reason(reason), True)],
                "usage": usage_, "spel": spel}

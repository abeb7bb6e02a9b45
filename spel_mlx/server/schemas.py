"""The request bodies as pydantic models (FastAPI's own validation library).

Every field is checked strictly (no "0.5" for a number, no true for an integer) and an
unknown field is an error; `validate` turns pydantic's first error into the 400 that
names the field (`messages[0].role`, `seed`).  The models also give /openapi.json its
request schemas."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from ..api import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from .protocol import ApiError, HugeNumber

MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 5          # completions' `logprobs`, as OpenAI's
MAX_TOP_LOGPROBS = 20     # chat's `top_logprobs`, as OpenAI's


def _unicode(s: str) -> str:
    """JSON may carry a lone surrogate ("\\ud800"), which is no Unicode text."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("surrogate", f"a lone surrogate (\\u{ord(s[e.start]):04x}) at index {e.start}: "
                                               "not Unicode text") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]


def _neutral(*allowed):
    """A field OpenAI defines and this server does not implement: only its "off" value."""
    def check(v):
        if v not in allowed:
            raise PydanticCustomError("unsupported", "{value} is not supported here", {"value": repr(v)})
        return v
    return Annotated[Any, AfterValidator(check)]


# OpenAI's fields this server does not implement, each accepted at its "off" value
One = _neutral(1)
Zero = _neutral(0, 0.0)
NoLogitBias = _neutral(None, {})
NoEcho = _neutral(False)
NoSuffix = _neutral(None, "")
NoTools = _neutral(None, [])
NoToolChoice = _neutral(None, "none")
NoParallelTools = _neutral(None, False)
TextFormat = _neutral(None, {"type": "text"})


def _stops(v):
    stops = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise PydanticCustomError("stop", "a string or a list of non-empty strings")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise PydanticCustomError("stop", f"at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
    return [_unicode(s) for s in stops]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class Common(BaseModel):
    """The fields both endpoints share."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0.0, le=2.0)
    top_p: float = Field(DEFAULT_TOP_P, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1 << 30, description="extension: 0 = off")
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="extension")
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: Annotated[Any, AfterValidator(_stops)] = Field(None, description="a string or up to 4 strings")
    stream: bool = False
    stream_options: StreamOptions | None = None
    mode: Literal["spec", "ar", "governed"] | None = Field(None, description="extension: decoding mode")
    draft: Literal["c", "mlx", "ngram", "auto"] | None = Field(None, description="extension: draft engine")
    k: int | None = Field(None, ge=1, le=16, description="extension: proposals per round")
    # accepted and ignored
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    n: One = 1
    presence_penalty: Zero = 0
    frequency_penalty: Zero = 0
    logit_bias: NoLogitBias = None

    def options(self, max_tokens: int | None) -> dict:
        """The Python API's options (`prepare`'s keywords) for this body."""
        opts = {"max_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "repetition_penalty": self.repetition_penalty, "seed": self.seed,
                "mode": self.mode, "draft": self.draft, "k": self.k, "stop": self.stop}
        return {k: v for k, v in opts.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _prompt(v):
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]            # a batch of one
    if isinstance(v, str):
        return _unicode(v)
    if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return v
    raise PydanticCustomError("prompt", "a string, a list of token ids, or a list of one of them "
                                        "(one prompt per request)")


class CompletionRequest(Common):
    prompt: Annotated[Any, AfterValidator(_prompt)] = Field(description="a string or a list of token ids")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="the log-probability of each token and of this many alternatives")
    echo: NoEcho = False
    best_of: One = 1
    suffix: NoSuffix = None

    def top_logprobs(self) -> int | None:
        """None: no log-probabilities; else how many alternatives per token."""
        return self.logprobs


def _content(v):
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in v):
        v = [p.get("text") for p in v]
        if all(isinstance(t, str) for t in v):
            return _unicode("".join(v))
    elif isinstance(v, str):
        return _unicode(v)
    raise PydanticCustomError("content", "a string or a list of parts of type text (only text is supported)")


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant"]
    content: Annotated[Any, AfterValidator(_content)]
    name: Text | None = None


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: NoTools = None
    tool_choice: NoToolChoice = None
    parallel_tool_calls: NoParallelTools = None
    response_format: TextFormat = None

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def _where(loc: tuple) -> str:
    """pydantic's error location as a field path: ("messages", 0, "role") -> messages[0].role."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "function-after[_unicode(), str]"):
            continue        # which branch of a union was tried
        else:
            out += ("." if out else "") + str(part)
    return out


def _message(err: dict) -> str:
    if isinstance(err.get("input"), HugeNumber):
        return f"a number of {err['input'].digits} digits is out of range"
    if err["type"] == "extra_forbidden":
        return "unrecognized field"
    if err["type"] == "missing":
        return "required"
    return err["msg"][0].lower() + err["msg"][1:]


def validate(model: type[BaseModel], body: dict, max_tokens_limit: int):
    """The body as `model`, or the 400 naming the first bad field."""
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _where(err["loc"]) or None
        raise ApiError(400, f"{param}: {_message(err)}" if param else _message(err), param) from None
    for name in ("max_tokens", "max_completion_tokens"):
        v = getattr(req, name, None)
        if v is not None and v > max_tokens_limit:
            raise ApiError(400, f"{name}: {v} is more than the server's limit of {max_tokens_limit}", name)
    return req

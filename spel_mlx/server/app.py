"""The FastAPI application: OpenAI-compatible routes over one DecodeWorker, and the page."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from ..api import GenerationError, prepare
from . import protocol
from .worker import END, DecodeWorker, Job, QueueFull

STATIC = Path(__file__).resolve().parent / "static"
MAX_BODY = 1 << 20       # bytes; a max_seq prompt is a few dozen kB
log = logging.getLogger("spel_mlx.server")


def _error(e: protocol.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _body(request: Request) -> bytes:
    """The request body, refused past MAX_BODY before it is all read."""
    too_big = protocol.ApiError(413, f"the body is larger than {MAX_BODY} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


class JobResponse(Response):
    """The answer to an accepted request: server-sent events as rounds finish, or one
    JSON body at the end.  A client that disconnects stops its job (after the current
    round, or before it starts if it is still queued)."""

    def __init__(self, job: Job, shaper: protocol.Shaper, stream: bool):
        super().__init__()
        self.job, self.shaper, self.stream = job, shaper, stream

    async def __call__(self, scope, receive, send):
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await (self._events(send) if self.stream else self._whole(send))
        except OSError:              # the client went away mid-send
            self.job.stop()
        finally:
            watcher.cancel()

    async def _watch(self, receive):
        while (await receive())["type"] != "http.disconnect":
            pass
        self.job.stop("client disconnected")
        self.job.events.put_nowait(END)

    def _summary(self, r) -> dict:
        return protocol.spel_summary(r.stats, self.job.queued_s)

    async def _events(self, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
        sh = self.shaper
        while (r := await self.job.events.get()) is not END:
            if isinstance(r, Exception):
                body = {"error": protocol.ApiError(500, f"decoding failed: {r}", type="server_error").body()["error"]}
            elif r.finish_reason is None:
                if not r.tokens and not r.text:
                    continue
                body = sh.chunk(r.text, {"round": r.round, "tokens": r.tokens, "from_draft": r.from_draft,
                                         "token_text": r.token_text, "proposed": r.proposed,
                                         "alpha": r.alpha, "tokens_per_round": r.tokens_per_round,
                                         "tok_s": r.tok_s})
            else:
                body = sh.last_chunk(r.text, r.finish_reason,
                                     protocol.usage(r.prompt_tokens, r.generation_tokens), self._summary(r))
            await send({"type": "http.response.body", "body": f"data: {json.dumps(body)}\n\n".encode(),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _whole(self, send):
        parts, last, failure = [], None, None
        while (r := await self.job.events.get()) is not END:
            if isinstance(r, Exception):
                failure = r
            else:
                parts.append(r.text)
                last = r if r.finish_reason is not None else last
        if failure is not None or last is None:
            e = protocol.ApiError(500, f"decoding failed: {failure or 'cancelled'}", type="server_error")
            status, body = e.status, e.body()
        else:
            status = 200
            body = self.shaper.whole("".join(parts), last.finish_reason,
                                     protocol.usage(last.prompt_tokens, last.generation_tokens),
                                     self._summary(last))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def create_app(loaded, tokenizer, *, model_id: str, api_key: str | None = None, queue_size: int = 8,
               defaults: dict | None = None, warmup: bool = True) -> FastAPI:
    """The application serving `loaded` (from spel_mlx.api.load).  `defaults` are the
    generation options a request does not set (mode, draft, k, ...)."""
    defaults = dict(defaults or {})
    max_tokens_limit = loaded.cfg.max_seq
    worker = DecodeWorker(loaded, capacity=queue_size)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        warm = prepare(loaded, tokenizer, "It is", 8, **{**defaults, "temperature": 0}) if warmup else None
        worker.start(warm)
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.shutdown)

    app = FastAPI(title="spel-mlx", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker

    @app.exception_handler(protocol.ApiError)
    async def api_error(request, e: protocol.ApiError):
        return _error(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return _error(protocol.ApiError(e.status_code, str(e.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def any_error(request, e: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return _error(protocol.ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    def authorize(request: Request):
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise protocol.ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                    type="invalid_request_error", code="invalid_api_key")

    async def serve(request: Request, chat: bool):
        authorize(request)
        body = protocol.parse_json(await _body(request))
        req = (protocol.chat_request if chat else protocol.completion_request)(body, max_tokens_limit)
        try:
            api_request = prepare(loaded, tokenizer, req["prompt"], **{**defaults, **req["options"]})
        except GenerationError as e:
            param = "messages" if chat and e.param == "prompt" else e.param
            raise protocol.ApiError(400, str(e), param) from None
        shaper = protocol.Shaper(chat, model_id)
        job = Job(api_request, asyncio.get_running_loop(), shaper.id)
        try:
            worker.submit(job)
        except QueueFull as e:
            raise protocol.ApiError(429, f"the server is busy: {e}; retry later",
                                    type="rate_limit_error", code="rate_limit_exceeded") from None
        return JobResponse(job, shaper, req["stream"])

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        cfg = loaded.cfg
        return {"object": "list", "data": [{
            "id": model_id, "object": "model", "created": created, "owned_by": "spel-mlx",
            "spel": {"max_seq": cfg.max_seq, "vocab": cfg.vocab, "spec_k": cfg.spec_k, "source": loaded.source}}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, **worker.status()}

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app

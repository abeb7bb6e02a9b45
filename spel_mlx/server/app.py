"""The FastAPI application: OpenAI-compatible routes over one DecodeWorker, the page,
/health, /metrics and the OpenAPI docs (/docs)."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

from ..api import GenerationError, make_prefix_cache, prepare
from . import protocol, schemas
from .chat import ChatFormat
from .guard import ClientGone, HostGuard, authorized, read_body, require_json, require_key
from .metrics import CONTENT_TYPE, Metrics
from .responses import answer
from .worker import DecodeWorker, Job, QueueFull, ShuttingDown

STATIC = Path(__file__).resolve().parent / "static"
RETRY_AFTER_S = 1        # a 429's Retry-After: a queued request's wait is about one generation
log = logging.getLogger("spel_mlx.server")


def _error(e: protocol.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(loaded, tokenizer, *, model_id: str, api_key: str | None = None, queue_size: int = 8,
               defaults: dict | None = None, warmup: bool = True, allowed_hosts=(), allowed_origins=(),
               max_tokens_limit: int | None = None, chat_format: ChatFormat | None = None,
               prompt_cache_size: int = 8) -> FastAPI:
    """The application serving `loaded` (from spel_mlx.api.load).  `defaults` are the
    generation options a request does not set (mode, draft, k, ...); `allowed_hosts`:
    Host names accepted beside loopback ("*": any); `allowed_origins`: CORS origins;
    `max_tokens_limit`: the most tokens a request may ask (default max_seq);
    `chat_format`: default, the model folder's chat template, else the plain format;
    `prompt_cache_size`: target states kept for prompts that begin with an earlier
    request's tokens (0: none; api.PrefixCache)."""
    defaults = dict(defaults or {})
    limit = loaded.cfg.max_seq if max_tokens_limit is None else min(max_tokens_limit, loaded.cfg.max_seq)
    chat_format = chat_format or ChatFormat.for_model(loaded.source, tokenizer)
    created = int(time.time())
    worker = DecodeWorker(loaded, tokenizer, capacity=queue_size)
    prefix_cache = make_prefix_cache(loaded, prompt_cache_size) if prompt_cache_size else None
    metrics = worker.metrics = Metrics(worker, prefix_cache)

    @asynccontextmanager
    async def lifespan(app):
        warm = prepare(loaded, tokenizer, "It is", 8, **{**defaults, "temperature": 0}) if warmup else None
        worker.start(warm)
        yield
        worker.begin_shutdown()
        await asyncio.get_running_loop().run_in_executor(None, worker.shutdown)

    app = FastAPI(title="spel-mlx", summary="OpenAI-compatible server for a spel-mlx model", lifespan=lifespan,
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.worker = worker
    app.state.metrics = metrics
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(HostGuard, allowed_hosts=tuple(allowed_hosts), on_status=metrics.answered)

    @app.exception_handler(protocol.ApiError)
    async def api_error(request, e: protocol.ApiError):
        return _error(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return _error(protocol.ApiError(e.status_code, str(e.detail), type="invalid_request_error"))

    @app.exception_handler(ClientGone)
    async def client_gone(request, e):
        log.info("%s: the client hung up before its body was sent", request.url.path)
        return Response(status_code=400)         # nobody reads it

    @app.exception_handler(Exception)
    async def any_error(request, e: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return _error(protocol.ApiError(500, f"internal error: {type(e).__name__}", type="server_error"))

    async def serve(request: Request, chat: bool):
        require_key(request, api_key)
        require_json(request)
        body = protocol.parse_json(await read_body(request))
        if chat:
            req = schemas.validate(schemas.ChatRequest, body, limit)
            prompt = chat_format.prompt([(m.role, m.content) for m in req.messages])
            options = req.options(req.max_completion_tokens if req.max_completion_tokens is not None
                                  else req.max_tokens)
            options["stop"] = options.get("stop", []) + chat_format.stop
            top = req.top_logprobs_count()
        else:
            req = schemas.validate(schemas.CompletionRequest, body, limit)
            prompt, options, top = req.prompt, req.options(req.max_tokens), req.top_logprobs()
        options["max_tokens"] = min(options["max_tokens"], limit)
        try:
            api_request = prepare(loaded, tokenizer, prompt, prefix_cache=prefix_cache, **{**defaults, **options})
        except GenerationError as e:
            param = "messages" if chat and e.param == "prompt" else e.param
            raise protocol.ApiError(400, str(e), param) from None
        shaper = protocol.Shaper(chat, model_id, req.include_usage)
        job = Job(api_request, asyncio.get_running_loop(), shaper.id, top)
        try:
            worker.submit(job)
        except QueueFull as e:
            raise protocol.ApiError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                                    code="rate_limit_exceeded", headers={"retry-after": str(RETRY_AFTER_S)}) from None
        except ShuttingDown:
            raise protocol.shutting_down() from None
        return await answer(request, job, shaper, req.stream)

    def body_schema(model) -> dict:
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}

    @app.post("/v1/completions", openapi_extra=body_schema(schemas.CompletionRequest))
    async def completions(request: Request):
        """A completion of `prompt` (OpenAI's legacy completions)."""
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(schemas.ChatRequest))
    async def chat_completions(request: Request):
        """The assistant's reply to `messages`."""
        return await serve(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        require_key(request, api_key)
        cfg = loaded.cfg
        return {"object": "list", "data": [{
            "id": model_id, "object": "model", "created": created, "owned_by": "spel-mlx",
            "spel": {"max_seq": cfg.max_seq, "vocab": cfg.vocab, "spec_k": cfg.spec_k,
                     "source": os.path.basename(os.path.normpath(loaded.source)),
                     "chat_template": chat_format.source is not None}}]}

    @app.get("/health")
    async def health(request: Request):
        """Up or not, and the queue; with the key, the counts and the last requests."""
        status = "shutting_down" if worker.stopping else "ok"
        return {"status": status, "model": model_id, **worker.status(detail=authorized(request, api_key))}

    @app.get("/metrics")
    async def prometheus(request: Request):
        """Prometheus' text format."""
        require_key(request, api_key)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in (schemas.CompletionRequest, schemas.ChatRequest)],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app

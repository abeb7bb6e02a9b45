"""The answer to an accepted request: server-sent events as rounds finish (a
StreamingResponse), or one JSON body at the end.

Nothing is sent until the decoding thread takes the job up, so a job the shutdown
drops from the queue is answered 503.  A client that disconnects stops its job: while
it waits or for a whole body, a watcher reading the connection sees it go; during a
stream, StreamingResponse does and cancels the event generator."""
from __future__ import annotations

import asyncio
import logging

from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import protocol
from .worker import DISCONNECTED, END, SHUTDOWN, STARTED, Job, Update

log = logging.getLogger("spel_mlx.server")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def _watch(receive, job: Job):
    while (await receive())["type"] != "http.disconnect":
        pass
    job.stop(DISCONNECTED)
    job.events.put_nowait(END)          # wakes whoever waits for the job's events


def _error_response(e: protocol.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _failed(failure) -> protocol.ApiError:
    return protocol.ApiError(500, f"decoding failed: {failure}", type="server_error")


async def answer(request, job: Job, shaper: protocol.Shaper, stream: bool) -> Response:
    watcher = asyncio.ensure_future(_watch(request.receive, job))
    try:
        if await job.events.get() is not STARTED:       # END: never started
            if job.why == SHUTDOWN:
                return _error_response(protocol.shutting_down())
            return Response(status_code=204)             # the client has gone: nobody reads this
        if not stream:
            return await _whole(job, shaper)
    finally:
        watcher.cancel()
    return StreamingResponse(_events(job, shaper), media_type="text/event-stream; charset=utf-8",
                             headers=SSE_HEADERS)


async def _events(job: Job, shaper: protocol.Shaper):
    sh = shaper
    try:
        while (item := await job.events.get()) is not END:
            if isinstance(item, Exception):
                yield protocol.sse({"error": _failed(item).body()["error"]})
                continue
            r, lps = item.response, item.logprobs
            if r.finish_reason is None:
                if r.tokens or r.text:
                    yield protocol.sse(sh.chunk(r.text, protocol.spel_round(r), lps))
            elif r.finish_reason == "cancelled" and job.why == SHUTDOWN:
                if r.text:
                    yield protocol.sse(sh.chunk(r.text, protocol.spel_round(r), lps))
                yield protocol.sse({"error": protocol.shutting_down().body()["error"]})
            else:
                yield protocol.sse(sh.chunk(r.text, protocol.spel_summary(r.stats, job.queued_s), lps,
                                            reason=r.finish_reason))
                if sh.include_usage:
                    yield protocol.sse(sh.usage_chunk(protocol.usage(r.prompt_tokens, r.generation_tokens, r.cached_tokens)))
        yield protocol.sse("[DONE]")
    finally:
        job.stop(DISCONNECTED)       # a stream cut short (the client went): stop decoding; else a no-op


async def _whole(job: Job, shaper: protocol.Shaper) -> JSONResponse:
    parts, lps, last, failure = [], [], None, None
    while (item := await job.events.get()) is not END:
        if isinstance(item, Update):
            parts.append(item.response.text)
            lps.extend(item.logprobs or [])
            last = item.response if item.response.finish_reason is not None else last
        else:
            failure = item
    if failure is not None:
        return _error_response(_failed(failure))
    if last is None or last.finish_reason == "cancelled":
        if job.why == SHUTDOWN:
            return _error_response(protocol.shutting_down())
        return Response(status_code=204)                # the client has gone
    body = shaper.whole("".join(parts), last.finish_reason, protocol.usage(last.prompt_tokens, last.generation_tokens,
                                                                           last.cached_tokens),
                        protocol.spel_summary(last.stats, job.queued_s),
                        lps if job.top_logprobs is not None else None)
    return JSONResponse(body)

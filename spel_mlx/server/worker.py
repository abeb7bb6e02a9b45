"""One model, one decoding thread, a bounded queue of jobs.

The HTTP side submits a Job (full queue: `QueueFull` at once, answered 429; shutting
down: `ShuttingDown`, 503) and reads its events from an asyncio queue: STARTED when the
thread takes it up, an Update per response, an exception if decoding failed, END.  The
decoding thread runs jobs one at a time, so the C draft is never entered from two
threads.  A job whose client has gone, or stopped by the server's shutdown (`cancel`
set, `why` saying which), is skipped if it has not started, and stops after the
current round if it has.  Whatever a job raises is handed to its client; the thread
goes on to the next job.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from .logprobs import Scorer

log = logging.getLogger("spel_mlx.server")
STARTED, END = object(), object()
DISCONNECTED, SHUTDOWN = "client disconnected", "server shutting down"


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass
class Update:
    response: object          # api.GenerationResponse
    logprobs: list | None     # logprobs.TokenLogprob per token, when the request asked for them


class Job:
    def __init__(self, request, loop: asyncio.AbstractEventLoop, ident: str, top_logprobs: int | None = None):
        self.request, self.loop, self.id = request, loop, ident
        self.top_logprobs = top_logprobs
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.submitted = time.perf_counter()
        self.started = self.cancelled_at = None
        self.queued_s = 0.0
        self.why = None

    def emit(self, item):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:     # the event loop has closed (shutdown): nobody is listening
            self.cancel.set()

    def stop(self, why: str = DISCONNECTED):
        if not self.cancel.is_set():
            self.cancelled_at = time.perf_counter()
            self.why = why
            self.cancel.set()


class DecodeWorker:
    def __init__(self, loaded, tokenizer=None, capacity: int = 8, recent: int = 64, metrics=None):
        self.loaded = loaded
        self.jobs: queue.Queue = queue.Queue(maxsize=capacity)
        self.capacity = capacity
        self.counts = Counter()
        self.recent = deque(maxlen=recent)
        self.current: Job | None = None
        self.metrics = metrics
        self.scorer = Scorer(loaded, tokenizer)
        self._stopping = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="spel-decode", daemon=True)

    def start(self, warmup=None):
        """Start the thread; `warmup` (a Request) runs on it first."""
        self._warmup = warmup
        self._thread.start()

    def submit(self, job: Job):
        if self._stopping.is_set():
            raise ShuttingDown("the server is shutting down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.counts["rejected"] += 1
            raise QueueFull(f"{self.capacity} requests are already waiting") from None

    def status(self, detail: bool = True) -> dict:
        """The queue; with `detail`, the counts and the last requests (ids, timings, errors)."""
        out = {"busy": self.current is not None, "queue_depth": self.jobs.qsize(), "queue_capacity": self.capacity}
        if detail:
            out.update(counts=dict(self.counts), recent=list(self.recent))
        return out

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def begin_shutdown(self):
        """Take no more jobs, stop the running one after its round, answer the queued ones
        (their clients hear END before STARTED, with `why` SHUTDOWN).  Returns at once."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        current = self.current
        if current is not None:
            current.stop(SHUTDOWN)
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                try:
                    self.jobs.put_nowait(None)     # the thread's last item
                    return
                except queue.Full:                 # a submit slipped in meanwhile
                    continue
            if job is not None:
                job.stop(SHUTDOWN)
                self._record(job, "cancelled", {"id": job.id, "tokens": 0, "reason": SHUTDOWN})

    def shutdown(self, timeout: float = 10):
        """`begin_shutdown`, then wait for the decoding thread to close the drafts."""
        self.begin_shutdown()
        self._closed.wait(timeout=timeout)

    # -- the decoding thread ----------------------------------------------
    def _serve(self):
        if self._warmup is not None:
            try:
                self._warmup.run()
            except Exception:
                log.exception("warm-up failed")
        while (job := self.jobs.get()) is not None:
            try:
                self._run(job)
            except Exception:                # bookkeeping failed: the thread must go on
                log.exception("request %s: the worker recovered from an error", job.id)
                job.emit(END)
        self.loaded.close()
        self._closed.set()
        # This thread never ends: MLX frees its per-thread compiled graphs when a thread
        # ends, which needs the GIL, and doing so while the interpreter shuts down aborts.
        threading.Event().wait()

    def _respond(self, job: Job):
        top = job.top_logprobs
        if top is None:
            return lambda r: job.emit(Update(r, None))
        self.scorer.start(job.request.prompt, job.request.max_tokens)
        return lambda r: job.emit(Update(r, self.scorer.score(r.tokens, top)))

    def _run(self, job: Job):
        job.queued_s = time.perf_counter() - job.submitted
        record = {"id": job.id, "queued_s": round(job.queued_s, 4)}
        if job.cancel.is_set():
            record.update(tokens=0, reason=job.why or "cancelled before it started")
            self._record(job, "cancelled", record)
            return
        self.current = job
        job.started = time.perf_counter()
        job.emit(STARTED)
        status, stats = "completed", None
        try:
            last = job.request.run(on_response=self._respond(job), should_stop=job.cancel.is_set)
            stats = last.stats
            if last.finish_reason == "cancelled":
                status = "cancelled"
            record.update(tokens=last.generation_tokens, rounds=last.round, finish_reason=last.finish_reason,
                          tok_s=stats.get("tok_s"), alpha=stats.get("alpha"))
        except Exception as e:           # a bad request must not take the server down
            status = "failed"
            log.exception("request %s failed", job.id)
            job.emit(e)
            record["error"] = f"{type(e).__name__}: {e}"
        finally:
            self.current = None
            done = time.perf_counter()
            record["decode_s"] = round(done - job.started, 4)
            if status == "cancelled":
                record["reason"] = job.why or "cancelled"
                if job.cancelled_at is not None:
                    record["stopped_after_cancel_s"] = round(done - job.cancelled_at, 4)
        self._record(job, status, record, stats)

    def _record(self, job: Job, status: str, record: dict, stats: dict | None = None):
        record["status"] = status
        self.counts[status] += 1           # counted before the client hears the end
        self.recent.append(record)
        if self.metrics is not None:
            self.metrics.finished(status, stats)
        job.emit(END)
        if status == "cancelled":
            log.info("request %s cancelled (%s) after %s tokens", job.id, record.get("reason"),
                     record.get("tokens", 0))
        else:
            log.info("request %s %s: %s", job.id, status, {k: v for k, v in record.items() if k != "id"})

"""One model, one decoding thread, a bounded queue of jobs.

The HTTP side submits a Job (full queue: `QueueFull` at once, answered 429) and reads
its responses from an asyncio queue; the decoding thread runs jobs one at a time, so
the C draft is never entered from two threads.  A job whose client has gone (`cancel`
set) is skipped if it has not started, and stops after the current round if it has.
Whatever a job raises is handed to its client; the thread goes on to the next job.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter, deque

log = logging.getLogger("spel_mlx.server")
END = object()


class QueueFull(Exception):
    pass


class Job:
    def __init__(self, request, loop: asyncio.AbstractEventLoop, ident: str):
        self.request, self.loop, self.id = request, loop, ident
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

    def stop(self, why: str = "client disconnected"):
        if not self.cancel.is_set():
            self.cancelled_at = time.perf_counter()
            self.why = why
            self.cancel.set()


class DecodeWorker:
    def __init__(self, loaded, capacity: int = 8, recent: int = 64):
        self.loaded = loaded
        self.jobs: queue.Queue = queue.Queue(maxsize=capacity)
        self.capacity = capacity
        self.counts = Counter()
        self.recent = deque(maxlen=recent)
        self.current: Job | None = None
        self._stopping = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="spel-decode", daemon=True)

    def start(self, warmup=None):
        """Start the thread; `warmup` (a Request) runs on it first."""
        self._warmup = warmup
        self._thread.start()

    def submit(self, job: Job):
        if self._stopping.is_set():
            raise QueueFull("the server is shutting down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.counts["rejected"] += 1
            raise QueueFull(f"{self.capacity} requests are already waiting") from None

    def status(self) -> dict:
        return {"busy": self.current is not None, "queue_depth": self.jobs.qsize(),
                "queue_capacity": self.capacity, "counts": dict(self.counts), "recent": list(self.recent)}

    def shutdown(self):
        """Stop taking jobs, stop the running one, close the drafts on the decoding thread."""
        self._stopping.set()
        if self.current is not None:
            self.current.stop("server shutting down")
        try:
            self.jobs.put_nowait(None)
        except queue.Full:
            while True:                      # drop what waits: its clients are gone with the server
                try:
                    j = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if j is not None:
                    j.emit(END)
            self.jobs.put_nowait(None)
        self._closed.wait(timeout=10)

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

    def _run(self, job: Job):
        job.queued_s = time.perf_counter() - job.submitted
        record = {"id": job.id, "queued_s": round(job.queued_s, 4)}
        if job.cancel.is_set():
            status = "cancelled"
            record.update(status=status, tokens=0, reason=job.why or "cancelled before it started")
        else:
            self.current = job
            job.started = time.perf_counter()
            status = "completed"
            try:
                last = job.request.run(on_response=job.emit, should_stop=job.cancel.is_set)
                if last.finish_reason == "cancelled":
                    status = "cancelled"
                record.update(tokens=last.generation_tokens, rounds=last.round, finish_reason=last.finish_reason,
                              tok_s=last.stats.get("tok_s"), alpha=last.stats.get("alpha"))
            except Exception as e:           # a bad request must not take the server down
                status = "failed"
                log.exception("request %s failed", job.id)
                job.emit(e)
                record["error"] = f"{type(e).__name__}: {e}"
            finally:
                self.current = None
                done = time.perf_counter()
                record.update(status=status, decode_s=round(done - job.started, 4))
                if status == "cancelled":
                    record["reason"] = job.why or "cancelled"
                    if job.cancelled_at is not None:
                        record["stopped_after_cancel_s"] = round(done - job.cancelled_at, 4)
        self.counts[status] += 1           # counted before the client hears the end
        self.recent.append(record)
        job.emit(END)
        if status == "cancelled":
            log.info("request %s cancelled (%s) after %s tokens", job.id, record.get("reason"),
                     record.get("tokens", 0))
        else:
            log.info("request %s %s: %s", job.id, status, {k: v for k, v in record.items() if k != "id"})

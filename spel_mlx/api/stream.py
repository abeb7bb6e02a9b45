"""A request's round responses as an iterator, decoded on the process's generation thread.

The decoding runs ahead of the reader by at most ``AHEAD`` rounds, then waits for it.
A stream whose reader has fallen ``GIVE_WAY`` rounds behind while another call waits
for the model (an iterator left open, never read again) gives the model up: it ends
after the current round, its closing response "cancelled", so the next call does not
wait for it to reach max_tokens.  Closing the iterator, or dropping it, stops the
decoding after the current round.

MLX's random state is per thread: the decoding starts from the reader's, and the reader's
continues from where the decoding left it, so a sampler drawing from ``mx.random`` gives
what it gives on the reader's thread (``mx.random.seed`` before the call reproduces it).
"""
from __future__ import annotations

import queue
import threading

import mlx.core as mx
import numpy as np

AHEAD = 16       # rounds decoded before the reader has taken them, at most
GIVE_WAY = 4     # rounds behind its reader, a stream yields the model to a waiting call


class _GenerationThread:
    """The thread streams decode on: one for the process, started on first use, never
    ending.  MLX keeps its compiled graphs per thread and frees them when a thread
    ends, which needs the GIL: a thread ending while the interpreter shuts down aborts
    the process, and a new thread per call would recompile."""

    _lock = threading.Lock()
    _jobs: queue.SimpleQueue | None = None

    @classmethod
    def submit(cls, job):
        with cls._lock:
            if cls._jobs is None:
                cls._jobs = queue.SimpleQueue()
                threading.Thread(target=cls._serve, args=(cls._jobs,), name="spel-generate",
                                 daemon=True).start()
        cls._jobs.put(job)

    @staticmethod
    def _serve(jobs):
        while True:
            jobs.get()()


class _Flow:
    """What the decoding side and the reader of one stream share: the responses not
    read yet, whether the reader closed, whether the stream gave the model up."""

    def __init__(self, loaded):
        self.loaded, self.turn = loaded, loaded.turn
        self.unread = 0
        self.closed = self.gave_way = False

    def put(self):
        """A response was queued (decoding side): wait while the reader is AHEAD rounds
        behind; give way if it is GIVE_WAY behind and another call waits."""
        with self.turn:
            self.unread += 1
            while not (self.closed or self.gave_way):
                if self.unread >= GIVE_WAY and self.loaded.waiting:
                    self.gave_way = True
                elif self.unread >= AHEAD:
                    self.turn.wait()
                else:
                    break

    def took(self):
        with self.turn:
            self.unread -= 1
            self.turn.notify_all()

    def close(self):
        with self.turn:
            self.closed = True
            self.turn.notify_all()

    def should_stop(self) -> bool:
        return self.closed or self.gave_way


def _random_key() -> int:
    """This thread's MLX random key, as the seed that sets it (mx.random.key(s) is [s >> 32, s & 0xffffffff])."""
    hi, lo = np.array(mx.random.state[0]).astype(np.uint64).tolist()
    return (hi << 32) | lo


def stream_rounds(request):
    """`request`'s RoundResponses, decoded on the generation thread as they are read."""
    loaded = request.model
    responses: queue.SimpleQueue = queue.SimpleQueue()
    flow = _Flow(loaded)
    end = object()

    def emit(response):
        responses.put(response)
        flow.put()

    key = [0]

    def job():
        try:
            mx.random.seed(key[0])
            if flow.closed:
                loaded.announce(-1)       # never started: no longer waiting for the model
            else:
                request.run(on_response=emit, should_stop=flow.should_stop, announced=True)
        except BaseException as e:  # handed to the reader, raised there
            responses.put(e)
        finally:
            key[0] = _random_key()
            responses.put(end)

    def read():
        key[0] = _random_key()
        loaded.announce(1)            # waiting for the model from now: a stalled stream gives way
        _GenerationThread.submit(job)
        item = None
        try:
            while (item := responses.get()) is not end:
                flow.took()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            flow.close()
            while item is not end:    # the job may still run: wait until it has let go of the model
                item = responses.get()
            mx.random.seed(key[0])

    return read()

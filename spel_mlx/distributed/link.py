"""The pipeline's messages between ranks, and the watchdog that bounds every wait.

Messages go one way round the ring the ring backend builds (rank r sends to
r+1 and receives from r-1; the last rank's result goes to rank 0, its ring
neighbour).  Each message is a fixed header (int32 [HEADER]) followed, for a
RUN, by the rows' activations [M, d]; the last rank answers a RUN that asks for
it with the argmax of each row (int32 [M]) or the rows' logits (float32 [M, V]),
and a PING with the header itself.

Waiting: the ring backend receives by retrying a non-blocking socket, a busy loop
for as long as the message takes to come, which takes a core from whatever else
runs there (on one machine, from the rank that computes).  So a rank first waits in
the kernel (``select``) until the socket from its previous rank is readable, and only
then asks MLX to receive; the ring's sockets are found by their addresses in
MLX_HOSTFILE (other backends: MLX's own wait).

Failure handling: MLX raises when a peer's socket closes (a rank that died);
``Link`` turns that into a ``PipelineError`` naming the rank and what it was
waiting for.  A peer that hangs (stopped, or a link that drops without closing)
would block a send or recv forever, so every one runs under the ``Watchdog``: a
thread that ends the process with a one-line error once the wait passes its
deadline.  mx.eval releases the GIL while it waits, so the thread runs.
"""
from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

import mlx.core as mx

HEADER = 8
MAGIC = 0x5E1D0001                 # protocol version 1
RESET, RUN, PING, STATS, STOP = 1, 2, 3, 4, 5
OPS = {RESET: "reset", RUN: "run", PING: "ping", STATS: "stats", STOP: "stop"}
WANT_NOTHING, WANT_ARGMAX, WANT_LOGITS = 0, 1, 2     # RUN flags: what the last rank sends back
STRICT = 1                                            # RESET flags
NO_CONTROL, DISCARD = -1, 0       # header control: commit n >= 1, discard (0) or nothing (-1)
EXIT_LOST = 1                     # exit status of a rank whose pipeline failed


class PipelineError(RuntimeError):
    """A rank of the pipeline failed: lost, timed out, or out of step with this one."""


@dataclass(frozen=True)
class Header:
    op: int
    rows: int = 0            # RUN: M
    control: int = NO_CONTROL  # applied before the op: the last round's commit / discard
    flags: int = 0
    pos: int = 0             # rank 0's committed position after the control
    seq: int = 0             # message number since the pipeline opened
    ring: int = 0            # RESET: the states' ring size

    def array(self) -> mx.array:
        return mx.array([MAGIC, self.op, self.rows, self.control, self.flags, self.pos, self.seq, self.ring],
                        dtype=mx.int32)

    @classmethod
    def parse(cls, a, source: str) -> "Header":
        v = [int(x) for x in np.array(a)]
        if v[0] != MAGIC or v[1] not in OPS:
            raise PipelineError(f"protocol: {source} sent a header this rank cannot read ({v}): "
                                f"are all ranks running the same spel_mlx?")
        return cls(*v[1:])


class Watchdog:
    """Ends the process (one line on stderr, exit EXIT_LOST) when the wait in
    progress outlives its deadline.  One wait at a time, as the rank runs them."""

    def __init__(self, rank: int, stream=None):
        self.rank, self.stream = rank, stream or sys.stderr
        self._cond = threading.Condition()
        self._deadline = self._what = None
        threading.Thread(target=self._watch, name="spel-pipeline-watchdog", daemon=True).start()

    @contextmanager
    def waiting(self, what: str, timeout: float):
        with self._cond:
            self._deadline, self._what, self._timeout = time.monotonic() + timeout, what, timeout
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._deadline = None

    def _watch(self):
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self.stream.write(f"error: pipeline rank {self.rank}: nothing for {self._timeout:g} s while "
                                  f"{self._what}: a rank hung or the link is down (SPEL_PIPELINE_TIMEOUT); "
                                  f"exiting\n")
                self.stream.flush()
                os._exit(EXIT_LOST)


def ring_sockets_from_prev(rank: int) -> list:
    """The ring backend's sockets from the previous rank: those accepted at this rank's
    own addresses in MLX_HOSTFILE (duplicates, only ever waited on); [] when there is
    no ring hostfile or none is found."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            nodes = json.load(f)
        own = {(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in nodes[rank]}
        fds = [int(n) for n in os.listdir("/dev/fd")]
    except (KeyError, OSError, ValueError, IndexError, TypeError, AttributeError):
        return []
    found = []
    for fd in fds:
        try:
            s = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            if s.getsockname()[:2] in own and s.getpeername():
                found.append(s)
                continue
        except OSError:
            pass
        s.close()
    return found


class Link:
    """This rank's side of the ring: headers and arrays to the next rank, from the
    previous one, each under the watchdog; `timeout` bounds every wait."""

    def __init__(self, group, timeout: float, watchdog: Watchdog | None = None):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.timeout = timeout
        self.watchdog = watchdog or Watchdog(self.rank)
        self._streams = threading.local()
        self.from_prev = ring_sockets_from_prev(self.rank)
        self.comm_s = 0.0                      # seconds spent in sends and receives

    @property
    def stream(self):
        """This thread's communication stream: on the CPU, apart from the default stream
        (MLX streams belong to the thread that made them; rank 0's keepalive has its own)."""
        s = getattr(self._streams, "s", None)
        if s is None:
            s = self._streams.s = mx.new_stream(mx.cpu)
        return s

    def _eval(self, a, what: str, peer: int, timeout: float | None, ready: bool = False):
        """Evaluate a send / recv under the watchdog; `ready`: first wait in the kernel
        until the previous rank's socket has data (or closed)."""
        t0 = time.perf_counter()
        try:
            with self.watchdog.waiting(what, self.timeout if timeout is None else timeout):
                if ready and self.from_prev:
                    select.select(self.from_prev, [], [])
                mx.eval(a)
        except RuntimeError as e:
            if "connection" not in str(e).lower():
                raise PipelineError(f"pipeline rank {self.rank}: {what} failed: {e}") from None
            raise PipelineError(f"pipeline rank {self.rank}: lost rank {peer} while {what} ({e}): "
                                f"it exited or its host is unreachable; see its own output") from None
        finally:
            self.comm_s += time.perf_counter() - t0
        return a

    def send(self, a: mx.array, what: str) -> None:
        self._eval(mx.distributed.send(a, self.next, group=self.group, stream=self.stream),
                   f"sending {what} to rank {self.next}", self.next, None)

    def recv(self, shape, dtype, what: str, timeout: float | None = None) -> mx.array:
        return self._eval(mx.distributed.recv(shape, dtype, self.prev, group=self.group, stream=self.stream),
                          f"waiting for {what} from rank {self.prev}", self.prev, timeout, ready=True)

    def send_header(self, h: Header) -> None:
        self.send(h.array(), OPS[h.op] + " header")

    def recv_header(self, what: str = "the next message", timeout: float | None = None) -> Header:
        return Header.parse(self.recv((HEADER,), mx.int32, what, timeout), f"rank {self.prev}")

    def gather_rows(self, row, what: str, timeout: float | None = None, dtype=np.float32) -> np.ndarray:
        """Every rank's `row` ([F] of `dtype`) as [size, F] on every rank: one all_sum
        of a matrix in which each rank fills its own row."""
        row = np.asarray(row, dtype=dtype)
        m = np.zeros((self.size, row.shape[0]), dtype)
        m[self.rank] = row
        out = mx.distributed.all_sum(mx.array(m), group=self.group, stream=self.stream)
        return np.array(self._eval(out, f"gathering {what}", self.prev, timeout))


STATS_FIELDS = ("runs", "rows", "compute_s", "compute_median_s", "prefill_runs", "prefill_s", "comm_s")


class StageCounters:
    """What a rank reports for STATS: RUNs that answer (verifications) and those that
    do not (prefill chunks), the seconds its stage computed for them (in all, and the
    median of one verification: robust to other work on the machine), and the seconds
    it spent in sends and receives."""

    def __init__(self, link: Link):
        self.link = link
        self.reset()

    def reset(self):
        self.rows = self.prefill_runs = 0
        self.times, self.prefill_s = [], 0.0
        self._comm0 = self.link.comm_s

    def ran(self, rows: int, seconds: float, answered: bool):
        if answered:
            self.rows += rows
            self.times.append(seconds)
        else:
            self.prefill_runs += 1
            self.prefill_s += seconds

    def row(self) -> list:
        median = float(np.median(self.times)) if self.times else 0.0
        return [len(self.times), self.rows, sum(self.times), median, self.prefill_runs, self.prefill_s,
                self.link.comm_s - self._comm0]

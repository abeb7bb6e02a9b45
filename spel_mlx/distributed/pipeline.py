"""Opening a pipeline: every rank loads its stage, then all agree they hold one model.

``open_pipeline`` is collective (every process of the group calls it).  Each rank
resolves the checkpoint and configuration, takes its slice of layers
(split.split_layers), reads only those tensors, and then all ranks exchange
one row each (loaded or not, the config, a checksum of a few shared bytes):
a rank that failed, or loaded another model, stops every rank with an error
naming it.  Rank 0 also loads the tokenizer and keeps views of the draft's
tensors for the C draft (read when a proposer is built).

``Pipeline`` is rank 0's handle: the messages it posts (numbered, carrying the
last round's commit), a keepalive that pings the ring when the decoder is idle
for a quarter of the timeout (so no rank waits past it while all are alive),
STATS, and STOP on close.  Other ranks call ``serve``.
"""
from __future__ import annotations

import threading
import time
import zlib

import numpy as np

import mlx.core as mx

from ..api.loading import LoadedModel
from ..checkpoints.rules import implied_memory, machine_memory
from ..settings import SettingError, setting
from ..model.backends import DeviceError, device_scope, placement_device
from ..loading import LoadError, checkpoint_path, decoding_config, decoding_tokenizer, reading_checkpoint, select_ops
from .link import (NO_CONTROL, PING, STATS, STATS_FIELDS, STOP, Header, Link, PipelineError, StageCounters,
                   Watchdog)
from .runner import PipelineTarget
from .split import draft_tensor_names, split_layers
from .stage import CheckpointTensors, StageModel
from .worker import serve as serve_stage

START_TIMEOUT = 600.0       # loading: the slowest rank's load, at least
FINGERPRINT = ("ok", "d_model", "n_layers", "n_heads", "head_dim", "d_ff", "vocab", "max_seq", "attn_period",
               "checksum")


def pipeline_timeout(timeout=None) -> float:
    if timeout is None:
        try:
            timeout = setting("SPEL_PIPELINE_TIMEOUT")
        except SettingError as e:
            raise LoadError(str(e)) from None
    if not timeout > 0:
        raise LoadError(f"pipeline timeout {timeout!r}: must be > 0 seconds")
    return float(timeout)


class Pipeline:
    """This process's place in the pipeline: its stage and link; on rank 0 also the
    LoadedModel to decode with (``loaded``) and the tokenizer."""

    def __init__(self, group, link: Link, stage: StageModel, stages: list, device: str):
        self.group, self.link, self.stage, self.stages, self.device = group, link, stage, stages, device
        self.rank, self.size = group.rank(), group.size()
        self.loaded = self.tokenizer = None
        self.counters = StageCounters(link)
        self.lock = threading.RLock()       # one message exchange at a time (decoder or keepalive)
        self.seq = 0
        self.control = NO_CONTROL           # the commit / discard the next message carries
        self.broken = self.closed = False
        self.final_stats = None
        self._last_post = time.monotonic()
        self.pings = 0                      # the keepalive's pings so far (tests idle by them)
        if self.rank == 0:
            threading.Thread(target=self._keepalive, name="spel-pipeline-keepalive", daemon=True).start()

    # --- rank 0 -----------------------------------------------------------------------
    def runner(self, ring: int, strict: bool):
        """The decoder's target side (SpeculativeDecoder's `runner`)."""
        return PipelineTarget(self, ring, strict)

    def post(self, op: int, **fields) -> Header:
        """Send the next header (numbered, with the pending control) down the ring."""
        if self.closed or self.broken:
            raise PipelineError("the pipeline is " + ("closed" if self.closed else "broken by an earlier error"))
        self.seq += 1
        h = Header(op, control=self.control, seq=self.seq, **fields)
        self.control = NO_CONTROL
        self.link.send_header(h)
        self._last_post = time.monotonic()
        return h

    def set_control(self, control: int) -> None:
        if self.control != NO_CONTROL:
            raise PipelineError(f"protocol: control {control} while {self.control} is still unsent")
        self.control = control

    def exchange(self, fn):
        """Run one message exchange under the lock; an error inside breaks the pipeline
        (the ring may hold half a message), so close() no longer talks to it."""
        with self.lock:
            try:
                return fn()
            except BaseException:
                self.broken = True
                raise

    def stats(self) -> list:
        """Every rank's counters since the last STATS (dicts of STATS_FIELDS), then reset."""
        def go():
            self.post(STATS)
            return self._gather()
        return self.exchange(go)

    def _gather(self) -> list:
        rows = self.link.gather_rows(self.counters.row(), "the other ranks' counters")
        self.counters.reset()
        return [dict(zip(STATS_FIELDS, (float(x) for x in r))) for r in rows]

    def summary(self) -> dict:
        """The split and, once closed, every rank's counters (for --stats)."""
        return {"ranks": self.size, "layers": [[s.start, s.end] for s in self.stages],
                "stage_bytes": [s.nbytes for s in self.stages], "per_rank": self.final_stats}

    def close(self) -> None:
        """STOP every rank (they exit their serve loop); keeps their last counters in
        ``final_stats``.  Quiet when the pipeline already failed."""
        with self.lock:
            if self.closed or self.rank != 0:
                return
            if not self.broken:
                try:
                    self.post(STOP)
                    self.final_stats = self._gather()
                except PipelineError:
                    self.broken = True
            self.closed = True

    def _keepalive(self):
        interval = self.link.timeout / 4
        while True:
            time.sleep(interval / 4)
            with self.lock:
                if self.closed or self.broken:
                    return
                if time.monotonic() - self._last_post < interval:
                    continue
                try:
                    self.exchange(self._ping)
                except PipelineError:
                    return              # the decoder meets the same error at its next message

    def _ping(self):
        h = self.post(PING)
        echo = self.link.recv_header("the keepalive's echo")
        if echo != h:
            raise PipelineError(f"protocol: the keepalive {h} came back as {echo}")
        self.pings += 1


def _fingerprint(cfg, tensors) -> list:
    """The config and a checksum of a few bytes every rank reads cheaply (the first rows
    of the embedding and the LM head), so ranks that loaded different files disagree."""
    crc = zlib.crc32(tensors.first_row("lm_head.weight"), zlib.crc32(tensors.first_row("tok_emb.weight")))
    return [1] + [getattr(cfg, f) for f in FINGERPRINT[1:-1]] + [crc & 0x7FFFFFFF]


def check_stage_memory(cfg, stage, have=None) -> None:
    """Refuse (LoadError) a stage this process cannot hold: its FP32 tensors, and on
    rank 0 the C draft (the whole model's check, checkpoints.rules, would refuse the
    very models a pipeline is for).  `have`: bytes available (None: machine_memory())."""
    need = stage.nbytes + (implied_memory(cfg)["C draft"] if stage.first else 0)
    have = machine_memory() if have is None else have
    if have is not None and need > have:
        raise LoadError(f"--pipeline: rank {stage.rank}'s stage (layers {stage.start}..{stage.end - 1}) needs about "
                        f"{need / 2**30:.2f} GiB but this process can allocate {have / 2**30:.2f} GiB: "
                        f"use more ranks")


def _load_stage(rank, size, checkpoint, config, tokenizer, device):
    path = checkpoint_path(checkpoint)
    with reading_checkpoint(path):
        tensors = CheckpointTensors(path)
    cfg = decoding_config(tensors.cfg, config)
    try:
        stages = split_layers(cfg, size)
    except ValueError as e:
        raise LoadError(f"--pipeline: {e}") from None
    check_stage_memory(cfg, stages[rank])
    tok = decoding_tokenizer(tokenizer, path, cfg) if rank == 0 else None
    stage = StageModel(cfg, stages[rank])
    with reading_checkpoint(path):
        stage.load_stage_weights(tensors)
    select_ops(stage, device)
    draft = None
    if rank == 0:       # views into the map; the C draft reads them when it is built
        draft = {n: tensors.get(n) for n in draft_tensor_names(cfg)}
    return path, cfg, stages, stage, tok, draft, _fingerprint(cfg, tensors)


def open_pipeline(checkpoint=None, *, config=None, tokenizer=None, placement=None, backend: str = "any",
                  timeout: float | None = None) -> Pipeline:
    """Collective: load this rank's stage of `checkpoint` and check that every rank
    loaded the same model.  Rank 0's Pipeline carries ``loaded`` (a LoadedModel whose
    target is the pipeline) and ``tokenizer``; the others then call ``serve``.
    `placement`: where each rank's stage runs, as ``spel_mlx.load``'s (None: the GPU
    where MLX has one, else the CPU)."""
    timeout = pipeline_timeout(timeout)
    try:
        device = placement_device(placement)
    except DeviceError as e:
        raise LoadError(str(e)) from None
    group = mx.distributed.init(backend=backend)
    rank, size = group.rank(), group.size()
    if size < 2:
        raise LoadError("--pipeline needs 2 or more processes: start them with mlx.launch (docs/distributed.md); "
                        "one process runs the whole model without --pipeline")
    link = Link(group, timeout, Watchdog(rank))
    error, row = None, [0] * len(FINGERPRINT)
    try:
        path, cfg, stages, stage, tok, draft, row = _load_stage(rank, size, checkpoint, config, tokenizer, device)
    except Exception as e:          # every rank must reach the exchange below, or the others wait
        error = e
    rows = link.gather_rows(row, "every rank's loading result", max(timeout, START_TIMEOUT), np.int32)
    if error is not None:
        raise error
    for r in range(size):
        if rows[r][0] != 1:
            raise PipelineError(f"pipeline rank {r} could not load its stage (its error is in its own output)")
        diff = [f for f, a, b in zip(FINGERPRINT, rows[r], rows[0]) if a != b]
        if diff:
            raise PipelineError(f"pipeline rank {r} loaded another model than rank 0 (differs in "
                                f"{', '.join(diff)}): give every rank the same checkpoint and --config")
    pipe = Pipeline(group, link, stage, stages, device)
    if rank == 0:
        pipe.loaded = LoadedModel(stage, draft, path, device, pipeline=pipe)
        pipe.tokenizer = tok
    return pipe


def serve(pipe: Pipeline) -> list:
    """A rank after the first: run its stage until rank 0 stops the pipeline."""
    with device_scope(pipe.device):
        pipe.final_stats = serve_stage(pipe.stage, pipe.link)
    return pipe.final_stats

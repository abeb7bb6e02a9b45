"""``load(path=None)``: a checkpoint, its tokenizer and the MLX model, ready to generate."""
from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..config import ModelConfig
from ..loading import LoadError, NoCheckpoint, load_for_decoding
from ..model.backends import DeviceError, placement_device
from ..model.state import KV_DTYPES
from .warm import PREPARE, start_draft, warm_up

__all__ = ["LoadError", "LoadedModel", "NoCheckpoint", "load"]


@dataclass(eq=False)
class LoadedModel:
    """What ``load`` returns as the model: the MLX target (with its FP32 draft layers),
    the FP32 weights the C draft is built from (its layers, the embedding, final norm
    and head; layout.draft_engine_names), and the proposers built so
    far (reused across calls; `close` releases them).  One generation runs at a time
    (`hold`, around `lock`): the C draft must never be entered from two threads.
    `device` is where the target runs, "cpu" | "gpu"; the C draft always runs on CPU cores."""

    model: object            # spel_mlx.model.SpelModel (a pipeline: rank 0's StageModel)
    weights: dict
    source: str
    device: str = "cpu"
    drafts: OrderedDict = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pipeline: object = None  # a target split across processes (spel_mlx.distributed.Pipeline)
    waiting: int = 0         # calls waiting for `lock` (a stream nobody reads gives way to them)
    turn: threading.Condition = field(default_factory=threading.Condition)   # guards `waiting`
    prepared: dict = field(default_factory=dict)   # C drafts being built at load: (threads, ring) -> Future

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    def announce(self, n: int):
        """Count `n` more (or fewer) calls waiting for the model, and wake whoever watches."""
        with self.turn:
            self.waiting += n
            self.turn.notify_all()

    @contextmanager
    def hold(self, announced: bool = False):
        """The model for one generation; meanwhile the call counts in `waiting` (already
        counted when `announced`: a stream counts itself when it is submitted)."""
        if not announced:
            self.announce(1)
        try:
            self.lock.acquire()
        finally:
            self.announce(-1)
        try:
            yield
        finally:
            self.lock.release()

    def close(self):
        """Close the cached proposers (the C draft's threads and buffers) and stop the
        pipeline's other processes, if any."""
        with self.hold():
            while self.drafts:
                self.drafts.popitem()[1].close()
            while self.prepared:
                built = self.prepared.popitem()[1]
                if built.exception() is None:      # waits for a build still running
                    built.result().close()
            if self.pipeline is not None:
                self.pipeline.close()


def load(path=None, *, tokenizer=None, config=None, placement=None, kv_cache="float32", prepare="spec"):
    """``(model, tokenizer)`` for a SPELW001 file or a safetensors folder.

    path None: $SPEL_WEIGHTS, else the shipped model.  tokenizer: a SentencePiece
    file (default: the one beside the checkpoint, else the shipped one; vocab 128 =
    the original's ASCII bytes).  config: overrides as ``"k=v,..."`` or a dict; they
    must agree with the checkpoint's header (only spec_k may differ).  placement:
    where the target runs, "gpu" (MLX's GPU: Metal or CUDA; a LoadError when there is
    none), "cpu", or None: the GPU where MLX has one, else the CPU.  kv_cache: the
    target's K/V cache dtype, "float32" (SPEC's exact model) or "float16" (half the
    bytes a long context reads per token; k and v rounded once as they are written,
    docs/model.md).  prepare: the one-time costs paid now rather than in the first call,
    "spec" (the target's layouts for its step and verification, the default C draft built
    meanwhile on another thread), "ar" (the step's layouts) or "none" (api/warm.py).
    Failures are LoadError, whose message names what is wrong, or NoCheckpoint when no
    path was given and no trained checkpoint is installed."""
    if kv_cache not in KV_DTYPES:
        raise LoadError(f"kv_cache={kv_cache!r}: expected one of {', '.join(KV_DTYPES)}")
    if prepare not in PREPARE:
        raise LoadError(f"prepare={prepare!r}: expected one of {', '.join(PREPARE)}")
    try:
        device = placement_device(placement)
    except DeviceError as e:
        raise LoadError(str(e)) from None
    prepared = {}      # the C draft, built from when the checkpoint is open
    try:
        ck, _, tok, model = load_for_decoding(None if path is None else str(path), config, None, tokenizer,
                                              device=device,
                                              opened=lambda cfg, w: prepared.update(start_draft(cfg, w, prepare)))
    except BaseException:
        for built in prepared.values():     # a load that failed leaves no draft behind
            if built.exception() is None:
                built.result().close()
        raise
    model.kv_cache = kv_cache
    loaded = LoadedModel(model, ck.weights, ck.source, device, prepared=prepared)   # the C draft's numpy weights only
    warm_up(loaded, prepare)
    return loaded, tok

"""``load(path=None)``: a checkpoint, its tokenizer and the MLX model, ready to generate."""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from ..checkpoints import CheckpointError, default_checkpoint_dir, load_checkpoint
from ..config import ConfigError, ModelConfig, resolve_config
from ..tokenizer import TokenizerError, load_tokenizer


class LoadError(ValueError):
    """The checkpoint, its config, its tokenizer or the kernel choice cannot be used;
    the message starts with which of them and names the file, field or offset."""


class NoCheckpointError(LoadError):
    """No path was given and no trained checkpoint is installed."""


@dataclass(eq=False)
class LoadedModel:
    """What ``load`` returns as the model: the MLX target (with its FP32 draft layers),
    the FP32 weights the C draft quantizes its layers from, and the draft engines built
    so far (reused across calls; `close` releases them).  One generation runs at a time
    (`lock`): the C draft must never be entered from two threads."""

    model: object            # spel_mlx.model.SpelModel
    weights: dict
    source: str
    drafts: OrderedDict = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    def close(self):
        """Close the cached draft engines (the C draft's threads and buffers)."""
        with self.lock:
            while self.drafts:
                self.drafts.popitem()[1].close()


def _tokenizer_path(tokenizer, source: str, vocab: int):
    if tokenizer:
        return os.fspath(tokenizer)
    if vocab == 128:  # the original's ASCII byte vocabulary, whatever lies beside the file
        return None
    folder = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
    beside = os.path.join(folder, "tokenizer.model")
    return beside if os.path.isfile(beside) else None


def load(path=None, *, tokenizer=None, config=None):
    """``(model, tokenizer)`` for a SPELW001 file or a safetensors folder.

    path None: $SPEL_WEIGHTS, else the shipped model.  tokenizer: a SentencePiece
    file (default: the one beside the checkpoint, else the shipped one; vocab 128 =
    the original's ASCII bytes).  config: overrides as ``"k=v,..."`` or a dict; they
    must agree with the checkpoint's header (only spec_k may differ).  Every failure
    is a LoadError whose message names what is wrong."""
    from .. import kernels
    from ..model import SpelModel

    if path is None:
        path = os.environ.get("SPEL_WEIGHTS", "").strip() or None
    if path is None:
        try:
            path = str(default_checkpoint_dir())
        except CheckpointError as e:
            raise NoCheckpointError(str(e)) from None
    path = os.fspath(path)
    try:
        ck = load_checkpoint(path)
    except CheckpointError as e:
        raise LoadError(f"checkpoint: {e}") from None
    except (OSError, ValueError) as e:
        raise LoadError(f"checkpoint {path}: {e}") from None
    try:
        cfg = resolve_config(checkpoint=ck.cfg, overrides=config)
    except ConfigError as e:
        raise LoadError(f"config: {e}") from None
    try:
        tok = load_tokenizer(cfg.vocab, _tokenizer_path(tokenizer, ck.source, cfg.vocab))
    except TokenizerError as e:
        raise LoadError(f"tokenizer: {e}") from None
    if getattr(tok, "vocab_size", cfg.vocab) != cfg.vocab:
        raise LoadError(f"tokenizer: {tok.name} has {tok.vocab_size} symbols but the checkpoint's "
                        f"vocab is {cfg.vocab}")
    model = SpelModel.from_weights(cfg, ck.weights)
    try:
        model.set_ops(kernels.select())  # SPEL_KERNELS; auto = Metal kernels where available
    except ValueError as e:
        raise LoadError(f"SPEL_KERNELS: {e}") from None
    return LoadedModel(model, ck.weights, ck.source), tok

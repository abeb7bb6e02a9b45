"""A checkpoint ready to decode: weights, configuration, tokenizer, model and its ops,
every failure a one-line error (the command-line tools print it)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import contextmanager


class LoadError(ValueError):
    """The checkpoint, configuration, tokenizer or ops selection is unusable."""


class NoCheckpoint(Exception):
    """No checkpoint was given and no trained one is installed."""


def find_tokenizer_path(tokenizer, ckpt_path: str, vocab: int):
    """The tokenizer given, else one beside the checkpoint (any entry of that name: one
    that cannot be read is an error, never a fall back), else None (the shipped one)."""
    if tokenizer:
        return tokenizer
    if vocab == 128:  # the original's ASCII byte vocabulary, whatever lies beside the file
        return None
    folder = ckpt_path if os.path.isdir(ckpt_path) else os.path.dirname(os.path.abspath(ckpt_path))
    beside = os.path.join(folder, "tokenizer.model")
    return beside if os.path.lexists(beside) else None


def checkpoint_path(checkpoint=None) -> str:
    """`checkpoint` (a path, or a shipped model's short name), else SPEL_WEIGHTS, else
    the installed default (NoCheckpoint when none)."""
    from .checkpoints import CheckpointError
    from .checkpoints.load import resolve_checkpoint_path
    try:
        return resolve_checkpoint_path(checkpoint)
    except CheckpointError as e:
        raise NoCheckpoint(str(e)) from None


@contextmanager
def reading_checkpoint(path: str):
    """What reading the checkpoint at `path` raises, as a one-line LoadError."""
    from .checkpoints import CheckpointError
    try:
        yield
    except CheckpointError as e:
        raise LoadError(f"checkpoint: {e}") from None
    except (OSError, ValueError) as e:
        raise LoadError(f"checkpoint {path}: {e}") from None


class HandOffWeights(Mapping):
    """A checkpoint's weights as the MLX model copies them: a tensor not in `keep`
    leaves `ck.weights` once read, so its numpy copy is freed as soon as MLX holds
    the tensor (a mapped file's pages are dropped as with page_dropping_weights).
    `read(name, tensor)`, where given, turns each tensor into what the model gets."""

    def __init__(self, ck, keep, read=None):
        self._src, self._dict, self._keep = ck.page_dropping_weights(), ck.weights, set(keep)
        self._read = read

    def __getitem__(self, name):
        a = self._src[name]
        if name not in self._keep:
            self._dict.pop(name, None)
        return self._read(name, a) if self._read is not None else a

    def __contains__(self, name):
        return name in self._dict

    def __iter__(self):
        return iter(list(self._src))

    def __len__(self):
        return len(self._src)


class CheckedReader:
    """For HandOffWeights: a float32 tensor that views a mapped checkpoint file becomes
    the MLX array read from the file with pread (no page faults on the mapping;
    docs/never_slower.md), checked for NaN and infinity as it arrives; any other tensor
    is checked with numpy and passed on.  `warn` then names the non-finite ones, as
    load_checkpoint would have.  `for_device` gives None off the CPU or without the
    fused CPU extension."""

    def __init__(self, ext):
        from .platform import huge_pages
        self._ext, self.nonfinite = ext, []
        self._huge = huge_pages.state() == "on"

    @classmethod
    def for_device(cls, device=None):
        import sys

        import mlx.core as mx

        from .model.cpu_ops import _spel_cpu
        on_cpu = device == "cpu" if device is not None else mx.default_device() == mx.cpu
        if _spel_cpu is None or sys.byteorder != "little" or not on_cpu:
            return None
        return cls(_spel_cpu)

    def __call__(self, name, a):
        import numpy as np

        from .checkpoints.files import mapped_region
        from .checkpoints.load import all_finite
        region = mapped_region(a) if getattr(a, "dtype", None) == np.float32 else None
        if region is not None:
            path, offset, dev, ino = region
            try:
                out, finite = self._ext.read_f32(path, offset, list(a.shape), dev, ino, self._huge)
            except RuntimeError:
                pass   # the file changed under its mapping: the mapped bytes, as before
            else:
                if not finite:
                    self.nonfinite.append(name)
                return out
        if not all_finite(a):
            self.nonfinite.append(name)
        return a

    def warn(self, source: str) -> None:
        from .checkpoints.load import warn_nonfinite_names
        warn_nonfinite_names(source, self.nonfinite, stacklevel=4)


def load_for_decoding(checkpoint=None, config=None, spec_k=None, tokenizer=None, device=None,
                      opened=None):
    """(checkpoint, config, tokenizer, model).  `checkpoint` None: SPEL_WEIGHTS, else
    the installed default; `config`: overrides "k=v,..." that must agree with it;
    `device`: where the target will run, "cpu" | "gpu" (None: the current default
    device), which decides its ops (spel_mlx.model.backends).  The checkpoint's
    ``weights`` keep only what the C draft reads (layout.draft_engine_names): the
    rest lives in the model.  `opened(config, weights)`, where given, is called once
    the checkpoint is open and before the model reads its weights (``load`` starts
    the C draft's build there)."""
    from .layout import draft_engine_names
    from .reader import load_checkpoint

    path = checkpoint_path(checkpoint)
    read = CheckedReader.for_device(device)
    with reading_checkpoint(path):
        ck = load_checkpoint(path, check_finite=read is None)
    cfg = decoding_config(ck.cfg, config, spec_k)
    tok = decoding_tokenizer(tokenizer, ck.source, cfg)
    if opened is not None:      # what the C draft reads (the model's reads take the rest out of ck.weights)
        opened(cfg, {n: ck.weights[n] for n in draft_engine_names(cfg) if n in ck.weights})
    from .model import SpelModel
    model = SpelModel.from_weights(cfg, HandOffWeights(ck, draft_engine_names(cfg), read))
    if read is not None:
        read.warn(ck.source)
    select_ops(model, device)
    return ck, cfg, tok, model


def decoding_config(ck_cfg, config=None, spec_k=None):
    """The checkpoint's config with the overrides `config` (which must agree with it) and spec_k."""
    from .config import ConfigError, resolve_config
    try:
        cfg = resolve_config(checkpoint=ck_cfg, overrides=config)
        if spec_k is not None:
            cfg = resolve_config(checkpoint=cfg, overrides={"spec_k": spec_k}, use_env=False)
    except ConfigError as e:
        raise LoadError(f"config: {e}") from None
    return cfg


def decoding_tokenizer(tokenizer, source: str, cfg):
    """The tokenizer for a checkpoint at `source` (see find_tokenizer_path), checked against its vocab."""
    from .tokenizer import TokenizerError, load_tokenizer
    try:
        tok = load_tokenizer(cfg.vocab, find_tokenizer_path(tokenizer, source, cfg.vocab))
    except TokenizerError as e:
        raise LoadError(f"tokenizer: {e}") from None
    if getattr(tok, "vocab_size", cfg.vocab) != cfg.vocab:
        raise LoadError(f"tokenizer: {tok.name} has {tok.vocab_size} symbols but the checkpoint's "
                        f"vocab is {cfg.vocab}")
    return tok


def select_ops(model, device=None) -> None:
    """The ops of SPEL_KERNELS for `model` on `device` (None: the current default device;
    auto: by device)."""
    from .model import select
    try:
        model.set_ops(select(device=device), device)
    except ValueError as e:
        raise LoadError(f"SPEL_KERNELS: {e}") from None

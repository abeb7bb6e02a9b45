"""A checkpoint ready to decode: weights, configuration, tokenizer, model and its ops,
every failure a one-line error (the command-line tools print it)."""
from __future__ import annotations

import os


class LoadError(ValueError):
    """The checkpoint, configuration, tokenizer or ops selection is unusable."""


class NoCheckpoint(Exception):
    """No checkpoint was given and no trained one is installed."""


def find_tokenizer_path(tokenizer, ckpt_path: str, vocab: int):
    """The tokenizer given, else one beside the checkpoint, else None (the shipped one)."""
    if tokenizer:
        return tokenizer
    if vocab == 128:  # the original's ASCII byte vocabulary, whatever lies beside the file
        return None
    folder = ckpt_path if os.path.isdir(ckpt_path) else os.path.dirname(os.path.abspath(ckpt_path))
    beside = os.path.join(folder, "tokenizer.model")
    return beside if os.path.isfile(beside) else None


def load_for_decoding(checkpoint=None, config=None, spec_k=None, tokenizer=None, device=None):
    """(checkpoint, config, tokenizer, model).  `checkpoint` None: SPEL_WEIGHTS, else
    the installed default; `config`: overrides "k=v,..." that must agree with it;
    `device`: where the target will run, "cpu" | "gpu" (None: the current default
    device), which decides its ops (spel_mlx.model.backends)."""
    from .checkpoints import CheckpointError, default_checkpoint_dir, load_checkpoint
    from .config import ConfigError, resolve_config
    from .tokenizer import TokenizerError, load_tokenizer

    path = checkpoint or os.environ.get("SPEL_WEIGHTS", "").strip() or None
    if path is None:
        try:
            path = str(default_checkpoint_dir())
        except CheckpointError as e:
            raise NoCheckpoint(str(e)) from None
    try:
        ck = load_checkpoint(path)
    except CheckpointError as e:
        raise LoadError(f"checkpoint: {e}") from None
    except (OSError, ValueError) as e:
        raise LoadError(f"checkpoint {path}: {e}") from None
    try:
        cfg = resolve_config(checkpoint=ck.cfg, overrides=config)
        if spec_k is not None:
            cfg = resolve_config(checkpoint=cfg, overrides={"spec_k": spec_k}, use_env=False)
    except ConfigError as e:
        raise LoadError(f"config: {e}") from None
    try:
        tok = load_tokenizer(cfg.vocab, find_tokenizer_path(tokenizer, ck.source, cfg.vocab))
    except TokenizerError as e:
        raise LoadError(f"tokenizer: {e}") from None
    if getattr(tok, "vocab_size", cfg.vocab) != cfg.vocab:
        raise LoadError(f"tokenizer: {tok.name} has {tok.vocab_size} symbols but the checkpoint's "
                        f"vocab is {cfg.vocab}")
    from .model import SpelModel, select
    model = SpelModel.from_weights(cfg, ck.weights)
    try:
        model.set_ops(select(device=device), device)  # SPEL_KERNELS; auto: by device
    except ValueError as e:
        raise LoadError(f"SPEL_KERNELS: {e}") from None
    return ck, cfg, tok, model

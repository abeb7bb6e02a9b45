"""A loaded checkpoint (``Checkpoint``), where one is found (SPEL_WEIGHTS, the shipped
default), and the checks every loaded one gets.  ``spel_mlx.reader.load_checkpoint``
reads either form into one: a SPELW001 file (this package) or a safetensors model
folder (spel_mlx.converters).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..settings import setting
from .files import PageDroppingWeights
from .footer import Golden
from .rules import CheckpointError, NonFiniteWeightsWarning
from .spelw import MAGIC

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_DIR = ASSETS_DIR / "default"
DEFAULT_MODEL_FILE = "model.safetensors"
# the models in the package, by short name -> their folder under assets/
SHIPPED = {"spel-21m": "default", "spel-8m": "spel-8m"}


@dataclass
class Checkpoint:
    cfg: ModelConfig
    weights: dict            # name -> np.float32 array, layout order
    golden: Golden | None
    source: str              # the path that was loaded
    format: str = "spelw"    # "spelw" | "safetensors"
    stored_dtype: str = "F32"  # on-disk dtype of the weights ("F32", "F16", "BF16" or "mixed"; ", draft packed")
    file_size: int = 0       # bytes on disk (all files of a folder)
    _release: object = field(default=None, repr=False, compare=False)
    _release_one: object = field(default=None, repr=False, compare=False)

    def page_dropping_weights(self):
        """``weights`` as a mapping that drops each tensor's mapped pages when the
        next one is fetched (for consumers that copy tensor by tensor)."""
        if self._release_one is None:
            return self.weights
        return PageDroppingWeights(self.weights, self._release_one)

    def release_pages(self):
        """Drop the mapped file pages from this process's resident set (after a
        consumer such as the MLX model has copied the weights); views stay valid."""
        if self._release is not None:
            self._release()

    @property
    def target_params(self) -> int:
        return self.cfg.target_params()

    @property
    def draft_params(self) -> int:
        return self.cfg.draft_params()


def default_checkpoint_dir() -> Path:
    """The shipped default model folder; raises CheckpointError when none is installed."""
    if not (DEFAULT_DIR / DEFAULT_MODEL_FILE).is_file():
        raise CheckpointError(
            DEFAULT_DIR, f"no trained checkpoint is installed ({DEFAULT_MODEL_FILE} missing). Install one with "
            f"`python -m spel_mlx.convert TRAINED.spelw {DEFAULT_DIR}`, or pass a checkpoint path / set "
            f"SPEL_WEIGHTS; for a random model run `python -m spel_mlx.synth --preset 21m --seed 0 --out m.spelw`")
    return DEFAULT_DIR


def shipped_path(path) -> str:
    """`path`, or the folder of the shipped model of that short name (SHIPPED) when no
    file or folder of that name exists here (a local path always wins)."""
    path = os.fspath(path)
    if path in SHIPPED and not os.path.lexists(path):
        return str(ASSETS_DIR / SHIPPED[path])
    return path


def resolve_checkpoint_path(path=None) -> str:
    """``path``, else $SPEL_WEIGHTS, else the shipped default folder; a short name of
    SHIPPED stands for that shipped model."""
    path = path or setting("SPEL_WEIGHTS")
    if path:
        return shipped_path(path)
    return str(default_checkpoint_dir())


def is_spelw(path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == MAGIC
    except OSError:
        return False


def all_finite(a) -> bool:
    """Whether a tensor holds no NaN and no +-inf (min/max propagate both)."""
    return not a.size or bool(np.isfinite(a.min()) and np.isfinite(a.max()))


def nonfinite_tensors(ck: Checkpoint) -> list:
    """Names of the weights holding NaN or +-inf (each tensor's mapped pages are
    dropped once looked at)."""
    bad = []
    for name, a in ck.weights.items():
        if not all_finite(a):
            bad.append(name)
        if ck._release_one is not None:
            ck._release_one(name)
    return bad


def warn_nonfinite(ck: Checkpoint):
    warn_nonfinite_names(ck.source, nonfinite_tensors(ck), stacklevel=4)


def warn_nonfinite_names(source: str, bad: list, stacklevel: int = 3):
    """The NonFiniteWeightsWarning for the weights `bad` of the checkpoint at `source` (none: nothing)."""
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        warnings.warn(f"{source}: non-finite weights (NaN or inf) in {', '.join(bad[:3])}{more}: "
                      f"the model's outputs will not be meaningful", NonFiniteWeightsWarning, stacklevel=stacklevel)

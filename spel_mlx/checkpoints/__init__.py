"""Checkpoints: the SPELW001 format, the golden footer, and loading either form.

* ``rules``: ``CheckpointError`` and the checks both readers share;
* ``footer``: the golden footer (``Golden``);
* ``files``: maps, page dropping, atomic output, progress;
* ``spelw``: the SPELW001 reader and streaming writer (SPEC 6);
* ``load``: ``load_checkpoint`` of a SPELW001 file or a safetensors folder.

The safetensors form lives in ``spel_mlx.converters`` (the top-level ``converters/``
folder).  See docs/checkpoints.md.
"""
from .files import Progress
from .footer import Golden
from .load import Checkpoint, default_checkpoint_dir, is_spelw, load_checkpoint
from .rules import CheckpointError, CheckpointTooLarge, NonFiniteWeightsWarning
from .spelw import SpelwFile, SpelwWriter, read_header, read_spelw, write_spelw

__all__ = ["CheckpointError", "CheckpointTooLarge", "NonFiniteWeightsWarning", "Golden", "Progress", "Checkpoint", "load_checkpoint", "default_checkpoint_dir",
           "is_spelw", "SpelwFile", "SpelwWriter", "read_header", "read_spelw", "write_spelw"]

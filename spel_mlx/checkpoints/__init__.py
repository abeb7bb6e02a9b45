"""Checkpoints: the SPELW001 format, the golden footer, a loaded checkpoint.

* ``rules``: ``CheckpointError`` and the checks both readers share;
* ``footer``: the golden footer (``Golden``);
* ``files``: maps, page dropping, atomic output, progress;
* ``spelw``: the SPELW001 reader and streaming writer (SPEC 6);
* ``load``: ``Checkpoint`` (a loaded one), where the default is, the checks it gets.

``spel_mlx.reader.load_checkpoint`` loads either form (SPELW001 or safetensors).

The safetensors form lives in ``spel_mlx.converters`` (the top-level ``converters/``
folder).  See docs/checkpoints.md.
"""
from .files import Progress
from .footer import Golden
from .load import Checkpoint, default_checkpoint_dir, is_spelw
from .rules import CheckpointError, CheckpointTooLarge, NonFiniteWeightsWarning
from .spelw import SpelwFile, SpelwWriter, read_header, read_spelw, write_spelw

__all__ = ["CheckpointError", "CheckpointTooLarge", "NonFiniteWeightsWarning", "Golden", "Progress", "Checkpoint", "default_checkpoint_dir",
           "is_spelw", "SpelwFile", "SpelwWriter", "read_header", "read_spelw", "write_spelw"]

"""Files that appear whole or not at all: written beside their path, then renamed over it
(the temporary file and the rename are checkpoints.files.AtomicFile's)."""
from __future__ import annotations

import errno
import json
import os

import numpy as np

from .checkpoints.files import AtomicFile


def write_text(path: str, text: str, encoding: str = "utf-8") -> None:
    with AtomicFile(path) as out:
        out.f.write(text.encode(encoding))


def write_json(path: str, obj, default=None) -> None:
    """``obj`` as indented JSON and a final newline."""
    write_text(path, json.dumps(obj, indent=1, default=default) + "\n")


def save_npy(path: str, array) -> None:
    with AtomicFile(path) as out:
        np.save(out.f, array)


def refuse_existing(paths, force: bool) -> None:
    """An output that exists is replaced only when asked (``force``: --force): nothing
    is overwritten by mistake.  FileExistsError names the first that exists."""
    for path in paths:
        if path and os.path.lexists(path) and not force:
            raise FileExistsError(errno.EEXIST, "already exists: pass --force to replace it", str(path))

"""The rules both checkpoint readers share, and the error they raise.

A SPELW001 header and a safetensors folder's config describe the same fields; both
readers check them here, with the bounds of ``spel_mlx.config`` (so nothing is sized
from an unchecked claim), and the writers check the same before writing, so nothing
is written that the readers would refuse.
"""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is malformed or inconsistent.

    The message names the file, the field or tensor and the byte offset, on one line.
    """

    def __init__(self, path, what: str, offset: int | None = None, field: str | None = None):
        self.path, self.field, self.offset = str(path), field, offset
        where = ""
        if field is not None and offset is not None:
            where = f" [{field} at byte {offset}]"
        elif field is not None:
            where = f" [{field}]"
        elif offset is not None:
            where = f" [at byte {offset}]"
        super().__init__(f"{path}: {what}{where}")

"""File plumbing shared by the checkpoint formats: read-only maps whose pages can be
dropped, float32 streaming writes, atomic temp-file-and-rename output, progress."""
from __future__ import annotations

import mmap
import os
import sys
import tempfile
import time
from collections.abc import Mapping

import numpy as np

from .rules import CheckpointError


def map_file(path):
    """Read-only mmap of a whole file (None for an empty file) and its size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror or e}") from None
    return mm, size


class PageDroppingWeights(Mapping):
    """A read-only mapping over memory-mapped tensor views that, on each lookup,
    drops the mapped pages of the tensor looked up before.  A consumer that copies
    tensors one at a time (``SpelModel.from_weights``) then never has the file's
    pages and its own copy resident together.  Views stay valid (pages fault back in
    from the page cache), so this is only a residency hint."""

    def __init__(self, tensors: dict, release_one):
        self._tensors, self._release_one, self._prev = tensors, release_one, None

    def __getitem__(self, name):
        a = self._tensors[name]
        if self._prev is not None and self._prev != name:
            self._release_one(self._prev)
        self._prev = name
        return a

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self):
        return len(self._tensors)


def drop_pages(mm, start: int, end: int):
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    lo = (start // page) * page
    hi = min(((end + page - 1) // page) * page, len(mm))
    if hi > lo:
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            pass  # advisory only


class Progress:
    """Byte progress on stderr: a rewritten line on a terminal, ~10% steps otherwise."""

    def __init__(self, label: str, total: int, stream=None, enabled: bool = True):
        self.label, self.total = label, max(int(total), 1)
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last_step, self.t0, self.done = -1, time.perf_counter(), 0

    def __call__(self, done: int):
        if not self.enabled:
            return
        self.done = done
        pct = min(100, int(100 * done / self.total))
        step = pct if self.tty else pct // 10
        if step == self.last_step:
            return
        self.last_step = step
        mb, tot = done / 2**20, self.total / 2**20
        msg = f"{self.label}: {pct:3d}% ({mb:.1f}/{tot:.1f} MiB, {time.perf_counter() - self.t0:.1f} s)"
        self.stream.write(("\r" + msg) if self.tty else (msg + "\n"))
        if self.tty and pct >= 100:
            self.stream.write("\n")
        self.stream.flush()


_CHUNK_ELEMS = 1 << 22  # 16 MiB of f32 per write when a conversion is needed


def write_f32(f, arr) -> int:
    """Write ``arr`` as little-endian float32, row-major.  A float32 C-contiguous
    array is written straight from its buffer; anything else in bounded chunks."""
    a = np.asarray(arr)
    if a.dtype == np.dtype("<f4") and a.flags.c_contiguous:
        if a.size:
            f.write(memoryview(a).cast("B"))
        return a.nbytes
    rows = a.reshape(a.shape[0], -1) if a.ndim > 1 else a.reshape(-1, 1)
    step = max(1, _CHUNK_ELEMS // max(1, rows.shape[1]))
    for r in range(0, rows.shape[0], step):
        f.write(np.ascontiguousarray(rows[r:r + step], dtype="<f4").tobytes())
    return 4 * a.size


def _new_file_mode(path) -> int:
    """The mode a plain open() would give: the old file's, else 0666 & ~umask."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


class AtomicFile:
    """A temp file beside ``path`` that replaces ``path`` only on commit()."""

    def __init__(self, path):
        self.path = os.fspath(path)
        d = os.path.dirname(os.path.abspath(self.path))
        fd, self.tmp_path = tempfile.mkstemp(prefix="." + os.path.basename(self.path) + ".", suffix=".tmp", dir=d)
        self.f = os.fdopen(fd, "w+b")
        os.chmod(self.tmp_path, _new_file_mode(self.path))  # mkstemp makes 0600
        self.done = False

    def commit(self):
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp_path, self.path)
        self.done = True

    def abort(self):
        if not self.f.closed:
            try:
                self.f.close()
            except OSError:  # the buffered tail cannot be written either (disk full): still remove
                pass
        if not self.done and os.path.exists(self.tmp_path):
            os.unlink(self.tmp_path)
        self.done = True

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None and not self.done:
            self.commit()
        else:
            self.abort()
        return False

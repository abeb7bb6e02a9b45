"""File plumbing shared by the checkpoint formats: read-only maps whose pages can be
dropped, float32 streaming writes, atomic temp-file-and-rename output (files, and
folders staged whole), progress."""
from __future__ import annotations

import mmap
import os
import re
import shutil
import sys
import tempfile
import weakref
from collections.abc import Mapping

import numpy as np

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no stale-temp detection
    fcntl = None

from .rules import CheckpointError


def map_file(path):
    """Read-only mmap of a whole file (None for an empty file) and its size."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if st.st_size else None
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror or e}") from None
    if mm is not None:
        base = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        _mapped.append((weakref.ref(mm), base, st.st_size, os.path.abspath(path), st.st_dev, st.st_ino))
    return mm, st.st_size


_mapped = []   # (weakref to the mmap, its address, size, path, st_dev, st_ino) of map_file's files


def mapped_region(a):
    """(path, offset, st_dev, st_ino) of the file bytes under `a` when it is a C-contiguous
    view into a live mapping made by map_file, else None: a consumer may then read the
    bytes itself (pread) instead of faulting the mapping's pages in."""
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or a.nbytes == 0:
        return None
    addr = a.ctypes.data
    _mapped[:] = [m for m in _mapped if m[0]() is not None and not m[0]().closed]   # a closed map's range may be reused
    for _, base, size, path, dev, ino in _mapped:
        if base <= addr and addr + a.nbytes <= base + size:
            return path, addr - base, dev, ino
    return None


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
    """Byte progress on stderr, drawn by tqdm: a bar redrawn in place on a terminal; to a
    file or pipe (a log) a line at the start, at most one a minute, and the last one, each
    on its own line (tqdm alone would join them with carriage returns).  ``enabled``
    False: nothing.  Called with the bytes done so far (and, from a writer that knows
    its output's size better than the caller, that size); the bar ends at ``total`` or
    ``close()``."""

    LOG_INTERVAL_S = 60

    def __init__(self, label: str, total: int, stream=None, enabled: bool = True):
        self.label, self.total = label, max(int(total), 1)
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self._bar = None

    def __call__(self, done: int, total: int | None = None):
        if not self.enabled:
            return
        if total is not None and self._bar is None:
            self.total = max(int(total), 1)
        if self._bar is None:
            from tqdm import tqdm
            out = self.stream if self.tty else _Lines(self.stream)
            self._bar = tqdm(total=self.total, desc=self.label, unit="B", unit_scale=True, unit_divisor=1024,
                             file=out, mininterval=0.1 if self.tty else self.LOG_INTERVAL_S,
                             dynamic_ncols=self.tty, ncols=None if self.tty else 100, ascii=not self.tty)
        done = min(int(done), self.total)
        self._bar.update(done - self.done)
        self.done = done
        if done >= self.total:
            self.close()

    def close(self):
        if self._bar is not None and self.enabled:
            self._bar.close()
        self.enabled = False


class _Lines:
    """A stream for tqdm in a log: each redraw ("\r" + status) starts a new line."""

    def __init__(self, stream):
        self.stream, self.started = stream, False

    def write(self, s: str):
        if s.startswith("\r"):
            s = ("\n" if self.started else "") + s[1:].rstrip(" ")
        self.started = self.started or bool(s)
        self.stream.write(s)

    def flush(self):
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


def _new_file_mode(path, base: int = 0o666) -> int:
    """The mode a plain open() (base 0o777: mkdir()) would give: the old one's, else base & ~umask."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return base & ~mask


class _CommitOnExit:
    """A `with` block commits what it wrote when it ends normally and aborts otherwise."""

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None and not self.done:
            self.commit()
        else:
            self.abort()
        return False


class AtomicFile(_CommitOnExit):
    """A temp file beside ``path`` that replaces ``path`` only on commit().

    The temp file (``.NAME.XXXXXXXX.tmp``) is flock()ed while it is written, so a
    later AtomicFile for the same path can tell a live writer's temp file from one a
    killed process left behind, and removes the latter (clean_stale_temps)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        d = os.path.dirname(os.path.abspath(self.path))
        clean_stale_temps(self.path)
        while True:
            fd, self.tmp_path = tempfile.mkstemp(prefix=_temp_prefix(self.path), suffix=".tmp", dir=d)
            _lock(fd)
            if os.fstat(fd).st_nlink:   # not removed as stale between mkstemp and the lock
                break
            os.close(fd)
        self.f = os.fdopen(fd, "w+b")
        os.chmod(self.tmp_path, _new_file_mode(self.path))  # mkstemp makes 0600
        self.done = False

    def commit(self):
        self.f.flush()
        os.fsync(self.f.fileno())
        os.replace(self.tmp_path, self.path)    # still locked: no cleaner can take it first
        self.f.close()
        self.done = True

    def abort(self):
        if not self.done:
            try:
                os.unlink(self.tmp_path)
            except FileNotFoundError:
                pass
        if not self.f.closed:
            try:
                self.f.close()
            except OSError:  # the buffered tail cannot be written either (disk full): removed anyway
                pass
        self.done = True


class StagedFolder(_CommitOnExit):
    """The files of a model folder ``path``, written into a temp folder beside it
    (``.NAME.XXXXXXXX.tmp``, flock()ed like AtomicFile's temp files) and moved into
    place only on commit(): a folder that did not exist (or was empty) appears whole,
    by one rename; into an existing folder the staged files are moved by renames, which
    need no space, so a disk that fills stops the conversion before anything moved.
    ``file(name)`` is where to write one of them."""

    def __init__(self, path):
        self.path = os.path.normpath(os.fspath(path))
        parent = os.path.dirname(os.path.abspath(self.path))
        clean_stale_temps(self.path)
        while True:
            self.tmp_path = tempfile.mkdtemp(prefix=_temp_prefix(self.path), suffix=".tmp", dir=parent)
            self._fd = os.open(self.tmp_path, os.O_RDONLY)
            _lock(self._fd)
            if os.path.isdir(self.tmp_path):    # not removed as stale between mkdtemp and the lock
                break
            os.close(self._fd)
        os.chmod(self.tmp_path, _new_file_mode(self.path, 0o777))     # mkdtemp makes 0700
        self.done = False

    def file(self, name: str) -> str:
        return os.path.join(self.tmp_path, name)

    def commit(self):
        os.fsync(self._fd)
        if not os.path.isdir(self.path) or not os.listdir(self.path):
            os.replace(self.tmp_path, self.path)          # an empty folder is replaced too
        else:
            for name in sorted(os.listdir(self.tmp_path)):
                os.replace(self.file(name), os.path.join(self.path, name))
            os.rmdir(self.tmp_path)
        self.done = True
        os.close(self._fd)

    def abort(self):
        if not self.done:
            shutil.rmtree(self.tmp_path, ignore_errors=True)
            os.close(self._fd)
        self.done = True


def _temp_prefix(path) -> str:
    return "." + os.path.basename(os.path.normpath(os.fspath(path))) + "."


def _lock(fd, block: bool = True) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        return True
    except OSError:
        return False


def clean_stale_temps(path) -> list:
    """Remove the temp files and staged folders of earlier writes to ``path`` whose
    writer is gone (no process holds their lock): what a conversion killed with SIGKILL
    leaves."""
    d = os.path.dirname(os.path.abspath(os.path.normpath(os.fspath(path)))) or "."
    pattern = re.compile(re.escape(_temp_prefix(path)) + r"[A-Za-z0-9_]{8}\.tmp")
    try:
        names = [n for n in os.listdir(d) if pattern.fullmatch(n)]
    except OSError:
        return []
    removed = []
    for n in names:
        p = os.path.join(d, n)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            if _lock(fd, block=False) and fcntl is not None:
                shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
                removed.append(p)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _under(child: str, parent: str) -> bool:
    return child != parent and os.path.commonpath([child, parent]) == parent


def _same(a: str, b: str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b) or (os.path.exists(a) and os.path.exists(b)
                                                              and os.path.samefile(a, b))
    except OSError:
        return False


def check_destination(dst, sources, outputs):
    """Refuse a destination that is, contains, or lies inside a source (real paths, so
    symlinks count; same inode, so hard links count), or an output that would replace
    a source file.  ``sources``: the source argument and every file it is read from;
    ``outputs``: the files the conversion writes."""
    dst = os.fspath(dst)
    rd = os.path.realpath(dst)
    for s in map(os.fspath, sources):
        rs = os.path.realpath(s)
        if _same(dst, s):
            raise CheckpointError(dst, f"destination is the source {s}")
        if os.path.isdir(s) and _under(rd, rs):
            raise CheckpointError(dst, f"destination lies inside the source folder {s}")
        if _under(rs, rd):
            raise CheckpointError(dst, f"destination contains the source {s}")
        for o in map(os.fspath, outputs):
            if _same(o, s):
                raise CheckpointError(dst, f"writing {o} would replace the source file {s}")

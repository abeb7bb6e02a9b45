"""SPELW001 checkpoints (SPEC 6): memory-mapped reader, streaming atomic writer.

Layout: a 64-byte little-endian header, the FP32 tensors of ``layout.tensor_specs``
in order with no padding, and, when flags bit 0 is set, a SPELV001 golden footer
(magic, u32 n, u32 tokens[n], f32 target_logits[n][V], f32 draft_logits[n][V]).

Reading never allocates what the header merely claims: every size is checked
against the real file size first, and tensors are zero-copy views of one
read-only mmap.  Writing streams tensor by tensor into a temp file in the
destination directory and renames it into place, so a failure leaves no output.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .config import MAX_DRAFT, ConfigError, ModelConfig
from .layout import TensorSpec, tensor_specs

MAGIC = b"SPELW001"
FOOTER_MAGIC = b"SPELV001"
HEADER_SIZE = 64
FLAG_GOLDEN = 1
KNOWN_FLAGS = FLAG_GOLDEN
UNUSED_DRAFT = 0xFF

# (name, byte offset) of the nine u32 header fields
HEADER_U32 = (("d_model", 8), ("n_layers", 12), ("n_heads", 16), ("head_dim", 20),
              ("d_ff", 24), ("vocab", 28), ("max_seq", 32), ("attn_period", 36),
              ("n_draft", 40))
OFF_DRAFT_MAP, OFF_ROPE_THETA, OFF_NORM_EPS, OFF_FLAGS = 44, 52, 56, 60

# Caps on header dimensions, far above any real model, so that a corrupt header
# is rejected before anything is sized from it.
HEADER_CAPS = {"d_model": 1 << 20, "n_layers": 4096, "n_heads": 1 << 16, "head_dim": 1 << 16,
               "d_ff": 1 << 22, "vocab": 1 << 24, "max_seq": 1 << 24, "attn_period": 1 << 16,
               "n_draft": MAX_DRAFT}
MAX_GOLDEN = 1 << 20


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


@dataclass
class Golden:
    """The SPELV001 golden footer: tokens fed one per position from reset, and the
    target / quantized-draft logits at each position."""
    tokens: np.ndarray          # uint32 [n]
    target_logits: np.ndarray   # float32 [n, V]
    draft_logits: np.ndarray    # float32 [n, V]

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    def check(self, vocab: int, path="<golden>"):
        t = np.asarray(self.tokens)
        n = t.shape[0] if t.ndim == 1 else -1
        if t.ndim != 1 or not (1 <= n <= MAX_GOLDEN):
            raise CheckpointError(path, f"golden tokens must be a 1-D array of 1..{MAX_GOLDEN}, got shape {t.shape}",
                                  field="golden.tokens")
        if t.dtype.kind not in "iu" or (n and (int(t.min()) < 0 or int(t.max()) >= vocab)):
            raise CheckpointError(path, f"golden tokens must be integers in 0..{vocab - 1}", field="golden.tokens")
        for name, a in (("golden.target_logits", self.target_logits), ("golden.draft_logits", self.draft_logits)):
            a = np.asarray(a)
            if a.shape != (n, vocab) or a.dtype.kind != "f":
                raise CheckpointError(path, f"{name} must be float [{n}, {vocab}], got {a.dtype} {list(a.shape)}",
                                      field=name)


def footer_nbytes(n: int, vocab: int) -> int:
    return 8 + 4 + 4 * n + 2 * 4 * n * vocab


# --------------------------------------------------------------------------- header

def header_bytes(cfg: ModelConfig, flags: int) -> bytes:
    """The 64 header bytes for ``cfg`` (spec_k is runtime-only and not stored)."""
    cfg.validate()
    if flags & ~KNOWN_FLAGS:
        raise ValueError(f"flags=0x{flags:x}: only bit 0 (golden footer) is defined")
    if any(j >= UNUSED_DRAFT for j in cfg.draft_map):
        raise ValueError("draft_map entries must be < 255 to fit the u8 header field")
    ints = [getattr(cfg, name) for name, _ in HEADER_U32[:-1]] + [cfg.n_draft]
    for (name, _), v in zip(HEADER_U32, ints):
        if v > HEADER_CAPS[name]:
            raise ValueError(f"{name}={v} exceeds the SPELW001 reader's cap {HEADER_CAPS[name]}")
    dmap = list(cfg.draft_map) + [UNUSED_DRAFT] * (MAX_DRAFT - cfg.n_draft)
    # struct 'f' rounds the Python float to the nearest f32: a value read from a
    # header (an exact f32) is written back bit-identically.
    out = MAGIC + struct.pack("<9I", *ints) + bytes(dmap) + struct.pack("<ffI", cfg.rope_theta, cfg.norm_eps, flags)
    assert len(out) == HEADER_SIZE
    return out


@dataclass
class SpelwHeader:
    path: str
    cfg: ModelConfig
    flags: int
    file_size: int

    @property
    def has_golden(self) -> bool:
        return bool(self.flags & FLAG_GOLDEN)

    @property
    def tensors_end(self) -> int:
        return HEADER_SIZE + sum(s.nbytes for s in tensor_specs(self.cfg))


def f32_to_float(v: float) -> float:
    """The shortest decimal of an f32 header value (1e-05, not 9.99999974e-06) when
    it maps back to the very same f32 bits, so configs compare equal to presets and
    the header is rewritten byte-identically; the exact value otherwise."""
    short = float(str(np.float32(v)))
    return short if struct.pack("<f", short) == struct.pack("<f", v) else float(v)


def parse_header(buf: bytes, path="<buffer>", file_size: int | None = None) -> SpelwHeader:
    """Validate the 64 header bytes field by field and build the ModelConfig."""
    if len(buf) < 8 or buf[:8] != MAGIC:
        got = bytes(buf[:8])
        raise CheckpointError(path, f"bad magic {got!r}, expected {MAGIC!r} (not a SPELW001 file)",
                              offset=0, field="magic")
    if len(buf) < HEADER_SIZE:
        raise CheckpointError(path, f"truncated header: {len(buf)} of {HEADER_SIZE} bytes",
                              offset=len(buf), field="header")
    vals = dict(zip((n for n, _ in HEADER_U32), struct.unpack_from("<9I", buf, 8)))
    for name, off in HEADER_U32:
        v = vals[name]
        if not (1 <= v <= HEADER_CAPS[name]):
            raise CheckpointError(path, f"header field {name}={v} out of range 1..{HEADER_CAPS[name]}",
                                  offset=off, field=name)
    if vals["head_dim"] % 2:
        raise CheckpointError(path, f"head_dim={vals['head_dim']} must be even (RoPE rotates pairs)",
                              offset=20, field="head_dim")
    if vals["n_heads"] * vals["head_dim"] > 1 << 20:
        raise CheckpointError(path, f"n_heads*head_dim={vals['n_heads'] * vals['head_dim']} is implausibly large",
                              offset=16, field="n_heads")
    n_draft = vals["n_draft"]
    dmap = list(buf[OFF_DRAFT_MAP:OFF_DRAFT_MAP + MAX_DRAFT])
    for j, v in enumerate(dmap):
        off = OFF_DRAFT_MAP + j
        if j < n_draft and v == UNUSED_DRAFT:
            raise CheckpointError(path, f"draft_map[{j}]=0xFF (unused) inside n_draft={n_draft}",
                                  offset=off, field=f"draft_map[{j}]")
        if j < n_draft and v >= vals["n_layers"]:
            raise CheckpointError(path, f"draft_map[{j}]={v} out of range 0..{vals['n_layers'] - 1}",
                                  offset=off, field=f"draft_map[{j}]")
        if j >= n_draft and v != UNUSED_DRAFT:
            raise CheckpointError(path, f"draft_map[{j}]={v} beyond n_draft={n_draft} must be 0xFF",
                                  offset=off, field=f"draft_map[{j}]")
    theta, eps, flags = struct.unpack_from("<ffI", buf, OFF_ROPE_THETA)
    for name, v, off in (("rope_theta", theta, OFF_ROPE_THETA), ("norm_eps", eps, OFF_NORM_EPS)):
        if not (math.isfinite(v) and v > 0):
            raise CheckpointError(path, f"header field {name}={v} must be finite and positive", offset=off, field=name)
    if flags & ~KNOWN_FLAGS:
        raise CheckpointError(path, f"flags=0x{flags:08x} has undefined bits (only bit 0, golden footer, exists)",
                              offset=OFF_FLAGS, field="flags")
    try:
        cfg = ModelConfig(d_model=vals["d_model"], n_layers=vals["n_layers"], n_heads=vals["n_heads"],
                          head_dim=vals["head_dim"], d_ff=vals["d_ff"], vocab=vals["vocab"],
                          max_seq=vals["max_seq"], attn_period=vals["attn_period"],
                          rope_theta=f32_to_float(theta), norm_eps=f32_to_float(eps),
                          draft_map=tuple(dmap[:n_draft])).validate()
    except ConfigError as e:
        raise CheckpointError(path, f"inconsistent header: {e}", offset=8, field="header") from None
    return SpelwHeader(str(path), cfg, flags, -1 if file_size is None else file_size)


def read_header(path) -> SpelwHeader:
    """Read and validate only the header (no mapping, no tensor access)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = f.read(HEADER_SIZE)
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror or e}") from None
    return parse_header(buf, path, size)


# --------------------------------------------------------------------------- reader

@dataclass
class SpelwFile:
    """An open SPELW001 file: ``tensors`` are read-only views into one mmap."""
    path: str
    header: SpelwHeader
    tensors: dict                       # name -> np.ndarray float32 (mmap view), layout order
    spans: dict                         # name -> (start, end) byte offsets in the file
    golden: Golden | None
    footer_offset: int | None
    _mm: mmap.mmap | None = field(default=None, repr=False)

    @property
    def cfg(self) -> ModelConfig:
        return self.header.cfg

    @property
    def flags(self) -> int:
        return self.header.flags

    @property
    def file_size(self) -> int:
        return self.header.file_size

    def release_tensor(self, name: str):
        self.release(*self.spans[name])

    def page_dropping_tensors(self) -> "PageDroppingWeights":
        return PageDroppingWeights(self.tensors, self.release_tensor)

    def release(self, start: int, end: int):
        """Drop the mapped pages of bytes [start, end) from this process's resident
        set (they stay in the page cache).  Keeps streaming conversions' RSS flat."""
        drop_pages(self._mm, start, end)


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


def map_file(path):
    """Read-only mmap of a whole file (None for an empty file) and its size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror or e}") from None
    return mm, size


def read_spelw(path) -> SpelwFile:
    """Open a SPELW001 file: validate header, sizes and footer, map the tensors."""
    path = os.fspath(path)
    mm, size = map_file(path)
    if size < HEADER_SIZE:
        buf = bytes(mm[:size]) if mm is not None else b""
        if buf[:8] != MAGIC[:len(buf[:8])]:
            parse_header(buf, path, size)  # raises: bad magic
        raise CheckpointError(path, f"truncated header: file has {size} of {HEADER_SIZE} bytes",
                              offset=size, field="header")
    header = parse_header(mm[:HEADER_SIZE], path, size)
    cfg = header.cfg
    specs = tensor_specs(cfg)
    end = HEADER_SIZE + sum(s.nbytes for s in specs)
    if size < end:
        off = HEADER_SIZE
        for s in specs:
            if off + s.nbytes > size:
                raise CheckpointError(
                    path, f"truncated: tensor {s.name} {list(s.shape)} needs bytes {off}..{off + s.nbytes} "
                    f"but the file ends at byte {size}", offset=off, field=s.name)
            off += s.nbytes
    golden, footer_off = None, None
    if header.has_golden:
        golden = _parse_footer(mm, path, size, end, cfg.vocab)
        footer_off = end
    elif size != end:
        hint = " (it looks like a SPELV001 footer but flags bit 0 is clear)" \
            if size >= end + 8 and mm[end:end + 8] == FOOTER_MAGIC else ""
        raise CheckpointError(path, f"file has {size} bytes but header + tensors take {end}: "
                              f"{size - end} trailing bytes{hint}", offset=end, field="file size")
    tensors, spans = {}, {}
    off = HEADER_SIZE
    for s in specs:
        tensors[s.name] = np.frombuffer(mm, dtype="<f4", count=s.numel, offset=off).reshape(s.shape)
        spans[s.name] = (off, off + s.nbytes)
        off += s.nbytes
    return SpelwFile(path, header, tensors, spans, golden, footer_off, mm)


def _parse_footer(mm, path, size, off, vocab) -> Golden:
    if size < off + 12:
        raise CheckpointError(path, f"flags bit 0 promises a SPELV001 footer at byte {off} but the file ends "
                              f"at byte {size}", offset=off, field="footer")
    magic = bytes(mm[off:off + 8])
    if magic != FOOTER_MAGIC:
        raise CheckpointError(path, f"bad footer magic {magic!r}, expected {FOOTER_MAGIC!r}",
                              offset=off, field="footer magic")
    n = struct.unpack_from("<I", mm, off + 8)[0]
    if not (1 <= n <= MAX_GOLDEN):
        raise CheckpointError(path, f"footer n={n} out of range 1..{MAX_GOLDEN}", offset=off + 8, field="footer n")
    need = footer_nbytes(n, vocab)
    if size != off + need:
        raise CheckpointError(path, f"footer with n={n}, vocab={vocab} needs {need} bytes ending at byte "
                              f"{off + need}, but the file has {size} bytes"
                              + (" (truncated)" if size < off + need else ""),
                              offset=off + 8, field="footer n")
    p = off + 12
    tokens = np.frombuffer(mm, dtype="<u4", count=n, offset=p)
    bad = np.nonzero(tokens >= vocab)[0]
    if bad.size:
        i = int(bad[0])
        raise CheckpointError(path, f"golden token {int(tokens[i])} >= vocab {vocab}",
                              offset=p + 4 * i, field=f"golden.tokens[{i}]")
    p += 4 * n
    tl = np.frombuffer(mm, dtype="<f4", count=n * vocab, offset=p).reshape(n, vocab)
    p += 4 * n * vocab
    dl = np.frombuffer(mm, dtype="<f4", count=n * vocab, offset=p).reshape(n, vocab)
    return Golden(tokens, tl, dl)


# --------------------------------------------------------------------------- writer

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


class SpelwWriter:
    """Streaming SPELW001 writer.

    ``with SpelwWriter(path, cfg) as w: w.write_tensor(name, a) ...; w.write_golden(g)``
    Tensors must come in layout order; the file appears at ``path`` only if all of
    them (and the footer, if any) were written without error.
    """

    def __init__(self, path, cfg: ModelConfig, progress=None):
        self.cfg = cfg.validate()
        self.specs = tensor_specs(cfg)
        self.next = 0
        self.progress = progress
        self.total = HEADER_SIZE + sum(s.nbytes for s in self.specs)
        self.golden_written = False
        header_bytes(cfg, 0)  # validate before creating any file
        self.out = AtomicFile(path)
        self.f = self.out.f
        self.f.write(header_bytes(cfg, 0))  # flags patched in write_golden
        self.written = HEADER_SIZE

    @property
    def tmp_path(self) -> str:
        return self.out.tmp_path

    def expected(self) -> TensorSpec | None:
        return self.specs[self.next] if self.next < len(self.specs) else None

    def write_tensor(self, name: str, arr):
        spec = self.expected()
        if spec is None:
            raise ValueError(f"{self.out.path}: extra tensor {name!r}: all {len(self.specs)} tensors already written")
        if name != spec.name:
            raise ValueError(f"{self.out.path}: tensor {name!r} given where {spec.name!r} comes next")
        a = np.asarray(arr) if not isinstance(arr, np.ndarray) else arr
        if tuple(a.shape) != spec.shape:
            raise ValueError(f"{self.out.path}: tensor {name} has shape {list(a.shape)}, expected {list(spec.shape)}")
        if a.dtype.kind != "f":
            raise ValueError(f"{self.out.path}: tensor {name} has dtype {a.dtype}, expected a float type")
        self.written += write_f32(self.f, a)
        self.next += 1
        if self.progress:
            self.progress(self.written)

    def flush_tensors(self):
        """Make the tensors written so far readable through ``tmp_path``."""
        self.f.flush()

    def write_golden(self, golden: Golden):
        if self.next != len(self.specs):
            raise ValueError(f"{self.out.path}: footer before all tensors (missing {self.specs[self.next].name})")
        golden.check(self.cfg.vocab, self.out.path)
        n = golden.n
        self.f.write(FOOTER_MAGIC + struct.pack("<I", n))
        self.f.write(np.ascontiguousarray(golden.tokens, dtype="<u4").tobytes())
        write_f32(self.f, golden.target_logits)
        write_f32(self.f, golden.draft_logits)
        self.written += footer_nbytes(n, self.cfg.vocab)
        if self.progress:
            self.progress(self.written)
        self.f.seek(OFF_FLAGS)
        self.f.write(struct.pack("<I", FLAG_GOLDEN))
        self.f.seek(0, os.SEEK_END)
        self.golden_written = True

    def close(self):
        if self.next != len(self.specs):
            raise ValueError(f"{self.out.path}: missing tensor {self.specs[self.next].name} "
                             f"({len(self.specs) - self.next} of {len(self.specs)} not written)")
        self.out.commit()

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            try:
                self.close()
            except BaseException:
                self.out.abort()
                raise
        else:
            self.out.abort()
        return False


def write_spelw(path, cfg: ModelConfig, tensors, golden: Golden | None = None, progress=None):
    """Write a SPELW001 file atomically.

    ``tensors``: a mapping name -> float array with exactly the layout names (extra
    ``golden.*`` keys are ignored), or a callable ``spec -> array`` that produces each
    tensor on demand (so a generator never holds the whole model).
    """
    cfg = cfg.validate()
    specs = tensor_specs(cfg)
    if not callable(tensors):
        names = {s.name for s in specs}
        extra = [k for k in tensors if k not in names and not str(k).startswith("golden.")]
        missing = [s.name for s in specs if s.name not in tensors]
        if missing or extra:
            raise ValueError(f"{path}: tensors do not match the layout: missing {missing[:5]}"
                             f"{'...' if len(missing) > 5 else ''}, extra {extra[:5]}")
    with SpelwWriter(path, cfg, progress=progress) as w:
        for s in specs:
            w.write_tensor(s.name, tensors(s) if callable(tensors) else tensors[s.name])
        if golden is not None:
            w.write_golden(golden)

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

import os
import struct
from dataclasses import dataclass, field

import numpy as np

from ..config import MAX_DRAFT, ModelConfig
from ..layout import TensorSpec, tensor_specs
from .files import AtomicFile, PageDroppingWeights, drop_pages, map_file, write_f32
from .footer import FOOTER_MAGIC, Golden, footer_nbytes
from .rules import CheckpointError, check_golden_count, config_from_fields

MAGIC = b"SPELW001"
HEADER_SIZE = 64
FLAG_GOLDEN = 1
KNOWN_FLAGS = FLAG_GOLDEN
UNUSED_DRAFT = 0xFF

# (name, byte offset) of the nine u32 header fields
HEADER_U32 = (("d_model", 8), ("n_layers", 12), ("n_heads", 16), ("head_dim", 20),
              ("d_ff", 24), ("vocab", 28), ("max_seq", 32), ("attn_period", 36),
              ("n_draft", 40))
OFF_DRAFT_MAP, OFF_ROPE_THETA, OFF_NORM_EPS, OFF_FLAGS = 44, 52, 56, 60

HEADER_OFFSETS = dict(HEADER_U32, draft_map=OFF_DRAFT_MAP, rope_theta=OFF_ROPE_THETA, norm_eps=OFF_NORM_EPS,
                      **{f"draft_map[{j}]": OFF_DRAFT_MAP + j for j in range(MAX_DRAFT)})


# --------------------------------------------------------------------------- header

def header_bytes(cfg: ModelConfig, flags: int) -> bytes:
    """The 64 header bytes for ``cfg`` (spec_k is runtime-only and not stored)."""
    cfg.validate()   # the readers' rules: every field in range, floats finite as f32
    if flags & ~KNOWN_FLAGS:
        raise ValueError(f"flags=0x{flags:x}: only bit 0 (golden footer) is defined")
    ints = [getattr(cfg, name) for name, _ in HEADER_U32[:-1]] + [cfg.n_draft]
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
    n_draft = vals.pop("n_draft")
    if not 1 <= n_draft <= MAX_DRAFT:
        raise CheckpointError(path, f"header field n_draft={n_draft} out of range 1..{MAX_DRAFT}",
                              offset=HEADER_OFFSETS["n_draft"], field="n_draft")
    dmap = list(buf[OFF_DRAFT_MAP:OFF_DRAFT_MAP + MAX_DRAFT])
    for j, v in enumerate(dmap):
        off, name = OFF_DRAFT_MAP + j, f"draft_map[{j}]"
        if j < n_draft and v == UNUSED_DRAFT:
            raise CheckpointError(path, f"{name}=0xFF (unused) inside n_draft={n_draft}", offset=off, field=name)
        if j >= n_draft and v != UNUSED_DRAFT:
            raise CheckpointError(path, f"{name}={v} beyond n_draft={n_draft} must be 0xFF", offset=off, field=name)
    theta, eps, flags = struct.unpack_from("<ffI", buf, OFF_ROPE_THETA)
    if flags & ~KNOWN_FLAGS:
        raise CheckpointError(path, f"flags=0x{flags:08x} has undefined bits (only bit 0, golden footer, exists)",
                              offset=OFF_FLAGS, field="flags")
    vals.update(rope_theta=f32_to_float(theta), norm_eps=f32_to_float(eps), draft_map=dmap[:n_draft])
    cfg = config_from_fields(vals, path, "header", offset=8, offsets=HEADER_OFFSETS)
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
    _mm: object = field(default=None, repr=False)

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
        golden = _parse_footer(mm, path, size, end, cfg)
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


def _parse_footer(mm, path, size, off, cfg) -> Golden:
    vocab = cfg.vocab
    if size < off + 12:
        raise CheckpointError(path, f"flags bit 0 promises a SPELV001 footer at byte {off} but the file ends "
                              f"at byte {size}", offset=off, field="footer")
    magic = bytes(mm[off:off + 8])
    if magic != FOOTER_MAGIC:
        raise CheckpointError(path, f"bad footer magic {magic!r}, expected {FOOTER_MAGIC!r}",
                              offset=off, field="footer magic")
    n = struct.unpack_from("<I", mm, off + 8)[0]
    check_golden_count(n, cfg, path, offset=off + 8, field="footer n")
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
        golden.check(self.cfg, self.out.path)
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

"""A streaming safetensors writer and a memory-mapped, validating reader.

Format (huggingface/safetensors): u64 little-endian N, N bytes of UTF-8 JSON
``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [b, e]}}``,
then the data buffer; offsets are relative to the buffer.  The ``safetensors``
package's ``save_file`` needs every tensor in RAM at once, so this module writes
the header first (all sizes are known from the shapes) and then each tensor's
bytes in turn.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from spel_mlx.checkpoints.files import AtomicFile, drop_pages, map_file, write_f32
from spel_mlx.checkpoints.rules import CheckpointError, load_json

# safetensors dtype -> (numpy dtype of the stored bytes, itemsize).  BF16 is read
# as raw u16 and widened by hand (numpy has no bfloat16).
DTYPES = {"F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2),
          "I64": ("<i8", 8), "U64": ("<u8", 8), "I32": ("<i4", 4), "U32": ("<u4", 4),
          "I16": ("<i2", 2), "U16": ("<u2", 2), "I8": ("i1", 1), "U8": ("u1", 1), "BOOL": ("u1", 1)}
FLOAT_DTYPES = ("F32", "F16", "BF16")
INT_DTYPES = ("U32", "I32", "I64", "U64")
MAX_HEADER = 100 * 2**20  # the reference implementation's limit


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), returned as uint16 bits."""
    u = np.ascontiguousarray(a, dtype="<f4").view("<u4")
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype("<u2")
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def bf16_bits_to_f32(u16: np.ndarray) -> np.ndarray:
    return (np.asarray(u16, dtype="<u2").astype("<u4") << 16).view("<f4")


def _encode(arr, dtype: str) -> np.ndarray:
    """Array as the bytes of safetensors dtype ``dtype`` (floats, U32, and the I8/U8 codes
    of a packed draft)."""
    if dtype == "F32":
        return np.asarray(arr, dtype="<f4")
    if dtype == "F16":
        return np.asarray(arr, dtype="<f4").astype("<f2")
    if dtype == "BF16":
        return f32_to_bf16_bits(np.asarray(arr, dtype="<f4"))
    if dtype == "U32":
        return np.asarray(arr, dtype="<u4")
    if dtype in ("I8", "U8"):
        return np.asarray(arr, dtype=DTYPES[dtype][0])
    raise ValueError(f"cannot write dtype {dtype}")


def write_safetensors(path, entries, metadata: dict, progress=None, after_each=None):
    """Stream a safetensors file atomically.

    ``entries``: list of ``(name, dtype, shape, get)``, ``get()`` returning the array
    (called once, when its bytes are due).  ``after_each(name)`` runs after each
    tensor is written (used to drop the source's mapped pages); ``progress(done, total)``
    after each tensor, in bytes of the file written.
    """
    header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    off = 0
    for name, dtype, shape, _ in entries:
        n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        nbytes = n * DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": [int(s) for s in shape], "data_offsets": [off, off + nbytes]}
        off += nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * (-len(hjson) % 8)  # align the data buffer to 8 bytes
    total = 8 + len(hjson) + off
    with AtomicFile(path) as out:
        f = out.f
        f.write(len(hjson).to_bytes(8, "little"))
        f.write(hjson)
        done = 8 + len(hjson)
        for name, dtype, shape, get in entries:
            a = _encode(get(), dtype)
            if tuple(a.shape) != tuple(shape):
                raise ValueError(f"{path}: tensor {name} has shape {list(a.shape)}, header says {list(shape)}")
            if a.dtype == np.dtype("<f4"):
                done += write_f32(f, a)
            else:
                b = np.ascontiguousarray(a)
                f.write(memoryview(b).cast("B") if b.size else b"")
                done += b.nbytes
            if after_each:
                after_each(name)
            if progress:
                progress(done, total)
        assert done == total, (done, total)


class Entry:
    __slots__ = ("name", "dtype", "shape", "start", "end", "file")

    def __init__(self, name, dtype, shape, start, end, file):
        self.name, self.dtype, self.shape, self.start, self.end, self.file = name, dtype, shape, start, end, file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SafetensorsFile:
    """One .safetensors file, validated against its real size, data mmapped."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.mm, self.size = map_file(self.path)
        p, size = self.path, self.size
        if size < 8:
            raise CheckpointError(p, f"truncated: {size} bytes, no 8-byte header length", offset=size,
                                  field="header length")
        n = int.from_bytes(self.mm[:8], "little")
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(p, f"header length {n} exceeds the file ({size} bytes)"
                                  if 8 + n > size else f"header length {n} exceeds {MAX_HEADER}",
                                  offset=0, field="header length")
        hdr = load_json(bytes(self.mm[8:8 + n]), p, "header", offset=8)
        if not isinstance(hdr, dict):
            raise CheckpointError(p, "bad JSON header: not an object", offset=8, field="header")
        meta = hdr.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise CheckpointError(p, "__metadata__ must map strings to strings", offset=8, field="__metadata__")
        self.metadata = meta
        self.data_start = 8 + n
        data_len = size - self.data_start
        self.entries = {}
        for name, info in hdr.items():
            self.entries[name] = self._entry(name, info, data_len)
        ordered = sorted(self.entries.values(), key=lambda e: (e.start, e.end))
        prev = None
        for e in ordered:
            if prev is not None and e.start < prev.end:
                raise CheckpointError(p, f"tensor {e.name} data overlaps {prev.name}", offset=e.start, field=e.name)
            prev = e
        last = ordered[-1].end if ordered else self.data_start
        if last != size:
            raise CheckpointError(p, f"{size - last} bytes after the last tensor's data (file size {size})",
                                  offset=last, field="file size")

    def _entry(self, name, info, data_len) -> Entry:
        p = self.path
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"} or \
                not {"dtype", "shape", "data_offsets"} <= set(info):
            raise CheckpointError(p, f"tensor {name}: header entry must have exactly dtype, shape, data_offsets",
                                  offset=8, field=name)
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES:
            raise CheckpointError(p, f"tensor {name}: unknown dtype {dtype!r}", offset=8, field=name)
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise CheckpointError(p, f"tensor {name}: bad shape {shape!r}", offset=8, field=name)
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                                   for o in offs)) or not (0 <= offs[0] <= offs[1]):
            raise CheckpointError(p, f"tensor {name}: bad data_offsets {offs!r}", offset=8, field=name)
        b, e = offs
        numel = 1
        for s in shape:
            numel *= s
        if e - b != numel * DTYPES[dtype][1]:
            raise CheckpointError(p, f"tensor {name}: data_offsets {offs} span {e - b} bytes but {dtype} "
                                  f"{shape} needs {numel * DTYPES[dtype][1]}", offset=self.data_start + b, field=name)
        if e > data_len:
            raise CheckpointError(p, f"truncated: tensor {name} data should end at byte {self.data_start + e} "
                                  f"but the file ends at byte {self.size}", offset=self.data_start + b, field=name)
        return Entry(name, dtype, tuple(shape), self.data_start + b, self.data_start + e, self)

    def raw(self, name) -> np.ndarray:
        """Zero-copy read-only view of the stored elements (BF16 as uint16)."""
        e = self.entries[name]
        return np.frombuffer(self.mm, dtype=DTYPES[e.dtype][0], count=e.numel, offset=e.start).reshape(e.shape)

    def f32(self, name) -> np.ndarray:
        """float32 values: a view for F32, an upcast copy for F16/BF16."""
        e = self.entries[name]
        a = self.raw(name)
        if e.dtype == "F32":
            return a
        if e.dtype == "BF16":
            return bf16_bits_to_f32(a)
        return a.astype(np.float32)

    def release(self, name):
        e = self.entries[name]
        drop_pages(self.mm, e.start, e.end)

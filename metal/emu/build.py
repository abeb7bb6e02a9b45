"""Compile mx.fast.metal_kernel bodies as C++ and run them on numpy buffers.

Tests and diagnostics (``spel_mlx.model.metal_ops.EmulatedOps`` runs on it).  For each kernel body the same function signature MLX writes
(``write_signature`` in MLX's metal_kernel: inputs ``const device T* name``,
``const constant T*`` below 8 elements, ``const constant T&`` for 0-d arrays,
``name_shape`` / ``name_strides`` / ``name_ndim`` when the body mentions them,
outputs ``device T* name``, then the Metal attributes the body mentions, in
MLX's order) is generated around the UNCHANGED body text, after
``metal_emu.h`` (the Metal built-ins) and the kernel's header.  A small
``extern "C"`` wrapper per instantiation hands the buffers to
``metal_emu::dispatch``, which runs the grid.  Libraries are cached on disk by a
hash of their full source and compiler command, written atomically.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass

import numpy as np

from ...settings import setting

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "metal_emu.h")            # the built-ins; includes runtime.h
HEADERS = (HEADER, os.path.join(HERE, "runtime.h"))   # what a build's cache key reads
MAX_CONSTANT_ARRAY_SIZE = 8  # MLX: smaller inputs go to the constant address space

# Metal attributes in the order MLX declares them; a body gets those whose name
# occurs in its text (plain substring search, as MLX does).
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
QUADGROUP_ATTRIBUTES = {"dispatch_quadgroups_per_threadgroup", "quadgroup_index_in_threadgroup",
                        "quadgroups_per_threadgroup", "thread_index_in_quadgroup"}

# numpy dtype -> MLX's Metal type string (get_type_string)
TYPE_STRINGS = {
    np.dtype(np.float32): "float", np.dtype(np.int32): "int32_t",
    np.dtype(np.uint32): "uint32_t", np.dtype(np.int8): "int8_t",
    np.dtype(np.uint8): "uint8_t", np.dtype(np.int64): "int64_t",
    np.dtype(np.uint64): "uint64_t", np.dtype(np.int16): "int16_t",
    np.dtype(np.uint16): "uint16_t", np.dtype(np.bool_): "bool",
}
# Names whose presence means the kernel needs real threads (barriers, SIMD ops).
_THREADED_MARKERS = re.compile(r"\b(threadgroup_barrier|simdgroup_barrier|simd_\w+)\s*\(")


class EmulationError(RuntimeError):
    """The emulated kernel failed to build or run."""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def cache_dir() -> str:
    d = setting("SPEL_METAL_EMU_CACHE")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "spel_mlx", "metal_emu")
    try:
        os.makedirs(d, exist_ok=True)
        probe = os.path.join(d, ".probe%d" % os.getpid())
        open(probe, "w").close()
        os.remove(probe)
    except OSError:
        d = os.path.join(tempfile.gettempdir(), "spel_mlx_metal_emu_%d" % os.getuid())
        os.makedirs(d, exist_ok=True)
    return d


@dataclass(frozen=True)
class ArgSpec:
    """How one input is passed: dtype, rank, and whether it is small (constant)."""
    dtype: np.dtype
    ndim: int
    small: bool

    @staticmethod
    def of(a: np.ndarray) -> "ArgSpec":
        return ArgSpec(np.dtype(a.dtype), a.ndim, a.size < MAX_CONSTANT_ARRAY_SIZE)


def _template_text(v) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "1" if v else "0"  # MLX streams bools without boolalpha
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    return TYPE_STRINGS[np.dtype(v)]


def _template_kind(v) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "bool"
    if isinstance(v, (int, np.integer)):
        return "int"
    return "typename"


@dataclass
class EmuKernel:
    """The emulation twin of ``mx.fast.metal_kernel(name, input_names, output_names, source, header)``."""
    name: str
    input_names: tuple
    output_names: tuple
    source: str
    header: str = ""

    def __post_init__(self):
        self.input_names = tuple(self.input_names)
        self.output_names = tuple(self.output_names)
        src = self.source
        self.shape_infos = tuple((n + "_shape" in src, n + "_strides" in src, n + "_ndim" in src)
                                 for n in self.input_names)
        self.attributes = tuple((a, t) for a, t in METAL_ATTRIBUTES if a in src)
        bad = [a for a, _ in self.attributes if a in QUADGROUP_ATTRIBUTES]
        if bad:
            raise EmulationError("kernel %s uses %s, which metal_emu.h does not emulate"
                                 % (self.name, ", ".join(bad)))
        self.threaded = bool(_THREADED_MARKERS.search(self.header + "\n" + src))

    # ---- source generation (mirrors MLX's write_signature) --------------------
    def signature_key(self, in_specs, out_dtypes, template) -> tuple:
        return (tuple(in_specs), tuple(np.dtype(d) for d in out_dtypes),
                tuple((n, _template_kind(v)) for n, v in template))

    def function_source(self, func_name, in_specs, out_dtypes, template) -> str:
        lines = []
        if template:
            lines.append("template <" + ", ".join("%s %s" % (_template_kind(v), n)
                                                  for n, v in template) + ">")
        lines.append("[[kernel]] void " + func_name + "(")
        params = []
        index = 0
        for name, spec, (has_shape, has_strides, has_ndim) in zip(
                self.input_names, in_specs, self.shape_infos):
            location = "constant" if spec.small else "device"
            ref = "&" if spec.ndim == 0 else "*"
            params.append("  const %s %s%s %s [[buffer(%d)]]"
                          % (location, TYPE_STRINGS[spec.dtype], ref, name, index))
            index += 1
            if spec.ndim > 0:
                if has_shape:
                    params.append("  const constant int* %s_shape [[buffer(%d)]]" % (name, index))
                    index += 1
                if has_strides:
                    params.append("  const constant int64_t* %s_strides [[buffer(%d)]]" % (name, index))
                    index += 1
                if has_ndim:
                    params.append("  const constant int& %s_ndim [[buffer(%d)]]" % (name, index))
                    index += 1
        for name, dt in zip(self.output_names, out_dtypes):
            params.append("  device %s* %s [[buffer(%d)]]" % (TYPE_STRINGS[np.dtype(dt)], name, index))
            index += 1
        for attr, typ in self.attributes:
            params.append("  %s %s [[%s]]" % (typ, attr, attr))
        lines.append(",\n".join(params) + ") {")
        lines.append(self.source)
        lines.append("}")
        return "\n".join(lines) + "\n"

    def wrapper_source(self, wrapper_name, func_name, in_specs, out_dtypes, template) -> str:
        args = []
        slot = 0
        for spec, (has_shape, has_strides, has_ndim) in zip(in_specs, self.shape_infos):
            t = TYPE_STRINGS[spec.dtype]
            if spec.ndim == 0:
                args.append("*(const %s*)a[%d]" % (t, slot))
                slot += 1
                continue
            args.append("(const %s*)a[%d]" % (t, slot))
            slot += 1
            for flag, ctype in ((has_shape, "const int*"), (has_strides, "const int64_t*")):
                if flag:
                    args.append("(%s)a[%d]" % (ctype, slot))
                    slot += 1
            if has_ndim:
                args.append("*(const int*)a[%d]" % slot)
                slot += 1
        for dt in out_dtypes:
            args.append("(%s*)a[%d]" % (TYPE_STRINGS[np.dtype(dt)], slot))
            slot += 1
        args += ["t_." + attr for attr, _ in self.attributes]
        targs = ("<" + ", ".join(_template_text(v) for _, v in template) + ">") if template else ""
        return ('extern "C" int %s(void** a, const uint32_t* launch, char* err, int errlen) {\n'
                "  return metal_emu::dispatch(launch, %s, [&](const metal_emu::ThreadIds& t_) {\n"
                "    (void)t_;\n    %s%s(%s);\n  }, err, errlen);\n}\n"
                % (wrapper_name, "true" if self.threaded else "false", func_name, targs,
                   ",\n      ".join(args)))


@dataclass(frozen=True)
class Instance:
    """One compiled instantiation: kernel, input specs, output dtypes, template values."""
    kernel: str
    in_specs: tuple
    out_dtypes: tuple
    template: tuple


class EmuLibrary:
    """Builds many kernel instantiations into one shared library (one compiler run)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._symbols = {}  # Instance -> ctypes function
        self._libs = []

    @staticmethod
    def flags() -> list:
        opt = setting("SPEL_METAL_EMU_OPT")
        flags = ["-std=c++17", opt, "-fPIC", "-shared", "-pthread", "-Wno-attributes",
                 "-fno-strict-aliasing", "-ffp-contract=off", "-fno-fast-math"]
        if setting("SPEL_METAL_EMU_ASAN"):
            flags += ["-fsanitize=address", "-fno-omit-frame-pointer"]
        return flags

    def build(self, kernels: dict, instances) -> None:
        """Compile every missing instance in ``instances`` (Instance objects)."""
        with self._lock:
            todo = [i for i in dict.fromkeys(instances) if i not in self._symbols]
            if not todo:
                return
            cxx = compiler()
            if cxx is None:
                raise EmulationError("no C++ compiler (g++/clang++) found: the Metal emulation needs one")
            emu_header = ""
            for path in HEADERS:
                with open(path, encoding="utf-8") as f:
                    emu_header += f.read()
            parts = ['#include "metal_emu.h"\n']
            seen_headers = set()
            funcs = {}
            wrappers = []
            for n, inst in enumerate(todo):
                k = kernels[inst.kernel]
                if k.header and k.header not in seen_headers:
                    seen_headers.add(k.header)
                    parts.append(k.header + "\n")
                key = (inst.kernel, k.signature_key(inst.in_specs, inst.out_dtypes, inst.template))
                if key not in funcs:
                    fname = "custom_kernel_%s_%d" % (inst.kernel, len(funcs))
                    funcs[key] = fname
                    parts.append(k.function_source(fname, inst.in_specs, inst.out_dtypes, inst.template))
                wname = "emu_launch_%d" % n
                wrappers.append((inst, wname))
                parts.append(k.wrapper_source(wname, funcs[key], inst.in_specs, inst.out_dtypes,
                                              inst.template))
            src = "\n".join(parts)
            cmd_flags = self.flags()
            digest = hashlib.sha256("\0".join([src, emu_header, cxx, *cmd_flags]).encode()).hexdigest()[:24]
            d = cache_dir()
            so_path = os.path.join(d, "emu_%s.so" % digest)
            if not os.path.exists(so_path):
                fd, tmp_cpp = tempfile.mkstemp(suffix=".cpp", prefix="emu_%s_" % digest, dir=d)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(src)
                tmp_so = tmp_cpp[:-4] + ".so"
                proc = subprocess.run([cxx, *cmd_flags, "-I", HERE, tmp_cpp, "-o", tmp_so],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    raise EmulationError("compiling the emulated kernels failed (%s):\n%s"
                                         % (tmp_cpp, proc.stderr[-6000:]))
                os.replace(tmp_so, so_path)  # atomic: concurrent sessions never see half a file
                os.remove(tmp_cpp)
            lib = ctypes.CDLL(so_path)
            self._libs.append(lib)
            for inst, wname in wrappers:
                fn = getattr(lib, wname)
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint32),
                               ctypes.c_char_p, ctypes.c_int]
                self._symbols[inst] = fn

    def symbol(self, inst):
        return self._symbols.get(inst)


def instance_for(kernel: EmuKernel, inputs, out_dtypes, template=()) -> Instance:
    return Instance(kernel.name, tuple(ArgSpec.of(np.asarray(a)) for a in inputs),
                    tuple(np.dtype(d) for d in out_dtypes), tuple(template))


def _poisoned(shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.full(shape, np.nan, dtype=dtype)
    out = np.empty(shape, dtype=dtype)
    out.view(np.uint8)[...] = 0xA5
    return out


def lanes_mode(lanes: str | None = None) -> int:
    """How the threads of a threadgroup run: "threads" (OS threads, default) or "fibers"."""
    lanes = lanes or os.environ.get("METAL_EMU_LANES") or "threads"
    if lanes not in ("threads", "fibers"):
        raise EmulationError("lanes must be 'threads' or 'fibers', not %r (METAL_EMU_LANES)" % lanes)
    return 1 if lanes == "fibers" else 0


def launch(library: EmuLibrary, kernels: dict, kernel: EmuKernel, inputs, template, grid, threadgroup,
           output_shapes, output_dtypes, lanes: str | None = None):
    """Run ``kernel`` like ``mx.fast.metal_kernel(...)(inputs=..., ...)``; returns numpy outputs."""
    mode = lanes_mode(lanes)
    arrs = [np.require(np.asarray(a), requirements="C") for a in inputs]  # ensure_row_contiguous=True
    for n, a in zip(kernel.input_names, arrs):
        if np.dtype(a.dtype) not in TYPE_STRINGS:
            raise EmulationError("input %s: dtype %s is not supported" % (n, a.dtype))
    inst = instance_for(kernel, arrs, output_dtypes, template)
    library.build(kernels, [inst])
    fn = library.symbol(inst)
    keep = []
    ptrs = []
    for a, (has_shape, has_strides, has_ndim) in zip(arrs, kernel.shape_infos):
        data = a if a.size else np.zeros(1, a.dtype)  # a valid pointer even for empty inputs
        keep.append(data)
        ptrs.append(data.ctypes.data)
        if a.ndim > 0:
            if has_shape:
                s = np.array(a.shape, dtype=np.int32)
                keep.append(s)
                ptrs.append(s.ctypes.data)
            if has_strides:
                s = np.array([st // a.itemsize for st in a.strides], dtype=np.int64)
                keep.append(s)
                ptrs.append(s.ctypes.data)
            if has_ndim:
                s = np.array([a.ndim], dtype=np.int32)
                keep.append(s)
                ptrs.append(s.ctypes.data)
    outs = [_poisoned(tuple(s), d) for s, d in zip(output_shapes, output_dtypes)]
    for o in outs:
        ptrs.append(o.ctypes.data if o.size else np.zeros(1, o.dtype).ctypes.data)
    argv = (ctypes.c_void_p * len(ptrs))(*ptrs)
    dims = (ctypes.c_uint32 * 7)(*[int(v) for v in tuple(grid) + tuple(threadgroup)], mode)
    err = ctypes.create_string_buffer(1024)
    rc = fn(argv, dims, err, len(err))
    del keep
    if rc != 0:
        raise EmulationError("emulated kernel %s failed: %s" % (kernel.name, err.value.decode(errors="replace")))
    return outs

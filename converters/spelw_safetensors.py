"""SPELW001 <-> safetensors model folder (HF / mlx-lm style).

Folder form: ``model.safetensors`` holding every layout tensor under its
``spel_mlx.layout`` name (F32 by default), the golden footer as ``golden.tokens``
(U32 [n]), ``golden.target_logits`` and ``golden.draft_logits`` (F32 [n, V]),
and the config in ``__metadata__``; ``config.json`` beside it repeats the config.

SPELW001 -> folder -> SPELW001 is byte-identical: the header is rebuilt from the
config (floats as exact decimal reprs of the stored f32 values) and the flags,
and tensor bytes are copied unchanged.  Both directions stream tensor by tensor
from a memory map, dropping each tensor's pages once written.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from spel_mlx.config import ModelConfig
from spel_mlx.layout import GOLDEN_DRAFT, GOLDEN_TARGET, GOLDEN_TOKENS, tensor_specs
from spel_mlx.checkpoints.files import AtomicFile, Progress, StagedFolder, check_destination
from spel_mlx.checkpoints.footer import Golden, footer_nbytes
from spel_mlx.checkpoints.rules import (STORED_FIELDS, CheckpointError, check_golden_count, config_from_fields, load_json,
                                        read_json_file)
from spel_mlx.checkpoints.spelw import FLAG_GOLDEN, HEADER_SIZE, SpelwWriter, read_spelw

from . import packed_draft
from .safetensors_io import FLOAT_DTYPES, INT_DTYPES, SafetensorsFile, write_safetensors

MODEL_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GOLDEN_NAMES = (GOLDEN_TOKENS, GOLDEN_TARGET, GOLDEN_DRAFT)
META_CONFIG, META_FLAGS, META_FORMAT, META_DTYPE = "spel.config", "spel.flags", "spel.format", "spel.dtype"
MAX_CONFIG_JSON = 1 << 20        # bytes: a config.json is a few hundred
MAX_INDEX_JSON = 64 << 20        # bytes: a shard index names each tensor once


def config_fields(cfg: ModelConfig) -> dict:
    d = {k: getattr(cfg, k) for k in STORED_FIELDS}
    d["draft_map"] = list(cfg.draft_map)
    return d


def config_json(cfg: ModelConfig, dtype: str = "float32") -> dict:
    out = {"model_type": "spel", "architectures": ["SpelModel"], "checkpoint_format": "SPELW001"}
    out.update(config_fields(cfg))
    out["torch_dtype"] = dtype
    return out


def _st_files(src: str):
    """The .safetensors files of a folder (index.json shards, model.safetensors, or
    the folder's only .safetensors file) or the file itself."""
    if os.path.isdir(src):
        idx = os.path.join(src, INDEX_FILE)
        if os.path.exists(idx):
            wm = read_json_file(idx, "shard index", MAX_INDEX_JSON)
            wm = wm.get("weight_map") if isinstance(wm, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise CheckpointError(idx, "bad shard index: weight_map must map tensor names to file names",
                                      field="weight_map")
            files = sorted(set(wm.values()))
            bad = [x for x in files if os.path.basename(x) != x or x in ("", ".", "..")]
            if bad:
                raise CheckpointError(idx, f"bad shard index: {bad[0]!r} is not a file name in the folder",
                                      field="weight_map")
            return [os.path.join(src, x) for x in files], src
        main = os.path.join(src, MODEL_FILE)
        if os.path.exists(main):
            return [main], src
        found = sorted(x for x in os.listdir(src) if x.endswith(".safetensors"))
        if len(found) != 1:
            raise CheckpointError(src, f"expected {MODEL_FILE} (or one .safetensors file) in the folder, "
                                  f"found {found or 'none'}")
        return [os.path.join(src, found[0])], src
    if not os.path.exists(src):
        raise CheckpointError(src, "no such file or folder")
    return [src], os.path.dirname(os.path.abspath(src))


class SafetensorsModel:
    """A safetensors checkpoint (file or folder) checked against the SPEL layout."""

    def __init__(self, src):
        src = os.fspath(src)
        self.src = src
        paths, folder = _st_files(src)
        self.folder = folder
        self.files = [SafetensorsFile(p) for p in paths]
        self.entries = {}
        for sf in self.files:
            for name, e in sf.entries.items():
                if name in self.entries:
                    raise CheckpointError(sf.path, f"tensor {name} also appears in {self.entries[name].file.path}",
                                          offset=e.start, field=name)
                self.entries[name] = e
        main = self.files[0]
        self.metadata = dict(main.metadata)
        self.cfg = self._config(main, folder)
        self._check_layout()
        self.flags = FLAG_GOLDEN if self.has_golden else 0
        if META_FLAGS in self.metadata:
            try:
                mflags = int(self.metadata[META_FLAGS])
            except ValueError:
                mflags = None
            if mflags != self.flags:
                raise CheckpointError(main.path, f"__metadata__ {META_FLAGS}={self.metadata[META_FLAGS]!r} disagrees "
                                      f"with the tensors (golden tensors {'present' if self.has_golden else 'absent'})",
                                      offset=8, field=META_FLAGS)

    def _config(self, main: SafetensorsFile, folder: str) -> ModelConfig:
        meta_cfg = None
        if META_CONFIG in self.metadata:
            d = load_json(self.metadata[META_CONFIG], main.path, f"__metadata__.{META_CONFIG}")
            meta_cfg = config_from_fields(d, main.path, f"__metadata__.{META_CONFIG}", 8)
        cj = os.path.join(folder, CONFIG_FILE)
        json_cfg, spec_k = None, None
        if os.path.exists(cj):
            d = read_json_file(cj, CONFIG_FILE, MAX_CONFIG_JSON)
            json_cfg = config_from_fields(d, cj, "config.json")
            spec_k = d.get("spec_k")
        if meta_cfg is None and json_cfg is None:
            raise CheckpointError(main.path, f"no model config: neither __metadata__['{META_CONFIG}'] "
                                  f"nor {CONFIG_FILE} beside it", offset=8, field="__metadata__")
        if meta_cfg is not None and json_cfg is not None and meta_cfg != json_cfg:
            diff = [k for k in STORED_FIELDS if getattr(meta_cfg, k) != getattr(json_cfg, k)]
            raise CheckpointError(cj, f"config.json contradicts {main.path} __metadata__ on {', '.join(diff)}",
                                  field=diff[0])
        cfg = meta_cfg if meta_cfg is not None else json_cfg
        if spec_k is None:
            return cfg
        # optional, runtime only: the K this model decodes best with (--spec-k and SPEL_SPEC_K still win)
        if not isinstance(spec_k, int) or isinstance(spec_k, bool) or not 1 <= spec_k <= 16:
            raise CheckpointError(cj, f"config.json spec_k={spec_k!r}: expected an integer 1..16", field="spec_k")
        return dataclasses.replace(cfg, spec_k=spec_k)

    def _err(self, e, what):
        raise CheckpointError(e.file.path, f"tensor {e.name}: {what}", offset=e.start, field=e.name)

    def _check_layout(self):
        cfg, ents = self.cfg, self.entries
        specs = tensor_specs(cfg)
        names = {s.name for s in specs}
        # a quantized draft matrix may be stored as its codes and scales (packed_draft.py)
        self.packed = {s.name for s in specs if s.name not in ents and packed_draft.stored_names(s.name)
                       and any(n in ents for n in packed_draft.stored_names(s.name))}
        names |= {n for p in self.packed for n in packed_draft.stored_names(p)}
        missing = [s.name for s in specs if s.name not in ents and s.name not in self.packed]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(self.files[0].path, f"missing tensors {', '.join(missing[:5])}{more}",
                                  offset=8, field=missing[0])
        extra = [n for n in ents if n not in names and n not in GOLDEN_NAMES]
        if extra:
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            raise CheckpointError(ents[extra[0]].file.path, f"unexpected tensors {', '.join(extra[:5])}{more} "
                                  f"(not in the layout of this config)", offset=8, field=extra[0])
        for s in specs:
            if s.name in self.packed:
                packed_draft.check(s.name, s.shape, ents, self.files[0].path)
                continue
            e = ents[s.name]
            if e.dtype not in FLOAT_DTYPES:
                self._err(e, f"dtype {e.dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
            if e.shape != s.shape:
                self._err(e, f"shape {list(e.shape)}, expected {list(s.shape)}")
        present = [n for n in GOLDEN_NAMES if n in ents]
        if present and len(present) != 3:
            absent = [n for n in GOLDEN_NAMES if n not in ents]
            raise CheckpointError(ents[present[0]].file.path, f"incomplete golden footer: {', '.join(absent)} missing",
                                  offset=8, field=absent[0])
        self.has_golden = bool(present)
        if self.has_golden:
            t = ents[GOLDEN_TOKENS]
            if t.dtype not in INT_DTYPES:
                self._err(t, f"dtype {t.dtype}, expected U32")
            if len(t.shape) != 1 or t.shape[0] < 1:
                self._err(t, f"shape {list(t.shape)}, expected [n] with n >= 1")
            n = t.shape[0]
            check_golden_count(n, cfg, t.file.path, offset=t.start, field=GOLDEN_TOKENS)
            for name in (GOLDEN_TARGET, GOLDEN_DRAFT):
                e = ents[name]
                if e.dtype not in FLOAT_DTYPES:
                    self._err(e, f"dtype {e.dtype}, expected F32")
                if e.shape != (n, cfg.vocab):
                    self._err(e, f"shape {list(e.shape)}, expected [{n}, {cfg.vocab}]")
            tok = t.file.raw(GOLDEN_TOKENS)
            bad = np.nonzero((tok < 0) | (tok >= cfg.vocab))[0]
            if bad.size:
                i = int(bad[0])
                raise CheckpointError(t.file.path, f"golden token {int(tok[i])} out of range 0..{cfg.vocab - 1}",
                                      offset=t.start + i * (t.end - t.start) // n, field=f"{GOLDEN_TOKENS}[{i}]")

    @property
    def stored_dtypes(self) -> set:
        """The floats' dtypes, and "packed" where the draft is stored as codes and scales."""
        return {"packed" if s.name in self.packed else self.entries[s.name].dtype for s in tensor_specs(self.cfg)}

    def f32(self, name) -> np.ndarray:
        if name in self.packed:
            return packed_draft.read(name, self._shape(name), self.entries)
        return self.entries[name].file.f32(name)

    def _shape(self, name) -> tuple:
        return next(s.shape for s in tensor_specs(self.cfg) if s.name == name)

    def release(self, name):
        for n in packed_draft.stored_names(name) if name in self.packed else (name,):
            self.entries[n].file.release(n)

    def golden(self) -> Golden | None:
        if not self.has_golden:
            return None
        t = self.entries[GOLDEN_TOKENS].file.raw(GOLDEN_TOKENS)
        return Golden(t if t.dtype == np.dtype("<u4") else t.astype("<u4"), self.f32(GOLDEN_TARGET),
                      self.f32(GOLDEN_DRAFT))

    @property
    def source_paths(self) -> list:
        """Every file this model is read from (data, config.json, shard index)."""
        extra = [os.path.join(self.folder, n) for n in (CONFIG_FILE, INDEX_FILE)]
        return [f.path for f in self.files] + [p for p in extra if os.path.exists(p)]

    @property
    def nbytes(self) -> int:
        return sum(e.end - e.start for e in self.entries.values())


def _check_dir(dst_dir):
    if os.path.exists(dst_dir) and not os.path.isdir(dst_dir):
        raise CheckpointError(dst_dir, "destination exists and is not a folder")
    if os.path.exists(os.path.join(dst_dir, INDEX_FILE)):
        raise CheckpointError(dst_dir, f"destination holds a sharded model ({INDEX_FILE}); choose an empty folder")
    parent = os.path.dirname(os.path.abspath(os.path.normpath(dst_dir)))
    if not os.path.isdir(parent):
        raise CheckpointError(dst_dir, f"no such folder: {parent}")


def spelw_to_safetensors(src, dst_dir, dtype: str = "F32", progress=None, golden: Golden | None = None,
                         pack_draft: bool = False):
    """Convert a SPELW001 file into a model folder ``dst_dir``.

    ``dtype`` F16/BF16 round the weights (golden logits stay F32); the caller must
    then pass ``golden`` recomputed for the rounded weights (``python -m
    spel_mlx.convert --dtype`` does), since the footer describes the stored values.
    ``pack_draft``: the draft's quantized matrices as codes and scales, exactly
    (packed_draft.py; refused unless they are on their grid); ``dtype`` then rounds
    only the other tensors.
    """
    dtype = dtype.upper()
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(FLOAT_DTYPES)}")
    check_destination(dst_dir, [src], [os.path.join(dst_dir, n) for n in (MODEL_FILE, CONFIG_FILE)])
    sp = read_spelw(src)
    cfg = sp.cfg
    g = golden if golden is not None else sp.golden
    flags = FLAG_GOLDEN if g is not None else 0
    meta = {"format": "mlx", META_FORMAT: "SPELW001",
            META_CONFIG: json.dumps(config_fields(cfg), separators=(",", ":")), META_FLAGS: str(flags)}
    if dtype != "F32":
        meta[META_DTYPE] = dtype
    entries = []
    for s in tensor_specs(cfg):
        if pack_draft and packed_draft.stored_names(s.name):
            entries += packed_draft.entries(s.name, s.shape, sp.tensors[s.name], src)
        else:
            entries.append((s.name, dtype, s.shape, (lambda n=s.name: sp.tensors[n])))
    if pack_draft:
        meta[packed_draft.META_DRAFT] = "packed"
    if g is not None:
        n, V = g.n, cfg.vocab
        entries += [(GOLDEN_TOKENS, "U32", (n,), lambda: g.tokens),
                    (GOLDEN_TARGET, "F32", (n, V), lambda: g.target_logits),
                    (GOLDEN_DRAFT, "F32", (n, V), lambda: g.draft_logits)]

    def drop(name):
        name = name.rsplit(".", 1)[0] if name not in sp.spans else name    # a packed matrix's pair
        if name in sp.spans:
            sp.release(*sp.spans[name])

    _check_dir(dst_dir)
    # both files are written in a staged folder beside dst_dir, which then appears whole
    # (or, into an existing folder, both move in once both are written): checkpoints.files
    with StagedFolder(dst_dir) as out:
        write_safetensors(out.file(MODEL_FILE), entries, meta, progress=progress, after_each=drop)
        with AtomicFile(out.file(CONFIG_FILE)) as cj:
            cj.f.write((json.dumps(config_json(cfg, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype]),
                                   indent=2) + "\n").encode())
    return os.path.join(dst_dir, MODEL_FILE)


def safetensors_to_spelw(src, dst, progress=None):
    """Convert a safetensors model (folder or file) into a SPELW001 file.

    F16/BF16 tensors are widened to F32 exactly (every F16/BF16 value is an F32 value).
    """
    st = SafetensorsModel(src)
    check_destination(dst, [src, *st.source_paths], [dst])
    cfg = st.cfg
    g = st.golden()
    with SpelwWriter(dst, cfg, progress=progress) as w:
        for s in tensor_specs(cfg):
            w.write_tensor(s.name, st.f32(s.name))
            st.release(s.name)
        if g is not None:
            w.write_golden(g)
    return dst


def spelw_size(cfg: ModelConfig, golden_n: int | None) -> int:
    return HEADER_SIZE + sum(s.nbytes for s in tensor_specs(cfg)) + (footer_nbytes(golden_n, cfg.vocab)
                                                                     if golden_n else 0)


__all__ = ["spelw_to_safetensors", "safetensors_to_spelw", "SafetensorsModel", "Progress", "config_json",
           "MODEL_FILE", "CONFIG_FILE"]

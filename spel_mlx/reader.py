"""Load a checkpoint in either form: a SPELW001 file (spel_mlx.checkpoints) or a
safetensors model folder (spel_mlx.converters).

``load_checkpoint(path)`` returns the config read from the checkpoint, the weights
dict (float32, memory-mapped views where the file stores F32; F16/BF16 tensors are
widened to float32 copies), the golden footer if any, and where it came from.  It sits
above both packages: the safetensors form is built on the checkpoint primitives.
"""
from __future__ import annotations

import os

from .checkpoints.load import Checkpoint, is_spelw, resolve_checkpoint_path, warn_nonfinite
from .checkpoints.rules import CheckpointError, check_memory
from .checkpoints.spelw import read_header, read_spelw
from .layout import tensor_specs


def load_checkpoint(path=None, check_finite: bool = True) -> Checkpoint:
    """Load a SPELW001 file or a safetensors model folder / file (see module doc).

    Refuses (CheckpointTooLarge) a checkpoint whose implied memory exceeds what this
    process can allocate, before allocating; warns (NonFiniteWeightsWarning) when
    weights hold NaN or infinity, naming the tensors (``check_finite`` False: the
    caller checks them as it reads them, as loading.load_for_decoding does)."""
    path = resolve_checkpoint_path(path)
    if not os.path.exists(path):
        raise CheckpointError(path, "no such file or folder")
    if os.path.isdir(path) or (path.endswith(".safetensors") and not is_spelw(path)):
        from .converters import SafetensorsModel

        st = SafetensorsModel(path)
        check_memory(st.cfg, path)
        weights = {s.name: st.f32(s.name) for s in tensor_specs(st.cfg)}
        dts = st.stored_dtypes
        floats = dts - {"packed"}
        stored = (floats.pop() if len(floats) == 1 else "mixed") + (", draft packed" if "packed" in dts else "")
        ck = Checkpoint(st.cfg, weights, st.golden(), path, "safetensors", stored, sum(f.size for f in st.files),
                        lambda: [st.release(n) for n in weights], st.release)
    else:
        check_memory(read_header(path).cfg, path)
        sp = read_spelw(path)
        ck = Checkpoint(sp.cfg, sp.tensors, sp.golden, path, "spelw", "F32", sp.file_size,
                        lambda: sp.release(0, sp.file_size), sp.release_tensor)
    if check_finite:
        warn_nonfinite(ck)
    return ck

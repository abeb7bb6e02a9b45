"""``python -m spel_mlx info [--model PATH | --preset P] [--config k=v,...]``

Describes a checkpoint (by default the one generate would load: SPEL_WEIGHTS, else the
shipped model) or, with --preset, a preset shape: its configuration, parameter counts
and sizes; and the machine it would run on: which BLAS MLX resolved, the MLX version
and device, its GPU (Metal, CUDA or none, with why), the kernel path, whether huge
pages back the weights.  A bad checkpoint or configuration is a one-line error, exit 2;
no installed checkpoint is one line, exit 1.
"""
from __future__ import annotations

import os
import sys

import spel_mlx
from .. import layout
from ..platform import heap, huge_pages
from ..config import ConfigError, resolve_config
from ..settings import effective
from . import args as shared
from .errors import UsageError


def _kernel_path() -> str:
    try:
        from ..model import backends
    except ImportError:
        return "mlx-ops"
    try:
        return str(backends.describe())
    except Exception as e:  # a broken kernel module must not hide the rest of the report
        return f"mlx-ops (backends.describe() failed: {type(e).__name__}: {e})"


def _mib(nbytes: int) -> str:
    return f"{nbytes:,} B ({nbytes / 2**20:.2f} MiB)"


def _gpu() -> str:
    try:
        from ..model import backends
        gpu = backends.gpu_backend()
        return f"{gpu} (generate --placement gpu)" if gpu else f"none: {backends.no_gpu_reason()}"
    except Exception as e:  # noqa: BLE001  (the rest of the report still prints)
        return f"unknown ({type(e).__name__}: {e})"


def report(cfg, checkpoint: str | None = None) -> list:
    import mlx.core as mx
    blas = spel_mlx.blas_info()
    target, draft = cfg.target_params(), cfg.draft_params()
    shared_params = 2 * cfg.vocab * cfg.d_model + cfg.d_model
    lines = [checkpoint] if checkpoint else []
    lines += [
        f"blas:           {blas.get('kind')}  {blas.get('path') or ''}  {blas.get('detail') or ''}".rstrip(),
        f"mlx:            {mx.__version__}  default device {mx.default_device()}",
        f"gpu:            {_gpu()}",
        f"kernels:        {_kernel_path()}",
        f"huge pages:     {huge_pages.state()} (weights and KV caches; SPEL_HUGE_PAGES=0 turns it off)",
        f"heap:           {heap.state()} (freed buffers stay mapped; SPEL_HEAP_TUNING=0 turns it off)",
        "config:         " + ",".join(f"{k}={':'.join(map(str, v)) if k == 'draft_map' else v}"
                                      for k, v in cfg.to_dict().items()),
        f"layers:         {len(cfg.gdn_layers)} GDN + {len(cfg.attention_layers)} attention "
        f"(attention at {cfg.attention_layers}); draft = layers {list(cfg.draft_map)} "
        f"({', '.join(cfg.layer_kind(i) for i in cfg.draft_map)})",
        f"params target:  {target:,}  (FP32 {_mib(4 * target)})",
        f"params draft:   {draft:,}  (FP32 {_mib(4 * draft)}; shared embedding/final norm/head "
        f"{shared_params:,} not counted)",
        f"params mixer:   GDN {cfg.mixer_params('gdn'):,} per layer, attention "
        f"{cfg.mixer_params('attn'):,} per layer",
        f"SPELW001 size:  {_mib(64 + layout.weights_nbytes(cfg))} without footer",
        "settings:       (spel_mlx/settings.py; README.md, \"Settings\")",
    ]
    lines += [f"  {name:<22} {value}{'' if how == 'set' else '  (default)'}" for name, value, how in effective()]
    return lines


def read_checkpoint(path: str):
    """(config, the "checkpoint:" line) from the checkpoint's header alone: no weights read."""
    from ..checkpoints import is_spelw, read_header
    if os.path.isdir(path) or (path.endswith(".safetensors") and not is_spelw(path)):
        from ..converters import SafetensorsModel
        st = SafetensorsModel(path)
        cfg, size, golden = st.cfg, sum(f.size for f in st.files), st.has_golden
        fmt = f"safetensors ({', '.join(sorted(st.stored_dtypes))})"
    else:
        header = read_header(path)
        cfg, size, golden, fmt = header.cfg, header.file_size, header.has_golden, "SPELW001"
    line = (f"checkpoint:     {path} [{fmt}]  {_mib(size)} on disk, "
            f"{'a' if golden else 'no'} golden footer")
    return cfg, line


def build_parser() -> shared.Parser:
    ap = shared.parser("info", shared.first_paragraph(__doc__))
    shared.model(ap, help="the checkpoint to describe (default SPEL_WEIGHTS, else the shipped model)")
    shared.preset(ap, default=None)
    shared.config(ap, help="overrides, e.g. d_model=1024,n_layers=16 (must agree with a checkpoint)")
    return ap


def main(argv=None) -> int:
    from ..checkpoints import CheckpointError
    from ..loading import NoCheckpoint, checkpoint_path
    try:
        args = build_parser().parse_args(argv)
        if args.preset is not None:
            if args.model is not None:
                raise UsageError("give --model or --preset, not both")
            cfg, line = resolve_config(args.preset, args.config), None
        else:
            ck_cfg, line = read_checkpoint(checkpoint_path(args.model))
            cfg = resolve_config(checkpoint=ck_cfg, overrides=args.config)
    except NoCheckpoint as e:
        print(f"spel_mlx.info: error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"spel_mlx.info: config error: {e}", file=sys.stderr)
        return 2
    except (UsageError, CheckpointError, OSError) as e:
        print(f"spel_mlx.info: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(report(cfg, line)))
    return 0

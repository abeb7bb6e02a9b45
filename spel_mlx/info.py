"""``python -m spel_mlx.info [--preset P] [--config k=v,...]``

Prints which BLAS MLX resolved, the MLX version and device, its GPU (Metal, CUDA or
none, with why), the sequence-kernel path, whether huge pages back the weights, the
effective configuration and its parameter counts / FP32 sizes.  A bad configuration is
a one-line error, exit 2.
"""
from __future__ import annotations

import argparse
import sys

import spel_mlx  # noqa: F401  (loads the BLAS before mlx.core)
from . import heap, huge_pages, layout
from .config import PRESETS, ConfigError, resolve_config


def _kernel_path() -> str:
    try:
        from .model import backends
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
        from .model import backends
        gpu = backends.gpu_backend()
        return f"{gpu} (generate --placement gpu)" if gpu else f"none: {backends.no_gpu_reason()}"
    except Exception as e:  # noqa: BLE001  (the rest of the report still prints)
        return f"unknown ({type(e).__name__}: {e})"


def report(cfg) -> list:
    import mlx.core as mx
    blas = spel_mlx.blas_info()
    target, draft = cfg.target_params(), cfg.draft_params()
    shared = 2 * cfg.vocab * cfg.d_model + cfg.d_model
    lines = [
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
        f"{shared:,} not counted)",
        f"params mixer:   GDN {cfg.mixer_params('gdn'):,} per layer, attention "
        f"{cfg.mixer_params('attn'):,} per layer",
        f"SPELW001 size:  {_mib(64 + layout.weights_nbytes(cfg))} without footer",
    ]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spel_mlx.info", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="21m", help=f"one of {', '.join(PRESETS)} (default 21m)")
    ap.add_argument("--config", default=None, help="overrides, e.g. d_model=1024,n_layers=16")
    args = ap.parse_args(argv)
    try:
        cfg = resolve_config(args.preset, args.config)
    except ConfigError as e:
        print(f"spel_mlx.info: config error: {e}", file=sys.stderr)
        return 2
    print("\n".join(report(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

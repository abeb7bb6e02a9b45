"""``python -m spel_mlx synth``: a random SPELW001 model with a golden footer
(spel_mlx/synth.py).  An existing --out is replaced only with --force."""
from __future__ import annotations

import os
import sys

from ..atomic import refuse_existing
from ..checkpoints import CheckpointError
from ..checkpoints.rules import check_memory
from ..config import ConfigError, resolve_config
from ..synth import __doc__ as SYNTH_DOC, write_synth
from . import args as shared
from .errors import guarded


def build_parser() -> shared.Parser:
    ap = shared.parser("synth", shared.first_paragraph(SYNTH_DOC))
    shared.preset(ap)
    shared.config(ap, help="overrides, e.g. d_model=64,n_layers=4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    shared.force(ap, "an existing --out")
    ap.add_argument("--golden-n", type=int, default=16, help="number of golden tokens (SPEC: 16)")
    ap.add_argument("--draft", choices=("auto", "c", "numpy"), default="auto",
                    help="quantized draft for the golden logits: C engine, numpy fake-quant, or C if it loads")
    ap.add_argument("--target", choices=("mlx", "numpy"), default="mlx",
                    help="FP32 target for the golden logits: the MLX model (default) or the numpy forward")
    ap.add_argument("--quiet", action="store_true")
    return ap


def main(argv=None) -> int:
    return guarded(lambda: _run(build_parser().parse_args(argv)), (ConfigError, CheckpointError, ValueError, OSError),
                   "synth", "interrupted (no output written)", internal=" (no output written)")


def _run(a) -> int:
    cfg = resolve_config(a.preset, a.config)
    if not (1 <= a.golden_n <= cfg.max_seq):
        raise ConfigError(f"--golden-n={a.golden_n}: must be in 1..max_seq={cfg.max_seq}")
    if a.seed < 0:
        raise ConfigError(f"--seed={a.seed}: must be >= 0")
    refuse_existing([a.out], a.force)
    check_memory(cfg, a.out)
    info = write_synth(a.out, cfg, a.seed, a.golden_n, a.draft, progress=not a.quiet, target=a.target)
    if not a.quiet:
        b = info.get("golden") or {}
        print(f"wrote {a.out}: {os.path.getsize(a.out)} bytes, target {cfg.target_params():,} params, "
              f"draft {cfg.draft_params():,} params, golden target={b.get('target')} draft={b.get('draft')}")
    return 0

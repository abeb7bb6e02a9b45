"""``python -m spel_mlx convert SRC DST``: SPELW001 <-> safetensors model folder
(spel_mlx/convert.py).  An existing DST is replaced only with --force."""
from __future__ import annotations

import sys

from ..checkpoints import CheckpointError
from ..config import ConfigError
from ..convert import __doc__ as CONVERT_DOC, convert
from . import args as shared
from .errors import guarded


def build_parser() -> shared.Parser:
    ap = shared.parser("convert", shared.first_paragraph(CONVERT_DOC))
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--dtype", default="f32", type=str.upper, choices=("F32", "F16", "BF16"))
    ap.add_argument("--pack-draft", action="store_true",
                    help="store the draft's quantized matrices as codes and scales (exact; the draft must be "
                         "on its quantization grid, as an exported model's is)")
    ap.add_argument("--quiet", action="store_true")
    shared.force(ap, "an existing destination")
    return ap


def main(argv=None) -> int:
    return guarded(lambda: _run(build_parser().parse_args(argv)), (CheckpointError, ConfigError, ValueError, OSError),
                   "convert", "interrupted (no output written)", internal=" (no output written)")


def _run(a) -> int:
    what = convert(a.src, a.dst, a.dtype, progress=not a.quiet, force=a.force, pack_draft=a.pack_draft)
    if not a.quiet:
        print(f"convert: {what}: {a.src} -> {a.dst}", file=sys.stderr)
    return 0

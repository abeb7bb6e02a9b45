"""``python -m spel_mlx verify-weights [FILE]``: a checkpoint against its golden footer
(spel_mlx/verify_weights.py).  Exit 0 PASS, 1 FAIL, 2 bad input, 3 internal error."""
from __future__ import annotations

from ..checkpoints import CheckpointError
from ..config import ConfigError
from ..verify_weights import __doc__ as VERIFY_DOC, verify
from . import args as shared
from .errors import guarded


def build_parser() -> shared.Parser:
    ap = shared.parser("verify-weights", shared.first_paragraph(VERIFY_DOC))
    ap.add_argument("file", nargs="?", default=None, help="SPELW001 file or safetensors folder "
                    "(default: $SPEL_WEIGHTS, then the shipped default)")
    shared.config(ap, help="k=v,... (must agree with the checkpoint header)")
    ap.add_argument("--draft", choices=("auto", "c", "numpy"), default="auto",
                    help="quantized draft: the C engine, the numpy fake-quant reference, or C if it loads")
    ap.add_argument("--target", choices=("mlx", "numpy"), default="mlx",
                    help="FP32 target: the MLX model (default) or the numpy forward")
    return ap


def _run(argv) -> int:
    a = build_parser().parse_args(argv)
    return 0 if verify(a.file, a.config, a.draft, target_backend=a.target) else 1


def main(argv=None) -> int:
    # ValueError: the C draft refusing weights
    return guarded(lambda: _run(argv), (CheckpointError, ConfigError, ValueError), "verify_weights", internal="")

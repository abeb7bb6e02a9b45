"""``python -m spel_mlx selftest``: the original's eight invariant suites on random
weights (spel_mlx/selftest.py).  Exit 0 PASS, 1 FAIL, 2 bad input."""
from __future__ import annotations

import sys

from ..config import ConfigError, resolve_config
from ..selftest import parse_only, run
from . import args as shared
from .errors import UsageError


def build_parser() -> shared.Parser:
    ap = shared.parser("selftest", "The eight invariant suites of the original, on random weights.")
    shared.preset(ap)
    shared.config(ap, help="overrides k=v,... (e.g. a smaller shape)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="comma-separated suite numbers, e.g. 3,6")
    return ap


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        cfg = resolve_config(args.preset, args.config)
        only = parse_only(args.only) if args.only is not None else None
    except (UsageError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return 1 if run(cfg, args.seed, only=only) else 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

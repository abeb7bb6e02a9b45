"""``python -m spel_mlx corpus``: build the training corpus (spel_mlx/training/corpus.py)."""
from __future__ import annotations

from ..training.corpus import KNOWN_SOURCES, SOURCES, CorpusError, __doc__ as CORPUS_DOC, prepare
from . import args as shared
from .errors import guarded


def build_parser() -> shared.Parser:
    ap = shared.parser("corpus", CORPUS_DOC.split("\n")[0])
    ap.add_argument("--out", default="data/corpus")
    ap.add_argument("--sources", default=",".join(SOURCES),
                    help=f"comma-separated, of {', '.join(KNOWN_SOURCES)} (default %(default)s)")
    return ap


def _run(a) -> int:
    m = prepare(a.out, [s.strip() for s in a.sources.split(",") if s.strip()])
    for s, v in m["sources"].items():
        print(f"{s}: {v['bytes']} bytes, train {v['train_bytes']}, held-out {v['heldout_bytes']}")
    return 0


def main(argv=None) -> int:
    return guarded(lambda: _run(build_parser().parse_args(argv)), (CorpusError,))

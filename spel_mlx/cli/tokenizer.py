"""``python -m spel_mlx tokenizer train|encode``: train the SentencePiece model, or show
how a text encodes (spel_mlx/tokenizer.py)."""
from __future__ import annotations

from ..tokenizer import DEFAULT_SP_MODEL, ByteTokenizer, SentencePieceTokenizer, TokenizerError, train_sentencepiece
from . import args as shared
from .errors import guarded


def build_parser() -> shared.Parser:
    ap = shared.parser("tokenizer", "Train the SentencePiece model, or print how a text encodes.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the SentencePiece model on the training split")
    t.add_argument("--input", default="data/corpus/train.txt")
    t.add_argument("--vocab", type=int, default=2048)
    t.add_argument("--out", default=DEFAULT_SP_MODEL)
    e = sub.add_parser("encode", help="print token ids of a text")
    e.add_argument("text")
    e.add_argument("--vocab", type=int, default=0, help="128 for the ASCII byte vocabulary")
    return ap


def main(argv=None) -> int:
    return guarded(lambda: _run(build_parser().parse_args(argv)), (TokenizerError,))


def _run(a) -> int:
    if a.cmd == "train":
        tok = train_sentencepiece(a.input, a.out, a.vocab)
        print(f"wrote {a.out} ({tok.vocab_size} pieces)")
    else:
        tok = ByteTokenizer() if a.vocab == 128 else SentencePieceTokenizer()
        ids = tok.encode(a.text)
        print(" ".join(map(str, ids)))
        print(" | ".join(tok.id_to_piece(i) for i in ids))
    return 0

"""``python -m spel_mlx notebank demo``: the needle demo from the command line."""
from __future__ import annotations

import os

from ..atomic import write_json
from ..notebank.config import QUERY_SOURCES, NoteBankConfig, NoteBankError
from ..notebank.demo import format_table, run_demo, toy_model
from . import args as shared
from .errors import guarded


def _load_for_demo(args):
    """(model, tokenizer, label) for --toy or a checkpoint (default: the shipped one)."""
    from ..tokenizer import ByteTokenizer, load_tokenizer
    if args.toy:
        tie = not args.toy_untied
        label = (f"toy 128d/8L random weights (seed {args.model_seed}, "
                 f"{'GDN q tied to k' if tie else 'independent q/k'})")
        return toy_model(args.model_seed, tie_qk=tie), ByteTokenizer(), label
    from ..reader import load_checkpoint
    from ..model import SpelModel
    ck = load_checkpoint(args.model)
    tok_path = None
    if os.path.isdir(ck.source) and os.path.isfile(os.path.join(ck.source, "tokenizer.model")):
        tok_path = os.path.join(ck.source, "tokenizer.model")
    tok = load_tokenizer(ck.cfg.vocab, tok_path)
    c = ck.cfg
    label = f"{ck.source} ({c.d_model}d/{c.n_layers}L, vocab {c.vocab}, {tok.name})"
    return SpelModel.from_weights(ck.cfg, ck.weights), tok, label


def _demo(args) -> int:
    cfg = NoteBankConfig(chunk=args.chunk, span=args.span, notes_per_chunk=args.notes_per_chunk,
                         query_positions=args.query_positions, top_r=args.top_r,
                         query_source=args.query_source,
                         channel_top=args.channel_top).validate()
    if args.tokens < 3 * 16:
        raise NoteBankError(f"--tokens={args.tokens}: need at least 48 to plant three needles")
    model, tok, label = _load_for_demo(args)
    if args.tokens + 64 > model.cfg.max_seq:
        raise NoteBankError(f"--tokens={args.tokens}: the model's max_seq is {model.cfg.max_seq}")
    res = run_demo(model, tok, cfg, args.tokens, args.seed, args.spec_tokens)
    res["label"] = label
    print(format_table(res, label))
    if args.json:
        try:
            write_json(args.json, res, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
        except OSError as e:
            raise OSError(f"cannot write {args.json}: {e}") from None
    return 0


def build_parser() -> shared.Parser:
    ap = shared.parser("notebank", "NoteBank episodic memory: the needle demo.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="three planted KEY_n=VALUE; needles, notes, query ?KEY_n=")
    shared.model(d)
    d.add_argument("--toy", action="store_true", help="random-weight 128d/8L toy model, byte vocab")
    d.add_argument("--toy-untied", action="store_true",
                   help="toy with independent random q/k (addressing by q is then chance)")
    d.add_argument("--model-seed", type=int, default=0)
    d.add_argument("--seed", type=int, default=0, help="seed of the filler and needle values")
    d.add_argument("--tokens", type=int, default=384, help="context length in tokens")
    d.add_argument("--chunk", type=int, default=128)
    d.add_argument("--span", type=int, default=16)
    d.add_argument("--notes-per-chunk", type=int, default=2)
    d.add_argument("--query-positions", type=int, default=4)
    d.add_argument("--top-r", type=int, default=2)
    d.add_argument("--query-source", choices=QUERY_SOURCES, default="k")
    d.add_argument("--channel-top", type=float, default=1.0,
                   help="fraction of channels whose distinctiveness scores a position (1 = mean)")
    d.add_argument("--spec-tokens", type=int, default=16, help="speculative run length (0: skip)")
    d.add_argument("--json", help="also write the measurements to this JSON file (atomically)")
    return ap


def _run(argv) -> int:
    args = build_parser().parse_args(argv)
    if args.toy_untied:
        args.toy = True
    return _demo(args)


def main(argv=None) -> int:
    # config, checkpoint, tokenizer and state errors are ValueError or OSError
    return guarded(lambda: _run(argv), (ValueError, OSError), prog="notebank demo")

"""``python -m spel_mlx server``: an OpenAI-compatible HTTP server and a live page.

    python -m spel_mlx server                          # the shipped model on 127.0.0.1:8080
    python -m spel_mlx server --model m.spelw --port 8000 --api-key SECRET

Needs the `server` extra (`pip install -e '.[server]'`).  See docs/server.md.
"""
from __future__ import annotations

import logging
import os
import sys

from ..settings import setting
from . import args as shared
from .errors import UsageError


def build_parser() -> shared.Parser:
    ap = shared.parser("server", "OpenAI-compatible server for a spel-mlx model, with a live page at /.")
    shared.model(ap)
    ap.add_argument("--tokenizer", help="SentencePiece model (default: beside the checkpoint, else the shipped one)")
    ap.add_argument("--model-id", help="the model's name in responses (default: spel-mlx-<folder or file name>)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    shared.port(ap, 8080)
    ap.add_argument("--allowed-hosts", nargs="+", default=[], metavar="NAME",
                    help="Host header names served beside loopback ones ('*': any; docs/server.md, \"Exposure\")")
    ap.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                    help="web origins allowed to call the API from a browser (CORS; default none)")
    ap.add_argument("--api-key", default=setting("SPEL_API_KEY") or None,
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: SPEL_API_KEY, else none)")
    ap.add_argument("--queue-size", type=shared.ranged(1, 4096), default=8,
                    help="requests that may wait behind the running one; more get 429 (default 8)")
    ap.add_argument("--prompt-cache-size", type=shared.ranged(0, 1024), default=8, metavar="N",
                    help="target states kept for requests whose prompt begins with an earlier one's tokens "
                         "(the N most recently used; 0: off; default 8; docs/server.md, \"Prompt cache\")")
    shared.mode(ap, help="default decoding mode")
    shared.draft(ap, kinds=("c", "mlx", "ngram", "auto"),
                 help="default draft (default: auto for greedy requests, c when sampling; mlx where "
                      "the C draft is not built)")
    shared.kv_cache(ap)
    ap.add_argument("--no-warmup", action="store_true", help="skip the short warm-up generation at start")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return ap


def model_name(source: str) -> str:
    base = os.path.basename(os.path.normpath(source))
    return "spel-mlx-" + (os.path.splitext(base)[0] if os.path.isfile(source) else base)


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        from ..server.app import create_app
        from ..server.serve import run
    except ImportError as e:
        print(f"error: the server needs FastAPI and uvicorn ({e}); install with pip install -e '.[server]'",
              file=sys.stderr)
        return 2
    from ..api import GenerationError, LoadError, NoCheckpoint, load, prepare
    from ..server.chat import ChatFormat, TemplateError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        loaded, tokenizer = load(args.model, tokenizer=args.tokenizer, kv_cache=args.kv_cache)
    except NoCheckpoint as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except LoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    defaults = {"mode": args.mode, "draft": args.draft, "k": args.spec_k, "draft_threads": args.draft_threads}
    try:
        prepare(loaded, tokenizer, [0], 1, **defaults)        # the defaults are valid settings
    except GenerationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        chat_format = ChatFormat.for_model(loaded.source, tokenizer)
    except TemplateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bound = [] if args.host in ("0.0.0.0", "::", "") else [args.host]     # the address it is reached by
    app = create_app(loaded, tokenizer, model_id=args.model_id or model_name(loaded.source),
                     api_key=args.api_key, queue_size=args.queue_size, defaults=defaults,
                     warmup=not args.no_warmup, allowed_hosts=bound + args.allowed_hosts,
                     allowed_origins=args.allowed_origins, chat_format=chat_format,
                     prompt_cache_size=args.prompt_cache_size)
    return run(app, host=args.host, port=args.port, log_level=args.log_level)

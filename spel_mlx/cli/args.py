"""The flags the commands share, each defined once: the same flag for the same thing in
every command, its choices taken from the lists the API checks against (modes, draft
kinds, K/V cache dtypes, accept rules), its range checked while parsing.

A command builds its parser with `parser(name, ...)`: a bad flag or value is then one
line (a UsageError its main prints, exit 2), never a usage dump or a traceback.
"""
from __future__ import annotations

import argparse

from ..settings import SettingError, check as check_settings
from .errors import UsageError

CHECKPOINT_HELP = "SPELW001 file or safetensors model folder (default SPEL_WEIGHTS, else the shipped model)"
BENCHMARK_MODES = ("forced", "oracle")      # modes for measurements, not for text


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)

    def parse_known_args(self, args=None, namespace=None):
        # a bad SPEL_* value stops every command before any work, as a bad flag does
        try:
            check_settings()
        except SettingError as e:
            raise UsageError(str(e)) from None
        return super().parse_known_args(args, namespace)


def parser(name: str, description: str = "", **kw) -> Parser:
    return Parser(prog=f"python -m spel_mlx {name}", description=description, **kw)


def first_paragraph(doc: str) -> str:
    return doc.strip().split("\n\n")[0]


def ranged(lo: int, hi: int | None = None, kind=int):
    """An argparse type: a number of `kind` in lo..hi (hi None: no upper bound)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{text}: must be in {lo}..{hi}" if hi is not None
                                             else f"{text}: must be >= {lo}")
        return value
    return parse


# --------------------------------------------------------------------------- the model

def model(ap, help: str = CHECKPOINT_HELP, **kw):
    """--model (--checkpoint: the same): the checkpoint to load."""
    ap.add_argument("--model", "--checkpoint", dest="model", metavar="PATH", help=help, **kw)


def tokenizer(ap):
    ap.add_argument("--tokenizer", help="SentencePiece model (default: beside the checkpoint, "
                                        "else the shipped one; vocab 128 uses ASCII bytes)")


def config(ap, help: str = "config overrides k=v,...; must agree with the checkpoint", **kw):
    ap.add_argument("--config", help=help, **kw)


def preset(ap, default: str | None = "21m"):
    from ..config import PRESETS
    ap.add_argument("--preset", default=default, help=f"one of {', '.join(PRESETS)}"
                    + (f" (default {default})" if default else ""))


def force(ap, what: str = "an existing output"):
    ap.add_argument("--force", action="store_true", help=f"replace {what}")


# --------------------------------------------------------------------------- decoding

def max_tokens(ap, default: int):
    ap.add_argument("--max-tokens", type=ranged(0), default=default, help=f"tokens to generate (default {default})")


def mode_help(benchmark: bool = False) -> str:
    from ..decoding import MODES
    if not benchmark:
        return " | ".join(m for m in MODES if m not in BENCHMARK_MODES)
    return " | ".join(m + "=ALPHA" if m == "forced" else m for m in MODES) + " (forced and oracle are benchmark-only)"


def mode(ap, default: str = "spec", benchmark: bool = False, help: str = "decoding mode"):
    """--mode: the decoding modes; with `benchmark` the measurement-only ones too (the
    command parses those itself: forced takes a value)."""
    from ..decoding import MODES
    if benchmark:
        ap.add_argument("--mode", default=default, help=f"{mode_help(True)} (default {default})")
    else:
        ap.add_argument("--mode", choices=tuple(m for m in MODES if m not in BENCHMARK_MODES), default=default,
                        help=f"{help} (default {default})")


def draft(ap, kinds=None, help: str = "draft engine"):
    """--draft, --spec-k (the draft length), --draft-threads."""
    from ..api.engine import MAX_DRAFT_THREADS
    from ..decoding import PROPOSER_KINDS
    ap.add_argument("--draft", default=None, choices=kinds or PROPOSER_KINDS, help=help)
    draft_length(ap)
    ap.add_argument("--draft-threads", type=ranged(1, MAX_DRAFT_THREADS), default=None,
                    help=f"C draft worker threads 1..{MAX_DRAFT_THREADS} (default SPEL_DRAFT_THREADS, else 1)")


def draft_length(ap, default: int | None = None, *aliases: str):
    """--spec-k (--num-draft-tokens, mlx-lm's name): the draft proposals per round."""
    from ..decoding.loop import MAX_K
    why = "SPEL_SPEC_K, else the checkpoint's spec_k: 4" if default is None else default
    ap.add_argument("--spec-k", "--num-draft-tokens", *aliases, dest="spec_k", type=ranged(1, MAX_K),
                    default=default, metavar="K", help=f"draft proposals per round, 1..{MAX_K} (default {why})")


def kv_cache(ap):
    from ..model.state import KV_DTYPES
    ap.add_argument("--kv-cache", choices=tuple(KV_DTYPES), default="float32",
                    help="the target's K/V cache dtype: float32 (the exact model, default) or float16 "
                         "(half the bytes per token at long contexts; k and v rounded once)")


def sampling(ap):
    """--temperature (--temp), --top-p, --top-k, --repetition-penalty, --seed, --accept."""
    from ..api import DEFAULT_REPETITION_PENALTY, DEFAULT_TEMPERATURE, DEFAULT_TOP_P
    from ..decoding.sampling import ACCEPT_RULES, DEFAULT_ACCEPT
    ap.add_argument("--temperature", "--temp", dest="temperature", type=float, default=DEFAULT_TEMPERATURE,
                    help=f"0 = exact greedy (default {DEFAULT_TEMPERATURE})")
    ap.add_argument("--top-p", type=float, default=DEFAULT_TOP_P)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--repetition-penalty", type=float, default=None,
                    help=f"1 = off; applied identically to draft and target (default "
                         f"{DEFAULT_REPETITION_PENALTY} when sampling, 1 with --temperature 0)")
    ap.add_argument("--seed", type=int, default=None, help="sampling seed (runs are reproducible)")
    ap.add_argument("--accept", choices=ACCEPT_RULES, default=DEFAULT_ACCEPT,
                    help="lossless rule of sampled speculation: coupled (draft and target sample with "
                         "the same per-position noise; the output equals --mode ar's for the same seed, "
                         "and the cost governor may stop drafting) or residual (accept min(1, p/q), "
                         "resample the residual; more proposals accepted, no timed governor) "
                         f"(default {DEFAULT_ACCEPT})")


# --------------------------------------------------------------------------- serving

def port(ap, default: int):
    ap.add_argument("--port", type=ranged(1, 65535), default=default, help=f"TCP port (default {default})")

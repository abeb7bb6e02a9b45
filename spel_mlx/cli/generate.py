"""Generate text with speculative decoding.

    python -m spel_mlx generate                       # default prompt, shipped model
    python -m spel_mlx generate --prompt "It is a truth" --max-tokens 200 --stats
    python -m spel_mlx generate --model m.spelw --mode governed --spec-k 8 --temp 0
    mlx.launch --hosts 127.0.0.1 -n 2 --python PYTHON -- -m spel_mlx generate --pipeline ...
                                                      # layers split across ranks (docs/distributed.md)

Text streams to stdout as tokens are accepted; --stats prints one JSON line of
decoding statistics on stderr (also after Ctrl-C, which stops cleanly, exit 130).
Bad input -- an unknown flag or value, K out of range, a prompt longer than
max_seq, a missing or malformed checkpoint, a tokenizer that does not match the
checkpoint's vocabulary -- gets one line on stderr and exit 2; no installed
default checkpoint gets one line and exit 1.
"""
from __future__ import annotations

import json
import os
import sys
import time

from ..api import GenerationError, GovernorConfig, LoadError, NoCheckpoint, load, prepare
from ..decoding.c_proposer import DRAFT_CONTEXT
from ..decoding.factory import default_draft_threads
from ..distributed.link import PipelineError
from . import args as shared
from .errors import UsageError

DEFAULT_PROMPT = "It is a truth universally acknowledged, that"
DEFAULT_MAX_TOKENS = 200

def build_parser() -> shared.Parser:
    ap = shared.parser("generate", "Generate text with the SPEL target and a speculative draft.")
    ap.add_argument("--prompt", help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    ap.add_argument("--prompt-file", help="read the prompt from this file ('-' = stdin)")
    shared.max_tokens(ap, DEFAULT_MAX_TOKENS)
    shared.mode(ap, benchmark=True)
    shared.draft(ap, help="draft engine (default: with --temperature 0 auto, n-gram lookup where the "
                          "text repeats and else the C draft; when sampling c, the ternary C draft; mlx "
                          "where the C draft is not built)")
    ap.add_argument("--draft-ahead", choices=("auto", "on", "off"), default="auto",
                    help="C draft: draft the next round on another core while the target "
                         "verifies (default auto: with 2+ CPUs and 1 draft thread, while the "
                         "measured wait for it stays below what it saves)")
    ap.add_argument("--draft-context", type=int, default=DRAFT_CONTEXT,
                    help="C draft: the most tokens of a long prompt it reads, 0 = all (default "
                         f"{DRAFT_CONTEXT}; the output is the same, only the speed changes)")
    shared.sampling(ap)
    shared.model(ap)
    shared.tokenizer(ap)
    shared.config(ap)
    ap.add_argument("--strict", action="store_true", help="strict (bit-exact) verification path")
    shared.kv_cache(ap)
    ap.add_argument("--governor", choices=("cost", "original", "off"), default=None,
                    help="when rounds draft: cost (the cost model: drafts while that pays, re-probes "
                         "with back-off), original (the original's rule: the first zero-accept round "
                         "stops drafting), off (every round drafts); default cost for --mode spec "
                         "(off when sampling with the residual rule), original for --mode governed")
    ap.add_argument("--governor-resume", type=shared.ranged(0), default=0, metavar="N",
                    help="governed mode: re-probe drafting after N AR tokens (0 = never)")
    ap.add_argument("--governor-window", type=shared.ranged(1), default=8, metavar="ROUNDS",
                    help="governed mode: rounds in the rolling acceptance window (default 8)")
    ap.add_argument("--alpha-threshold", type=float, default=0.3,
                    help="governed mode: suspend drafting below this rolling acceptance (default 0.3)")
    ap.add_argument("--governor-grace", type=shared.ranged(0), default=0, metavar="ROUNDS",
                    help="governed mode: a zero-accept round trips only after this many rounds "
                         "(default 0, the original's rule: the first zero-accept round trips)")
    ap.add_argument("--placement", choices=("gpu", "cpu", "auto"), default=None,
                    help="where the target runs: gpu (MLX's GPU, Metal or CUDA; an error when "
                         "there is none), cpu, or auto: calibrate c and v for each target/draft "
                         "placement and use the one the cost model ranks first (reported in "
                         "--stats); default: the GPU where MLX has one, else the CPU. The C "
                         "draft always runs on CPU cores")
    ap.add_argument("--pipeline", action="store_true",
                    help="split the target's layers across the processes mlx.launch started (mx.distributed); "
                         "rank 0 drafts and prints (docs/distributed.md)")
    ap.add_argument("--stats", action="store_true", help="one JSON line of statistics on stderr")
    ap.add_argument("--no-stream", action="store_true", help="print the text only at the end")
    return ap


def parse_mode(s: str):
    """'forced=0.75' -> ('forced', 0.75); others -> (mode, None)."""
    from ..decoding import MODES
    s = s.strip()
    if s.startswith("forced"):
        _, eq, val = s.partition("=")
        try:
            alpha = float(val) if eq else float("nan")
        except ValueError:
            alpha = float("nan")
        if not (0.0 <= alpha <= 1.0):
            raise UsageError(f"--mode {s!r}: forced needs an acceptance in [0, 1], e.g. forced=0.75")
        return "forced", alpha
    if s not in MODES:
        raise UsageError(f"--mode {s!r}: expected {shared.mode_help(benchmark=True)}")
    return s, None


def read_prompt(args) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            if args.prompt_file == "-":
                return _utf8_text(sys.stdin.read(), "--prompt-file -")
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {args.prompt_file}: {getattr(e, 'strerror', None) or e}") from None
    return DEFAULT_PROMPT if args.prompt is None else _utf8_text(args.prompt, "--prompt")


def _utf8_text(text: str, source: str) -> str:
    """argv and stdin turn invalid bytes into lone surrogates (surrogateescape),
    which the tokenizers cannot encode: reject them here, as a file's are."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{source}: not valid UTF-8 (bad byte at character {e.start})") from None
    return text


def check_args(args):
    """The ranges argparse's types do not check."""
    if not (0.0 <= args.alpha_threshold <= 1.0):
        raise UsageError(f"--alpha-threshold {args.alpha_threshold}: must be in [0, 1]")


def load_model(args, mode: str = "spec"):
    """(model, tokenizer) for the command line's flags; the one-time costs of the run
    they ask for paid at load (the default C draft built meanwhile only where it drafts)."""
    placement = None if args.placement == "auto" else args.placement  # auto: chosen after loading
    default_c = args.draft in (None, "c", "auto") and args.draft_threads in (None, default_draft_threads()) \
        and args.draft_ahead == "auto" and args.placement != "auto" and args.spec_k is None
    ahead_of_time = "spec" if mode != "ar" and default_c else "ar"
    try:
        return load(args.model, tokenizer=args.tokenizer, config=args.config, placement=placement,
                    kv_cache=args.kv_cache, prepare=ahead_of_time)
    except LoadError as e:
        raise UsageError(str(e)) from None


def check_pipeline(args, mode):
    """--pipeline drafts on rank 0 with the C draft or n-gram lookup (no MLX draft stack there)."""
    if args.pipeline and (mode == "oracle" or args.draft in ("mlx", "target") or args.placement == "auto"):
        raise UsageError("--pipeline drafts with the C draft or n-gram lookup on rank 0: "
                         "--draft mlx/target, --mode oracle and --placement auto are not available")
    if args.pipeline and args.kv_cache != "float32":
        raise UsageError("--pipeline: the stages keep float32 K/V caches (--kv-cache float16 is not available)")


def open_pipeline(args):
    """--pipeline: this process's stage (collective: every rank loads its own)."""
    from ..distributed import open_pipeline as open_stage
    try:
        return open_stage(args.model, config=args.config, tokenizer=args.tokenizer, placement=args.placement)
    except LoadError as e:
        raise UsageError(str(e)) from None


def serve_rank(pipe, stderr) -> int:
    """A pipeline rank after the first: serve rank 0 until it stops (rank 0 prints)."""
    try:
        from ..distributed import serve
        serve(pipe)
    except PipelineError as e:
        print(f"error: {e}", file=stderr)
        return 1
    return 0


def placed_proposer(args, model, k, prompt, stderr):
    """--placement auto: (the proposer of the placement the cost model ranks first, it)."""
    if args.draft is not None:
        raise UsageError("--placement auto chooses the draft itself; drop --draft")
    from ..decoding import placement as plc
    try:
        ranked = plc.calibrate_placement(model.model, model.weights, k=k,
                                         how=plc.Calibration(prompt=prompt[-8:], include_unavailable=False))
        if not ranked:
            raise UsageError("--placement auto: no placement could be calibrated")
        proposer = plc.apply_placement(ranked[0], model.model, model.weights, k=k)
    except plc.PlacementError as e:
        raise UsageError(f"--placement auto: {e}") from None
    model.device = ranked[0].target_device
    if args.stats:
        print(plc.format_ranking(ranked), file=stderr)
    return proposer, ranked[0]


def make_request(args, mode, forced_alpha, model, tok, text, stderr):
    """The API request for the flags: (request, the placement or None, its proposer or None)."""
    prompt = tok.encode(text)
    if not prompt:
        raise UsageError("the prompt is empty: give at least one character")
    k = model.cfg.spec_k if args.spec_k is None else args.spec_k
    draft, placement, placed = args.draft, None, None
    if args.placement == "auto" and mode != "ar":
        placed, placement = placed_proposer(args, model, k, prompt, stderr)
        draft = placed
    gov = GovernorConfig(policy=args.governor, window=args.governor_window, alpha_threshold=args.alpha_threshold,
                         resume_after=args.governor_resume, zero_accept_grace=args.governor_grace)
    try:
        request = prepare(model, tok, prompt, args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, repetition_penalty=args.repetition_penalty, seed=args.seed,
                          accept=args.accept,
                          mode=mode, draft=draft, k=k, governor=gov, strict=args.strict,
                          draft_threads=args.draft_threads, draft_ahead=args.draft_ahead,
                          draft_context=args.draft_context, forced_alpha=forced_alpha)
    except GenerationError as e:
        raise UsageError(str(e)) from None
    return request, placement, placed


class TextOut:
    """The API's responses as text on `out`: as they come, or all at the end (--no-stream)."""

    def __init__(self, out, stream: bool):
        self.out, self.stream, self.parts = out, stream, []

    def __call__(self, response):
        if self.stream:
            self.out.write(response.text)
            self.out.flush()
        else:
            self.parts.append(response.text)
        if response.finish_reason is not None:
            self.finish()

    def finish(self):
        self.out.write("".join(self.parts) + "\n")
        self.out.flush()


def run(argv=None, stdout=None, stderr=None) -> int:
    from ..decoding import DecodeError
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        args = build_parser().parse_args(argv)
        mode, forced_alpha = parse_mode(args.mode)
        check_args(args)
        check_pipeline(args, mode)
        text = read_prompt(args)
        if args.pipeline:
            pipe = open_pipeline(args)
            if pipe.rank > 0:
                return serve_rank(pipe, stderr)
            model, tok = pipe.loaded, pipe.tokenizer
        else:
            model, tok = load_model(args, mode)
        request, placement, placed = make_request(args, mode, forced_alpha, model, tok, text, stderr)
    except (NoCheckpoint, PipelineError) as e:
        print(f"error: {e}", file=stderr)
        return 1
    except UsageError as e:
        print(f"error: {e}", file=stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=stderr)
        return 130

    code = 0
    text_out = TextOut(stdout, not args.no_stream)
    t0 = time.perf_counter()
    try:
        request.run(on_response=text_out, calibrate=args.stats)
    except KeyboardInterrupt:
        code = 130
        try:
            text_out.finish()
        except OSError:
            pass
    except DecodeError as e:
        print(f"error: {e}", file=stderr)
        return 2
    except PipelineError as e:   # a rank of --pipeline failed
        print(f"error: {e}", file=stderr)
        return 1
    except BrokenPipeError:
        raise  # main() stops quietly (piped into `head`)
    except OSError as e:  # stdout unwritable (full disk, ...): one line, not a traceback
        print(f"error: cannot write the output: {e.strerror or e}", file=stderr)
        return 1
    finally:
        wall = time.perf_counter() - t0
        model.close()
        if placed is not None:
            placed.close()
    if args.stats:
        d = dict(request.stats)
        d.update({"wall_s": round(wall, 6), "checkpoint": model.source, "tokenizer": tok.name,
                  "vocab": model.cfg.vocab, "temperature": request.params.temperature,
                  "top_p": request.params.top_p, "top_k": request.params.top_k,
                  "repetition_penalty": request.params.repetition_penalty, "seed": request.params.seed,
                  "accept": request.params.accept,
                  "draft_threads": request.decoding.draft_threads, "target_device": model.device})
        if forced_alpha is not None:
            d["forced_alpha"] = forced_alpha
        if placement is not None:
            d["placement"] = placement.to_dict()
        if model.pipeline is not None:
            d["pipeline"] = model.pipeline.summary()
        print(json.dumps(d), file=stderr, flush=True)
    return code


def main(argv=None) -> int:
    try:
        return run(argv)
    except KeyboardInterrupt:  # before the decoder existed (e.g. while loading)
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 0

"""B2 by context: the target's cost at real context lengths (issue 14).

Per regime, in ONE process with the calls interleaved round by round (so load changes on a
shared machine hit every context alike):

* passes: one target forward of M rows (M = 1 and the K+1 batches) on a state holding a
  prompt of each context length, nothing committed, in bursts of one shape (one untimed
  pass, then BURST timed: decoding runs its passes back to back, and a pass right after
  another shape's is slower); v(M) = pass(M) / pass(1) at the same
  context, and where a pass's time goes (the fused CPU primitives' profile: products,
  attention, delta rule, other bodies, and the rest = dispatch and Python overhead);
* AR decode tok/s at each context through the decoding loop (``--mode ar``), its ratio
  to the shortest context, and beside it the same with the attention helper thread off
  and with a float16 K/V cache (``--kv-cache float16``; its passes of M = 1 and 5 too);
* prefill throughput of ``ar`` and ``spec`` (C draft, drafting ahead: its prompt prefill
  runs beside the target's) at a few prompt lengths, beside mlx-lm's prefill of a GDN
  hybrid of the same shape (qwen3_next, bench/peers.py), chunks of 2048 as mlx-lm does;
* ``--draft ngram`` against ``--mode ar`` on a long repetitive document (trained regimes:
  random weights do not continue a repetition).
"""
from __future__ import annotations

import time

from . import common
from .b2_verify import get_model
from .common import make_row, median, unavailable

SECTION = "b2ctx"
BURST = 3      # timed passes of one shape in a row (after an untimed one)
# the profile's kinds -> the split's parts (block.* are parts of the sub-blocks' time)
PARTS = {"products": ("linear", "block.linear"), "attention": ("attend", "block.attend"),
         "delta rule": ("delta", "block.delta")}


def context_prompt(regime: dict, n: int) -> list:
    """n tokens of held-out text (repeated when the text is shorter)."""
    from .regimes import prompt_tokens
    base = regime.get("long_prompt")
    if base is None or len(base) < n:
        base, _ = prompt_tokens(regime["cfg"], max(n, 512), regime.get("tokenizer"))
        while len(base) < n:
            base = base + base
        regime["long_prompt"] = base
    return list(base[:n])


def repetitive_document(regime: dict, n: int, page: int = 400) -> list:
    """A long repetitive document: one page (``page`` tokens) of held-out text repeated to
    n tokens.  (The shipped model does not copy the page back; it settles into loops of
    its own, which the n-gram lookup then follows: alpha depends on the document.)"""
    para = context_prompt(regime, page)
    return (para * (n // len(para) + 1))[:n]


def _profiled(fn):
    """(wall s, cpu s, {kind: body s}) of one call of fn; the profile is on."""
    from spel_mlx.model.cpu_ops import _spel_cpu
    if _spel_cpu is not None:
        _spel_cpu.profile(True)
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    w, c = time.perf_counter() - w0, time.process_time() - c0
    prof = {k: v[1] for k, v in _spel_cpu.profile(True).items()} if _spel_cpu is not None else {}
    return w, c, prof


def median_sample(samples: list):
    """The (wall, cpu, profile) call of median wall time (the lower one of an even count)."""
    return sorted(samples, key=lambda s: s[0])[(len(samples) - 1) // 2]


def split(wall: float, prof: dict) -> dict:
    """Where a pass went, ms: the parts of PARTS, the other primitive bodies, and the
    overhead (wall - all bodies: graph dispatch, Python, waiting on the worker)."""
    top = sum(v for k, v in prof.items() if "." not in k)
    out = {part: sum(prof.get(k, 0.0) for k in kinds) * 1e3 for part, kinds in PARTS.items()}
    out["other bodies"] = max(0.0, top * 1e3 - sum(out.values()))
    out["overhead"] = max(0.0, (wall - top) * 1e3)
    return out


HALF_MS = (1, 5)   # the float16 cache's passes: v(K+1=5), the figure of issue 14's goal


def with_kv_cache(model, kv: str, make):
    """make() with the model's new states holding ``kv`` caches."""
    old = model.kv_cache
    model.kv_cache = kv
    try:
        return make()
    finally:
        model.kv_cache = old


def pass_rows(model, regime, contexts, Ms, repeats) -> list:
    import mlx.core as mx
    from spel_mlx.model.cpu_ops import _spel_cpu
    cfg, name = regime["cfg"], regime["name"]
    states, toks = {}, {}
    shapes = [(kv, M) for kv in ("float32", "float16") for M in Ms if kv == "float32" or M in HALF_MS]
    for ctx in contexts:
        for kv in ("float32", "float16"):
            st = with_kv_cache(model, kv, lambda: model.new_state("target", ring=max(Ms) + 1))
            model.prefill(context_prompt(regime, ctx), st)
            states[(ctx, kv)] = st
    for M in Ms:
        toks[M] = [(7 * j + 3) % cfg.vocab for j in range(M)]

    def call(ctx, shape):
        # docs/model.md, "Passes in bursts"
        kv, M = shape
        st = states[(ctx, kv)]
        mx.eval(model.forward(toks[M], st))
        st.discard()
        out = []
        for _ in range(BURST):
            out.append(_profiled(lambda: mx.eval(model.forward(toks[M], st))))
            st.discard()
        return out
    for ctx in contexts:                 # compile and warm every shape
        for shape in shapes:
            call(ctx, shape)
    got = {(c, shape): [] for c in contexts for shape in shapes}
    for _ in range(repeats):
        for ctx in contexts:
            for shape in shapes:
                got[(ctx, shape)].extend(call(ctx, shape))
    rows = []
    for ctx in contexts:
        for kv, M in shapes:
            ar = median_sample(got[(ctx, (kv, 1))])[0]
            samples = got[(ctx, (kv, M))]
            wall, _, prof = median_sample(samples)    # the split of that one call adds up to its wall
            metrics = {"ms": wall * 1e3, "cpu_ms": median([s[1] for s in samples]) * 1e3, "v": wall / ar,
                       "context": ctx, "M": M, **{f"split {k}": v for k, v in split(wall, prof).items()}}
            label = "target pass" if kv == "float32" else "target pass, float16 K/V"
            rows.append(make_row(SECTION, f"{label}, context {ctx}", regime=name, placement="target=mlx-cpu",
                                 mode="fast", K=M - 1, primary="v", metrics=metrics,
                                 samples=[s[0] * 1e3 for s in samples], context=ctx,
                                 note="" if _spel_cpu is not None else "no profile: MLX ops"))
    return rows


def ar_decode_rows(model, regime, contexts, gen, repeats) -> list:
    """AR decode tok/s by context; each call beside one with the attention helper thread
    switched off and one with a float16 K/V cache (the same text, interleaved): their
    ratios are the helper's gain and the half cache's."""
    from spel_mlx.decoding.loop import SpeculativeDecoder
    from spel_mlx.model.cpu_ops import _spel_cpu
    decs = {"float32": SpeculativeDecoder(model, None, mode="ar"),
            "float16": with_kv_cache(model, "float16", lambda: SpeculativeDecoder(model, None, mode="ar"))}
    variants = ["float32", "float16"] + (["no helper"] if _spel_cpu is not None else [])
    rates = {(v, c): [] for v in variants for c in contexts}
    for ctx in contexts:                 # warm
        for dec in decs.values():
            dec.generate(context_prompt(regime, ctx), 4)
    for rep in range(repeats):
        for ctx in contexts:
            for v in (variants if rep % 2 == 0 else variants[::-1]):
                dec = decs["float16" if v == "float16" else "float32"]
                old = _spel_cpu.set_helper(v != "no helper") if _spel_cpu is not None else None
                try:
                    dec.generate(context_prompt(regime, ctx), gen)
                finally:
                    if _spel_cpu is not None:
                        _spel_cpu.set_helper(old)
                rates[(v, ctx)].append(dec.stats.tok_s)
    med = {key: median(r) if r else None for key, r in rates.items()}

    def ratio(a, b):
        return a / b if a and b else None
    return [make_row(SECTION, f"AR decode, context {ctx}", regime=regime["name"], placement="target=mlx-cpu", mode="ar",
                     primary="tok_s", context=ctx, samples=rates[("float32", ctx)],
                     metrics={"tok_s": med[("float32", ctx)], "context": ctx,
                              "vs_shortest": ratio(med[("float32", ctx)], med[("float32", contexts[0])]),
                              "tok_s_no_helper": med.get(("no helper", ctx)),
                              "helper_gain": ratio(med[("float32", ctx)], med.get(("no helper", ctx))),
                              "tok_s_half": med[("float16", ctx)],
                              "half_vs_shortest": ratio(med[("float16", ctx)], med[("float16", contexts[0])]),
                              "half_gain": ratio(med[("float16", ctx)], med[("float32", ctx)])})
            for ctx in contexts]


def mlx_lm_prefill_s(cfg, prompt) -> float:
    """Seconds mlx-lm takes to prefill ``prompt`` into a fresh cache of a same-shape
    qwen3_next GDN hybrid (chunks of 2048, as mlx_lm.generate's prefill_step_size)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from .peers import build_gdn_hybrid
    model = build_gdn_hybrid(cfg)
    arr = mx.array(prompt, dtype=mx.uint32)
    for n in (32, len(prompt)):          # warm, then the timed one
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        for i in range(0, n, 2048):
            model(arr[None, i:min(n, i + 2048)], cache=cache)
            mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def prefill_repeats(n: int, repeats: int) -> int:
    """Interleaved calls per prompt length: a short prefill is cheap and noisy (tens of
    milliseconds against a scheduler's time slice), so it gets more, up to 15."""
    return max(repeats, min(15, repeats * 4000 // max(n, 1)))


def prefill_rows(model, regime, lengths, repeats, K) -> list:
    from spel_mlx.decoding.factory import make_proposer, DraftOptions
    from spel_mlx.decoding.loop import SpeculativeDecoder
    name, cfg = regime["name"], regime["cfg"]
    ar = SpeculativeDecoder(model, None, mode="ar")
    draft = make_proposer("c", model, regime["weights"], k=K, options=DraftOptions(threads=1, ahead=True))
    spec = SpeculativeDecoder(model, draft, mode="spec", k=K)
    got = {(n, m): [] for n in lengths for m in ("ar", "spec")}
    try:
        for dec in (ar, spec):
            dec.generate(context_prompt(regime, 64), 1)
        reps = {n: prefill_repeats(n, repeats) for n in lengths}
        for rep in range(max(reps.values())):
            for n in lengths:
                if rep >= reps[n]:
                    continue
                prompt = context_prompt(regime, n + 1)    # n tokens prefilled, the last one pending
                for mode, dec in (("ar", ar), ("spec", spec)):
                    dec.generate(prompt, 1)
                    got[(n, mode)].append(dec.stats.prefill_s)
    finally:
        draft.close()
    rows = []
    for n in lengths:
        a, s = median(got[(n, "ar")]), median(got[(n, "spec")])
        # the ratio of each spec call to the ar call beside it: the machine's drift cancels
        paired = median([b / c for c, b in zip(got[(n, "ar")], got[(n, "spec")])])
        for mode in ("ar", "spec"):
            t = a if mode == "ar" else s
            rows.append(make_row(SECTION, f"prefill {n}", regime=name, placement="target=mlx-cpu" +
                                 (" draft=c-cpu ahead" if mode == "spec" else ""), mode=mode, K=n,
                                 primary="tok_s", context=n, samples=got[(n, mode)],
                                 metrics={"tok_s": n / t, "s": t, "context": n,
                                          **({"vs_ar": paired} if mode == "spec" else {})}))
    for n in lengths:
        try:
            t = mlx_lm_prefill_s(cfg, context_prompt(regime, n))
            rows.append(make_row(SECTION, f"prefill {n}", regime=name, placement="mlx-lm qwen3_next on cpu",
                                 mode="mlx-lm", K=n, primary="tok_s", context=n,
                                 metrics={"tok_s": n / t, "s": t, "context": n}, note="random weights"))
        except ImportError as e:
            rows.append(unavailable(SECTION, f"prefill {n}", f"mlx-lm not installed ({e})", status=common.SKIPPED,
                                    regime=name, placement="mlx-lm qwen3_next on cpu", mode="mlx-lm", K=n))
    return rows


def ngram_rows(model, regime, doc_len, gen, K) -> list:
    from spel_mlx.decoding.factory import make_proposer, DraftOptions
    from spel_mlx.decoding.loop import SpeculativeDecoder
    name = regime["name"]
    if regime.get("systems_only"):
        return [unavailable(SECTION, "ngram on a repetitive document", "random weights do not continue a "
                            "repetition (trained regimes only)", status=common.SKIPPED, regime=name,
                            mode="ngram", K=K)]
    doc = repetitive_document(regime, doc_len)
    ar = SpeculativeDecoder(model, None, mode="ar")
    ng = SpeculativeDecoder(model, make_proposer("ngram", model, k=K), mode="spec", k=K)
    for dec in (ar, ng):
        dec.generate(doc[:64], 4)
    rates, same = {"ar": [], "ngram": []}, True
    for _ in range(2):
        out_ar = ar.generate(doc, gen)
        rates["ar"].append(ar.stats.tok_s)
        out_ng = ng.generate(doc, gen)
        rates["ngram"].append(ng.stats.tok_s)
        same = same and out_ar == out_ng
    st = ng.stats
    return [make_row(SECTION, "ngram on a repetitive document", regime=name, placement="target=mlx-cpu draft=ngram",
                     mode="ngram", K=K, primary="speedup", context=doc_len,
                     metrics={"tok_s": median(rates["ngram"]), "ar_tok_s": median(rates["ar"]),
                              "speedup": median(rates["ngram"]) / median(rates["ar"]), "alpha": st.alpha,
                              "tokens_per_round": st.tokens_per_round, "v": st.v, "context": doc_len,
                              "longest": st.extra.get("ngram_longest", 0)},
                     note="" if same else "ngram output differs from ar (fast-mode rounding)")]


def run(job: dict, regime: dict) -> list:
    import mlx.core as mx
    cfg = regime["cfg"]
    gen = job["ctx_gen"]
    top = cfg.max_seq - max(max(job["ctx_M"]), gen) - 1
    contexts = [c for c in job["contexts"] if c <= top]
    lengths = [n for n in job["prefill_lengths"] if n < cfg.max_seq]
    with mx.stream(mx.cpu):
        model = get_model(regime)
        rows = pass_rows(model, regime, contexts, job["ctx_M"], job["ctx_repeats"])
        rows += ar_decode_rows(model, regime, contexts, gen, max(1, job["ctx_repeats"] // 5))
        rows += prefill_rows(model, regime, lengths, max(1, job["ctx_repeats"] // 5), job["K"])
        doc = min(job["ngram_doc"], cfg.max_seq - job["ngram_gen"] - 1)
        rows += ngram_rows(model, regime, doc, job["ngram_gen"], job["K"])
    return rows

"""User-facing self-check: the original's eight invariant suites.

    python -m spel_mlx selftest [--preset 21m] [--config k=v,...] [--seed N] [--only 3,6]

Runs on random weights of the given shape (21m by default), strict path unless a
suite says otherwise, and prints one line per suite, then ``PASS (0 failures)``
or ``FAIL (n failures)`` (exit 0 / 1).  A suite whose module is not installed or
built reports SKIP with the reason and does not count as a failure.

 [1] ternary kernels: pack/dot/GEMV, every kernel agrees with the numpy reference
 [2] batched vs sequential: strict K+1 batch logits == single steps, bit for bit
 [3] speculative fidelity: K=4 and K=16, plain and governed == AR token for token
 [4] NoteBank needles (when the module is present)
 [5] fast path: strict AR == fast speculative tokens; fast logits bits / argmax
 [6] forced acceptance: exact accepted/proposed, emitted count, aligned positions
 [7] weights round-trip: SPELW001 -> load max_abs 0; -> safetensors -> SPELW001 bytes equal
 [8] draft pool: C draft logits with 1 vs 4 threads, 0 differ
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np


class Skip(Exception):
    """The suite cannot run here (module missing / not built)."""


def _bits_differ(a, b) -> int:
    a = np.ascontiguousarray(np.asarray(a, np.float32))
    b = np.ascontiguousarray(np.asarray(b, np.float32))
    return int((a.view(np.uint32) != b.view(np.uint32)).sum())


def _cdraft_module():
    try:
        from .native import cdraft, clib
        clib.require()
        return cdraft
    except Exception as e:  # noqa: BLE001  not built / not importable
        raise Skip(f"C draft unavailable ({type(e).__name__}: {e})") from None


class Context:
    """The shared random model and prompts."""

    def __init__(self, cfg, seed: int):
        from .model import SpelModel, init_weights
        self.cfg = cfg
        self.seed = seed
        w = init_weights(cfg, seed=seed)
        # draft layers = copies of the target layers they map to, so the draft agrees
        # with the target often enough that fidelity is exercised on accepted tokens too
        for j, src in enumerate(cfg.draft_map):
            for name in list(w):
                if name.startswith(f"layers.{src}."):
                    w["draft." + name.replace(f"layers.{src}.", f"layers.{j}.", 1)] = w[name].copy()
        self.weights = w
        self.model = SpelModel.from_weights(cfg, w)
        rng = np.random.default_rng(seed)
        # short prompts: strict prefill is one single-token step per prompt token
        text = "It is a truth univ"
        self.prompts = [[ord(c) % cfg.vocab for c in text],
                        rng.integers(0, cfg.vocab, size=18).tolist()]
        self._ar = {}

    def ar(self, prompt_i: int, n: int, strict: bool = True):
        # greedy AR is prefix-consistent: a longer cached run answers a shorter request
        for (pi, m, st), toks in self._ar.items():
            if pi == prompt_i and st == strict and m >= n:
                return toks[:n]
        from .decoding import SpeculativeDecoder, DecodeOptions
        toks = SpeculativeDecoder(self.model, None, "ar", k=4, options=DecodeOptions(strict=strict)).generate(
            self.prompts[prompt_i], n)
        self._ar[(prompt_i, n, strict)] = toks
        return toks

    def draft(self, k: int, threads: int = 1, strict: bool = True):
        """A proposer: the C draft when built, else the MLX FP32 draft stack."""
        from .decoding import make_proposer, DraftOptions
        try:
            _cdraft_module()
            return make_proposer("c", self.model, self.weights, k=k, options=DraftOptions(threads=threads))
        except Skip:
            return make_proposer("mlx", self.model, k=k, options=DraftOptions(strict=strict))


# ------------------------------------------------------------------- suites

def suite_kernels(ctx):
    cdraft = _cdraft_module()
    from . import quant
    rng = np.random.default_rng(ctx.seed)
    rows, cols = 96, 200  # cols not a multiple of 64: exercises row padding
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal(cols).astype(np.float32)
    t_ref, s_ref = quant.quantize_ternary(w)
    t_c, s_c = cdraft.c_quantize_ternary(w)
    if not (np.array_equal(t_ref, t_c) and _bits_differ(s_ref, s_c) == 0):
        return False, "C ternary quantizer differs from the numpy reference"
    packed = quant.pack_ternary(t_ref)
    if not np.array_equal(packed, cdraft.c_pack_ternary(t_ref)):
        return False, "C packing differs from the canonical packing"
    xq, sx = quant.quantize_activation(x)
    want = t_ref.astype(np.int32) @ xq.astype(np.int32)
    kernels = cdraft.available_kernels()
    for k in kernels:
        got = cdraft.dot_ternary(k, packed, cols, xq)
        if not np.array_equal(got, want):
            return False, f"kernel {k}: int32 dots differ from the reference"
    ref = quant.gemv_ternary_ref(t_ref, s_ref, x)
    worst = 0.0
    with cdraft.Pool(1) as pool:
        m = cdraft.QMatrix(w, ternary=True)
        for k in kernels:
            y = m.gemv(x, pool, kernel=k)
            worst = max(worst, float(np.max(np.abs(y - ref)) / (np.max(np.abs(ref)) + 1e-30)))
        m.close()
    if worst > 1e-5:
        return False, f"GEMV vs dequantized reference rel err {worst:.2e}"
    return True, f"{', '.join(kernels)} agree on {rows}x{cols} dots; GEMV rel err {worst:.1e}"


def suite_batched(ctx):
    import mlx.core as mx
    model, cfg = ctx.model, ctx.cfg
    M = min(cfg.spec_k + 1, 5) if cfg.spec_k >= 4 else cfg.spec_k + 1
    prefix = ctx.prompts[0][:20]
    toks = ctx.prompts[1][:M]
    total = differ = 0
    for start in (0, len(prefix)):
        s1 = model.new_state("target", ring=M)
        s2 = model.new_state("target", ring=M)
        if start:
            model.prefill(prefix, s1, strict=True)
            model.prefill(prefix, s2, strict=True)
        batched = np.array(model.forward(toks, s1, strict=True))
        rows = []
        for t in toks:
            r = model.forward([t], s2, strict=True)
            mx.eval(r)
            rows.append(np.array(r)[-1])
        differ += _bits_differ(batched, np.stack(rows))
        total += batched.size
    return differ == 0, f"batched vs sequential {total} logits, {differ} differ"


def suite_spec_fidelity(ctx):
    from .decoding import GovernorConfig, SpeculativeDecoder, DecodeOptions, make_proposer, DraftOptions
    parts, ok = [], True
    raw = GovernorConfig(policy="off")     # spec drafts every round: the most rounds checked
    for K, mode, n in ((4, "spec", 40), (4, "governed", 32), (16, "spec", 32), (16, "governed", 32)):
        ref = ctx.ar(0, n)
        draft = ctx.draft(K)
        dec = SpeculativeDecoder(ctx.model, draft, mode, k=K,
                                 options=DecodeOptions(strict=True, governor=raw if mode == "spec" else None))
        out = dec.generate(ctx.prompts[0], n)
        draft.close()
        same = sum(a == b for a, b in zip(out, ref)) if len(out) == len(ref) else 0
        ok &= out == ref
        label = f"K={K}{' governed' if mode == 'governed' else ''}"
        parts.append(f"{label} {same}/{n} (alpha {dec.stats.alpha:.2f})")
    name = ctx.draft(4).name
    # the full target as its own draft: every proposal must be accepted (strict rows are
    # bit-identical), which exercises the accept path a random draft rarely reaches
    ref = ctx.ar(0, 40)
    dec = SpeculativeDecoder(ctx.model, make_proposer("target", ctx.model, k=4, options=DraftOptions(strict=True)),
                                "oracle", k=4, options=DecodeOptions(strict=True))
    out = dec.generate(ctx.prompts[0], 40)
    ok &= out == ref and dec.stats.alpha == 1.0
    parts.append(f"oracle K=4 {sum(a == b for a, b in zip(out, ref))}/40 (alpha {dec.stats.alpha:.2f})")
    return ok, f"{name} draft: " + "; ".join(parts)


def suite_notebank(ctx):
    try:
        from . import notebank as nb
        from .tokenizer import ByteTokenizer
    except ImportError as e:
        raise Skip(f"NoteBank module unavailable ({e})") from None
    model = nb.toy_model(seed=0)
    cfg = nb.NoteBankConfig().validate()
    tokens, needles = nb.needle_document(ByteTokenizer(), 384, 3, cfg.chunk, seed=0)
    bank = nb.NoteBank(model, cfg)
    state = model.new_state("target")
    bank.write(state, tokens)
    ranges = [(n.start, n.end) for n in needles]
    contained = nb.containment(bank.notes, ranges)
    hits = {"summed": 0, "votes": 0}
    for nd in needles:
        for ranker in hits:
            hits[ranker] += nb.hit_at_r(bank.retrieve(state, nd.query, ranker).top, nd.start, nd.end)
    n = len(needles)
    return contained == n, (f"needles {contained}/{n}; similarity recall {hits['summed']}/{n}; "
                            f"votes {hits['votes']}/{n}; storage {bank.storage_bytes():,} B")


def suite_fast_path(ctx):
    import mlx.core as mx
    from .decoding import GovernorConfig, SpeculativeDecoder, DecodeOptions
    n = 24
    ref = ctx.ar(0, n, strict=True)
    draft = ctx.draft(4, strict=False)
    dec = SpeculativeDecoder(ctx.model, draft, "spec", k=4,
                             options=DecodeOptions(strict=False, governor=GovernorConfig(policy="off")))
    out = dec.generate(ctx.prompts[0], n)
    draft.close()
    same = sum(a == b for a, b in zip(out, ref))
    # fast batch logits vs strict: not bit-identical, argmax must agree
    model = ctx.model
    toks = ctx.prompts[0][:2]
    fast = np.array(model.forward(toks, model.new_state("target", ring=2), strict=False))
    strict = np.array(model.forward(toks, model.new_state("target", ring=2), strict=True))
    mx.eval()
    bits = _bits_differ(fast, strict)
    arg = int((fast.argmax(-1) != strict.argmax(-1)).sum())
    return out == ref and arg == 0, (f"strict AR vs fast spec {same}/{n} tokens; {bits}/{fast.size} "
                                     f"logit bits differ; argmax differs {arg}/{fast.shape[0]}")


def suite_forced(ctx):
    from .decoding import SpeculativeDecoder, DecodeOptions
    parts, ok = [], True
    for alpha, rounds in ((0.75, 10), (1.0, 8)):
        K = 4
        n_tokens = rounds * (int(alpha * K) + 1)
        draft = ctx.draft(K)
        dec = SpeculativeDecoder(ctx.model, draft, "forced", k=K,
                                 options=DecodeOptions(forced_alpha=alpha, strict=True))
        out = dec.generate(ctx.prompts[1], n_tokens)
        st = dec.stats
        want_acc = int(round(alpha * K * rounds))
        dpos = draft.pos
        aligned = dpos == dec.target.pos
        draft.close()
        ok &= (st.accepted == want_acc and st.proposed == K * rounds and len(out) == n_tokens
               and st.rounds == rounds and aligned)
        parts.append(f"{st.accepted}/{st.proposed} at {alpha:.2f}")
    parts.append(f"emitted {len(out)}/{n_tokens}")
    parts.append("target/draft positions aligned" if ok else "MISALIGNED")
    return ok, "; ".join(parts)


def suite_roundtrip(ctx):
    import mlx.core as mx
    try:
        from .reader import load_checkpoint
        from .converters.spelw_safetensors import safetensors_to_spelw, spelw_to_safetensors
        from .checkpoints import write_spelw
    except ImportError as e:
        raise Skip(f"checkpoint modules unavailable ({e})") from None
    from .model import SpelModel
    cfg, w = ctx.cfg, ctx.weights
    with tempfile.TemporaryDirectory(prefix="spel-selftest-") as tmp:
        a = os.path.join(tmp, "a.spelw")
        write_spelw(a, cfg, w)
        ck = load_checkpoint(a)
        max_abs = max(float(np.max(np.abs(np.asarray(ck.weights[k]) - w[k]))) for k in w)
        folder = os.path.join(tmp, "st")
        spelw_to_safetensors(a, folder)
        b = os.path.join(tmp, "b.spelw")
        safetensors_to_spelw(folder, b)
        with open(a, "rb") as fa, open(b, "rb") as fb:
            same_bytes = fa.read() == fb.read()
        # the reloaded model produces the same logits, target and draft stacks
        m2 = SpelModel.from_weights(ck.cfg, ck.weights)
        toks = ctx.prompts[1][:16]
        agree = {}
        for stack in ("target", "draft"):
            rows = []
            for model in (ctx.model, m2):
                st = model.new_state(stack, ring=2)
                r = []
                for t in toks:
                    out = model.forward([t], st, strict=True, stack=stack)
                    st.commit(1)
                    mx.eval(out)
                    r.append(np.array(out)[-1])
                rows.append(np.stack(r))
            agree[stack] = sum(_bits_differ(x, y) == 0 for x, y in zip(*rows))
    n = len(toks)
    ok = max_abs == 0.0 and same_bytes and agree["target"] == n and agree["draft"] == n
    return ok, (f"max_abs={max_abs:g}; SPELW->safetensors->SPELW {'byte-identical' if same_bytes else 'DIFFERS'}; "
                f"{agree['target']}/{n} target and {agree['draft']}/{n} draft positions bit-equal")


def suite_pool(ctx):
    cdraft = _cdraft_module()
    toks = ctx.prompts[0][:16]
    outs = []
    for threads in (1, 4):
        d = cdraft.CDraft(ctx.cfg, ctx.weights, threads=threads, ring=ctx.cfg.spec_k + 1)
        outs.append(np.stack([d.step(t) for t in toks]))
        d.close()
    diff = _bits_differ(outs[0], outs[1])
    return diff == 0, f"draft pool {outs[0].shape[0]} x {outs[0].shape[1]} logits, threads 1 vs 4, {diff} differ"


SUITES = (
    ("ternary kernels", suite_kernels),
    ("batched vs sequential", suite_batched),
    ("speculative fidelity", suite_spec_fidelity),
    ("NoteBank needles", suite_notebank),
    ("fast path", suite_fast_path),
    ("forced acceptance", suite_forced),
    ("weights round-trip", suite_roundtrip),
    ("draft pool", suite_pool),
)


def run(cfg, seed: int = 0, out=None, only=None) -> int:
    """Run the suites; returns the number of failures."""
    out = out or sys.stdout
    t_all = time.perf_counter()
    ctx = Context(cfg, seed)
    failures = 0
    for i, (name, fn) in enumerate(SUITES, 1):
        if only and i not in only:
            continue
        t0 = time.perf_counter()
        try:
            ok, detail = fn(ctx)
            verdict = "ok" if ok else "FAIL"
        except Skip as e:
            ok, verdict, detail = True, "SKIP", str(e)
        except Exception as e:  # noqa: BLE001  a crashing suite is a failure, reported on one line
            ok, verdict, detail = False, "FAIL", f"{type(e).__name__}: {e}"
        failures += not ok
        print(f"[{i}] {name:<22} {verdict:<4} {detail} ({time.perf_counter() - t0:.1f} s)",
              file=out, flush=True)
    secs = time.perf_counter() - t_all
    if failures:
        print(f"FAIL ({failures} failure{'s' if failures != 1 else ''}) in {secs:.1f} s", file=out)
    else:
        print(f"PASS (0 failures) in {secs:.1f} s", file=out)
    return failures


def parse_only(text: str) -> set:
    """Suite numbers from --only; an unknown number would silently run nothing and PASS."""
    n = len(SUITES)
    only = set()
    for item in text.split(","):
        item = item.strip()
        if not (item.isdigit() and 1 <= int(item) <= n):
            raise ValueError(f"--only {text!r}: expected comma-separated suite numbers in 1..{n}")
        only.add(int(item))
    return only


if __name__ == "__main__":       # python -m spel_mlx.selftest: the selftest command
    from .cli.selftest import main
    sys.exit(main())

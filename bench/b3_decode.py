"""B3: decode.

Per regime and placement: AR target tok/s; draft-only tok/s and its c; raw speculation,
default speculation (spec's cost-model governor), governed speculation (the original's
rule), forced acceptance 0.75 and 1.00 at each draft thread count; the full-target-as-draft oracle; the rollback primitive against copying the KV cache.

Every speculative row carries the cost model beside the measurement, with this run's
own figures: ``c`` = draft time per draft forward / AR token time, ``v`` = verification
time per K+1 batch / AR token time (both from the row's own rounds), ``alpha`` =
accepted/proposed, and ``projected = (1 + alpha*K) / ((K+1)*c + v)``. ``speedup`` is the
row's tok/s over that of an AR call made just before it in the same process (``ar_tok_s``;
c and v use it too): the machine's speed drifts from minute to minute. The governed rows' projection
weights their speculative and AR rounds (a tripped governor runs AR rounds).

Placements: target MLX on GPU or CPU x draft C-on-CPU (the ternary/q8 engine, 1..6
threads), MLX-on-CPU (the FP32 draft layers) or MLX-on-GPU. Rows for a device this
machine lacks are kept and say "not available".
"""
from __future__ import annotations

import contextlib

from spel_mlx.decoding import DraftOptions
from spel_mlx.decoding.placement import DeviceProposer

from . import common
from .b2_verify import device_stream, get_model
from .common import ERROR, make_row, median, unavailable

SECTION = "b3"


def cost_fields(st, ar_token_s: float, ar_tok_s: float, K: int, governed: bool = False) -> dict:
    """Measured figures of one speculative call plus its cost-model projection."""
    m = {"tok_s": st.tok_s, "speedup": st.tok_s / ar_tok_s if ar_tok_s else None,
         "alpha": st.alpha, "tokens_per_round": st.tokens_per_round, "rounds": st.rounds,
         "spec_rounds": st.spec_rounds, "ar_rounds": st.ar_rounds,
         "governor_trips": st.governor_trips, "tokens": st.tokens}
    # forwards of the decode's own proposals (k_eff+1 per round); the engine's forward
    # counter also holds the prompt sync, which draft_s does not time
    forwards = st.proposed + st.spec_rounds
    c = (st.draft_s / forwards) / ar_token_s if forwards else None
    v = (st.verify_s / st.spec_rounds) / ar_token_s if st.spec_rounds else None
    m["c"], m["v"] = c, v
    if c is not None and v is not None:
        m["projected"] = common.cost_model_speedup(st.alpha, K, c, v)
        if governed:
            # tokens over the round costs in AR-token units: spec rounds at (K+1)c+v, AR rounds at 1
            cost = st.spec_rounds * ((K + 1) * c + v) + st.ar_rounds
            m["projected"] = st.tokens / cost if cost else None
    elif governed and st.spec_rounds == 0 and st.ar_rounds:
        m["projected"] = 1.0        # the governor verified nothing: every round was AR's
    return m


def draft_only_c(engine, prompt, n: int) -> float:
    """tok/s of the C draft alone: prompt fed in ring-sized chunks, then n greedy steps."""
    import numpy as np
    d = engine.cdraft
    d.reset()
    ring = engine.ring
    for i in range(0, len(prompt) - 1, ring):
        chunk = [int(t) for t in prompt[i:min(i + ring, len(prompt) - 1)]]
        d.forward(chunk)
        d.commit(len(chunk))
    tok = int(prompt[-1])
    for _ in range(2):  # warm: first-touch of the pool and the packed weights
        d.step(tok)
    t0 = common.now()
    for _ in range(n):
        tok = int(np.argmax(d.step(tok)))
    dt = common.now() - t0
    d.reset()
    return n / dt


def draft_only_mlx(model, prompt, n: int, ring: int) -> float:
    import mlx.core as mx
    state = model.new_state("draft", ring=ring)
    model.prefill(prompt[:-1], state, stack="draft")
    tok = int(prompt[-1])
    for _ in range(2):
        mx.eval(model.forward([tok], state, stack="draft"))
        state.discard()
    t0 = common.now()
    for _ in range(n):
        logits = model.forward([tok], state, stack="draft")
        tok = int(mx.argmax(logits[-1]).item())
        state.commit(1)
    return n / (common.now() - t0)


def decode(model, draft, mode, K, prompt, warm, gen, forced_alpha=None, governor=None):
    """(stats) of one timed generate call after an untimed warm call."""
    from spel_mlx.decoding import SpeculativeDecoder, DecodeOptions
    dec = SpeculativeDecoder(model, draft, mode=mode, k=K,
                             options=DecodeOptions(forced_alpha=forced_alpha, governor=governor))
    if warm:
        dec.generate(prompt, warm)
    dec.generate(prompt, gen)
    return dec.stats, dec.output


def rollback_rows(model, regime, K: int, iters: int) -> list:
    """The O(1) commit primitive (ring index + KV position) against copying the KV cache."""
    import mlx.core as mx
    name = regime["name"]
    state = model.new_state("target", ring=K + 1)

    def primitive():
        state.advance(K + 1)   # K+1 tokens forwarded (indices only) ...
        state.commit(1)        # ... of which one is kept: this is the rollback
    ts = common.time_loop(primitive, iters, 5)
    state.pos = state.read = state.pending = 0
    caches = [c for i in state.attn_layers for c in state.kv(i)]
    nbytes = sum(c.nbytes for c in caches)

    def copy_kv():
        mx.eval([mx.array(c) for c in caches])  # mx.array(x) makes a real copy
    tc = common.time_calls(copy_kv, 5, 2)
    prim = median(ts)
    return [make_row(SECTION, "rollback primitive (commit of K+1 pending)", regime=name,
                     placement="target=mlx-cpu", mode="rollback", K=K, primary="us",
                     metrics={"us": prim * 1e6}, samples=[t * 1e6 for t in ts],
                     note="Python-level index update; timer amortised over "
                          f"{iters} calls"),
            make_row(SECTION, "copy the attention KV cache", regime=name,
                     placement="target=mlx-cpu", mode="kv-copy", primary="us",
                     metrics={"us": median(tc) * 1e6, "mib": nbytes / 2**20,
                              "ratio_to_primitive": median(tc) / prim},
                     samples=[t * 1e6 for t in tc],
                     note=f"{len(caches)} arrays (K and V of {len(state.attn_layers)} attention "
                          f"layers, max_seq={state.max_seq})")]


def draft_placements(threads: list, drafts=("c", "mlx")) -> list:
    """[(placement label, kind, threads, device or None, reason)]."""
    gpu = common.gpu_available()
    out = [("draft=c-cpu", "c", t, "cpu" if "c" in drafts else None,
            "" if "c" in drafts else "not in this level's protocol") for t in threads]
    # the C draft drafting the next round on the other core during verification
    # (CDraftAheadProposer: generate's draft when sampling, the fallback of its greedy default auto)
    out.append(("draft=c-cpu ahead", "c-ahead", 1, "cpu" if "c" in drafts else None,
                "" if "c" in drafts else "not in this level's protocol"))
    out.append(("draft=mlx-cpu", "mlx", None, "cpu" if "mlx" in drafts else None,
                "" if "mlx" in drafts else "not in this level's protocol for this regime"))
    out.append(("draft=mlx-gpu", "mlx", None, "gpu" if gpu else None,
                "" if gpu else "MLX reports no GPU on this machine"))
    return out


SPEC_MODES = (("raw spec", "spec", None), ("default spec", "spec", None),
              ("governed spec", "governed", None), ("forced 0.75", "forced", 0.75),
              ("forced 1.00", "forced", 1.00))


def governor(label: str):
    """Raw speculation drafts every round; default spec runs spec's default (the cost
    model's governor); governed runs the original's rule."""
    from spel_mlx.decoding import GovernorConfig
    return GovernorConfig(policy="off") if label == "raw spec" else None


def run(job: dict, regime: dict) -> list:
    import spel_mlx  # noqa: F401
    from spel_mlx.decoding import make_proposer

    name = regime["name"]
    K, warm, gen, prompt = job["K"], job["warm"], job["gen"], regime["prompt"]
    threads = [t for t in job["threads"] if 1 <= t <= 6]
    rows = []
    gpu = common.gpu_available()
    targets = job.get("targets", ("gpu", "cpu"))     # the device check measures the GPU alone
    for tgt_label, tgt_dev in (("target=mlx-gpu", "gpu" if gpu else None), ("target=mlx-cpu", "cpu")):
        if tgt_label.rsplit("-", 1)[1] not in targets:
            continue
        if tgt_dev is None:
            reason = "MLX reports no GPU on this machine"
            rows.append(unavailable(SECTION, "AR target", reason, regime=name,
                                    placement=tgt_label, mode="ar"))
            for dl, kind, th, _, _ in draft_placements(threads, job.get("drafts", ("c", "mlx"))):
                for label, mode, _ in SPEC_MODES:
                    rows.append(unavailable(SECTION, label, reason, regime=name,
                                            placement=f"{tgt_label} {dl}", mode=mode, threads=th, K=K))
            continue
        with device_stream(tgt_dev):
            rows += run_target_placement(job, regime, tgt_label, tgt_dev, K, warm, gen, prompt,
                                         threads, make_proposer)
    return rows


def run_target_placement(job, regime, tgt_label, tgt_dev, K, warm, gen, prompt, threads, make_proposer):
    name = regime["name"]
    rows = []
    model = get_model(regime)
    st, _ = decode(model, None, "ar", K, prompt, warm, gen)
    ar_tok_s = st.tok_s
    ar_token_s = st.decode_s / st.tokens
    rows.append(make_row(SECTION, "AR target", regime=name, placement=tgt_label, mode="ar",
                         primary="tok_s", metrics={"tok_s": ar_tok_s, "ms_per_token": ar_token_s * 1e3,
                                                   "speedup": 1.0}))
    for dl, kind, th, ddev, reason in draft_placements(threads, job.get("drafts", ("c", "mlx"))):
        placement = f"{tgt_label} {dl}"
        fields = dict(regime=name, placement=placement, threads=th, K=K)
        if ddev is None:
            status = common.NOT_AVAILABLE if "GPU" in reason else common.SKIPPED
            rows.append(unavailable(SECTION, "draft only", reason, mode="draft-only", status=status,
                                    **fields))
            for label, mode, _ in SPEC_MODES:
                rows.append(unavailable(SECTION, label, reason, mode=mode, status=status, **fields))
            continue
        try:
            engine = make_proposer("c" if kind == "c-ahead" else kind, model, regime["weights"], k=K,
                                   options=DraftOptions(threads=th or 1, ahead=kind == "c-ahead"))
        except Exception as e:
            why = f"draft {kind!r} could not be built: {type(e).__name__}: {e}"
            rows.append(unavailable(SECTION, "draft only", why, mode="draft-only", **fields))
            for label, mode, _ in SPEC_MODES:
                rows.append(unavailable(SECTION, label, why, mode=mode, **fields))
            continue
        if ddev != tgt_dev:
            engine = DeviceProposer(engine, ddev)
        try:
            n_only = max(16, 2 * gen)
            with (device_stream(ddev) if kind == "mlx" else contextlib.nullcontext()):
                rate = (draft_only_c(engine, prompt, n_only) if kind in ("c", "c-ahead")
                        else draft_only_mlx(model, prompt, n_only, K + 1))
            rows.append(make_row(SECTION, "draft only", mode="draft-only", primary="tok_s",
                                 metrics={"tok_s": rate, "c": ar_tok_s / rate}, **fields))
        except Exception as e:
            rows.append(unavailable(SECTION, "draft only", f"{type(e).__name__}: {e}",
                                    status=ERROR, mode="draft-only", **fields))
        for n_mode, (label, mode, fa) in enumerate(SPEC_MODES):
            try:
                # each row's AR reference is an AR call just before it: this machine's speed
                # drifts from minute to minute, and a ~1x row (a governor on a useless draft)
                # divided by an AR call from minutes earlier measured the drift
                near, _ = decode(model, None, "ar", K, prompt, 0, gen)
                # one untimed warm call per engine is enough: compiled steps and the
                # draft's packed weights are shared by every mode that follows
                st, _ = decode(model, engine, mode, K, prompt, warm if n_mode == 0 else 0, gen,
                               forced_alpha=fa, governor=governor(label))
                m = cost_fields(st, near.decode_s / near.tokens, near.tok_s, K,
                                governed=label in ("default spec", "governed spec"))
                m["ar_tok_s"] = near.tok_s
                note = "forced acceptance: a system ceiling, not decoding" if mode == "forced" else ""
                rows.append(make_row(SECTION, label, mode=mode, primary="tok_s", metrics=m,
                                     note=note, forced_alpha=fa, **fields))
            except Exception as e:
                rows.append(unavailable(SECTION, label, f"{type(e).__name__}: {e}", status=ERROR,
                                        mode=mode, **fields))
        engine.close()
    # the full target as its own draft: the ceiling a target-sized draft can reach
    fields = dict(regime=name, placement=f"{tgt_label} draft=target", threads=None, K=K)
    try:
        engine = make_proposer("target", model, k=K)
        st, _ = decode(model, engine, "oracle", K, prompt, warm, gen)
        rows.append(make_row(SECTION, "full-target oracle", mode="oracle", primary="tok_s",
                             metrics=cost_fields(st, ar_token_s, ar_tok_s, K), **fields))
    except Exception as e:
        rows.append(unavailable(SECTION, "full-target oracle", f"{type(e).__name__}: {e}",
                                status=ERROR, mode="oracle", **fields))
    # the forced ceiling at the original's historical depth (full runs)
    Kc = job.get("K_ceiling")
    if Kc and Kc != K:
        fields = dict(regime=name, placement=f"{tgt_label} draft=c-cpu", threads=1, K=Kc)
        try:
            engine = make_proposer("c", model, regime["weights"], k=Kc, options=DraftOptions(threads=1))
            st, _ = decode(model, engine, "forced", Kc, prompt, warm, gen, forced_alpha=1.0)
            rows.append(make_row(SECTION, "forced 1.00", mode="forced", primary="tok_s",
                                 metrics=cost_fields(st, ar_token_s, ar_tok_s, Kc), forced_alpha=1.0,
                                 note="forced acceptance: a system ceiling, not decoding", **fields))
            engine.close()
        except Exception as e:
            rows.append(unavailable(SECTION, "forced 1.00", f"{type(e).__name__}: {e}",
                                    status=ERROR, mode="forced", **fields))
    if tgt_dev == "cpu":
        rows += rollback_rows(model, regime, K, 20000)
    return rows

"""The needle experiment (SPEC 7 report): three planted KEY_n=VALUE; needles, notes
over the context, retrieval by ?KEY_n=, the value's rank with and without replay, a
speculative run on the answer, and the two-column table."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from .config import NoteBankConfig
from .glue import Branch, NoteBank, feed
from .measures import (containment, dense_kv_bytes, gdn_channel_count, hit_at_r, hybrid_kv_bytes,
                       native_payload_bytes, note_bytes, token_rank)
from .writer import NoteWriter


FILLER_WORDS = ("a an at on no so to tea ten net sat eat oat nose tone stone seat east "
                "toes notes").split()


def toy_config():
    """The toy shape of the original's NoteBank table: 128d / 8 layers (6 GDN + 2 attention)."""
    return ModelConfig(d_model=128, n_layers=8, n_heads=4, head_dim=32, d_ff=256,
                       vocab=128, max_seq=1024, draft_map=(0, 3, 4, 6))


def toy_model(seed: int = 0, tie_qk: bool = True):
    """A random-weight toy model over the byte vocabulary.

    With independent random q and k projections, q.k carries no association at all,
    so addressing by q is chance. ``tie_qk`` copies every GDN layer's k rows of wqkv
    into its q rows, which gives the toy the q/k geometry a trained associative
    memory has (a query token reads where the same token was written). The demo and
    docs report this choice; ``tie_qk=False`` is the honest-chance control."""
    from ..model import SpelModel, init_weights
    cfg = toy_config()
    w = init_weights(cfg, seed=seed)
    if tie_qk:
        inner = cfg.inner
        for i in cfg.gdn_layers:
            wqkv = w[f"layers.{i}.mixer.wqkv.weight"]
            wqkv[:inner] = wqkv[inner:2 * inner]
    return SpelModel.from_weights(cfg, w)


@dataclass
class Needle:
    key: str
    value: str
    start: int                 # token range of "KEY_n=VALUE;" in the document
    end: int
    query: list                # tokens of "?KEY_n="
    value_token: int           # first token of the value after the query


def needle_document(tokenizer, n_tokens: int = 384, n_needles: int = 3, chunk: int = 128,
                    seed: int = 0):
    """Filler text over a small common alphabet with ``n_needles`` ``KEY_n=VALUE;``
    needles planted, one per chunk (or per equal share of the context when
    ``n_needles`` chunks do not fit) at a seeded offset. Segments are tokenized
    separately so every needle's token range is exact. Returns (tokens, needles)."""
    rng = np.random.default_rng(seed)

    def filler(n):
        toks: list = []
        while len(toks) < n:
            toks += tokenizer.encode(" ".join(FILLER_WORDS[i] for i in
                                              rng.integers(0, len(FILLER_WORDS), 8)) + " ")
        return toks[:n]

    # one needle per chunk when the chunks fit, else evenly spread
    span = chunk if n_needles * chunk <= n_tokens else max(1, n_tokens // max(1, n_needles))
    tokens: list = []
    needles = []
    for i in range(n_needles):
        key = f"KEY_{i + 1}"
        value = str(int(rng.integers(1000, 10000)))
        text = tokenizer.encode(f"{key}={value};")
        at = i * span + int(rng.integers(span // 8, max(span // 8 + 1, span - len(text) - span // 8)))
        tokens += filler(at - len(tokens))
        q = tokenizer.encode(f"?{key}=")
        full = tokenizer.encode(f"?{key}={value}")
        # the query ends where the value's first token starts in the joint tokenization
        # (a subword tokenizer may merge across "=" and the value)
        j = 0
        while j < min(len(q), len(full) - 1) and q[j] == full[j]:
            j += 1
        q, vt = (full[:j], full[j]) if j else (q, tokenizer.encode(value)[0])
        needles.append(Needle(key, value, len(tokens), len(tokens) + len(text), q, vt))
        tokens += text
    tokens += filler(n_tokens - len(tokens))
    return tokens, needles


def run_demo(model, tokenizer, cfg: NoteBankConfig | None = None, n_tokens: int = 384,
             seed: int = 0, spec_tokens: int = 16) -> dict:
    """The needle experiment (SPEC 7 report). Returns a dict of everything measured."""
    cfg = (cfg or NoteBankConfig()).validate()
    mcfg = model.cfg
    tokens, needles = needle_document(tokenizer, n_tokens, 3, cfg.chunk, seed)
    ranges = [(n.start, n.end) for n in needles]
    bank = NoteBank(model, cfg, native_payload=True, keep_keys=True)
    state = model.new_state("target")
    wr = bank.write(state, tokens)
    # the writer math alone, warm, best of 3 (the in-line figure includes first-call costs)
    keys = np.concatenate(bank.keys)
    warm = []
    for _ in range(3):
        w = NoteWriter(cfg, keys.shape[1], keys.shape[2])
        w.write(keys)
        warm.append(w.seconds)
    res: dict = {
        "context_tokens": wr.tokens, "chunks": wr.chunks, "notes": wr.notes,
        "forward_capture_ms": wr.forward_s * 1e3, "writer_inline_ms": wr.writer_s * 1e3,
        "writer_ms": min(warm) * 1e3,
        "native_payload_ms": wr.native_s * 1e3,
        "containment": containment(bank.notes, ranges), "needles": len(needles),
        "spans": [(n.start, n.end) for n in bank.notes], "needle_ranges": ranges,
    }
    address_ms = {"summed": [], "votes": []}
    hits = {"summed": 0, "votes": 0}
    ranks = {"none": [], "tokens": [], "native": []}
    replay_ms = {"tokens": [], "native": []}
    per_needle = []
    for nd in needles:
        row = {"key": nd.key, "value": nd.value}
        tops = {}
        for ranker in ("summed", "votes"):
            r = bank.retrieve(state, nd.query, ranker)
            address_ms[ranker].append(r.seconds * 1e3)
            hit = hit_at_r(r.top, nd.start, nd.end)
            hits[ranker] += hit
            tops[ranker] = r.top
            row[ranker] = [(n.start, n.end) for n in r.top]
        with Branch(state):
            ranks["none"].append(token_rank(feed(model, state, nd.query), nd.value_token))
        for kind, replay in (("tokens", bank.replay_tokens), ("native", bank.replay_native)):
            with Branch(state):
                t0 = time.perf_counter()
                replay(state, tops["summed"])
                replay_ms[kind].append((time.perf_counter() - t0) * 1e3)
                ranks[kind].append(token_rank(feed(model, state, nd.query), nd.value_token))
        per_needle.append(row)
    C = gdn_channel_count(mcfg)
    res.update({
        "address_ms": {k: (min(v), max(v)) for k, v in address_ms.items()},
        "recall_summed": hits["summed"], "recall_votes": hits["votes"], "top_r": cfg.top_r,
        "query_positions": cfg.query_positions,
        "note_storage_bytes": bank.storage_bytes(),
        "note_bytes_each": note_bytes(C, cfg.coords), "channels": C,
        "dense_kv_bytes": dense_kv_bytes(mcfg, wr.tokens),
        "hybrid_kv_bytes": hybrid_kv_bytes(mcfg, wr.tokens),
        "native_payload_bytes_each": native_payload_bytes(mcfg),
        "rank_no_replay": ranks["none"], "rank_token_replay": ranks["tokens"],
        "rank_native_replay": ranks["native"],
        "replay_ms": {k: (min(v), max(v)) for k, v in replay_ms.items()},
        "per_needle": per_needle,
    })
    try:
        res["spec"] = _demo_spec(model, bank, tokens, needles[0], tokenizer, spec_tokens)
    except Exception as e:  # noqa: BLE001  the engine is another part; report, keep the table
        res["spec"] = {"skipped": f"speculative run failed: {type(e).__name__}: {e}"}
    return res


def _demo_spec(model, bank, tokens, needle, tokenizer, n: int) -> dict:
    """Speculative greedy run on the answer of the first needle's read branch
    (context + token replay of its top notes + query), checked against AR."""
    try:
        from .. import decoding as spec
    except ImportError as e:  # the engine is a separate part; the demo works without it
        return {"skipped": f"spel_mlx.decoding unavailable: {e}"}
    if n <= 0:
        return {"skipped": "--spec-tokens 0"}
    state = model.new_state("target")
    feed(model, state, tokens)
    top = bank.retrieve(state, needle.query, "summed").top
    replay = [t for nt in bank.replay_order(top) for t in bank.span_tokens(nt)]
    prompt = list(tokens) + replay + list(needle.query)
    if len(prompt) + n + 1 > model.cfg.max_seq:
        return {"skipped": f"prompt of {len(prompt)} tokens + {n} exceeds max_seq"}
    K = model.cfg.spec_k
    ar = spec.SpeculativeDecoder(model, None, mode="ar", k=K)
    ar_out = ar.generate(prompt, n)
    # the C ternary/q8 draft (SPEC 3) when it is built, else the FP32 MLX draft layers
    try:
        draft, draft_name = spec.make_proposer("c", model, model.weights_dict(), k=K), "C ternary/q8"
    except (ImportError, OSError, ValueError):
        draft, draft_name = spec.make_proposer("mlx", model, k=K), "MLX FP32"
    sd = spec.SpeculativeDecoder(model, draft, mode="spec", k=K)
    try:
        t0 = time.perf_counter()
        sp_out = sd.generate(prompt, n)
        dt = time.perf_counter() - t0
    finally:
        sd.close()
    st = sd.stats
    return {"tokens": len(sp_out), "matches_ar": sp_out == ar_out, "draft": draft_name, "k": K,
            "agree": sum(a == b for a, b in zip(sp_out, ar_out)),
            "alpha": float(st.alpha), "tokens_per_round": float(st.tokens_per_round),
            "seconds": dt, "answer": tokenizer.decode(sp_out), "value": needle.value,
            "answer_starts_with_value": tokenizer.decode(sp_out).startswith(needle.value)}


def format_table(res: dict, label: str) -> str:
    """The demo's report as a two-column text table."""
    def ms(pair):
        lo, hi = pair
        return f"{lo:.3f} ms" if abs(hi - lo) < 5e-4 else f"{lo:.3f}-{hi:.3f} ms"

    dense, hyb, notes = res["dense_kv_bytes"], res["hybrid_kv_bytes"], res["note_storage_bytes"]
    rows = [
        ("context / chunks / notes", f"{res['context_tokens']} / {res['chunks']} / {res['notes']}"),
        ("forward with capture", f"{res['forward_capture_ms']:.1f} ms"),
        ("writer time (warm, best of 3)", f"{res['writer_ms']:.3f} ms "
                                          f"(in-line {res['writer_inline_ms']:.3f} ms)"),
        (f"address time (Q={res['query_positions']}, R={res['top_r']}) summed",
         ms(res["address_ms"]["summed"])),
        ("address time votes", ms(res["address_ms"]["votes"])),
        ("writer needle containment", f"{res['containment']}/{res['needles']}"),
        (f"summed-similarity recall@{res['top_r']}", f"{res['recall_summed']}/{res['needles']}"),
        (f"vote-ranker recall@{res['top_r']}", f"{res['recall_votes']}/{res['needles']}"),
        ("note storage", f"{notes:,} B ({res['notes']} x {res['note_bytes_each']:,} B, "
                         f"{res['channels']} channels)"),
        ("dense KV, all layers (FP32)", f"{dense:,} B ({dense / max(1, notes):.1f}x)"),
        ("hybrid attention KV (FP32)", f"{hyb:,} B ({hyb / max(1, notes):.1f}x)"),
        ("value rank, no replay", "/".join(map(str, res["rank_no_replay"]))),
        ("value rank, token replay", "/".join(map(str, res["rank_token_replay"]))),
        ("value rank, native replay", "/".join(map(str, res["rank_native_replay"]))),
        ("token replay time", ms(res["replay_ms"]["tokens"])),
        ("native replay time (payload cached)", ms(res["replay_ms"]["native"])),
        ("native payload / note", f"{res['native_payload_bytes_each']:,} B (FP32 S, all GDN layers)"),
        ("native payloads, compute at write", f"{res['native_payload_ms']:.1f} ms"),
    ]
    sp = res.get("spec", {})
    if "skipped" in sp:
        rows.append(("spec run on the answer", "skipped: " + sp["skipped"]))
    elif sp:
        rows.append(("spec run on the answer",
                     f"{sp['agree']}/{sp['tokens']} tokens = AR; alpha={sp['alpha']:.3f}; "
                     f"{sp['tokens_per_round']:.2f} tok/round ({sp['draft']} draft, K={sp['k']})"))
        rows.append(("spec answer", repr(sp["answer"][:40]) + f" (value {sp['value']})"))
    w = max(len(a) for a, _ in rows)
    out = [f"NoteBank needle demo: {label}", "-" * (w + 40)]
    out += [f"{a:<{w}}  {b}" for a, b in rows]
    return "\n".join(out)


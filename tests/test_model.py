"""The MLX model against the independent numpy reference, strict/fast modes,
weights round trip, parameter counts."""
import numpy as np
import pytest

import spel_mlx  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from spel_mlx import layout
from spel_mlx.config import PRESETS, ModelConfig
from spel_mlx.model import SpelModel, init_weights

from spel_mlx.reference import forward_reference

# both layer types in target (3 GDN + 1 attention per period) and in the draft
SMALL = ModelConfig(d_model=64, n_layers=6, n_heads=2, head_dim=32, d_ff=96, vocab=64,
                    max_seq=160, attn_period=3, draft_map=(0, 2, 4), spec_k=4)


@pytest.fixture(scope="module")
def small():
    w = init_weights(SMALL, seed=7)
    return w, SpelModel.from_weights(SMALL, w)


def tokens(n, seed=0, vocab=SMALL.vocab):
    return np.random.default_rng(seed).integers(0, vocab, n)


def decode_batches(model, toks, stack, strict, batch):
    st = model.new_state(stack)
    out = []
    for i in range(0, len(toks), batch):
        chunk = toks[i:i + batch]
        out.append(np.array(model.forward(chunk, st, strict=strict)))
        st.commit(len(chunk))
    return np.concatenate(out)


@pytest.mark.parametrize("stack", ["target", "draft"])
@pytest.mark.parametrize("strict,batch", [(True, 1), (False, 5), (True, 5)])
def test_matches_numpy_reference(small, stack, strict, batch):
    w, model = small
    toks = tokens(72, seed=1)
    ref = forward_reference(SMALL, w, toks, stack=stack)
    got = decode_batches(model, toks, stack, strict, batch)
    assert got.shape == ref.shape == (72, SMALL.vocab)
    assert np.abs(ref).max() > 1.0          # realistic logit scale, not a vacuous check
    assert np.abs(got - ref).max() < 1e-4


def test_reference_matvec_hook_sees_every_linear(small):
    w, _ = small
    seen = set()

    def mv(name, W, x):
        seen.add(name)
        return W @ x
    forward_reference(SMALL, w, tokens(2), stack="draft", matvec=mv)
    want = {s.name for s in layout.draft_specs(SMALL) if s.name.split(".")[-2] in
            ("wqkv", "wo", "w1", "w2", "w3")}
    assert seen == want


def test_prefill_returns_last_logits(small):
    w, model = small
    toks = tokens(13, seed=3)
    st = model.new_state("target")
    last = np.array(model.prefill(toks, st))
    assert st.pos == 13 and st.pending == 0
    ref = forward_reference(SMALL, w, toks)
    assert np.abs(last - ref[-1]).max() < 1e-4


def _bytes_differ(a, b):
    a = np.ascontiguousarray(np.array(a, dtype=np.float32))
    b = np.ascontiguousarray(np.array(b, dtype=np.float32))
    assert a.shape == b.shape
    return int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))


@pytest.mark.parametrize("stack,n_prompt", [("target", 11), ("draft", 11), ("target", 61)])
def test_strict_batch_bit_identical_to_single_steps(small, stack, n_prompt):
    """n_prompt=61: the batch (positions 61..65) crosses the 64-row attention window."""
    _, model = small
    prompt, batch = tokens(n_prompt, seed=4), tokens(5, seed=5)
    a = model.new_state(stack)
    model.prefill(prompt, a, strict=True)
    batched = model.forward(batch, a, strict=True)
    b = model.new_state(stack)
    model.prefill(prompt, b, strict=True)
    singles = []
    for t in batch:
        singles.append(model.forward([t], b))
        b.commit(1)
    singles = mx.concatenate(singles)
    assert batched.size >= 256 + 64 and batched.dtype == mx.float32
    assert _bytes_differ(batched, singles) == 0


def test_fast_batch_close_and_argmax_equal(small):
    _, model = small
    prompt, batch = tokens(21, seed=6), tokens(5, seed=8)
    a, b = model.new_state(), model.new_state()
    model.prefill(prompt, a, strict=True)
    model.prefill(prompt, b, strict=True)
    fast = np.array(model.forward(batch, a, strict=False))
    strict = np.array(model.forward(batch, b, strict=True))
    assert np.abs(fast - strict).max() < 1e-4
    assert (fast.argmax(-1) == strict.argmax(-1)).all()


def test_rollback_then_continue_equals_prefix_from_scratch(small):
    _, model = small
    prompt, proposal, after = tokens(9, seed=9), tokens(5, seed=10), tokens(12, seed=11)
    for n in (1, 3, 5):
        a = model.new_state()
        model.prefill(prompt, a, strict=True)
        model.forward(proposal, a, strict=True)
        a.commit(n)                      # rollback of 5 - n tokens
        b = model.new_state()
        model.prefill(np.concatenate([prompt, proposal[:n]]), b, strict=True)
        assert (a.pos, b.pos) == (9 + n, 9 + n)
        for i in range(0, len(after), 4):
            chunk = after[i:i + 4]
            la = model.forward(chunk, a, strict=True)
            a.commit(len(chunk))
            lb = []
            for t in chunk:
                lb.append(model.forward([t], b))
                b.commit(1)
            lb = mx.concatenate(lb)
            assert _bytes_differ(la, lb) == 0


def test_chained_uncommitted_forwards(small):
    """Draft-style proposal: single-token forwards chained without commit."""
    _, model = small
    prompt, prop = tokens(7, seed=12), tokens(5, seed=13)
    a, b = model.new_state("draft"), model.new_state("draft")
    model.prefill(prompt, a, strict=True)
    model.prefill(prompt, b, strict=True)
    chained = mx.concatenate([model.forward([t], a) for t in prop])
    assert a.pending == 5
    batched = model.forward(prop, b, strict=True)
    assert _bytes_differ(chained, batched) == 0
    a.commit(2)
    assert a.pos == 9


def test_capture_gdn_qk(small):
    _, model = small
    for strict in (True, False):
        st = model.new_state()
        cap = {}
        model.forward(tokens(4, seed=14), st, strict=strict, capture=cap)
        assert sorted(cap) == SMALL.gdn_layers
        for d in cap.values():
            assert d["q"].shape == d["k"].shape == (4, SMALL.n_heads, SMALL.head_dim)
            norms = np.linalg.norm(np.array(d["k"]), axis=-1)
            assert np.allclose(norms, 1.0, atol=1e-4)


def test_weights_roundtrip_and_names(small):
    w, model = small
    got = model.weights_dict()
    assert list(got) == [s.name for s in layout.tensor_specs(SMALL)]
    assert all(got[k].dtype == np.float32 and np.array_equal(got[k], w[k]) for k in w)


def test_load_rejects_wrong_weights(small):
    w, _ = small
    bad = dict(w)
    del bad["lm_head.weight"]
    with pytest.raises(ValueError, match="lm_head.weight"):
        SpelModel.from_weights(SMALL, bad)
    bad = dict(w)
    bad["layers.0.mixer.conv"] = np.zeros((2, SMALL.d_model), np.float32)
    with pytest.raises(ValueError, match="layers.0.mixer.conv"):
        SpelModel.from_weights(SMALL, bad)


def test_token_out_of_range(small):
    _, model = small
    with pytest.raises(ValueError, match="out of range"):
        model.forward([SMALL.vocab], model.new_state())


def test_set_ops_is_used(small):
    _, model = small
    from spel_mlx.model import MLXOps

    class Counting(MLXOps):
        calls = {"attend": 0, "mixer_block": 0, "ffn_block": 0}

        def attend(self, *a):
            Counting.calls["attend"] += 1
            return super().attend(*a)

        def mixer_block(self, *a):
            Counting.calls["mixer_block"] += 1
            return super().mixer_block(*a)

        def ffn_block(self, *a):
            Counting.calls["ffn_block"] += 1
            return super().ffn_block(*a)
    model.set_ops(MLXOps())
    ref = np.array(model.forward(tokens(5), model.new_state()))
    model.set_ops(Counting())
    try:
        got = np.array(model.forward(tokens(5), model.new_state()))
    finally:
        model.set_ops(None)
    # every layer is the two residual halves of Block.__call__, through the ops object
    assert Counting.calls == {"attend": len(SMALL.attention_layers), "mixer_block": SMALL.n_layers,
                              "ffn_block": SMALL.n_layers}
    assert _bytes_differ(got, ref) == 0


def test_parameter_counts_21m_module_tree():
    """The MLX module tree itself has exactly the SPEC 2 counts (not run)."""
    from mlx.utils import tree_flatten
    cfg = PRESETS["21m"]
    model = SpelModel(cfg)
    params = dict(tree_flatten(model.parameters()))
    assert {k: tuple(v.shape) for k, v in params.items()} == \
        {s.name: s.shape for s in layout.tensor_specs(cfg)}
    target = sum(v.size for k, v in params.items() if not k.startswith("draft."))
    draft = sum(v.size for k, v in params.items() if k.startswith("draft."))
    assert (target, draft) == (21_352_044, 7_084_452)
    gdn0 = sum(v.size for k, v in params.items() if k.startswith("layers.0.mixer."))
    assert gdn0 == 590_988


def test_update_drops_compiled_passes(small):
    w, model = small
    toks = tokens(3, seed=15)
    before = np.array(model.forward(toks, model.new_state()))
    w2 = dict(w)
    w2["lm_head.weight"] = w["lm_head.weight"] * 2.0
    model.update({"lm_head": {"weight": mx.array(w2["lm_head.weight"])}})
    try:
        after = np.array(model.forward(toks, model.new_state()))
        fresh = np.array(SpelModel.from_weights(SMALL, w2).forward(toks, model.new_state()))
    finally:
        model.update({"lm_head": {"weight": mx.array(w["lm_head.weight"])}})
    assert np.array_equal(after, fresh)
    assert np.allclose(after, 2 * before, rtol=1e-5, atol=1e-5)


def test_uncompiled_pass_matches_compiled(small):
    w, _ = small
    eager = SpelModel.from_weights(SMALL, w)
    eager.compile = False
    _, model = small
    toks = tokens(5, seed=16)
    a = np.array(eager.forward(toks, eager.new_state()))
    b = np.array(model.forward(toks, model.new_state()))
    assert np.abs(a - b).max() < 1e-5


def test_init_weights_deterministic_and_complete():
    a, b = init_weights(SMALL, seed=5), init_weights(SMALL, seed=5)
    c = init_weights(SMALL, seed=6)
    assert list(a) == [s.name for s in layout.tensor_specs(SMALL)]
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["layers.0.mlp.w1.weight"], c["layers.0.mlp.w1.weight"])
    assert not np.array_equal(a["layers.0.mlp.w1.weight"], a["draft.layers.0.mlp.w1.weight"])


def test_info_cli(capsys):
    from spel_mlx.cli import info
    assert info.main(["--preset", "21m"]) == 0
    out = capsys.readouterr().out
    assert "params target:  21,352,044" in out and "params draft:   7,084,452" in out
    assert "GDN 590,988" in out and "blas:" in out and "mlx:" in out and "kernels:" in out and "huge pages:" in out
    assert info.main(["--preset", "218m"]) == 0
    out = capsys.readouterr().out
    assert "218,436,992" in out and "54,543,456" in out
    for bad in (["--config", "nope=1"], ["--preset", "huge"], ["--config", "draft_map=0:99"],
                ["--config", "head_dim=63"]):
        assert info.main(bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("spel_mlx.info: config error:")


def test_row_blocked_matmuls(small, monkeypatch):
    """The CPU row-blocking of Linear (off for SMALL's tiny weights by default),
    forced on: still the reference function, and strict stays bit-identical."""
    from spel_mlx.model import linear
    monkeypatch.setattr(linear, "BLOCK_ROWS", {5: 32, None: 16})
    assert linear.row_block(96, 64, 1) == 32 and linear.row_block(64, 96, 9) == 16
    w, _ = small
    model = SpelModel.from_weights(SMALL, w)
    toks = tokens(20, seed=17)
    ref = forward_reference(SMALL, w, toks)
    assert np.abs(decode_batches(model, toks, "target", False, 5) - ref).max() < 1e-4
    a, b = model.new_state(), model.new_state()
    batched = model.forward(toks[:5], a, strict=True)
    singles = []
    for t in toks[:5]:
        singles.append(model.forward([t], b))
        b.commit(1)
    assert _bytes_differ(batched, mx.concatenate(singles)) == 0


# ---- the chunked (closed-form) delta rule of fast M > 1 passes -------------------------------
def _delta_inputs(M, H, hd, seed):
    from spel_mlx.model import l2_normalize
    r = np.random.default_rng(seed)
    q = l2_normalize(mx.array(r.standard_normal((M, H, hd)).astype(np.float32)))
    k = l2_normalize(mx.array(r.standard_normal((M, H, hd)).astype(np.float32)))
    v = mx.array(r.standard_normal((M, H, hd)).astype(np.float32))
    # decays from fast (a ~ 0.05) to slow (a ~ 0.99), betas up to ~0.98
    a = mx.sigmoid(mx.array(np.linspace(-3.0, 5.0, H).astype(np.float32)))
    b = mx.sigmoid(mx.array(np.linspace(4.0, -2.0, H).astype(np.float32)))
    S0 = mx.array((0.5 * r.standard_normal((H, hd, hd))).astype(np.float32))
    return q, k, v, a, b, S0


@pytest.mark.parametrize("M", [2, 3, 4, 5, 8, 9, 16, 17])
def test_chunked_delta_rule_matches_recurrence(M):
    """The verification form: one chunk of M tokens from S0, every token's state."""
    from spel_mlx.model import MLXOps
    from spel_mlx.model.delta_rule import chunk_gates, delta_rule_recurrent
    ops = MLXOps()
    args = _delta_inputs(M, 4, 32, seed=M)
    o_ref, S_ref = delta_rule_recurrent(*args)
    S_ref = mx.stack(S_ref)
    gates = chunk_gates(args[3], M)
    for fn in (ops.delta_rule, mx.compile(ops.delta_rule)):
        for g in (None, gates):
            o, states = fn(*args, g)
            assert o.shape == o_ref.shape and len(states) == M and S_ref.shape == (M, 4, 32, 32)
            assert float(mx.abs(o - o_ref).max()) < 2e-6
            assert float(mx.abs(mx.stack(states) - S_ref).max()) < 2e-6 * float(mx.abs(S_ref).max())


def test_fast_k16_verify_commit_any_prefix(small):
    """A 17-row fast pass (K=16) against strict rows, then commit n and continue:
    the accepted token's GDN state (left lazy by the pass) is the right one."""
    _, model = small
    prompt, batch, nxt = tokens(13, seed=20), tokens(17, seed=21), tokens(3, seed=22)
    for n in (1, 6, 17):
        a, b = model.new_state(ring=17), model.new_state(ring=17)
        model.prefill(prompt, a, strict=True)
        model.prefill(prompt, b, strict=True)
        fast = np.array(model.forward(batch, a))
        strict = np.array(model.forward(batch, b, strict=True))
        assert np.abs(fast - strict).max() < 1e-4
        assert (fast.argmax(-1) == strict.argmax(-1)).all()
        a.commit(n)
        b.commit(n)
        fa = np.array(model.forward(nxt, a))
        fb = np.array(model.forward(nxt, b, strict=True))
        assert np.abs(fa - fb).max() < 1e-4 and (fa.argmax(-1) == fb.argmax(-1)).all()


def test_replaced_delta_rule_used_in_batched_pass(small):
    """A subclass that overrides only delta_rule is what an M-row pass runs."""
    _, model = small
    from spel_mlx.model import MLXOps
    from spel_mlx.model.delta_rule import delta_rule_recurrent

    class Counting(MLXOps):
        Ms = []

        def delta_rule(self, q, k, v, a, beta, S0, gates=None):
            Counting.Ms.append(q.shape[0])
            return delta_rule_recurrent(q, k, v, a, beta, S0)
    model.set_ops(MLXOps())
    ref = np.array(model.forward(tokens(5), model.new_state()))
    model.set_ops(Counting())
    try:
        got = np.array(model.forward(tokens(5), model.new_state()))
    finally:
        model.set_ops(None)
    assert Counting.Ms == [5] * len(SMALL.gdn_layers)
    assert np.abs(got - ref).max() < 1e-4


@pytest.mark.parametrize("W,pos0,M", [(64, 0, 2), (64, 40, 5), (160, 143, 17), (1152, 1100, 3)])
def test_attend_head_major_matches_all_heads_form(W, pos0, M, monkeypatch):
    """The head-major attend (M > 1, short windows) against the all-heads form."""
    from spel_mlx.model import MLXOps, l2_normalize
    from spel_mlx.model import ops as model_mod
    r = np.random.default_rng(W + M)
    q = l2_normalize(mx.array(r.standard_normal((M, 3, 32)).astype(np.float32)))
    kc = l2_normalize(mx.array(r.standard_normal((W, 3, 32)).astype(np.float32)))
    vc = mx.array(r.standard_normal((W, 3, 32)).astype(np.float32))
    pos = mx.array(pos0, dtype=mx.int32)
    got = MLXOps().attend(q, kc, vc, pos, M)
    monkeypatch.setattr(model_mod, "ATTEND_HEAD_MAJOR_MAX", 0)
    want = MLXOps().attend(q, kc, vc, pos, M)
    assert got.shape == want.shape == (M, 3, 32)
    assert float(mx.abs(got - want).max()) < 1e-5
    qn, kn, vn = (np.array(t, dtype=np.float64) for t in (q, kc, vc))   # float64 reference
    for j in range(M):
        for h in range(3):
            sc = kn[:pos0 + j + 1, h] @ qn[j, h] * np.sqrt(32)
            p = np.exp(sc - sc.max())
            ref = (p / p.sum()) @ vn[:pos0 + j + 1, h]
            assert np.abs(np.array(want)[j, h] - ref).max() < 1e-5
    # rows past pos0 + j are masked: changing them changes nothing
    kc2 = mx.concatenate([kc[:pos0 + M], 5.0 + kc[pos0 + M:]]) if pos0 + M < W else kc
    monkeypatch.setattr(model_mod, "ATTEND_HEAD_MAJOR_MAX", 1024)
    assert float(mx.abs(MLXOps().attend(q, kc2, vc, pos, M) - got).max()) == 0.0


def test_update_rebuilds_cached_constants(small):
    """Gate constants and weight views are cached per parameter array: after
    update the M=1 and M=5 passes use the new values (equal to a fresh model)."""
    w, model = small
    li = SMALL.gdn_layers[0]
    pre = f"layers.{li}."
    w2 = dict(w)
    w2[pre + "mixer.decay_logit"] = w[pre + "mixer.decay_logit"] - 1.5
    w2[pre + "mixer.beta_logit"] = w[pre + "mixer.beta_logit"] + 0.5
    w2[pre + "mlp.w2.weight"] = w[pre + "mlp.w2.weight"] * 1.5
    toks = tokens(6, seed=31)

    def run(m):
        st = m.new_state()
        single = np.array(m.forward(toks[:1], st))
        st.commit(1)
        return single, np.array(m.forward(toks[1:], st))
    run(model)                                    # caches built for the old weights
    model.load_weights_dict(w2)
    try:
        got = run(model)
    finally:
        model.load_weights_dict(w)
    want = run(SpelModel.from_weights(SMALL, w2))
    for g, f in zip(got, want):
        assert np.array_equal(g, f)
    assert np.abs(run(model)[1] - got[1]).max() > 1e-3   # the change mattered


def test_row_block_sizes_by_batch():
    """64-row blocks up to 5 rows, 32 beyond (a divisor of the rows, at least 16);
    weights of at most one block's rows are one contiguous W^T."""
    from spel_mlx.model.linear import row_block
    assert row_block(3072, 1024, 1) == 64 and row_block(3072, 1024, 5) == 64
    assert row_block(3072, 1024, 9) == 32 and row_block(3072, 1024, 17) == 32
    assert row_block(1152, 384, 5) == 64 and row_block(1152, 384, 6) == 32
    assert row_block(2048, 256, 1) == 64                    # the shipped LM head
    assert row_block(64, 64, 5) is None                     # one block: plain W^T
    assert row_block(40, 64, 17) == 20                      # 40 rows > 32: divisor 20 ...
    assert row_block(100, 64, 1) == 50 and row_block(97, 64, 1) is None   # ... prime: no blocks


def test_warm_layout_is_contiguous_and_exact():
    """The warmed (CPU) weight layout is a contiguous copy, and x @ it equals x @ W^T."""
    from spel_mlx.model import Linear
    lin = Linear(64, 192)
    x = mx.random.normal((5, 64))
    want = np.asarray(x) @ np.asarray(lin.weight).T
    for M in (1, 5, 9):
        lin.warm(M)
        got = np.asarray(lin(x[:M]))
        assert np.abs(got - want[:M]).max() < 1e-5
    rb64 = lin.weight_view(64)
    assert rb64.shape == (3, 64, 64) and np.array_equal(np.asarray(rb64)[1], np.asarray(lin.weight)[64:128].T)


def test_silu_mul_matches_float64():
    """The exp-free SwiGLU gate against float64 silu(a) * b, from -100 to 100."""
    from spel_mlx.model import silu_mul
    a = np.concatenate([np.linspace(-100, 100, 20001), [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0]]).astype(np.float32)
    b = np.random.default_rng(3).standard_normal(a.shape).astype(np.float32)
    got = np.array(silu_mul(mx.array(a), mx.array(b))).astype(np.float64)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = a64 * b64 / (1.0 + np.exp(-a64))
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= 1e-6 * np.abs(want) + 1e-30).all()


def test_masked_softmax_exact_zeros_and_float64():
    from spel_mlx.model import masked_softmax
    r = np.random.default_rng(5)
    s = (8.0 * r.standard_normal((7, 300))).astype(np.float32)
    vis = np.arange(300)[None, :] <= (np.arange(7) * 40 + 3)[:, None]
    got = np.array(masked_softmax(mx.array(s), mx.array(vis), axis=-1))
    assert (got[~vis] == 0).all()                       # masked positions: exact zeros
    s64 = np.where(vis, s.astype(np.float64), -np.inf)
    e = np.exp(s64 - s64.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    assert np.abs(got - want).max() < 1e-6 and np.abs(got.sum(-1) - 1).max() < 1e-6
    got0 = np.array(masked_softmax(mx.array(s.T), mx.array(vis.T), axis=0))
    assert np.array_equal(got0, got.T)

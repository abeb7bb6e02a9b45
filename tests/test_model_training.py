"""The model's training forward: the chunked delta rule against the recurrence (values
and gradients), batch_logits against the numpy reference and the decoding forward,
SPEC 3 fake quantization against spel_mlx.quant."""
import numpy as np
import pytest

import spel_mlx  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from spel_mlx import quant
from spel_mlx.config import ModelConfig
from spel_mlx.model import SpelModel, copy_target_to_draft, init_params, l2_normalize
from spel_mlx.model.delta_rule import delta_rule_chunked, delta_rule_recurrent
from spel_mlx.model.training_ops import fake_quant_linear, fq_act, fq_q8_rows, ternary_scale_codes

# 4 layers with attn_period 2: GDN, attention, GDN, attention; draft of 3 layers
TINY = ModelConfig(d_model=32, n_layers=4, n_heads=2, head_dim=16, d_ff=48, vocab=128,
                   max_seq=256, attn_period=2, draft_map=(0, 1, 2))


def _rand_qkv(B, T_, H, hd, seed=0):
    """Token-major q, k (unit), v [B, T, H, hd]."""
    rng = np.random.default_rng(seed)
    q = l2_normalize(mx.array(rng.standard_normal((B, T_, H, hd)).astype(np.float32)))
    k = l2_normalize(mx.array(rng.standard_normal((B, T_, H, hd)).astype(np.float32)))
    v = mx.array(rng.standard_normal((B, T_, H, hd)).astype(np.float32))
    return q, k, v


def _recurrent(q, k, v, a, b):
    B, _, H, hd = q.shape
    o, states = delta_rule_recurrent(q, k, v, a, b, mx.zeros((B, H, hd, hd)))
    return o, states[-1]


@pytest.mark.parametrize("T_,chunk", [(32, 8), (32, 32), (37, 16), (5, 64)])
def test_chunked_delta_rule_matches_recurrence(T_, chunk):
    q, k, v = _rand_qkv(2, T_, 3, 16)
    a = mx.array([0.5, 0.9, 0.999])
    b = mx.array([0.2, 0.7, 1.0])
    o_ref, S_ref = _recurrent(q, k, v, a, b)
    o, S = delta_rule_chunked(q, k, v, a, b, chunk=chunk)
    assert o.shape == o_ref.shape == (2, T_, 3, 16)
    assert float(mx.abs(o_ref).max()) > 0.05
    assert float(mx.abs(o - o_ref).max()) < 1e-5
    if T_ % min(chunk, T_) == 0:
        assert float(mx.abs(S - S_ref).max()) < 1e-5
    else:
        assert S is None


def test_chunked_delta_rule_gradients_match_recurrence():
    q, k, v = _rand_qkv(1, 24, 2, 8, seed=3)
    a = mx.array([0.8, 0.97])
    b = mx.array([0.6, 0.9])
    w = mx.array(np.random.default_rng(1).standard_normal((1, 24, 2, 8)).astype(np.float32))

    def f(fn, **kw):
        return lambda q, k, v, a, b: mx.sum(fn(q, k, v, a, b, **kw)[0] * w)
    g_ref = mx.grad(f(_recurrent), argnums=(0, 1, 2, 3, 4))(q, k, v, a, b)
    g = mx.grad(f(delta_rule_chunked, chunk=8), argnums=(0, 1, 2, 3, 4))(q, k, v, a, b)
    for x, y in zip(g_ref, g):
        assert float(mx.abs(x - y).max()) < 1e-4 * max(1.0, float(mx.abs(x).max()))
        assert float(mx.abs(x).max()) > 0


def test_training_forward_matches_reference_and_decoding():
    from spel_mlx.reference import forward_reference
    params = init_params(TINY, seed=5)
    w = {n: np.array(a) for n, a in params.items()}
    toks = np.random.default_rng(2).integers(0, TINY.vocab, 40)
    model = SpelModel.from_weights(TINY, w)
    for stack in ("target", "draft"):
        got = np.array(model.batch_logits(mx.array(toks[None].astype(np.int32)), stack, chunk=16))[0]
        ref = forward_reference(TINY, w, toks, stack=stack)
        assert np.abs(ref).max() > 0.5
        assert np.abs(got - ref).max() < 1e-4
        st = model.new_state(stack, ring=TINY.spec_k + 1)
        dec = []
        for i in range(0, len(toks), 5):
            dec.append(np.array(model.forward(toks[i:i + 5], st, stack=stack)))
            st.commit(5)
        assert np.abs(got - np.concatenate(dec)).max() < 1e-4


def test_batch_logits_params_and_fake_quant_scope():
    """A params dict is what the forward runs with; fake quantization touches only the
    draft's linears (q8 projections, ternary MLP), never the target or the shared head."""
    params = copy_target_to_draft(TINY, init_params(TINY, seed=6))
    x = mx.array(np.random.default_rng(3).integers(0, TINY.vocab, (2, 24)).astype(np.int32))
    model = SpelModel(TINY)
    target = model.batch_logits(x, "target", chunk=8, params=params)
    assert np.array_equal(np.array(target), np.array(model.batch_logits(x, "target", fake_quant=True, chunk=8)))
    draft = np.array(model.batch_logits(x, "draft", chunk=8))
    fq = np.array(model.batch_logits(x, "draft", fake_quant=True, chunk=8))
    assert 1e-4 < np.abs(fq - draft).max() < 0.5 * np.abs(draft).max()
    kinds = {lin.quant for blk in model.draft.layers for lin in blk.linears()}
    assert kinds == {"q8", "ternary"} and model.lm_head.quant is None
    assert {lin.quant for blk in model.layers for lin in blk.linears()} == {None}
    other = dict(params)
    other["lm_head.weight"] = params["lm_head.weight"] * 2.0
    doubled = model.batch_logits(x, "target", chunk=8, params=other)
    assert np.allclose(np.array(doubled), 2 * np.array(target), rtol=1e-5, atol=1e-5)


def test_fake_quant_matches_numpy_reference():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 200)) * rng.uniform(0.01, 2.0, (48, 1))).astype(np.float32)
    w[3] = 0.0                                        # an all-zero row keeps zeros
    q8, s8 = quant.quantize_q8(w)
    got = np.array(fq_q8_rows(mx.array(w)))
    assert np.array_equal(got, quant.dequantize(q8, s8))
    t, st = quant.quantize_ternary(w)
    qm, sm = ternary_scale_codes(mx.array(w))
    assert np.array_equal(np.array(qm).astype(np.int8), t)
    assert np.allclose(np.array(sm)[:, 0], st, rtol=2e-6, atol=0)
    x = (rng.standard_normal((7, 200)) * 3).astype(np.float32)
    x[2] = 0.0
    xq, sx = quant.quantize_activation(x)
    assert np.array_equal(np.array(fq_act(mx.array(x))), quant.dequantize(xq, sx))


def test_fake_quant_linear_matches_quantized_gemv():
    """A QAT linear equals the reference integer GEMV (s_r*s_x*sum q x_q) to float rounding."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((24, 64)).astype(np.float32)
    x = rng.standard_normal(64).astype(np.float32)
    for kind in ("q8", "ternary"):
        got = np.array(fake_quant_linear(mx.array(x[None]), mx.array(w), kind))[0]
        if kind == "q8":
            ref = quant.gemv_q8_ref(*quant.quantize_q8(w), x)
        else:
            ref = quant.gemv_ternary_ref(*quant.quantize_ternary(w), x)
        assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()


def test_straight_through_gradient():
    w = mx.array(np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32))
    x = mx.array(np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32))
    g = mx.grad(lambda w: mx.sum(fake_quant_linear(x, w, "ternary")))(w)
    g_plain = mx.grad(lambda w: mx.sum(fake_quant_linear(fq_act(x), w, None)))(w)
    assert float(mx.abs(g - g_plain).max()) < 1e-5   # d/dw passes through the quantizer
    assert float(mx.abs(g).max()) > 0


# --- the fused CPU training bodies (spel_mlx._spel_cpu) against MLX's autodiff ------------
from spel_mlx.model import cpu_ops, training_ops as TO   # noqa: E402

fused_only = pytest.mark.skipif(not cpu_ops.available(), reason="spel_mlx._spel_cpu not built")


@pytest.fixture(params=["avx2", "baseline"])
def simd(request):
    """Each fused body in both of its compiled forms (the AVX2 one where the CPU has it)."""
    old = cpu_ops._spel_cpu.set_simd(request.param != "baseline")
    yield request.param
    cpu_ops._spel_cpu.set_simd(old)


def _close(x, y, tol):
    x, y = np.array(x), np.array(y)
    assert np.abs(y).max() > 0
    assert np.abs(x - y).max() <= tol * max(1.0, np.abs(y).max()), np.abs(x - y).max()


@fused_only
@pytest.mark.parametrize("T_,chunk", [(37, 8), (64, 64), (5, 16)])
def test_fused_delta_rule_and_gradients_match_the_recurrence(simd, T_, chunk):
    q, k, v = _rand_qkv(2, T_, 3, 16, seed=7)
    a, b = mx.array([0.5, 0.9, 0.999]), mx.array([0.2, 0.7, 1.0])
    w = mx.array(np.random.default_rng(2).standard_normal((2, T_, 3, 16)).astype(np.float32))
    run = TO.delta_rule_fused(chunk)
    o, ck = run(q, k, v, a, b)
    _close(o, _recurrent(q, k, v, a, b)[0], 1e-5)
    assert ck.shape == (2, 3, -(-T_ // chunk), 16, 16) and float(mx.abs(ck[:, :, 0]).max()) == 0.0
    args = (0, 1, 2, 3, 4)
    g_ref = mx.grad(lambda *p: mx.sum(_recurrent(*p)[0] * w), argnums=args)(q, k, v, a, b)
    g = mx.grad(lambda *p: mx.sum(run(*p)[0] * w), argnums=args)(q, k, v, a, b)
    for x, y in zip(g, g_ref):
        _close(x, y, 1e-4)


@fused_only
def test_fused_gate_softmax_and_loss_match_autodiff(simd):
    rng = np.random.default_rng(4)
    A, B = (mx.array(rng.standard_normal((3, 5, 40)).astype(np.float32) * 4) for _ in range(2))
    W = mx.array(rng.standard_normal((3, 5, 40)).astype(np.float32))
    plain = mx.grad(lambda a, b: mx.sum(a * mx.sigmoid(a) * b * W), argnums=(0, 1))(A, B)
    fused = mx.grad(lambda a, b: mx.sum(TO.silu_mul_fused(a, b) * W), argnums=(0, 1))(A, B)
    _close(TO.silu_mul_fused(A, B), A * mx.sigmoid(A) * B, 1e-5)
    for x, y in zip(fused, plain):
        _close(x, y, 1e-5)
    S = mx.array(rng.standard_normal((2, 3, 9, 9)).astype(np.float32) * 5)
    Ws = mx.array(rng.standard_normal((2, 3, 9, 9)).astype(np.float32))
    mask = mx.tril(mx.ones((9, 9))) > 0

    def masked(s):
        return mx.softmax(mx.where(mask, s, -mx.inf), axis=-1)
    P = TO.softmax_causal(S)
    _close(P, masked(S), 1e-6)
    assert float(mx.abs(mx.where(mask, 0.0, P)).max()) == 0.0      # nothing above the diagonal
    _close(mx.grad(lambda s: mx.sum(TO.softmax_causal(s) * Ws))(S),
           mx.grad(lambda s: mx.sum(masked(s) * Ws))(S), 1e-5)
    logits = mx.array(rng.standard_normal((2, 7, 50)).astype(np.float32) * 6)
    y = mx.array(rng.integers(0, 50, (2, 7)).astype(np.int32))

    def ce_plain(lg):
        return mx.mean(mx.logsumexp(lg, axis=-1) - mx.take_along_axis(lg, y[..., None], axis=-1)[..., 0])
    assert abs(TO.cross_entropy(logits, y).item() - ce_plain(logits).item()) < 1e-5
    _close(mx.grad(lambda lg: TO.cross_entropy(lg, y))(logits), mx.grad(ce_plain)(logits), 1e-5)


@fused_only
def test_training_step_gradients_fused_and_plain_agree(monkeypatch):
    """The whole target loss and its gradient with the fused bodies and with plain MLX;
    a wrong backward in any of them moves some parameter's gradient far past 1e-4."""
    from spel_mlx import layout
    from spel_mlx.training import steps
    params = {n: mx.array(np.asarray(a)) for n, a in init_params(TINY, seed=3).items()}
    rng = np.random.default_rng(5)
    x, y = (mx.array(rng.integers(0, TINY.vocab, (2, 45)).astype(np.int32)) for _ in range(2))
    names = [s.name for s in layout.tensor_specs(TINY) if not s.name.startswith("draft.")]

    def loss_and_grads(flag):
        monkeypatch.setenv("SPEL_TRAIN_FUSED", flag)
        fwd = steps._forward(TINY, 16)
        return mx.value_and_grad(lambda p: TO.cross_entropy(fwd({**params, **p}, x, "target"), y))(
            {n: params[n] for n in names})
    (l0, g0), (l1, g1) = loss_and_grads("0"), loss_and_grads("1")
    assert abs(l0.item() - l1.item()) < 1e-5
    for n in names:
        _close(g1[n], g0[n], 1e-4)

"""The decoding pass built in C++ (``CPUFusedOps.pass_plan``, ``_spel_cpu.PassPlan``):
the same nodes the traced pass makes, so the same bits, with the GDN slots read as rows
of the stacked states in place."""
import os

import numpy as np
import pytest

import spel_mlx  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from spel_mlx.config import ModelConfig
from spel_mlx.model import SpelModel, cpu_ops, init_weights
from spel_mlx.model.state import _Row

if os.environ.get("SPEL_REQUIRE_CPU_EXT") != "1" and not cpu_ops.available():
    pytest.skip("spel_mlx._spel_cpu not built: " + cpu_ops.status()[1], allow_module_level=True)

E = cpu_ops._spel_cpu
CFG = ModelConfig(d_model=128, n_layers=4, n_heads=2, head_dim=64, d_ff=192, vocab=96,
                  max_seq=300, attn_period=2, draft_map=(0, 1), spec_k=4)


class TracedOps(cpu_ops.CPUFusedOps):
    """The same primitives, the pass traced from Python by mx.compile (no plan)."""

    def pass_plan(self, model, layers, M):
        return None


def _model(ops, kv="float32"):
    m = SpelModel.from_weights(CFG, init_weights(CFG, seed=8))
    object.__setattr__(m, "kv_cache", kv)     # what load(kv_cache=...) sets
    m.set_ops(ops)
    return m


def _decode(model, toks, batch):
    """Logits of every row, forwarding `batch` tokens a pass and committing all but the
    last of each (so the next pass starts from a row of a stacked state), plus the
    final KV caches and committed states."""
    st, out, i = model.new_state(ring=18), [], 0
    while i < len(toks):
        chunk = toks[i:i + batch]
        logits = np.array(model.forward(chunk, st))
        keep = max(1, len(chunk) - 1)
        out.append(logits[:keep])
        st.commit(keep)
        i += keep
    mx.eval([st.kv(li) for li in st.attn_layers])
    caches = [np.array(a) for li in st.attn_layers for a in st.kv(li)]
    states = [np.array(a) for li in st.gdn_layers for a in st.committed_gdn(li)]
    return np.concatenate(out), caches, states


def _same(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_the_plan_gives_the_bits_of_the_traced_pass(kv):
    toks = list(np.random.default_rng(2).integers(0, CFG.vocab, 120))
    plan, traced = _model(cpu_ops.CPUFusedOps(), kv), _model(TracedOps(), kv)
    for batch in (1, 5, 9, 17):
        got, want = _decode(plan, toks, batch), _decode(traced, toks, batch)
        assert _same(got[0], want[0]), batch
        assert all(_same(g, w) for g, w in zip(got[1] + got[2], want[1] + want[2])), batch
    key = next(k for k in plan._compiled if isinstance(k, tuple) and k[0] == "target")
    assert isinstance(plan._compiled[key][0], E.PassPlan)
    assert not isinstance(traced._compiled[key][0], E.PassPlan)


def test_q_and_k_only_when_captured():
    """Without a capture the plan makes no q/k arrays (5 -> 3 outputs per GDN block) and
    the logits, caches and states keep their bits; a capture's q/k are the traced pass's."""
    toks = list(np.random.default_rng(3).integers(0, CFG.vocab, 40))
    plan, traced = _model(cpu_ops.CPUFusedOps()), _model(TracedOps())
    for M in (1, 5):
        st_p, st_t = plan.new_state(ring=18), traced.new_state(ring=18)
        for m, st in ((plan, st_p), (traced, st_t)):
            m.prefill(toks, st)
        cap_p, cap_t = {}, {}
        with_qk = np.array(plan.forward(toks[:M], st_p, capture=cap_p))
        want = np.array(traced.forward(toks[:M], st_t, capture=cap_t))
        assert set(cap_p) == set(cap_t) == set(range(0, CFG.n_layers, 2))
        for li in cap_p:
            assert all(_same(np.array(cap_p[li][n]), np.array(cap_t[li][n])) for n in ("q", "k"))
        st_p.discard()
        without = np.array(plan.forward(toks[:M], st_p))
        assert _same(with_qk, want) and _same(without, want)
        li = st_p.gdn_layers[0]
        arrays, _ = st_p.current_gdn_rows(li)
        assert arrays[0].shape[0] == M          # the states, stacked per row, are still written
    m = next(v[0] for k, v in plan._compiled.items() if isinstance(k, tuple) and k[:2] == ("target", 1))
    st = plan.new_state(ring=4)
    args = (mx.array([1], dtype=mx.int32), mx.array(0, dtype=mx.int32))
    gdn_in, rows = [], []
    for li in st.gdn_layers:
        a, r = st.current_gdn_rows(li)
        gdn_in += a
        rows += r
    kv = [a for li in st.attn_layers for a in st.kv(li)]
    assert len(m(*args, gdn_in, rows, kv)[3]) == 2 * len(st.gdn_layers)
    assert m(*args, gdn_in, rows, kv, qk=False)[3] == []


def test_a_pass_reads_its_slot_in_place():
    """The slot the next pass starts from stays a row of the stacked states (no slice)."""
    m = _model(cpu_ops.CPUFusedOps())
    st = m.new_state(ring=8)
    mx.eval(m.forward([1, 2, 3, 4, 5], st))
    st.commit(3)
    li = st.gdn_layers[0]
    arrays, rows = st.current_gdn_rows(li)
    assert rows == [2, 2] and arrays[0].shape[0] == 5
    mx.eval(m.forward([6], st))
    assert isinstance(st.ring_S[li][st.read], _Row)


def _rand(shape, seed, scale=1.0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale)


def test_gdn_block_reads_a_row_of_stacked_inputs():
    m = _model(cpu_ops.CPUFusedOps())
    blk = m.layers[0]
    mx.eval(m.forward([1], m.new_state(ring=4)))       # warms the blocks of 1 row
    w = [blk.mixer.wqkv.blocks(1), blk.mixer.wo.blocks(1)]
    g = blk.mixer.gates(1)
    x, S_all, tails = _rand((1, 128), 1), _rand((4, 2, 64, 64), 2, 0.1), _rand((4, 2, 128), 3)
    args = (blk.attn_norm.weight, None, blk.mixer.conv, w[0], g["a"], g["b"], None, w[1], 1e-5)

    def run(tail, S, **rows):
        a = list(args)
        a[1], a[6] = tail, S
        return [np.array(o) for o in E.gdn_block(x, *a, **rows)]
    for r in (0, 3):
        got = run(tails, S_all, s_row=r, t_row=r)
        want = run(tails[r], S_all[r])
        assert all(_same(g_, w_) for g_, w_ in zip(got, want))
    with pytest.raises(ValueError, match="row is past"):
        run(tails, S_all, s_row=4, t_row=0)
    with pytest.raises(ValueError, match="S0 must have 4 dimensions"):
        run(tails, S_all[0], s_row=0, t_row=0)


def test_bad_plans_are_clear_errors():
    with pytest.raises(ValueError, match="takes 10 arrays, not 2"):
        E.PassPlan(None, [E.PlanLayer(True, 1e-5, 1e-5, [mx.zeros(3), mx.zeros(3)])], [], 0.0)
    with pytest.raises(ValueError, match="final norm, lm_head"):
        E.PassPlan(None, [], [mx.zeros(3)], 0.0)
    plan = E.PassPlan(None, [], [], 0.0)
    with pytest.raises(ValueError, match="per GDN layer"):
        plan(mx.zeros((1, 8)), mx.array(0, dtype=mx.int32), [mx.zeros(3)], [-1], [])

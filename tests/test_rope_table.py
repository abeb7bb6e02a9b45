"""The RoPE table is sized by the positions in use, as the KV caches are (issue 36): a
header declaring max_seq 2^24 allocates no 2^24-row table, and the positions used get
exactly the values a full table gives them."""
import os
import subprocess
import sys

import numpy as np
import pytest

import spel_mlx  # noqa: F401  (the BLAS first)
from spel_mlx.config import ModelConfig
from spel_mlx.decoding import SpeculativeDecoder
from spel_mlx.model import SpelModel, functional

from test_spelw import tiny_tensors

SMALL = ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=16, d_ff=128, vocab=128, max_seq=4096,
                    draft_map=(0, 3))
HUGE = SMALL.replace(max_seq=1 << 24)


def test_a_row_does_not_depend_on_the_tables_size():
    full = [np.array(a) for a in functional.rope_table(4096, 64, 10000.0)]
    for rows in (1, 7, 64, 100, 1024):
        part = functional.rope_table(rows, 64, 10000.0)
        assert all(np.array_equal(np.array(p), f[:rows]) for p, f in zip(part, full))


def test_tables_follow_the_kv_caches(monkeypatch):
    """Decoding 200 positions under a 2^24 max_seq builds tables of at most the KV
    caches' rows (256), and the same tokens and logits as the model with a small max_seq."""
    import spel_mlx.model.layers as layers
    sizes = []
    real = layers.rope_table

    def counting(rows, hd, theta):
        sizes.append(rows)
        return real(rows, hd, theta)

    monkeypatch.setattr(layers, "rope_table", counting)
    w = tiny_tensors(SMALL)
    prompt = [int(t) for t in np.arange(40) * 37 % SMALL.vocab]
    runs = {}
    for cfg in (SMALL, HUGE):
        sizes.clear()
        model = SpelModel.from_weights(cfg, w)
        dec = SpeculativeDecoder(model, None, "ar")
        tokens = dec.generate(prompt, 160)
        logits = np.array(model.forward(prompt[:5], model.new_state("target", ring=16), stack="target"))
        runs[cfg.max_seq] = (tokens, logits, max(sizes))
    assert runs[SMALL.max_seq][0] == runs[HUGE.max_seq][0]
    assert np.array_equal(runs[SMALL.max_seq][1], runs[HUGE.max_seq][1])
    assert runs[HUGE.max_seq][2] <= 256                     # the KV caches' rows for 200 positions
    assert runs[SMALL.max_seq][2] <= SMALL.max_seq


def test_a_huge_max_seq_header_decodes_in_little_memory():
    """A tiny model whose header says max_seq 2^24 loads and decodes under a 3 GiB
    address-space limit (the 2^24-row table was built through float64 arrays of 4 GiB
    each at head_dim 64)."""
    import resource
    code = ("import sys; sys.path.insert(0, 'tests'); import spel_mlx; "
            "from spel_mlx.config import ModelConfig; from spel_mlx.model import SpelModel; "
            "from spel_mlx.decoding import SpeculativeDecoder; from test_spelw import tiny_tensors; "
            "cfg = ModelConfig(d_model=64, n_layers=4, n_heads=1, head_dim=64, d_ff=128, vocab=128, "
            "max_seq=1 << 24, draft_map=(0, 3)); "
            "m = SpelModel.from_weights(cfg, tiny_tensors(cfg)); "
            "print(len(SpeculativeDecoder(m, None, 'ar').generate(list(range(10)), 100)))")

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, preexec_fn=cap,
                         env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout.split()[-1] == "100", out.stderr[-2000:]


@pytest.mark.parametrize("max_seq,plan", [(4096, True), (1 << 20, False)])
def test_the_pass_plan_captures_a_whole_table_only_when_small(max_seq, plan):
    from spel_mlx.model.layers import Attention
    att = Attention(SMALL.replace(max_seq=max_seq))
    whole = att.rope_all()
    assert (whole is not None) == plan
    if plan:
        assert whole[0].shape == (max_seq, SMALL.head_dim // 2)

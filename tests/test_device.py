"""Device selection and the ops per device (spel_mlx.model.backends), with the GPU's
availability injected: a GPU asked for where there is none is an error naming it,
the default is the CPU here, and a CUDA GPU gets the plain MLX ops (neither the
Metal kernels nor the fused CPU primitives).  Also: the GPU form of the chunked delta
rule's triangular inverse, the C draft from MLX arrays, the engine's device scope."""
import contextlib
import importlib.metadata as metadata
import io

import mlx.core as mx
import numpy as np
import pytest

import spel_mlx  # noqa: F401
from spel_mlx.api import LoadError, load
from spel_mlx.config import resolve_config
from spel_mlx.model import MLXOps, SpelModel, backends, cpu_ops, init_weights
from spel_mlx.model.delta_rule import chunk_gates, unit_lower_inv_blocked
from spel_mlx.metal import executors

from spel_mlx.cli import generate as gen  # noqa: E402
TINY = "d_model=32,n_layers=4,n_heads=2,head_dim=16,d_ff=64,vocab=128,max_seq=96,draft_map=0:3"


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(executors, "metal_available", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: False)
    monkeypatch.setattr(mx, "is_available", lambda d: d == mx.cpu)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(executors, "metal_available", lambda: False)
    monkeypatch.setattr(backends, "_cuda_available", lambda: True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from spel_mlx.checkpoints import write_spelw
    cfg = resolve_config(overrides=TINY, use_env=False)
    path = tmp_path_factory.mktemp("dev") / "tiny.spelw"
    write_spelw(str(path), cfg, init_weights(cfg, seed=5))
    return path


# ---- the target's device -------------------------------------------------------------------
def test_gpu_asked_without_one_is_an_error_naming_it(no_gpu):
    assert backends.gpu_backend() is None
    with pytest.raises(backends.DeviceError, match="placement gpu: MLX .* reports no GPU"):
        backends.placement_device("gpu")
    assert backends.placement_device(None) == "cpu"
    assert backends.placement_device("cpu") == "cpu"
    for bad in ("auto", "tpu"):
        with pytest.raises(backends.DeviceError, match=repr(bad)):
            backends.placement_device(bad)


def test_default_placement_here_is_the_cpu():
    # this machine has no GPU (the GPU session's device check runs elsewhere)
    if backends.gpu_available():
        pytest.skip("MLX has a GPU here")
    assert backends.placement_device(None) == "cpu"
    assert backends.device_name() == "cpu"


def test_cuda_gpu_is_the_default_and_gets_the_plain_mlx_ops(fake_cuda, monkeypatch):
    monkeypatch.delenv("SPEL_KERNELS", raising=False)
    assert backends.gpu_backend() == "cuda"
    assert backends.placement_device(None) == backends.placement_device("gpu") == "gpu"
    assert backends.resolve(None, "gpu") == "mlx"
    for ops in (backends.select(None, "gpu"), backends.auto_ops("gpu")):
        assert type(ops) is MLXOps                     # not MetalOps, not CPUFusedOps
    # the CPU device keeps the fused primitives beside it
    assert backends.resolve(None, "cpu") == ("cpu" if cpu_ops.available() else "mlx")
    with pytest.raises(backends.DeviceError, match="fused CPU primitives run only on the CPU.*cuda"):
        backends.resolve("cpu", "gpu")
    with pytest.raises(backends.DeviceError, match="Metal GPU, not on the cuda GPU"):
        backends.resolve("metal", "gpu")
    monkeypatch.setenv("SPEL_KERNELS", "cpu")     # an explicit CPU path: still refused on the GPU
    with pytest.raises(backends.DeviceError):
        backends.select(None, "gpu")


def test_metal_kernels_only_on_a_metal_gpu(monkeypatch):
    monkeypatch.delenv("SPEL_KERNELS", raising=False)
    monkeypatch.setattr(executors, "metal_available", lambda: True)
    assert backends.gpu_backend() == "metal"
    assert backends.resolve(None, "gpu") == "metal"
    assert backends.resolve(None, "cpu") != "metal"
    with pytest.raises(backends.DeviceError, match="not on the CPU device"):
        backends.resolve("metal", "cpu")


def test_no_gpu_reason_names_the_overwritten_cuda_build(no_gpu, monkeypatch):
    dists = {"mlx-cuda-13": "0.32.4", "mlx-cpu": "0.32.4"}

    def version(name):
        if name not in dists:
            raise metadata.PackageNotFoundError(name)
        return dists[name]
    monkeypatch.setattr(metadata, "version", version)
    why = backends.no_gpu_reason()
    assert "both installed" in why and "--force-reinstall --no-deps mlx-cuda-13==0.32.4" in why
    dists.pop("mlx-cpu")
    assert "nvidia-smi" in backends.no_gpu_reason()
    dists.clear()
    assert "spel-mlx[cuda]" in backends.no_gpu_reason()


# ---- ops per device in the model ----------------------------------------------------------
def test_model_keeps_ops_per_device(fake_cuda):
    cfg = resolve_config(overrides=TINY, use_env=False)
    model = SpelModel.from_weights(cfg, init_weights(cfg, seed=1))
    assert type(model.ops_for("gpu")) is MLXOps
    assert model.ops is model.ops_for("cpu")                       # the default device here
    if cpu_ops.available():
        assert isinstance(model.ops_for("cpu"), cpu_ops.CPUFusedOps)
        with pytest.raises(ValueError, match="CPUFusedOps cannot run on the gpu device"):
            model.set_ops(cpu_ops.CPUFusedOps(), "gpu")
    plain = MLXOps()
    model.set_ops(plain, "gpu")
    assert model.ops_for("gpu") is plain and model.ops_for("cpu") is not plain


def test_load_for_a_cuda_gpu_selects_the_mlx_ops(ckpt, fake_cuda, monkeypatch):
    monkeypatch.delenv("SPEL_KERNELS", raising=False)
    loaded, _ = load(ckpt, placement="gpu")
    try:
        assert loaded.device == "gpu" and type(loaded.model.ops_for("gpu")) is MLXOps
    finally:
        loaded.close()
    loaded, _ = load(ckpt, placement="cpu")
    assert loaded.device == "cpu"
    loaded.close()


def test_load_and_cli_refuse_gpu_without_one(ckpt, no_gpu):
    with pytest.raises(LoadError, match="placement gpu: .*no GPU"):
        load(ckpt, placement="gpu")
    out, err = io.StringIO(), io.StringIO()
    code = gen.run(["--checkpoint", str(ckpt), "--placement", "gpu", "--max-tokens", "4"], stdout=out, stderr=err)
    assert code == 2 and err.getvalue().startswith("error: placement gpu: ") and "no GPU" in err.getvalue()


def test_cli_cpu_placement_reports_the_device(ckpt):
    out, err = io.StringIO(), io.StringIO()
    code = gen.run(["--checkpoint", str(ckpt), "--placement", "cpu", "--max-tokens", "6", "--temperature", "0",
                    "--stats", "--prompt", "the cat"], stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    assert '"target_device": "cpu"' in err.getvalue()


def test_engine_decodes_in_the_loaded_devices_scope(ckpt, monkeypatch):
    from spel_mlx.api import engine, generate
    seen = []

    @contextlib.contextmanager
    def scope(name):
        seen.append(name)
        yield
    monkeypatch.setattr(engine, "device_scope", scope)
    loaded, tok = load(ckpt, placement="cpu")
    try:
        generate(loaded, tok, "the cat", max_tokens=4, temperature=0, draft="mlx")
        loaded.device = "gpu"              # as load(placement="gpu") leaves it on a GPU machine
        generate(loaded, tok, "the cat", max_tokens=4, temperature=0, draft="mlx")
    finally:
        loaded.close()
    assert seen == ["cpu", "gpu"]


# ---- the chunked delta rule's inverse on a GPU ----------------------------------------------
@pytest.mark.parametrize("C", [1, 2, 5, 8, 17, 64])
def test_blocked_unit_lower_inverse_matches_tri_inv(C):
    """The GPU form against MLX's CPU triangular inverse, on the chunk's real matrix
    I + beta (Gm * K K^T) (unit keys, sigmoided gates)."""
    rng = np.random.default_rng(C)
    H, N, hd = 3, 2, 16
    k = rng.standard_normal((H, N, C, hd)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    a = mx.array(rng.uniform(0.8, 0.99, H).astype(np.float32))
    beta = rng.uniform(0.1, 0.9, H).astype(np.float32).reshape(H, 1, 1, 1)
    km = mx.array(k)
    A = mx.eye(C) + mx.array(beta) * (chunk_gates(a, C)["Gm"] * (km @ mx.swapaxes(km, -1, -2)))
    want = np.array(mx.linalg.tri_inv(A, upper=False, stream=mx.cpu))
    got = np.array(unit_lower_inv_blocked(A))
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    assert np.array_equal(np.triu(got, 1), np.zeros_like(got))               # exactly triangular
    assert np.array_equal(np.diagonal(got, axis1=-2, axis2=-1), np.ones((H, N, C), np.float32))
    if C > 1:   # negative control: another matrix's inverse is far from it
        other = np.array(unit_lower_inv_blocked(A + mx.tril(mx.ones((C, C)), -1) * 0.1))
        assert np.abs(other - want).max() > 1e-3


# ---- the C draft takes MLX arrays ----------------------------------------------------------
def test_cdraft_from_mlx_arrays_is_the_numpy_one():
    from spel_mlx.native import clib
    from spel_mlx.native.cdraft import CDraft
    if not clib.available():
        pytest.skip("the C draft is not built")
    cfg = resolve_config(overrides=TINY, use_env=False)
    w = init_weights(cfg, seed=2)
    outs = []
    for weights in (w, {n: mx.array(v) for n, v in w.items()}):
        d = CDraft(cfg, weights, threads=1, ring=5)
        try:
            outs.append(np.stack([np.array(d.step(t)) for t in (3, 9, 27, 81)]))
        finally:
            d.close()
    assert np.array_equal(outs[0], outs[1])


def test_plain_mlx_passes_with_the_gpu_inverse_agree(monkeypatch):
    """A CUDA GPU runs the plain MLX ops, whose chunked delta rule there inverts by block
    doubling: the decoding pass (M=5) and the training forward (64-token chunks) with
    that inverse agree with MLX's triangular inverse."""
    monkeypatch.setenv("SPEL_TRAIN_FUSED", "0")    # the GPU's training forward: plain MLX ops
    cfg = resolve_config(overrides="d_model=64,n_layers=4,n_heads=2,head_dim=32,d_ff=128,vocab=96,max_seq=160,"
                                   "attn_period=2,draft_map=0:1", use_env=False)
    model = SpelModel.from_weights(cfg, init_weights(cfg, seed=4))
    model.set_ops(MLXOps())
    toks = np.random.default_rng(4).integers(0, cfg.vocab, (2, 150))
    ref_pass = np.array(model.forward(toks[0, :5].tolist(), model.new_state()))
    ref_train = np.array(model.batch_logits(mx.array(toks), chunk=64))
    calls = []

    def blocked(A, upper=False, stream=None):
        calls.append(A.shape[-1])
        return unit_lower_inv_blocked(A)
    monkeypatch.setattr(mx.linalg, "tri_inv", blocked)
    model.set_ops(MLXOps())                       # drops the compiled passes
    got_pass = np.array(model.forward(toks[0, :5].tolist(), model.new_state()))
    got_train = np.array(model.batch_logits(mx.array(toks), chunk=64))
    assert np.abs(got_pass - ref_pass).max() < 1e-4 and np.abs(got_train - ref_train).max() < 1e-4
    assert set(calls) == {5, 64}                  # the pass's M=5 chunk and the training chunks

"""SPELW001 <-> safetensors folder: byte-identical round trips, interop, every error."""
import json
import os
import struct

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import spel_mlx  # noqa: F401
from spel_mlx import converters
from spel_mlx.reader import load_checkpoint
from spel_mlx.converters import (CONFIG_FILE, MODEL_FILE, SafetensorsModel, safetensors_to_spelw,
                                 spelw_to_safetensors)
from spel_mlx.converters import safetensors_io
from spel_mlx.converters.safetensors_io import bf16_bits_to_f32, f32_to_bf16_bits
from spel_mlx.layout import tensor_specs
from spel_mlx.checkpoints import CheckpointError, read_spelw, write_spelw

from test_spelw import TINY, tiny_golden, tiny_tensors


@pytest.fixture
def spelw_file(tmp_path):
    p = tmp_path / "m.spelw"
    write_spelw(p, TINY, tiny_tensors(), tiny_golden())
    return p


@pytest.fixture
def st_dir(tmp_path, spelw_file):
    d = tmp_path / "folder"
    spelw_to_safetensors(spelw_file, d)
    return d


def st_dict(d):
    return load_file(str(d / MODEL_FILE))


def st_meta(d):
    with safe_open(str(d / MODEL_FILE), "np") as f:
        return f.metadata()


def save_variant(tmp_path, tensors, meta, name="v"):
    d = tmp_path / name
    d.mkdir()
    save_file(tensors, str(d / MODEL_FILE), metadata=meta)
    return d


# --------------------------------------------------------------------------- round trips

def test_spelw_st_spelw_byte_identical(tmp_path, spelw_file, st_dir):
    back = tmp_path / "back.spelw"
    safetensors_to_spelw(st_dir, back)
    assert back.read_bytes() == spelw_file.read_bytes()
    # also from the .safetensors file itself (config from metadata)
    back2 = tmp_path / "back2.spelw"
    safetensors_to_spelw(st_dir / MODEL_FILE, back2)
    assert back2.read_bytes() == spelw_file.read_bytes()


def test_spelw_without_footer_round_trips(tmp_path):
    p = tmp_path / "nf.spelw"
    write_spelw(p, TINY, tiny_tensors())
    d = tmp_path / "nf"
    spelw_to_safetensors(p, d)
    assert not any(k.startswith("golden.") for k in st_dict(d))
    assert st_meta(d)["spel.flags"] == "0"
    safetensors_to_spelw(d, tmp_path / "nf2.spelw")
    assert (tmp_path / "nf2.spelw").read_bytes() == p.read_bytes()


def test_st_spelw_st_identical(tmp_path, st_dir):
    s1 = tmp_path / "s1.spelw"
    safetensors_to_spelw(st_dir, s1)
    d2 = tmp_path / "again"
    spelw_to_safetensors(s1, d2)
    assert (d2 / MODEL_FILE).read_bytes() == (st_dir / MODEL_FILE).read_bytes()
    assert (d2 / CONFIG_FILE).read_bytes() == (st_dir / CONFIG_FILE).read_bytes()


def test_third_party_st_round_trip_equal_tensors_and_metadata(tmp_path, st_dir):
    # written by the safetensors library itself (different byte layout), same content
    tensors = {k: np.array(v) for k, v in st_dict(st_dir).items()}
    meta = st_meta(st_dir)
    src = save_variant(tmp_path, tensors, meta, "lib")
    s = tmp_path / "lib.spelw"
    safetensors_to_spelw(src, s)
    out = tmp_path / "lib_back"
    spelw_to_safetensors(s, out)
    back = st_dict(out)
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and np.array_equal(back[k], v), k
    assert st_meta(out) == meta


def test_folder_layout_and_interop(st_dir, spelw_file):
    d = st_dict(st_dir)
    t, g = tiny_tensors(), tiny_golden()
    assert set(d) == {s.name for s in tensor_specs(TINY)} | {"golden.tokens", "golden.target_logits",
                                                             "golden.draft_logits"}
    for k, v in t.items():
        assert d[k].dtype == np.float32 and np.array_equal(d[k], v)
    assert d["golden.tokens"].dtype == np.uint32 and np.array_equal(d["golden.tokens"], g.tokens)
    assert np.array_equal(d["golden.target_logits"], g.target_logits)
    meta = st_meta(st_dir)
    cfg = json.loads(meta["spel.config"])
    assert cfg["draft_map"] == [0, 3] and cfg["norm_eps"] == 1e-05 and meta["spel.format"] == "SPELW001"
    cj = json.loads((st_dir / CONFIG_FILE).read_text())
    assert cj["model_type"] == "spel" and cj["d_model"] == 64 and cj["torch_dtype"] == "float32"
    import mlx.core as mx
    m = mx.load(str(st_dir / MODEL_FILE))
    assert np.array_equal(np.array(m["lm_head.weight"]), t["lm_head.weight"])


def test_load_checkpoint_both_forms(st_dir, spelw_file):
    a, b = load_checkpoint(spelw_file), load_checkpoint(st_dir)
    assert a.cfg == b.cfg == TINY
    assert (a.format, b.format) == ("spelw", "safetensors")
    assert list(a.weights) == list(b.weights) == [s.name for s in tensor_specs(TINY)]
    for k in a.weights:
        assert np.array_equal(a.weights[k], b.weights[k])
    assert np.array_equal(a.golden.draft_logits, b.golden.draft_logits)


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_precision_folders_upcast(tmp_path, spelw_file, dtype):
    d = tmp_path / dtype
    spelw_to_safetensors(spelw_file, d, dtype=dtype)
    assert st_meta(d)["spel.dtype"] == dtype
    t = tiny_tensors()
    ck = load_checkpoint(d)
    assert ck.stored_dtype == dtype
    for k, v in t.items():
        want = v.astype(np.float16).astype(np.float32) if dtype == "F16" else bf16_bits_to_f32(f32_to_bf16_bits(v))
        assert ck.weights[k].dtype == np.float32 and np.array_equal(ck.weights[k], want), k
    s = tmp_path / f"{dtype}.spelw"
    safetensors_to_spelw(d, s)          # widening is exact
    r = read_spelw(s)
    for k in t:
        assert np.array_equal(r.tensors[k], ck.weights[k])


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.00390625, 1.0078125 + 2**-9, -2.5, np.inf, np.nan, 3.0e38], np.float32)
    got = bf16_bits_to_f32(f32_to_bf16_bits(x))
    assert got[0] == 1.0 and got[1] == 1.0           # tie rounds to even
    assert got[3] == -2.5 and np.isinf(got[4]) and np.isnan(got[5])


def test_sharded_folder(tmp_path, st_dir):
    d = st_dict(st_dir)
    meta = st_meta(st_dir)
    names = sorted(d)
    sh = tmp_path / "sharded"
    sh.mkdir()
    half = len(names) // 2
    save_file({k: d[k] for k in names[:half]}, str(sh / "model-00001-of-00002.safetensors"), metadata=meta)
    save_file({k: d[k] for k in names[half:]}, str(sh / "model-00002-of-00002.safetensors"), metadata=meta)
    wm = {k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
          for i, k in enumerate(names)}
    (sh / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    out = tmp_path / "sh.spelw"
    safetensors_to_spelw(sh, out)
    ref = tmp_path / "ref.spelw"
    safetensors_to_spelw(st_dir, ref)
    assert out.read_bytes() == ref.read_bytes()


# --------------------------------------------------------------------------- errors

def st_error(src, *fragments):
    with pytest.raises(CheckpointError) as ei:
        SafetensorsModel(src)
    msg = str(ei.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def test_missing_extra_misshaped_mistyped(tmp_path, st_dir):
    base = {k: np.array(v) for k, v in st_dict(st_dir).items()}
    meta = st_meta(st_dir)
    t = dict(base)
    del t["layers.1.mixer.beta_logit"]
    st_error(save_variant(tmp_path, t, meta, "miss"), "missing tensors", "layers.1.mixer.beta_logit")
    t = dict(base, **{"layers.9.mlp.w1.weight": np.zeros((2, 2), np.float32)})
    st_error(save_variant(tmp_path, t, meta, "extra"), "unexpected tensors", "layers.9.mlp.w1.weight")
    t = dict(base, **{"layers.2.mlp.w3.weight": np.zeros((128, 63), np.float32)})
    st_error(save_variant(tmp_path, t, meta, "shape"), "layers.2.mlp.w3.weight", "shape [128, 63]",
             "expected [128, 64]")
    t = dict(base, **{"lm_head.weight": base["lm_head.weight"].astype(np.int32)})
    st_error(save_variant(tmp_path, t, meta, "type"), "lm_head.weight", "dtype I32")
    t = dict(base, **{"golden.tokens": base["golden.tokens"].astype(np.float32)})
    st_error(save_variant(tmp_path, t, meta, "gtype"), "golden.tokens", "dtype F32")
    t = dict(base)
    del t["golden.draft_logits"]
    st_error(save_variant(tmp_path, t, meta, "ginc"), "incomplete golden", "golden.draft_logits")
    t = dict(base, **{"golden.tokens": np.full(16, 200, np.uint32)})
    st_error(save_variant(tmp_path, t, meta, "gtok"), "golden token 200", "golden.tokens[0]")


def test_config_errors(tmp_path, st_dir):
    base = {k: np.array(v) for k, v in st_dict(st_dir).items()}
    meta = st_meta(st_dir)
    st_error(save_variant(tmp_path, base, {"format": "mlx"}, "nocfg"), "no model config")
    d = save_variant(tmp_path, base, meta, "contra")
    cj = json.loads((st_dir / CONFIG_FILE).read_text())
    cj["d_ff"] = 256
    (d / CONFIG_FILE).write_text(json.dumps(cj))
    st_error(d, "config.json contradicts", "d_ff")
    # config.json alone is enough
    d = save_variant(tmp_path, base, {}, "cjonly")
    (d / CONFIG_FILE).write_text((st_dir / CONFIG_FILE).read_text())
    assert SafetensorsModel(d).cfg == TINY
    st_error(save_variant(tmp_path, base, dict(meta, **{"spel.config": "{bad"}), "badjson"), "spel.config")
    st_error(save_variant(tmp_path, base, dict(meta, **{"spel.flags": "0"}), "flags"), "spel.flags")
    m = json.loads(meta["spel.config"])
    m["n_heads"] = "2"
    st_error(save_variant(tmp_path, base, dict(meta, **{"spel.config": json.dumps(m)}), "type"), "n_heads")


def raw_file(tmp_path, header_obj_or_bytes, data=b"", name="raw.safetensors"):
    h = header_obj_or_bytes if isinstance(header_obj_or_bytes, bytes) else json.dumps(header_obj_or_bytes).encode()
    p = tmp_path / name
    p.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return p


def test_safetensors_structure_errors(tmp_path, st_dir):
    def err(p, *frags):
        with pytest.raises(CheckpointError) as ei:
            safetensors_io.SafetensorsFile(p)
        msg = str(ei.value)
        assert "\n" not in msg and str(p) in msg
        for f in frags:
            assert f in msg, (f, msg)
    err(raw_file(tmp_path, b'{"a": ', name="j.safetensors"), "bad JSON header", "byte 14")
    err(raw_file(tmp_path, b"\xff\xfe{}", name="u.safetensors"), "not UTF-8")
    p = tmp_path / "len.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    err(p, "header length", "byte 0")
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    err(tmp_path / "tiny.safetensors", "truncated")
    err(raw_file(tmp_path, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8,
                 "trunc.safetensors"), "truncated", "tensor x", "ends at byte")
    err(raw_file(tmp_path, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 12,
                 "span.safetensors"), "tensor x", "needs 16")
    err(raw_file(tmp_path, {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                            "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12,
                 "ovl.safetensors"), "overlaps")
    err(raw_file(tmp_path, {"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8,
                 "dt.safetensors"), "unknown dtype")
    err(raw_file(tmp_path, {"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8,
                 "neg.safetensors"), "bad data_offsets")
    err(raw_file(tmp_path, {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 9,
                 "trail.safetensors"), "1 bytes after")
    # a truncated real model file names the tensor that is cut
    data = (st_dir / MODEL_FILE).read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:len(data) // 2])
    err(cut, "truncated", "tensor")


def test_failed_conversions_leave_nothing(tmp_path, spelw_file, st_dir, monkeypatch):
    real_encode = safetensors_io._encode
    calls = {"n": 0}

    def failing_encode(arr, dtype):
        calls["n"] += 1
        if calls["n"] == 7:
            raise OSError(28, "No space left on device")
        return real_encode(arr, dtype)

    monkeypatch.setattr(safetensors_io, "_encode", failing_encode)
    out = tmp_path / "new_folder"
    with pytest.raises(OSError):
        spelw_to_safetensors(spelw_file, out)
    assert not out.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    calls["n"] = 0
    with pytest.raises(OSError):
        spelw_to_safetensors(spelw_file, existing)
    assert os.listdir(existing) == []
    monkeypatch.undo()

    real_f32 = SafetensorsModel.f32
    seen = {"n": 0}

    def failing_f32(self, name):
        seen["n"] += 1
        if seen["n"] == 9:
            raise OSError(5, "Input/output error")
        return real_f32(self, name)

    monkeypatch.setattr(SafetensorsModel, "f32", failing_f32)
    before = set(os.listdir(tmp_path))
    with pytest.raises(OSError):
        safetensors_to_spelw(st_dir, tmp_path / "x.spelw")
    assert set(os.listdir(tmp_path)) == before


def test_bad_source_creates_nothing(tmp_path, spelw_file):
    bad = tmp_path / "bad.spelw"
    bad.write_bytes(spelw_file.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated"):
        spelw_to_safetensors(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert converters.MODEL_FILE == "model.safetensors"


# --------------------------------------------------------------------------- a packed draft

@pytest.fixture
def snapped_spelw(tmp_path):
    """TINY with its draft on its quantization grid (what an export writes)."""
    from spel_mlx.training.export import snap_draft
    p = tmp_path / "snapped.spelw"
    write_spelw(p, TINY, snap_draft(tiny_tensors()), tiny_golden())
    return p


def test_packed_draft_round_trips_byte_identical(tmp_path, snapped_spelw):
    """The draft's q8 and ternary matrices as codes and scales: SPELW001 -> packed folder
    -> SPELW001 is byte-identical, the loaded weights are the same floats, the codes are
    what the C draft quantizes to, and the folder is smaller than the float one."""
    from spel_mlx import quant
    from spel_mlx.layout import draft_quant
    packed, plain = tmp_path / "packed", tmp_path / "plain"
    spelw_to_safetensors(snapped_spelw, packed, pack_draft=True)
    spelw_to_safetensors(snapped_spelw, plain)
    back = tmp_path / "back.spelw"
    safetensors_to_spelw(packed, back)
    assert back.read_bytes() == snapped_spelw.read_bytes()
    st = SafetensorsModel(packed)
    stored = st_dict(packed)
    quantized = [s.name for s in tensor_specs(TINY) if draft_quant(s.name)]
    assert st.packed == set(quantized) and st_meta(packed)["spel.draft"] == "packed"
    for n in quantized:
        assert n not in stored and stored[n + ".scale"].dtype == np.float32
        q, s = quant.QUANTIZERS[draft_quant(n)](read_spelw(snapped_spelw).tensors[n])
        codes = stored[n + ".q8"] if draft_quant(n) == "q8" else quant.unpack_ternary(stored[n + ".ternary"], q.shape[1])
        assert np.array_equal(codes, q) and np.array_equal(stored[n + ".scale"], s)
    a, b = load_checkpoint(str(packed)), load_checkpoint(str(snapped_spelw))
    assert all(np.array_equal(a.weights[n], b.weights[n]) for n in b.weights)
    assert a.stored_dtype == "F32, draft packed"
    assert os.path.getsize(packed / MODEL_FILE) < os.path.getsize(plain / MODEL_FILE)


def test_packing_refuses_a_draft_off_its_grid(tmp_path, spelw_file):
    with pytest.raises(CheckpointError, match=r"draft\.layers\.0\.mixer\.wqkv\.weight: not on its q8 grid"):
        spelw_to_safetensors(spelw_file, tmp_path / "p", pack_draft=True)
    assert not (tmp_path / "p").exists()


def test_packed_draft_damage_is_named(tmp_path, snapped_spelw):
    packed = tmp_path / "packed"
    spelw_to_safetensors(snapped_spelw, packed, pack_draft=True)
    good, meta = st_dict(packed), st_meta(packed)
    q8, tern = "draft.layers.0.mixer.wo.weight", "draft.layers.1.mlp.w2.weight"
    cases = [
        ("missing scale", {k: v for k, v in good.items() if k != q8 + ".scale"}, q8 + ".scale missing"),
        ("float codes", {**good, q8 + ".q8": good[q8 + ".q8"].astype(np.float32)}, q8 + r"\.q8: F32"),
        ("q8 -128", {**good, q8 + ".q8": np.where(np.arange(good[q8 + ".q8"].size).reshape(good[q8 + ".q8"].shape)
                                                   == 5, -128, good[q8 + ".q8"]).astype(np.int8)}, "row 0"),
        ("ternary code 2", {**good, tern + ".ternary": np.full_like(good[tern + ".ternary"], 0b10)},
         tern + r"\.ternary: row 0"),
        ("negative scale", {**good, tern + ".scale": -good[tern + ".scale"] - 1}, tern + r"\.scale: scales"),
    ]
    for i, (what, tensors, msg) in enumerate(cases):
        d = save_variant(tmp_path, tensors, meta, name=f"bad{i}")
        with pytest.raises(CheckpointError, match=msg):
            load_checkpoint(str(d))

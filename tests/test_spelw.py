"""SPELW001 reader/writer (SPEC 6): exact layout, round trips, every malformed-input error."""
import os
import struct
import tracemalloc

import numpy as np
import pytest

import spel_mlx  # noqa: F401
from spel_mlx.checkpoints import CheckpointError, Golden
from spel_mlx.checkpoints.footer import FOOTER_MAGIC, footer_nbytes
from spel_mlx.checkpoints.spelw import HEADER_SIZE, header_bytes, parse_header, read_header, read_spelw, write_spelw
from spel_mlx.config import LIMITS, MAX_INNER, PRESETS, ModelConfig
from spel_mlx.layout import tensor_specs, weights_nbytes

TINY = ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=16, d_ff=128, vocab=128, max_seq=64,
                   draft_map=(0, 3))


def tiny_tensors(cfg=TINY, seed=0):
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in tensor_specs(cfg)}


def tiny_golden(cfg=TINY, n=16, seed=1):
    rng = np.random.default_rng(seed)
    return Golden(rng.integers(0, cfg.vocab, n).astype(np.uint32),
                  rng.standard_normal((n, cfg.vocab)).astype(np.float32),
                  rng.standard_normal((n, cfg.vocab)).astype(np.float32))


@pytest.fixture
def tiny_file(tmp_path):
    p = tmp_path / "tiny.spelw"
    t, g = tiny_tensors(), tiny_golden()
    write_spelw(p, TINY, t, g)
    return p, t, g


def rewrite(path, data, out):
    out.write_bytes(data)
    return out


def expect_error(path, *fragments):
    with pytest.raises(CheckpointError) as ei:
        read_spelw(path)
    msg = str(ei.value)
    assert "\n" not in msg
    assert str(path) in msg
    for f in fragments:
        assert f in msg, (f, msg)
    return ei.value


# --------------------------------------------------------------------------- layout

def test_header_layout_is_spec6():
    cfg = PRESETS["21m"]
    h = header_bytes(cfg, 1)
    assert len(h) == 64 and h[:8] == b"SPELW001"
    assert struct.unpack_from("<9I", h, 8) == (384, 12, 6, 64, 1024, 128, 4096, 4, 4)
    assert list(h[44:52]) == [0, 3, 6, 9, 255, 255, 255, 255]
    assert struct.unpack_from("<ffI", h, 52) == (np.float32(10000.0), np.float32(1e-5), 1)


def test_header_round_trip_equals_presets():
    for name, cfg in PRESETS.items():
        for flags in (0, 1):
            hdr = parse_header(header_bytes(cfg, flags))
            assert hdr.cfg == cfg, name           # 1e-5 comes back as 1e-5, not 9.99999974e-06
            assert hdr.flags == flags
            assert header_bytes(hdr.cfg, flags) == header_bytes(cfg, flags)


def test_header_floats_round_trip_bit_exact():
    cfg = TINY.replace(rope_theta=12345.678901, norm_eps=3.3e-7)
    b = header_bytes(cfg, 0)
    again = header_bytes(parse_header(b).cfg, 0)
    assert again == b


def test_file_sizes_match_spec_counts():
    # target + draft parameters, FP32, plus header and the 16-token footer
    assert weights_nbytes(PRESETS["21m"]) == 4 * (21_352_044 + 7_084_452)
    big = PRESETS["218m"]
    assert HEADER_SIZE + weights_nbytes(big) + footer_nbytes(16, big.vocab) == 1_091_938_316  # the original's file


def test_round_trip_tensors_golden_and_views(tiny_file):
    p, t, g = tiny_file
    f = read_spelw(p)
    assert f.cfg == TINY and f.flags == 1
    assert list(f.tensors) == [s.name for s in tensor_specs(TINY)]
    for k, v in t.items():
        assert f.tensors[k].dtype == np.float32 and np.array_equal(f.tensors[k], v)
        assert not f.tensors[k].flags.writeable      # views of the read-only map, not copies
        assert not f.tensors[k].flags.owndata
    assert np.array_equal(f.golden.tokens, g.tokens)
    assert np.array_equal(f.golden.target_logits, g.target_logits)
    assert np.array_equal(f.golden.draft_logits, g.draft_logits)
    assert os.path.getsize(p) == HEADER_SIZE + weights_nbytes(TINY) + footer_nbytes(16, 128)
    # tensors are contiguous in layout order right after the header
    off = HEADER_SIZE
    for s in tensor_specs(TINY):
        assert f.spans[s.name] == (off, off + s.nbytes)
        off += s.nbytes
    assert f.footer_offset == off
    assert read_header(p).cfg == TINY


def test_no_footer_file(tmp_path):
    p = tmp_path / "nf.spelw"
    write_spelw(p, TINY, tiny_tensors())
    f = read_spelw(p)
    assert f.golden is None and f.flags == 0
    assert os.path.getsize(p) == HEADER_SIZE + weights_nbytes(TINY)


def test_write_is_byte_deterministic_and_streams_from_callable(tmp_path, tiny_file):
    p, t, g = tiny_file
    q = tmp_path / "again.spelw"
    write_spelw(q, TINY, lambda spec: t[spec.name], g)
    assert q.read_bytes() == p.read_bytes()


def test_writer_failure_leaves_nothing(tmp_path):
    t = tiny_tensors()
    bad = dict(t)
    bad["layers.2.mlp.w2.weight"] = np.zeros((3, 3), np.float32)
    out = tmp_path / "out.spelw"
    with pytest.raises(ValueError, match="layers.2.mlp.w2.weight"):
        write_spelw(out, TINY, bad)
    assert os.listdir(tmp_path) == []
    # an existing file is left untouched by a failed rewrite
    write_spelw(out, TINY, t)
    before = out.read_bytes()
    with pytest.raises(ValueError):
        write_spelw(out, TINY, bad)
    assert out.read_bytes() == before and os.listdir(tmp_path) == ["out.spelw"]


def test_disk_full_write_leaves_no_temp_file(tmp_path, tiny_file):
    # A write error with data still buffered (disk full, file-size limit) used to make
    # abort()'s close() raise again before it could unlink the temp file.
    import resource
    import signal
    p, t, g = tiny_file
    size = p.stat().st_size
    out_dir = tmp_path / "full"
    out_dir.mkdir()
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    try:
        for limit in (HEADER_SIZE + 10, size // 2, size - 1000, size - 1):
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
            try:
                with pytest.raises(OSError):
                    write_spelw(out_dir / "x.spelw", TINY, t, g)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
            assert os.listdir(out_dir) == [], limit
    finally:
        signal.signal(signal.SIGXFSZ, old_handler)


def test_writer_rejects_missing_and_extra(tmp_path):
    t = tiny_tensors()
    t2 = dict(t)
    del t2["final_norm.weight"]
    with pytest.raises(ValueError, match="final_norm.weight"):
        write_spelw(tmp_path / "a", TINY, t2)
    t3 = dict(t, bogus=np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="bogus"):
        write_spelw(tmp_path / "b", TINY, t3)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- malformed input

def test_truncation_everywhere_names_tensor_and_offset(tiny_file, tmp_path):
    p, _, _ = tiny_file
    data = p.read_bytes()
    spans = read_spelw(p).spans
    q = tmp_path / "cut.spelw"
    for cut in (0, 3, 8, 40, 63):
        expect_error(rewrite(p, data[:cut], q), "truncated header", f"byte {cut}")
    specs = tensor_specs(TINY)
    for s in (specs[0], specs[7], specs[-1]):
        a, b = spans[s.name]
        for cut in (a, (a + b) // 2, b - 1):
            e = expect_error(rewrite(p, data[:cut], q), "truncated", s.name, f"byte {a}", f"ends at byte {cut}")
            assert e.offset == a and e.field == s.name
    end = spans[specs[-1].name][1]
    for cut in (end, end + 5, end + 12, len(data) - 1):
        expect_error(rewrite(p, data[:cut], q), "footer")


def test_bad_magic(tiny_file, tmp_path):
    p, _, _ = tiny_file
    data = bytearray(p.read_bytes())
    data[:8] = b"GGUF\x03\x00\x00\x00"
    e = expect_error(rewrite(p, bytes(data), tmp_path / "m"), "bad magic", "byte 0")
    assert e.field == "magic"
    expect_error(rewrite(p, b"hello", tmp_path / "short"), "bad magic")


def patched(p, tmp_path, offset, fmt, value, name="patched.spelw"):
    data = bytearray(p.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    return rewrite(p, bytes(data), tmp_path / name)


@pytest.mark.parametrize("field,offset,value,fragment", [
    ("d_model", 8, 0, "d_model=0"),
    ("n_layers", 12, 0, "n_layers=0"),
    ("n_draft", 40, 9, "n_draft=9"),
    ("n_draft", 40, 0, "n_draft=0"),
    ("vocab", 28, 0xFFFFFFFF, "vocab=4294967295"),
    ("d_model", 8, 1 << 21, "out of range"),
    ("head_dim", 20, 15, "must be even"),
])
def test_header_fields_out_of_range(tiny_file, tmp_path, field, offset, value, fragment):
    p, _, _ = tiny_file
    e = expect_error(patched(p, tmp_path, offset, "<I", value), fragment, f"byte {offset}")
    assert e.offset == offset


def test_draft_map_errors(tiny_file, tmp_path):
    p, _, _ = tiny_file   # n_draft = 2, draft_map = [0, 3, FF x6]
    expect_error(patched(p, tmp_path, 45, "<B", 0xFF), "draft_map[1]=0xFF", "byte 45")
    expect_error(patched(p, tmp_path, 46, "<B", 1), "draft_map[2]=1", "must be 0xFF", "byte 46")
    expect_error(patched(p, tmp_path, 44, "<B", 4), "draft_map[0]=4 out of range", "byte 44")


def test_float_and_flag_fields(tiny_file, tmp_path):
    p, _, _ = tiny_file
    expect_error(patched(p, tmp_path, 52, "<f", float("nan")), "rope_theta", "byte 52")
    expect_error(patched(p, tmp_path, 56, "<f", -1.0), "norm_eps", "byte 56")
    expect_error(patched(p, tmp_path, 60, "<I", 3), "flags", "byte 60")


def test_header_inconsistent_with_file_size(tiny_file, tmp_path):
    p, _, _ = tiny_file
    data = p.read_bytes()
    end = HEADER_SIZE + weights_nbytes(TINY)
    # flags cleared: the footer becomes trailing bytes, and the message says so
    q = patched(p, tmp_path, 60, "<I", 0)
    expect_error(q, "trailing bytes", "flags bit 0 is clear", f"byte {end}")
    # a header claiming a bigger model than the file holds
    q = patched(p, tmp_path, 24, "<I", 256)   # d_ff 128 -> 256
    expect_error(q, "truncated")
    # extra garbage after a footer-less file
    q = tmp_path / "extra.spelw"
    write_spelw(q, TINY, tiny_tensors())
    q.write_bytes(q.read_bytes() + b"\0" * 7)
    expect_error(q, "7 trailing bytes", f"byte {end}")
    del data


def test_bad_footer(tiny_file, tmp_path):
    p, _, _ = tiny_file
    end = HEADER_SIZE + weights_nbytes(TINY)
    data = bytearray(p.read_bytes())
    data[end:end + 8] = b"SPELV002"
    expect_error(rewrite(p, bytes(data), tmp_path / "fm"), "bad footer magic", f"byte {end}")
    for n, frag in ((0, "n=0 out of range"), (17, "n=17"), (15, "n=15"), (0xFFFFFFFF, "out of range")):
        expect_error(patched(p, tmp_path, end + 8, "<I", n), frag, f"byte {end + 8}")
    # a golden token outside the vocabulary
    expect_error(patched(p, tmp_path, end + 12 + 4 * 5, "<I", 128), "golden token 128", "golden.tokens[5]",
                 f"byte {end + 12 + 20}")


def test_huge_claims_allocate_nothing(tmp_path):
    # header claims the largest allowed dims in a 64-byte file: rejected from sizes alone
    cfg = ModelConfig(d_model=LIMITS["d_model"], n_layers=LIMITS["n_layers"], n_heads=MAX_INNER // 64, head_dim=64,
                      d_ff=LIMITS["d_ff"], vocab=LIMITS["vocab"], max_seq=16, draft_map=(0,))
    q = tmp_path / "huge.spelw"
    q.write_bytes(header_bytes(cfg, 1))
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="truncated"):
            read_spelw(q)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak


def test_missing_file_is_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read"):
        read_spelw(tmp_path / "nope.spelw")


def test_golden_check_on_write(tmp_path):
    g = tiny_golden()
    g.tokens = g.tokens.copy()
    g.tokens[0] = 999
    with pytest.raises(CheckpointError, match="golden"):
        write_spelw(tmp_path / "g.spelw", TINY, tiny_tensors(), g)
    assert os.listdir(tmp_path) == []
    assert FOOTER_MAGIC == b"SPELV001"


def test_released_pages_read_back_unchanged(tiny_file):
    p, t, _ = tiny_file
    f = read_spelw(p)
    pd = f.page_dropping_tensors()
    for name in t:                       # each lookup drops the previous tensor's pages
        assert np.array_equal(pd[name], t[name])
    f.release(0, f.file_size)
    for name in t:                       # views stay valid: pages fault back in
        assert np.array_equal(f.tensors[name], t[name])
    assert len(pd) == len(t) and list(pd) == list(t)

"""The governor's store across processes: round trips, what it ignores (stale, another
version, a corrupt file), its bound, and a fresh load's first call starting from it."""
import json
import os
import time

import pytest

import spel_mlx
from spel_mlx.config import ModelConfig
from spel_mlx.decoding import governor_store as gs
from spel_mlx.decoding.governor import GovernorMemory

USELESS = GovernorMemory(ar_seconds=0.002, useless=True, backoff_left=64, failures=2, accepted=0, proposed=48)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEL_GOVERNOR_STORE", "1")
    monkeypatch.setenv("SPEL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / gs.FILE


def test_round_trip_and_what_is_ignored(store, monkeypatch):
    k = gs.key("/no/such/model", "c", 4, False)
    assert gs.recall(k) is None                         # nothing stored yet
    gs.remember(k, USELESS)
    assert store.exists() and gs.recall(k) == USELESS
    assert gs.recall(gs.key("/no/such/model", "c", 4, True)) is None     # sampled is its own entry
    gs.remember(k, GovernorMemory(ar_seconds=None))     # no AR time learned: nothing to keep
    assert gs.recall(k) == USELESS
    data = json.loads(store.read_text())
    data["entries"][k]["saved"] = time.time() - gs.MAX_AGE_S - 1
    store.write_text(json.dumps(data))
    assert gs.recall(k) is None                         # stale
    gs.remember(k, USELESS)
    monkeypatch.setattr(gs, "_version", lambda: "0.0.0-other")
    assert gs.recall(k) is None                         # another spel_mlx version
    monkeypatch.undo()
    monkeypatch.setenv("SPEL_GOVERNOR_STORE", "1")
    monkeypatch.setenv("SPEL_CACHE_DIR", str(store.parent))
    for junk in ("{not json", "[]", json.dumps({"format": 99, "entries": {}}),
                 json.dumps({"format": gs.FORMAT, "entries": {k: {"memory": {"ar_seconds": "x"}}}})):
        store.write_text(junk)
        assert gs.recall(k) is None
    gs.remember(k, USELESS)                             # a bad file is replaced on the next write
    assert gs.recall(k) == USELESS


ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
stepping\t: 1
cache size\t: 512 KB
flags\t\t: fpu avx2

processor\t: 1
model\t\t: 99
"""


def test_the_cpu_key_tells_apart_cpus_that_share_a_model_name():
    """Two EPYC generations both call themselves "AMD EPYC": the key holds family, model,
    stepping and cache size (the first processor's), and the usable CPUs."""
    zen3 = gs._cpu(ZEN3)
    zen4 = gs._cpu(ZEN3.replace("model\t\t: 1\n", "model\t\t: 17\n").replace("512 KB", "1024 KB"))
    assert zen3.startswith("model name=AMD EPYC, cpu family=25, model=1, stepping=1, cache size=512 KB, ")
    assert zen3.endswith(" cpus") and "model=99" not in zen3
    assert zen4 != zen3 and "model=17" in zen4
    assert gs._cpu("") == gs._cpu("garbage without fields") != ""


def test_bounded_and_off(store, monkeypatch):
    for i in range(gs.MAX_ENTRIES + 5):
        gs.remember(f"key {i}", USELESS)
    entries = json.loads(store.read_text())["entries"]
    assert len(entries) == gs.MAX_ENTRIES and "key 0" not in entries and f"key {gs.MAX_ENTRIES + 4}" in entries
    monkeypatch.setenv("SPEL_GOVERNOR_STORE", "0")
    assert gs.recall(f"key {gs.MAX_ENTRIES + 4}") is None
    os.remove(store)
    gs.remember("x", USELESS)
    assert not store.exists()


def test_an_unwritable_store_is_left_alone(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPEL_GOVERNOR_STORE", "1")
    monkeypatch.setenv("SPEL_CACHE_DIR", str(blocker / "sub"))     # a folder under a file
    gs.remember("k", USELESS)                                       # no exception
    assert gs.recall("k") is None


@pytest.fixture
def random_checkpoint(tmp_path):
    from spel_mlx.checkpoints import write_spelw
    from spel_mlx.model import init_weights
    cfg = ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=32, d_ff=96, vocab=128, max_seq=512,
                      draft_map=(0, 3)).validate()
    path = tmp_path / "random.spelw"
    write_spelw(str(path), cfg, init_weights(cfg, seed=3))
    return str(path)


def _proposed(model, tok, n):
    *_, last = spel_mlx.stream_generate(model, tok, "It was", max_tokens=n, temperature=0, draft="mlx")
    return last.stats["proposed"] + last.stats.get("shadow_proposed", 0)   # verified or not


def test_a_fresh_load_starts_from_the_stored_verdict(store, random_checkpoint):
    """A stored "useless" verdict for this checkpoint and draft: the first call of a new
    load drafts nothing; without it (negative control) the first call probes."""
    model, tok = spel_mlx.load(random_checkpoint)
    try:
        assert _proposed(model, tok, 24) > 0            # nothing stored: the governor probes
    finally:
        model.close()
    data = json.loads(store.read_text())                # ... and the call left its memory
    (k, e), = data["entries"].items()
    assert os.path.abspath(random_checkpoint) in k and "greedy" in k and e["memory"]["ar_seconds"] > 0
    gs.remember(k, USELESS)
    model, tok = spel_mlx.load(random_checkpoint)
    try:
        assert _proposed(model, tok, 24) == 0
    finally:
        model.close()

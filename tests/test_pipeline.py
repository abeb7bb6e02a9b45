"""The target split across processes (spel_mlx.distributed).

In-process: the layer split against a brute force, stages composed in one process
against the whole model (bit for bit, fast and strict), and which tensors a stage
reads.  Launched on 127.0.0.1 (ring backend): 2 and 3 ranks decode the same tokens
as one process in every mode (greedy equal to AR, sampled equal for the seed), the
CLI under mlx.launch, and a rank that dies, hangs, fails to load or loads another
model ends every rank with an error naming it.
"""
import io
import itertools
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

import spel_mlx  # noqa: F401
from spel_mlx.distributed.launch import launch_command, start_ranks

TINY = "d_model=32,n_layers=4,n_heads=2,head_dim=16,d_ff=64,vocab=128,max_seq=4096,draft_map=0:3"
PROMPT = "the cat sat on the mat. the cat"
TIMEOUT = 120          # a launch that takes longer hangs


def tiny_config(overrides=TINY):
    from spel_mlx.config import resolve_config
    return resolve_config(overrides=overrides, use_env=False)


def write_tiny(path, seed=5, overrides=TINY):
    from spel_mlx.checkpoints import write_spelw
    from spel_mlx.model import init_weights
    cfg = tiny_config(overrides)
    w = init_weights(cfg, seed=seed)
    for j, src in enumerate(cfg.draft_map):     # a draft close to its target: proposals get accepted
        for name in list(w):
            if name.startswith(f"layers.{src}."):
                w["draft." + name.replace(f"layers.{src}.", f"layers.{j}.", 1)] = w[name].copy()
    write_spelw(str(path), cfg, w)
    return cfg, w


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe") / "tiny.spelw"
    write_tiny(path)
    return path


# --- the split ------------------------------------------------------------------------

def test_split_is_the_best_contiguous_split_by_bytes():
    from spel_mlx.distributed.split import _head_nbytes, layer_nbytes, split_layers
    for over in (TINY, "d_model=64,n_layers=7,n_heads=2,head_dim=16,d_ff=96,vocab=512,attn_period=3,draft_map=0:2",
                 "d_model=32,n_layers=5,n_heads=2,head_dim=16,d_ff=64,vocab=4096,draft_map=0"):
        cfg = tiny_config(over)
        L = cfg.n_layers
        w = [layer_nbytes(cfg, i) for i in range(L)]
        w[0] += cfg.vocab * cfg.d_model * 4
        w[-1] += _head_nbytes(cfg)
        for P in range(1, L + 1):
            stages = split_layers(cfg, P)
            assert [s.rank for s in stages] == list(range(P))
            assert stages[0].start == 0 and stages[-1].end == L
            assert all(a.end == b.start for a, b in zip(stages, stages[1:]))
            assert all(s.end > s.start and s.nbytes == sum(w[s.start:s.end]) for s in stages)
            best = min(max(sum(w[a:b]) for a, b in zip((0,) + cuts, cuts + (L,)))
                       for cuts in itertools.combinations(range(1, L), P - 1))
            assert max(s.nbytes for s in stages) == best
        with pytest.raises(ValueError, match="needs 1"):
            split_layers(cfg, L + 1)


def test_stage_tensors_partition_the_target():
    from spel_mlx import layout
    from spel_mlx.distributed.split import split_layers, stage_tensor_names
    cfg = tiny_config()
    for P in (1, 2, 3, 4):
        names = [n for s in split_layers(cfg, P) for n in stage_tensor_names(cfg, s)]
        assert sorted(names) == sorted(s.name for s in layout.target_specs(cfg))


def test_a_stage_too_large_for_its_process_is_refused_naming_it():
    from spel_mlx.checkpoints.rules import implied_memory
    from spel_mlx.distributed.pipeline import check_stage_memory
    from spel_mlx.distributed.split import split_layers
    from spel_mlx.loading import LoadError
    cfg = tiny_config()
    first, last = split_layers(cfg, 2)
    draft = implied_memory(cfg)["C draft"]
    check_stage_memory(cfg, first, have=first.nbytes + draft)         # exactly enough
    check_stage_memory(cfg, last, have=last.nbytes)
    with pytest.raises(LoadError, match=r"rank 0's stage \(layers 0..1\) needs about"):
        check_stage_memory(cfg, first, have=first.nbytes + draft - 1)  # the draft counts on rank 0
    with pytest.raises(LoadError, match=r"rank 1's stage \(layers 2..3\)"):
        check_stage_memory(cfg, last, have=last.nbytes - 1)


# --- stages in one process --------------------------------------------------------------

def load_stages(path, P, recorded=None):
    from spel_mlx.distributed.split import split_layers
    from spel_mlx.distributed.stage import CheckpointTensors, StageModel
    from spel_mlx.model import select
    stages = []
    for s in split_layers(tiny_config(), P):
        t = CheckpointTensors(str(path))
        if recorded is not None:
            get, seen = t.get, recorded.setdefault(s.rank, [])
            t.get = lambda name, get=get, seen=seen: seen.append(name) or get(name)
        m = StageModel(t.cfg, s)
        m.load_stage_weights(t)
        m.set_ops(select())
        stages.append(m)
    return stages


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("strict", [False, True])
def test_stages_in_sequence_give_the_whole_models_bits(tiny, P, strict):
    from spel_mlx.reader import load_checkpoint
    from spel_mlx.model import SpelModel, select
    ck = load_checkpoint(str(tiny))
    full = SpelModel.from_weights(ck.cfg, ck.weights)
    full.set_ops(select())
    stages = load_stages(tiny, P)
    ref_state = full.new_state(ring=16)
    states = [m.new_state(ring=16) for m in stages]
    rng = np.random.default_rng(1)
    for rnd in range(8):
        toks = rng.integers(0, 128, size=rnd % 5 + 1).tolist()
        ref = full.forward(toks, ref_state, strict=strict)
        x = toks
        for m, st in zip(stages, states):
            x = m.forward(x, st, strict=strict)
        assert np.array_equal(np.array(ref), np.array(x)), (rnd, strict)
        for st in [ref_state] + states:        # keep some rows, or none
            st.commit(len(toks) - rnd % 2) if len(toks) - rnd % 2 else st.discard()


def test_a_stage_reads_only_its_tensors(tiny, tmp_path):
    from spel_mlx.converters import spelw_to_safetensors
    from spel_mlx.distributed.split import split_layers, stage_tensor_names
    folder = tmp_path / "st"
    spelw_to_safetensors(str(tiny), str(folder), dtype="F16")
    cfg = tiny_config()
    for path in (tiny, folder):
        seen = {}
        load_stages(path, 3, seen)
        for s in split_layers(cfg, 3):
            assert sorted(seen[s.rank]) == sorted(stage_tensor_names(cfg, s))


# --- launched pipelines ------------------------------------------------------------------

def single_process(path, requests):
    from spel_mlx.api import load
    from spel_mlx.distributed.batch import run_request
    model, tok = load(str(path))
    try:
        return [run_request(model, tok, spec)["tokens"] for spec in requests]
    finally:
        model.close()


def pipelined(n, path, requests, tmp_path):
    reqs = tmp_path / f"reqs{n}.json"
    reqs.write_text(json.dumps(requests))
    cmd = launch_command(n, ["-m", "spel_mlx.distributed", "--checkpoint", str(path), "--requests", str(reqs)])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert [ln["index"] for ln in lines] == list(range(len(requests))), p.stdout + p.stderr
    return lines


def needs_c_draft():
    from spel_mlx.native import clib
    if not clib.available():
        pytest.skip("the C draft is not built")


GREEDY = dict(prompt=PROMPT, max_tokens=40, temperature=0)
SAMPLED = dict(prompt=PROMPT, max_tokens=40, temperature=0.8, top_p=0.9, seed=11)
# raw speculation where a row checks that the draft got tokens accepted (a timed governor may not draft)
MODES = [dict(GREEDY, mode="ar"), dict(GREEDY, mode="spec", draft="c", governor="off"), dict(GREEDY, mode="governed", draft="c"),
         dict(GREEDY, mode="spec", draft="ngram", k=3), dict(GREEDY, mode="spec", draft="c", strict=True),
         dict(SAMPLED, mode="ar"), dict(SAMPLED, mode="spec", draft="c", accept="residual"),
         dict(SAMPLED, mode="spec", draft="c", accept="coupled"), dict(SAMPLED, mode="spec", draft="ngram")]


def test_two_ranks_decode_as_one_process(tiny, tmp_path):
    needs_c_draft()
    lines = pipelined(2, tiny, MODES, tmp_path)
    ref = single_process(tiny, MODES)
    got = [ln["tokens"] for ln in lines]
    assert got == ref
    assert all(toks == ref[0] for toks, spec in zip(got, MODES) if spec["temperature"] == 0)
    assert len(ref[0]) == 40 and lines[1]["stats"]["accepted"] > 0      # the draft did get tokens accepted
    for ln, spec in zip(lines, MODES):
        ranks = ln["ranks"]
        assert len(ranks) == 2
        rounds = ln["stats"]["rounds"]
        # one RUN per round reaches every rank (plus --stats-free requests: no calibration)
        assert [r["runs"] for r in ranks] == [rounds, rounds], spec
        assert ranks[0]["rows"] == ranks[1]["rows"] == rounds + ln["stats"]["proposed"]


def test_three_ranks_of_the_shipped_model_decode_as_one_process(tmp_path):
    needs_c_draft()
    from spel_mlx.checkpoints import default_checkpoint_dir
    path = default_checkpoint_dir()
    requests = [dict(prompt="It is a truth", max_tokens=24, temperature=0, mode="ar"),
                dict(prompt="It is a truth", max_tokens=24, temperature=0, mode="spec", draft="c"),
                dict(prompt="It is a truth", max_tokens=24, temperature=0.7, seed=3, mode="spec", draft="c")]
    got = [ln["tokens"] for ln in pipelined(3, path, requests, tmp_path)]
    ref = single_process(path, requests)
    assert got == ref and got[0] == got[1]


def test_the_cli_under_mlx_launch(tiny):
    needs_c_draft()
    from spel_mlx.cli import generate as gen
    argv = ["--checkpoint", str(tiny), "--prompt", PROMPT, "--max-tokens", "30", "--temperature", "0"]
    out, err = io.StringIO(), io.StringIO()
    assert gen.run(argv + ["--mode", "ar"], stdout=out, stderr=err) == 0, err.getvalue()
    p = subprocess.run(launch_command(2, ["-m", "spel_mlx.generate", "--pipeline", "--stats"] + argv),
                       capture_output=True, timeout=TIMEOUT)      # bytes: the text holds "\r"
    assert p.returncode == 0, p.stderr
    assert p.stdout == out.getvalue().encode()
    stats = json.loads([ln for ln in p.stderr.decode().splitlines() if ln.startswith("{")][0])
    assert stats["pipeline"]["ranks"] == 2 and stats["pipeline"]["layers"] == [[0, 2], [2, 4]]
    # every round's RUN, and --stats' calibration (warm-up and reps, each discarded), reached both ranks
    from inspect import signature
    from spel_mlx.decoding import SpeculativeDecoder
    calibration = signature(SpeculativeDecoder._calibrate_ar).parameters["reps"].default + 1
    assert [r["runs"] for r in stats["pipeline"]["per_rank"]] == [stats["rounds"] + calibration] * 2
    bad = subprocess.run(launch_command(2, ["-m", "spel_mlx.generate", "--pipeline", "--draft", "mlx"] + argv),
                         capture_output=True, text=True, timeout=TIMEOUT)
    # every rank refuses the flags; mlx.launch itself exits 0 whatever its ranks do, it
    # reports their codes (and ends the other ranks once one failed)
    assert "--pipeline drafts with the C draft or n-gram" in bad.stderr
    assert "exited with code 2" in bad.stderr


def ranks(tmp_path, n, requests, args_of_rank=None, env=None):
    reqs = tmp_path / "reqs.json"
    reqs.write_text(json.dumps(requests))
    base = ["-m", "spel_mlx.distributed", "--requests", str(reqs)]
    return start_ranks(n, lambda r: base + args_of_rank(r), str(tmp_path / "hosts.json"), env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs, timeout=30):
    """(returncode, stderr) of each; a rank still running after `timeout` s is a hang."""
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank still runs {timeout} s later: it hangs")
        out.append((p.returncode, err))
    return out


LONG = [dict(prompt=PROMPT, max_tokens=4, temperature=0, mode="ar"),
        dict(prompt=PROMPT, max_tokens=4000, temperature=0, mode="ar")]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_rank_that_dies_or_hangs_ends_the_others(tiny, tmp_path, sig):
    env = dict(os.environ, SPEL_PIPELINE_TIMEOUT="3")
    procs = ranks(tmp_path, 3, LONG, lambda r: ["--checkpoint", str(tiny)], env)
    first = procs[0].stdout.readline()           # the short request is done: the long one starts
    assert json.loads(first)["index"] == 0, finish(procs)
    os.kill(procs[1].pid, sig)                   # (during the long request or before it starts)
    try:
        results = finish([procs[0], procs[2]])
    finally:
        procs[1].kill()
        procs[1].wait()
    for code, err in results:
        assert code == 1, err
        if sig == signal.SIGKILL:
            assert "lost rank" in err, err
        else:
            assert "nothing for 3 s" in err or "lost rank" in err, err
    if sig == signal.SIGSTOP:   # the ranks next to the stopped one time out; rank 0 says so
        assert "pipeline rank 0: nothing for 3 s while" in results[0][1]


IDLE_DRIVER = """
import sys, time
from spel_mlx.api import prepare
from spel_mlx.distributed import open_pipeline, serve
pipe = open_pipeline(sys.argv[1])
if pipe.rank:
    serve(pipe)
    sys.exit(0)
for i in range(2):
    req = prepare(pipe.loaded, pipe.tokenizer, "the cat", 8, temperature=0, mode="spec", draft="ngram")
    req.run()
    print(req.stats["tokens"], flush=True)
    pings = pipe.pings + int(sys.argv[2])        # idle until the keepalive has pinged that often
    while pipe.pings < pings:
        time.sleep(0.05)
pipe.loaded.close()
print(len(pipe.final_stats), flush=True)
"""


def test_an_idle_rank_0_keeps_the_others_waiting(tiny, tmp_path):
    """Rank 0 idles between requests for longer than the timeout: its keepalive pings
    keep the other ranks from taking it for hung.  Idle is counted in pings, not seconds
    (a ping follows a quarter timeout of silence, so 6 of them span 1.5 timeouts), and
    the timeout leaves a loaded machine room to schedule them."""
    driver = tmp_path / "idle.py"
    driver.write_text(IDLE_DRIVER)
    env = dict(os.environ, SPEL_PIPELINE_TIMEOUT="3")
    procs = start_ranks(2, lambda r: [str(driver), str(tiny), "6"], str(tmp_path / "hosts.json"), env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    for p in procs:
        o, e = p.communicate(timeout=TIMEOUT)
        out.append((p.returncode, o, e))
    assert [c for c, _, _ in out] == [0, 0], out
    assert out[0][1].split() == ["8", "8", "2"]


def test_ranks_agree_on_the_model_or_stop(tiny, tmp_path):
    other = tmp_path / "other.spelw"
    write_tiny(other, seed=6)
    cases = (([tiny, other], "pipeline rank 1 loaded another model than rank 0 (differs in checksum)", 1),
             ([tiny, tmp_path / "missing.spelw"], "pipeline rank 1 could not load its stage", 2))
    for paths, msg, rank1_code in cases:
        procs = ranks(tmp_path, 2, LONG[:1], lambda r: ["--checkpoint", str(paths[r])])
        (c0, e0), (c1, e1) = finish(procs)
        assert c0 == 1 and msg in e0, e0
        assert c1 == rank1_code, e1      # the missing file: rank 1's own error, a usage error

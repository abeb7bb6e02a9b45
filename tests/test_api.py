"""The Python API (spel_mlx.load / generate / stream_generate): the same tokens as the
engine, per-round origins that add up to the engine's counts, stop strings, seeds,
errors that name the parameter, cancellation, and one generation at a time."""
import subprocess
import sys
import threading

import pytest

import spel_mlx
from spel_mlx.decoding import SpeculativeDecoder
from spel_mlx.api import GenerationError, LoadError, load, prepare
from spel_mlx.api.text import Detokenizer, StopStrings

PROMPT = "Elizabeth was"


@pytest.fixture(scope="module")
def shipped():
    model, tok = load()
    yield model, tok
    model.close()


def ar_tokens(model, tok, prompt, n):
    return SpeculativeDecoder(model.model, None, "ar", k=4).generate(tok.encode(prompt), n)


def test_import_is_cheap_and_exports_lazily():
    code = ("import sys, spel_mlx; assert 'spel_mlx.api' not in sys.modules and 'mlx.core' not in sys.modules; "
            "assert spel_mlx.generate.__module__ == 'spel_mlx.api.generation'; "
            "assert set(spel_mlx.__all__) >= {'load', 'generate', 'stream_generate'}; "
            "import importlib; cli = importlib.import_module('spel_mlx.cli.generate'); "
            "assert callable(cli.main) and spel_mlx.generate.__module__ == 'spel_mlx.api.generation'; "
            "from spel_mlx import generate; assert generate is spel_mlx.generate\n"
            "try: importlib.import_module('spel_mlx.generate')\n"
            "except ImportError as e: assert 'API function' in str(e)\n"
            "else: raise AssertionError('imported the command shim')\n"
            "assert spel_mlx.generate.__module__ == 'spel_mlx.api.generation'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
    with pytest.raises(AttributeError):
        spel_mlx.no_such_name


def test_greedy_text_is_the_engines(shipped):
    model, tok = shipped
    want = ar_tokens(model, tok, PROMPT, 40)
    for opts in ({"mode": "ar"}, {}, {"draft": "mlx"}, {"draft": "ngram", "k": 6}, {"mode": "governed"}):
        responses = list(spel_mlx.stream_generate(model, tok, PROMPT, 40, rounds=True, temperature=0, **opts))
        tokens = [t for r in responses for t in r.tokens]
        assert tokens == want, opts
        text = "".join(r.text for r in responses)
        assert text == "".join(t for r in responses for t in r.token_text)
        assert spel_mlx.generate(model, tok, PROMPT, max_tokens=40, temperature=0, **opts) == text
        full, head = tok.decode(tok.encode(PROMPT) + want), tok.decode(tok.encode(PROMPT))
        assert full == head + text


def test_rounds_report_draft_and_correction(shipped):
    model, tok = shipped
    responses = list(spel_mlx.stream_generate(model, tok, PROMPT, 60, rounds=True, temperature=0))
    *rounds, last = responses
    st = last.stats
    assert last.finish_reason == "length" and st["stop_reason"] == "max_tokens" and st["tokens"] == 60
    assert len(rounds) == st["rounds"] and last.round == st["rounds"]
    assert sum(r.proposed for r in rounds) == st["proposed"]
    assert sum(sum(r.from_draft) for r in rounds) == st["accepted"] > 0
    for r in rounds:   # accepted proposals first, then the target's token
        a = sum(r.from_draft)
        assert r.from_draft == [True] * a + [False] and a <= r.proposed
    assert [r.generation_tokens for r in rounds] == list(
        __import__("itertools").accumulate(len(r.tokens) for r in rounds))
    assert last.alpha == pytest.approx(st["alpha"], abs=1e-4) and last.tok_s > 0
    ar = list(spel_mlx.stream_generate(model, tok, PROMPT, 5, rounds=True, temperature=0, mode="ar"))
    assert [r.from_draft for r in ar[:-1]] == [[False]] * 5 and ar[-1].stats["proposed"] == 0
    # the oracle (the target as its own draft, strict) has every proposal accepted
    oracle = list(spel_mlx.stream_generate(model, tok, PROMPT, 21, rounds=True, temperature=0, mode="oracle", strict=True))
    assert [r.from_draft for r in oracle[:-1]] == [[True] * 4 + [False]] * 4 + [[False]]


def test_seed_reproducible(shipped):
    model, tok = shipped
    a = spel_mlx.generate(model, tok, PROMPT, max_tokens=40, seed=3)
    assert spel_mlx.generate(model, tok, PROMPT, max_tokens=40, seed=3) == a
    assert spel_mlx.generate(model, tok, PROMPT, max_tokens=40, seed=4) != a


def test_stop_strings_end_the_text(shipped):
    model, tok = shipped
    full = spel_mlx.generate(model, tok, PROMPT, max_tokens=40, temperature=0)
    for stop in (full[7:10], full[-3:], full[:2]):
        cut = full[:full.index(stop)]
        responses = list(spel_mlx.stream_generate(model, tok, PROMPT, 40, rounds=True, temperature=0, stop=["@@", stop]))
        assert "".join(r.text for r in responses) == cut
        assert responses[-1].finish_reason == "stop" and responses[-1].stats["stop_reason"] == "stop_string"
        assert responses[-1].generation_tokens == responses[-1].stats["tokens"] < 40


def test_stop_strings_unit():
    s = StopStrings(["END", "xy"])
    assert s.feed([[1, "ab", True], [2, "cE", False]]) == [[1, "ab", True]]    # "cE" may start END
    assert s.feed([[3, "N", True]]) == []                                       # "EN" still may
    assert s.feed([[4, "Dzz", False]]) == [[2, "c", False]] and s.hit           # cut inside a piece
    assert s.feed([[5, "more", False]]) == [] and s.flush() == []
    s = StopStrings(["xy"])
    assert s.feed([[1, "ax", False]]) == [] and s.flush() == [[1, "ax", False]]
    s = StopStrings([])
    assert s.feed([[1, "END", False]]) == [[1, "END", False]]


@pytest.mark.parametrize("kind", ["bytes", "sentencepiece"])
def test_detokenizer_equals_one_shot_decode(kind):
    """Token by token, the text adds up to decoding everything at once (after the same
    prompt), and an incomplete UTF-8 sequence is held back, never shown as U+FFFD."""
    from spel_mlx.tokenizer import DEFAULT_SP_MODEL, ByteTokenizer, SentencePieceTokenizer
    if kind == "bytes":
        tok = ByteTokenizer()
        text = "It is a truth universally acknowledged, that a single man"
    else:
        tok = SentencePieceTokenizer(DEFAULT_SP_MODEL)
        text = " Café naïve — “quoted” ünïcödé words, 3½ times, and the LORD spake\nnew line"
    prompt = tok.encode("Once upon a time")
    ids = tok.encode(text)
    d = Detokenizer(tok, prompt)
    pieces = [d.push(t) for t in ids]
    assert not any("\ufffd" in p for p in pieces)
    anchor = prompt[-Detokenizer.ANCHOR:]
    one_shot = tok.decode(anchor + ids)[len(tok.decode(anchor)):]
    assert "".join(pieces) + d.flush() == one_shot
    assert one_shot.strip() == tok.decode(ids).strip()
    if kind == "sentencepiece":
        assert "" in pieces        # a character spread over byte tokens waits for its last byte


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"seed": -2}, "seed"), ({"k": 0}, "k"),
    ({"k": 17}, "k"), ({"mode": "fast"}, "mode"), ({"draft": "big"}, "draft"), ({"draft_threads": 9}, "draft_threads"),
    ({"draft_ahead": "maybe"}, "draft_ahead"), ({"draft_context": -5}, "draft_context"),
    ({"draft_context": 1.5}, "draft_context"), ({"max_tokens": -2}, "max_tokens"), ({"stop": [""]}, "stop"),
    ({"prompt": ""}, "prompt"), ({"prompt": "a " * 5000}, "prompt"), ({"prompt": [5000]}, "prompt"),
    ({"mode": "forced"}, "forced_alpha"),
    # wrong types (issue 36): each names its parameter, never a TypeError from deep inside
    ({"temperature": "0.5"}, "temperature"), ({"top_p": "0.9"}, "top_p"), ({"top_k": 2.0}, "top_k"),
    ({"top_k": True}, "top_k"), ({"seed": True}, "seed"), ({"repetition_penalty": "x"}, "repetition_penalty"),
    ({"temperature": 10 ** 400}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"draft": 5}, "draft"), ({"governor": "cost"}, "governor"), ({"stop": 5}, "stop"), ({"stop": [5]}, "stop"),
    ({"strict": "yes"}, "strict"), ({"max_tokens": 1.0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"prompt": "a\ud800b"}, "prompt"), ({"prompt": [1.0, 2]}, "prompt"), ({"prompt": ["1", "2"]}, "prompt"),
    ({"prompt": [True, 5]}, "prompt"), ({"prompt": b"ab"}, "prompt"), ({"prompt": None}, "prompt"),
    ({"prompt": [[1, 2]]}, "prompt"), ({"prompt": __import__("numpy").array([1.5])}, "prompt"),
    ({"no_such_option": 1}, "no_such_option"), ({"sampler": 3}, "sampler"),
    ({"logits_processors": lambda t, x: x}, "logits_processors"),
    ({"sampler": lambda x: x, "temperature": 0.5}, "temperature"), ({"num_draft_tokens": "2"}, "num_draft_tokens"),
    ({"num_draft_tokens": 2, "k": 3}, "num_draft_tokens"), ({"draft_model": "big"}, "draft_model"),
    ({"draft_model": "mlx", "draft": "c"}, "draft_model"), ({"draft_model": 3.5}, "draft_model"),
    ({"max_kv_size": 512}, "max_kv_size"), ({"kv_bits": 4}, "kv_bits"), ({"prompt_cache": []}, "prompt_cache"),
    ({"input_embeddings": [0.5]}, "input_embeddings"), ({"prefill_step_size": 0}, "prefill_step_size"),
    ({"logprobs": "yes"}, "logprobs"), ({"prompt_progress_callback": 3}, "prompt_progress_callback"),
])
def test_bad_arguments_name_the_parameter(shipped, kwargs, param):
    model, tok = shipped
    kwargs = {"prompt": PROMPT, **kwargs}
    with pytest.raises(GenerationError) as e:
        prepare(model, tok, **kwargs)
    assert e.value.param == param, str(e.value)


def test_load_errors(tmp_path):
    with pytest.raises(LoadError, match="checkpoint.*no such file"):
        load(tmp_path / "missing.spelw")
    bad = tmp_path / "bad.spelw"
    bad.write_bytes(b"SPELW001" + b"\0" * 10)
    with pytest.raises(LoadError, match="checkpoint"):
        load(bad)
    with pytest.raises(LoadError, match="config"):
        load(None, config="d_model=64")


def test_cancel_between_rounds(shipped):
    model, tok = shipped
    seen = []
    last = prepare(model, tok, PROMPT, 3000, temperature=0).run(
        on_response=seen.append, should_stop=lambda: len(seen) >= 3)
    assert last.finish_reason == "cancelled" and last.stats["stop_reason"] == "cancelled"
    assert last.round == 3 and len(seen) == 4
    req = prepare(model, tok, PROMPT, 3000, temperature=0)
    stream = req.stream()
    first = [next(stream), next(stream)]
    stream.close()                   # returns once the decoding let go of the model
    assert not model.lock.locked() and req.stats["stop_reason"] == "cancelled"
    assert first[1].generation_tokens <= req.stats["tokens"] < 3000


def test_a_finished_call_frees_its_state_without_the_garbage_collector(shipped):
    """The decoder's last call kept the caller's round callback, which reaches back to
    the request holding the decoder: a cycle that held the call's ring and KV caches
    until a collection, so every call took fresh memory."""
    import gc
    import weakref
    model, tok = shipped
    gc.collect()
    gc.disable()
    try:
        for opts in ({}, {"temperature": 0}, {"mode": "ar"}):
            req = prepare(model, tok, PROMPT, 24, **opts)
            req.run()
            decoder = weakref.ref(req.decoding.decoder)
            state = weakref.ref(req.decoding.decoder.target.state)
            del req
            assert decoder() is None and state() is None, opts
    finally:
        gc.enable()


def test_one_generation_at_a_time(shipped):
    model, tok = shipped
    want = {s: spel_mlx.generate(model, tok, PROMPT, max_tokens=48, seed=s) for s in (1, 2, 3, 4)}
    got = {}
    threads = [threading.Thread(target=lambda s=s: got.__setitem__(s, spel_mlx.generate(model, tok, PROMPT, max_tokens=48, seed=s)))
               for s in want]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_default_draft_rule():
    from spel_mlx.api.engine import default_draft
    from spel_mlx.decoding.sampling import GREEDY, SamplingParams
    from spel_mlx.native import clib
    model_draft = "c" if clib.available() else "mlx"
    assert default_draft("spec", GREEDY) == "auto"
    assert default_draft("spec", SamplingParams(repetition_penalty=1.1)) == model_draft   # greedy with a penalty
    assert default_draft("spec", SamplingParams(temperature=0.7)) == model_draft
    assert default_draft("governed", GREEDY) == model_draft


class _EotTokenizer:
    """The shipped tokenizer with one of its ids standing in for the end-of-text piece."""

    def __init__(self, tok, eot_id):
        self._tok, self.eot_id = tok, eot_id

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.mark.parametrize("opts", [{"mode": "ar"}, {}, {"temperature": 0.7, "seed": 3},
                                  {"temperature": 0.7, "seed": 3, "mode": "ar"}])
def test_generation_ends_on_the_end_of_text_token(shipped, opts):
    """Every mode stops right after the target's first end-of-text token: finish reason
    "stop", stop_reason "end_of_text", the same tokens as the run without it cut there."""
    model, tok = shipped
    kw = {"temperature": 0, **opts}
    free = [t for r in spel_mlx.stream_generate(model, tok, PROMPT, 40, rounds=True, **kw) for t in r.tokens]
    eot = free[9]
    responses = list(spel_mlx.stream_generate(model, _EotTokenizer(tok, eot), PROMPT, 40, rounds=True, **kw))
    tokens = [t for r in responses for t in r.tokens]
    assert tokens == free[:free.index(eot) + 1]
    assert responses[-1].finish_reason == "stop" and responses[-1].stats["stop_reason"] == "end_of_text"
    # a token the target never emits leaves the run as it was (negative control)
    unused = next(i for i in range(tok.vocab_size) if i not in free)
    again = [t for r in spel_mlx.stream_generate(model, _EotTokenizer(tok, unused), PROMPT, 40, rounds=True, **kw)
             for t in r.tokens]
    assert again == free


def _c_drafts(loaded):
    """The CDraft objects of the cached proposers (an "auto" proposer's behind its fallback)."""
    out = []
    for p in loaded.drafts.values():
        p = getattr(p, "fallback", p)
        if hasattr(p, "cdraft"):
            out.append(p.cdraft)
    return out


def test_a_load_prepares_the_default_draft_and_the_text_is_the_same():
    """load(prepare="spec") builds the default C draft on another thread while the
    target's layouts are built; the first call uses that draft (the same object), and
    the text equals a model loaded with nothing prepared, greedy and seeded sampling."""
    from spel_mlx.native import clib
    if not clib.available():
        pytest.skip("the C draft is not built")
    cold, tok = load(prepare="none")
    warm, _ = load(prepare="spec")
    try:
        assert not cold.prepared and len(warm.prepared) == 1
        built = 0 if warm.model.ops.windowed else len({1, warm.cfg.spec_k + 1})   # the step's and verification's passes
        assert cold.model.passes_built == 0 and warm.model.passes_built == built
        from spel_mlx.layout import draft_engine_names      # numpy weights kept: the C draft's only
        assert list(warm.weights) == draft_engine_names(warm.cfg) and "layers.0.mlp.w1.weight" not in warm.weights
        built = next(iter(warm.prepared.values())).result()
        for opts in ({"temperature": 0}, {"temperature": 0.7, "seed": 5}):
            assert spel_mlx.generate(warm, tok, PROMPT, max_tokens=48, **opts) == \
                spel_mlx.generate(cold, tok, PROMPT, max_tokens=48, **opts), opts
        assert not warm.prepared and any(d is built for d in _c_drafts(warm))
        assert not any(d is built for d in _c_drafts(cold))
        ar, _ = load(prepare="ar")
        assert not ar.prepared
        ar.close()
    finally:
        cold.close()
        warm.close()
    with pytest.raises(LoadError, match="prepare='soon'"):
        load(prepare="soon")


def test_the_draft_build_starts_before_the_target_reads_its_weights(monkeypatch):
    """load(prepare="spec") starts the C draft's build once the checkpoint is open, from
    the draft's own tensors, before the model reads a weight (so its quantization runs
    beside that read); a load that fails after that closes the draft it started."""
    from spel_mlx.api import loading as api_loading
    from spel_mlx.api import warm
    from spel_mlx.layout import draft_engine_names
    from spel_mlx.model import SpelModel
    from spel_mlx.native import clib
    if not clib.available():
        pytest.skip("the C draft is not built")
    events, start, from_weights = [], warm.start_draft, SpelModel.from_weights.__func__

    def started(cfg, weights, mode="spec"):
        events.append(("draft", sorted(weights)))
        return start(cfg, weights, mode)

    def model_reads(cls, cfg, weights):
        events.append(("model", None))
        return from_weights(cls, cfg, weights)
    monkeypatch.setattr(api_loading, "start_draft", started)
    monkeypatch.setattr(SpelModel, "from_weights", classmethod(model_reads))
    model, _ = load(prepare="spec")
    try:
        assert [e[0] for e in events] == ["draft", "model"]
        assert events[0][1] == sorted(draft_engine_names(model.cfg)) and len(model.prepared) == 1
    finally:
        model.close()

    closed = []

    def failing(cls, cfg, weights):
        raise MemoryError("no room for the model")
    monkeypatch.setattr(SpelModel, "from_weights", classmethod(failing))
    from spel_mlx.native import cdraft
    close = cdraft.CDraft.close

    def counted_close(self):
        if self._d is not None:
            closed.append(1)
        close(self)
    monkeypatch.setattr(cdraft.CDraft, "close", counted_close)
    with pytest.raises(MemoryError, match="no room"):
        load(prepare="spec")
    assert closed == [1]


def test_a_prepared_draft_that_failed_is_built_again_where_its_error_shows(monkeypatch):
    """A background build that raised leaves no trace: the call builds its own draft."""
    from concurrent.futures import Future
    from spel_mlx.native import clib
    if not clib.available():
        pytest.skip("the C draft is not built")
    model, tok = load(prepare="none")
    try:
        want = spel_mlx.generate(model, tok, PROMPT, max_tokens=24, temperature=0.7, seed=2)
        model.close()                    # the call's draft closed: the next call builds one
        failed = Future()
        failed.set_exception(MemoryError("no room"))
        from spel_mlx.api import warm
        threads, ahead = warm.c_draft_plan(None, "auto")
        model.prepared[(threads, warm.c_draft_ring(model.cfg.spec_k, ahead))] = failed
        assert spel_mlx.generate(model, tok, PROMPT, max_tokens=24, temperature=0.7, seed=2) == want
        assert not model.prepared and _c_drafts(model)
    finally:
        model.close()

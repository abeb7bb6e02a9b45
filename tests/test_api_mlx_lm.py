"""The API as mlx-lm users write it: one response per token with mlx-lm's fields, its
argument order, sampler and logits_processors callables that keep decoding exact,
draft_model / num_draft_tokens, a prompt cache across a chat's turns, the server's
prefix cache (the tokens of a call without it, fewer prefilled), and a script
written for mlx-lm that runs unchanged (tests/mlx_lm_script.py)."""
import gc
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import spel_mlx
from spel_mlx.api import GenerationError, load, make_prefix_cache, make_prompt_cache, prepare
from spel_mlx.decoding import SpeculativeDecoder

PROMPT = "Elizabeth was"
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def shipped():
    model, tok = load()
    yield model, tok
    model.close()


def ar_tokens(model, prompt_ids, n):
    return SpeculativeDecoder(model.model, None, "ar", k=4).generate(prompt_ids, n)


def tokens_of(responses):
    return [r.token for r in responses]


def test_one_response_per_token_with_mlx_lm_fields(shipped):
    model, tok = shipped
    want = ar_tokens(model, tok.encode(PROMPT), 30)
    responses = list(spel_mlx.stream_generate(model, tok, PROMPT, 30, temperature=0))
    assert tokens_of(responses) == want
    assert [r.generation_tokens for r in responses] == list(range(1, 31))
    assert [r.finish_reason for r in responses] == [None] * 29 + ["length"]
    last = responses[-1]
    assert last.prompt_tokens == len(tok.encode(PROMPT)) and last.prompt_tps > 0 and last.generation_tps > 0
    assert last.peak_memory >= 0 and last.stats["tokens"] == 30
    text = "".join(r.text for r in responses)
    assert text == spel_mlx.generate(model, tok, PROMPT, max_tokens=30, temperature=0)
    assert tok.decode(tok.encode(PROMPT) + want) == PROMPT + text
    # round-level detail: each round's accepted proposals, then the target's token
    by_round = {}
    for r in responses:
        by_round.setdefault(r.round, []).append(r.from_draft)
    assert sorted(by_round) == list(range(1, last.stats["rounds"] + 1))
    for origins in by_round.values():
        assert origins == [True] * (len(origins) - 1) + [False]
    assert sum(r.from_draft for r in responses) == last.stats["accepted"] > 0


def test_logprobs(shipped):
    model, tok = shipped
    greedy = list(spel_mlx.stream_generate(model, tok, PROMPT, 16, temperature=0))
    assert all(r.logprobs is None for r in greedy)         # plain greedy keeps the rows on the device
    asked = list(spel_mlx.stream_generate(model, tok, PROMPT, 16, temperature=0, logprobs=True))
    assert tokens_of(asked) == tokens_of(greedy)          # the same tokens, the rows read on the host
    for r in asked:
        lp = r.logprobs
        assert lp.shape == (model.cfg.vocab,) and abs(float(mx.logsumexp(lp))) < 1e-4
        assert int(mx.argmax(lp)) == r.token
    sampled = list(spel_mlx.stream_generate(model, tok, PROMPT, 16, seed=2))
    assert all(r.logprobs is not None and r.logprobs.shape == (model.cfg.vocab,) for r in sampled)
    assert all(float(r.logprobs[r.token]) > -30 for r in sampled)   # top-p 0.95 never draws the far tail
    off = list(spel_mlx.stream_generate(model, tok, PROMPT, 16, seed=2, logprobs=False))
    assert tokens_of(off) == tokens_of(sampled) and all(r.logprobs is None for r in off)


class CountingSampler:
    """Categorical sampling at a temperature from mx.random (as mlx-lm's make_sampler)."""

    def __init__(self, temp=0.8):
        self.temp, self.calls = temp, 0

    def __call__(self, logprobs):
        self.calls += 1
        return mx.random.categorical(logprobs * (1 / self.temp))


@pytest.mark.parametrize("opts", [{}, {"draft": "mlx"}, {"draft": "ngram", "k": 6}, {"mode": "governed"}])
def test_a_sampler_gives_ars_text_with_one_call_per_token(shipped, opts):
    """A sampler is called once per emitted token, in order, on the rows an AR loop
    would give it: with the same random state, spec's text is ar's."""
    model, tok = shipped
    runs = {}
    for mode_opts in ({"mode": "ar"}, opts):
        sampler = CountingSampler()
        mx.random.seed(7)
        responses = list(spel_mlx.stream_generate(model, tok, PROMPT, 40, sampler=sampler, **mode_opts))
        assert sampler.calls == len(responses) == 40
        runs[str(mode_opts)] = tokens_of(responses)
    ar, spec = runs.values()
    assert ar == spec
    mx.random.seed(8)
    assert tokens_of(spel_mlx.stream_generate(model, tok, PROMPT, 40, sampler=CountingSampler(), **opts)) != ar


def test_greedy_sampler_is_greedy(shipped):
    model, tok = shipped
    want = ar_tokens(model, tok.encode(PROMPT), 30)
    got = tokens_of(spel_mlx.stream_generate(model, tok, PROMPT, 30, sampler=lambda lp: mx.argmax(lp, axis=-1)))
    assert got == want
    with pytest.raises(ValueError, match="sampler returned"):
        spel_mlx.generate(model, tok, PROMPT, max_tokens=4, sampler=lambda lp: mx.array([10 ** 6]))


def test_logits_processors_apply_to_every_row(shipped):
    """A processor sees every token so far and its row; banning the greedy text's tokens
    changes the text, the same in every mode (negative control: an identity processor)."""
    model, tok = shipped
    prompt = tok.encode(PROMPT)
    free = ar_tokens(model, prompt, 24)
    seen = []

    def identity(tokens, logits):
        seen.append(np.array(tokens).tolist())
        return logits

    got = tokens_of(spel_mlx.stream_generate(model, tok, PROMPT, 24, logits_processors=[identity]))
    assert got == free                     # no sampler with processors: greedy, as in mlx-lm
    contexts = {tuple(s) for s in seen}
    for i in range(24):                    # every emitted token's context was processed
        assert tuple(prompt + free[:i]) in contexts
    banned = set(free[:6])

    def ban(tokens, logits):
        return mx.where(mx.array(np.isin(np.arange(logits.shape[-1]), list(banned))), -mx.inf, logits)

    texts = [tokens_of(spel_mlx.stream_generate(model, tok, PROMPT, 24, logits_processors=[ban], **o))
             for o in ({"mode": "ar"}, {}, {"draft": "mlx"})]
    assert texts[0] == texts[1] == texts[2] and not banned & set(texts[0])


def test_draft_model_and_num_draft_tokens(shipped, tmp_path):
    model, tok = shipped
    want = ar_tokens(model, tok.encode(PROMPT), 21)
    rs = list(spel_mlx.stream_generate(model, tok, PROMPT, 21, model, temperature=0, num_draft_tokens=4,
                                       strict=True, governor=spel_mlx.api.GovernorConfig(policy="off")))
    assert tokens_of(rs) == want
    st = rs[-1].stats
    assert st["k"] == 4 and st["draft"] == "target" and st["alpha"] == 1.0     # the target drafting itself
    st = list(spel_mlx.stream_generate(model, tok, PROMPT, 21, temperature=0, num_draft_tokens=2))[-1].stats
    assert st["k"] == 2
    from spel_mlx.synth import write_synth
    from test_spelw import TINY
    write_synth(tmp_path / "tiny.spelw", TINY, 1, progress=False, target="numpy", draft="numpy")
    tiny, _ = load(tmp_path / "tiny.spelw")
    with pytest.raises(GenerationError) as e:
        spel_mlx.generate(model, tok, PROMPT, draft_model=tiny)
    assert e.value.param == "draft_model" and "vocabulary" in str(e.value)
    tiny.close()


def test_prompt_cache_continues_a_chat(shipped):
    """The next turn starts from the state the last one left (only the new tokens are
    prefilled) and gives the tokens a fresh call on the whole conversation gives."""
    model, tok = shipped
    cache = make_prompt_cache(model)
    turns = ["Elizabeth was", " Then Mr. Darcy", " and"]
    for i, turn in enumerate(turns):
        before = list(cache.tokens)
        rs = list(spel_mlx.stream_generate(model, tok, turn, 20, temperature=0, strict=True, prompt_cache=cache))
        context = before + tok.encode(turn)
        assert tokens_of(rs) == ar_tokens(model, context, 20)
        assert cache.tokens == context + tokens_of(rs)
        assert rs[-1].prompt_tokens == len(tok.encode(turn))
        assert cache.reused == (len(before) - 1 if i else 0)     # all but the last token given out
    # a cache is for one model; a context past max_seq is a named error
    with pytest.raises(GenerationError, match="prompt_cache"):
        spel_mlx.generate(model, tok, PROMPT, prompt_cache=[])
    with pytest.raises(GenerationError, match="max_seq.*prompt cache"):
        spel_mlx.generate(model, tok, [5] * (model.cfg.max_seq - len(cache) + 1), prompt_cache=cache)
    with pytest.raises(GenerationError):
        make_prompt_cache(model, max_kv_size=128)


def test_prompt_cache_after_a_cut_round_starts_afresh(shipped):
    """A call that ended inside a round (a stop string) leaves more in the state than it
    gave; the cache then prefills again rather than reuse it, and stays exact."""
    model, tok = shipped
    full = spel_mlx.generate(model, tok, PROMPT, max_tokens=30, temperature=0)
    cache = make_prompt_cache(model)
    spel_mlx.generate(model, tok, PROMPT, max_tokens=30, temperature=0, stop=full[5:9], prompt_cache=cache,
                      strict=True)
    before = list(cache.tokens)
    rs = list(spel_mlx.stream_generate(model, tok, " And", 12, temperature=0, strict=True, prompt_cache=cache))
    assert tokens_of(rs) == ar_tokens(model, before + tok.encode(" And"), 12)


LONG_PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
               "must be in want of a wife.")


@pytest.mark.parametrize("batched_rows_differ", [False, True])
def test_prefix_cache_gives_the_tokens_of_a_call_without_it(shipped, monkeypatch, batched_rows_differ):
    """A request that extends an earlier one (its prompt and completion, a chat's next
    turn) resumes from a saved state and gives, bit for bit, the tokens of a call
    without the cache: greedy, strict and sampled.  Where fast rows depend on their
    batch (forced here: the GPU's case), fast calls save states only at whole prefill
    batches; elsewhere at any position, the completion's end too."""
    model, tok = shipped
    if batched_rows_differ:
        monkeypatch.setattr(model.model, "rows_independent", lambda stack, m: False)
    anywhere = all(model.model.rows_independent("target", m) for m in range(1, 17))

    def run(prompt, **kw):
        rs = list(spel_mlx.stream_generate(model, tok, prompt, 24, rounds=True, **kw))
        return [t for r in rs for t in r.tokens], rs[-1]

    n = len(tok.encode(LONG_PROMPT))
    assert n > 17             # the prompt spans a whole prefill batch of 16
    for kw in ({"temperature": 0}, {"temperature": 0, "strict": True}, {"temperature": 0.7, "seed": 3}):
        cache = make_prefix_cache(model, 4)
        first, last = run(LONG_PROMPT, prefix_cache=cache, **kw)
        assert first == run(LONG_PROMPT, **kw)[0] and last.cached_tokens == 0
        turn = LONG_PROMPT + tok.decode(first) + " However little known"
        again, last = run(turn, prefix_cache=cache, **kw)
        assert again == run(turn, **kw)[0], kw
        if kw.get("strict") or anywhere:     # the state after prompt + completion
            assert last.cached_tokens > n and last.stats["cached_tokens"] == last.cached_tokens
        else:                                # the last whole prefill batch of the first prompt
            assert last.cached_tokens == (n - 1) // 16 * 16
        other, last = run("Mr. Darcy " + LONG_PROMPT, prefix_cache=cache, **kw)
        assert last.cached_tokens == 0 and other == run("Mr. Darcy " + LONG_PROMPT, **kw)[0]
        assert cache.hits == 1 and cache.misses == 2 and 0 < len(cache) <= 4 and cache.nbytes > 0


def test_prefix_cache_is_bounded(shipped):
    model, tok = shipped
    one = make_prefix_cache(model, 1)
    for prompt in (LONG_PROMPT, "Mr. Darcy " + LONG_PROMPT):
        spel_mlx.generate(model, tok, prompt, max_tokens=4, temperature=0, prefix_cache=one)
    assert len(one) == 1       # the older prompt's state is gone: its next call prefills it all
    rs = list(spel_mlx.stream_generate(model, tok, LONG_PROMPT + " And", 4, temperature=0, prefix_cache=one))
    assert rs[-1].stats["cached_tokens"] == 0
    off = make_prefix_cache(model, 0)
    spel_mlx.generate(model, tok, LONG_PROMPT, max_tokens=4, temperature=0, prefix_cache=off)
    assert len(off) == 0
    with pytest.raises(GenerationError, match="prefix_cache"):
        spel_mlx.generate(model, tok, PROMPT, prefix_cache=make_prompt_cache(model))
    with pytest.raises(GenerationError, match="not both"):
        spel_mlx.generate(model, tok, PROMPT, prefix_cache=one, prompt_cache=make_prompt_cache(model))
    with pytest.raises(GenerationError, match="size"):
        make_prefix_cache(model, -1)


def test_argument_order_and_limits(shipped):
    model, tok = shipped
    with pytest.raises(GenerationError) as e:
        spel_mlx.generate(model, tok, PROMPT, 40)            # mlx-lm's fourth argument is verbose
    assert e.value.param == "verbose"
    assert prepare(model, tok, PROMPT, -1).max_tokens == model.cfg.max_seq    # -1: no limit
    (only,) = spel_mlx.stream_generate(model, tok, PROMPT, 0)
    assert only.token is None and only.finish_reason == "length" and only.generation_tokens == 0
    seen = []
    spel_mlx.generate(model, tok, PROMPT, max_tokens=3, prompt_progress_callback=lambda a, b: seen.append((a, b)))
    n = len(tok.encode(PROMPT))
    assert seen == [(0, n), (n, n)]
    ids = tok.encode(PROMPT)
    for prompt in (ids, tuple(ids), np.array(ids), mx.array(ids)):
        assert spel_mlx.generate(model, tok, prompt, max_tokens=6, temperature=0) == \
            spel_mlx.generate(model, tok, PROMPT, max_tokens=6, temperature=0)


def test_the_end_of_text_token_ends_as_mlx_lm_eos(shipped):
    """The end-of-text token is the last response's token, finish "stop" (mlx-lm's eos)."""
    from test_api import _EotTokenizer
    model, tok = shipped
    free = tokens_of(spel_mlx.stream_generate(model, tok, PROMPT, 30, temperature=0))
    eot = free[7]
    rs = list(spel_mlx.stream_generate(model, _EotTokenizer(tok, eot), PROMPT, 30, temperature=0))
    assert tokens_of(rs) == free[:free.index(eot) + 1] and rs[-1].token == eot
    assert [r.finish_reason for r in rs] == [None] * (len(rs) - 1) + ["stop"]
    assert rs[-1].stats["stop_reason"] == "end_of_text"


def test_a_stream_nobody_reads_gives_the_model_up(shipped):
    """An open stream that is never read again does not hold the model until
    max_tokens: the next call runs, and the stalled stream ends "cancelled"."""
    model, tok = shipped
    want = spel_mlx.generate(model, tok, PROMPT, max_tokens=8, temperature=0)
    stalled = spel_mlx.stream_generate(model, tok, PROMPT, 3000, temperature=0)
    next(stalled)
    assert spel_mlx.generate(model, tok, PROMPT, max_tokens=8, temperature=0) == want
    rest = list(stalled)
    assert rest[-1].finish_reason == "cancelled" and rest[-1].generation_tokens < 3000
    assert model.waiting == 0 and not model.lock.locked()
    # dropped without closing: released at once
    dropped = spel_mlx.stream_generate(model, tok, PROMPT, 3000, temperature=0, rounds=True)
    next(dropped)
    del dropped
    gc.collect()
    assert not model.lock.locked() and model.waiting == 0


def _shim(tmp_path) -> Path:
    """A package named mlx_lm that is spel_mlx's API (load, generate, stream_generate,
    models.cache.make_prompt_cache) and mlx-lm's own sample_utils when mlx-lm is
    installed (else a minimal stand-in): a script written for mlx-lm imports it."""
    pkg = tmp_path / "shim" / "mlx_lm"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from spel_mlx import load, generate, stream_generate  # noqa: F401\n")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "cache.py").write_text("from spel_mlx import make_prompt_cache  # noqa: F401\n")
    real = importlib.util.find_spec("mlx_lm")
    real_utils = Path(real.origin).parent / "sample_utils.py" if real is not None else None
    if real_utils is not None and real_utils.exists():
        (pkg / "sample_utils.py").write_text(textwrap.dedent(f"""\
            import importlib.util
            _spec = importlib.util.spec_from_file_location("_mlx_lm_sample_utils", {str(real_utils)!r})
            _real = importlib.util.module_from_spec(_spec)
            _spec.loader.exec_module(_real)
            make_sampler, make_logits_processors = _real.make_sampler, _real.make_logits_processors
            """))
    else:
        (pkg / "sample_utils.py").write_text(textwrap.dedent("""\
            import mlx.core as mx

            def make_sampler(temp=0.0, top_p=0.0, **_):
                if temp == 0:
                    return lambda lp: mx.argmax(lp, axis=-1)
                return lambda lp: mx.random.categorical(lp * (1 / temp))

            def make_logits_processors(logit_bias=None, repetition_penalty=None, **_):
                def penalty(tokens, logits):
                    seen = mx.array(sorted(set(tokens.tolist()[-20:])))
                    got = logits[:, seen]
                    return mx.put_along_axis(logits, seen[None], mx.where(got < 0, got * repetition_penalty,
                                                                           got / repetition_penalty), axis=-1)
                return [penalty] if repetition_penalty else []
            """))
    return pkg.parent


def test_a_script_written_for_mlx_lm_runs_unchanged(shipped, tmp_path):
    model, tok = shipped
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_shim(tmp_path)), os.environ.get("PYTHONPATH", "")]),
           "MODEL": model.source}
    out = subprocess.run([sys.executable, str(HERE / "mlx_lm_script.py")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    greedy = spel_mlx.generate(model, tok, "Elizabeth was", max_tokens=24,
                               sampler=lambda lp: mx.argmax(lp, axis=-1))
    assert report["greedy"] == greedy
    assert report["tokens"] == 24 and report["finish"] == "length" and report["vocab"] == model.cfg.vocab
    assert report["turns"] == 2 and report["drafted"] >= 0 and report["verbose"].startswith("=" * 10)

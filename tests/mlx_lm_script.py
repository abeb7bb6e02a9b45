"""A script written for mlx-lm (its imports, calls and fields, nothing of spel_mlx):
tests/test_api_mlx_lm.py runs it with `mlx_lm` resolving to spel_mlx's API, and it
must run unchanged.  The model path comes from $MODEL; the last line is a JSON report."""
import contextlib
import io
import json
import os

import mlx.core as mx
from mlx_lm import generate, load, stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

model, tokenizer = load(os.environ["MODEL"])
prompt = "Elizabeth was"

# greedy, as mlx-lm's default sampler is
greedy = generate(model, tokenizer, prompt, max_tokens=24, sampler=make_sampler(temp=0.0))

# verbose prints the text and the statistics
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    text = generate(model, tokenizer, prompt=prompt, verbose=True, max_tokens=16)
assert text and text in printed.getvalue() and "Peak memory" in printed.getvalue()

# streaming with a sampler and logits processors
mx.random.seed(0)
sampler = make_sampler(temp=0.7, top_p=0.9)
processors = make_logits_processors(repetition_penalty=1.1)
pieces, drafted = [], 0
for response in stream_generate(model, tokenizer, prompt, max_tokens=24, sampler=sampler,
                                logits_processors=processors):
    pieces.append(response.text)
    drafted += response.from_draft
    assert isinstance(response.token, int) and response.logprobs.ndim == 1
    assert response.prompt_tokens > 0 and response.generation_tps >= 0 and response.peak_memory >= 0
print("".join(pieces))
print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")

# token ids as the prompt, an mx.array too
ids = tokenizer.encode(prompt)
assert generate(model, tokenizer, ids, max_tokens=8, sampler=make_sampler(temp=0.0)) == \
    generate(model, tokenizer, mx.array(ids), max_tokens=8, sampler=make_sampler(temp=0.0))

# a chat whose turns reuse the cache
prompt_cache = make_prompt_cache(model)
turns = 0
for turn in ["It is a truth", " universally acknowledged"]:
    reply = generate(model, tokenizer, turn, max_tokens=12, prompt_cache=prompt_cache)
    turns += 1

# speculative decoding with a draft model
spec = generate(model, tokenizer, prompt, max_tokens=24, draft_model=model, num_draft_tokens=3,
                sampler=make_sampler(temp=0.0))
assert spec == greedy

print(json.dumps({"greedy": greedy, "tokens": response.generation_tokens, "finish": response.finish_reason,
                  "vocab": response.logprobs.shape[0], "turns": turns, "drafted": int(drafted),
                  "verbose": printed.getvalue()}))

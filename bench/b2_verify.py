"""B2: verification cost.

``v`` = time of one K+1-token target verification batch / time of one AR token, for
K in {1, 2, 4, 8, 16} (M = K+1), in strict mode (row-by-row, bit-identical to AR) and
fast mode (batched GEMM). Both are measured in this process against this process's own
AR token, on a state holding the prompt, and nothing is committed (the pending tokens
are discarded after each timed call, so every call sees the same position).
"""
from __future__ import annotations

from . import common
from .common import make_row, median, unavailable

SECTION = "b2"


def get_model(regime: dict):
    """The regime's MLX model, built once per process."""
    if "model" not in regime:
        import spel_mlx  # noqa: F401
        from spel_mlx.model import SpelModel
        regime["model"] = SpelModel.from_weights(regime["cfg"], regime["weights"])
    return regime["model"]


def target_placements(targets=("gpu", "cpu")) -> list:
    """[(label, device name or None, reason)]: MLX target on GPU and on CPU (those of
    ``targets``, a job's "targets"). The GPU row is kept with a reason where there is
    none, so it never silently vanishes."""
    gpu = common.gpu_available()
    rows = [("target=mlx-gpu", "gpu" if gpu else None,
             "" if gpu else "MLX reports no GPU on this machine"),
            ("target=mlx-cpu", "cpu", "")]
    return [r for r in rows if r[0].rsplit("-", 1)[1] in targets]


def device_stream(dev: str):
    import mlx.core as mx
    return mx.stream(mx.gpu if dev == "gpu" else mx.cpu)


def time_forward(model, state, tokens, strict: bool, repeats: int, warmup: int = 1) -> list:
    """Seconds per forward of ``tokens`` on ``state`` (discarded after each call)."""
    import mlx.core as mx

    def call():
        mx.eval(model.forward(tokens, state, strict=strict))
        state.discard()
    return common.time_calls(call, repeats, warmup)


def prefilled_state(model, prompt, ring: int):
    state = model.new_state("target", ring=ring)
    model.prefill(prompt, state)
    return state


def run(job: dict, regime: dict) -> list:
    name = regime["name"]
    Ks = [k for k in job["b2_K"] if 1 <= k <= 16]
    reps = max(1, job["b2_repeats"])
    rows = []
    for placement, dev, reason in target_placements(job.get("targets", ("gpu", "cpu"))):
        if dev is None:
            for mode in ("strict", "fast"):
                for K in Ks:
                    rows.append(unavailable(SECTION, f"verify M=K+1 {mode}", reason, regime=name,
                                            placement=placement, mode=mode, K=K))
            continue
        with device_stream(dev):
            model = get_model(regime)
            ring = max(Ks) + 2  # room for M = K+1 on top of nothing pending, and discard
            state = prefilled_state(model, regime["prompt"], ring)
            pending = regime["prompt"][-1]
            ar = time_forward(model, state, [pending], False, max(reps, 5))
            ar_s = median(ar)
            rows.append(make_row(SECTION, "AR token (one target forward)", regime=name,
                                 placement=placement, mode="ar", primary="ms",
                                 metrics={"ms": ar_s * 1e3, "tok_s": 1.0 / ar_s},
                                 samples=[a * 1e3 for a in ar]))
            prompt = regime["prompt"]
            draft_tokens = [int(prompt[j % len(prompt)]) for j in range(16)]
            for mode in ("strict", "fast"):
                for K in Ks:
                    toks = [pending] + draft_tokens[:K]
                    ts = time_forward(model, state, toks, mode == "strict", reps)
                    t = median(ts)
                    rows.append(make_row(SECTION, f"verify M=K+1 {mode}", regime=name,
                                         placement=placement, mode=mode, K=K, primary="v",
                                         metrics={"v": t / ar_s, "ms": t * 1e3, "M": K + 1,
                                                  "ar_ms": ar_s * 1e3},
                                         samples=[x * 1e3 for x in ts]))
    return rows

"""What a benchmark level runs: the regimes, sections and decode protocol of each level,
and the worker jobs (one per process run and regime) that carry them out."""
from __future__ import annotations

import os

# Per level: what runs, and the protocol of each regime (prompt tokens, warm tokens,
# generated tokens, draft threads, draft kinds, B2 repeats, peer tokens). The 218m
# shape runs fewer tokens: each of its target tokens costs ~10x a 21m one.
LEVELS = {
    # smoke leaves B1 out: bench/kernels.py has no form small enough for the test suite
    "smoke": {"regimes": ["tiny"], "runs": 2, "K": 4, "K_ceiling": None, "timeout": 120,
              "sections": ["b2", "b3", "placement", "peers", "b2ctx"], "b2_K": [1, 2, 4],
              "per_regime": {"tiny": {"prompt_len": 16, "warm": 2, "gen": 8, "threads": [1, 2],
                                      "drafts": ["c", "mlx"], "b2_repeats": 3, "peers_gen": 8,
                                      "contexts": [16, 64, 160], "ctx_M": [1, 2, 5], "ctx_repeats": 3,
                                      "ctx_gen": 8, "prefill_lengths": [32, 128], "ngram_doc": 128,
                                      "ngram_gen": 16}}},
    "quick": {"regimes": ["shipped", "218m"], "runs": 2, "K": 4, "K_ceiling": None, "timeout": 240,
              "sections": ["b1", "b2", "b3", "placement", "peers"], "b2_K": [1, 2, 4, 8, 16],
              "per_regime": {"shipped": {"prompt_len": 32, "warm": 4, "gen": 24, "threads": "auto",
                                         "drafts": ["c", "mlx"], "b2_repeats": 3, "peers_gen": 16},
                             "218m": {"prompt_len": 12, "warm": 2, "gen": 6, "threads": "auto",
                                      "drafts": ["c"], "b2_repeats": 2, "peers_gen": 0,
                                      "runs": 1, "b2_K": [1, 4, 16]}}},
    # full: the original's decode protocol (64-token prompt, 8 warm tokens, 64 generated)
    "full": {"regimes": ["shipped", "21m", "218m"], "runs": 3, "K": 4, "K_ceiling": 16, "timeout": 600,
             "sections": ["b1", "b2", "b3", "placement", "peers", "b2ctx"], "b2_K": [1, 2, 4, 8, 16],
             "per_regime": {"shipped": {"prompt_len": 64, "warm": 8, "gen": 64, "threads": "auto",
                                        "drafts": ["c", "mlx"], "b2_repeats": 5, "peers_gen": 64},
                            "21m": {"prompt_len": 64, "warm": 8, "gen": 64, "threads": "auto",
                                    "drafts": ["c", "mlx"], "b2_repeats": 5, "peers_gen": 64},
                            "218m": {"prompt_len": 64, "warm": 8, "gen": 64, "threads": "auto",
                                     "drafts": ["c"], "b2_repeats": 3, "peers_gen": 16, "contexts": []}}},
}
# B2 by context (bench/b2_context.py): contexts of the pass and AR rows, the pass sizes M,
# interleaved repeats, AR tokens generated per context, prefill lengths, and the ngram
# run's document length and generated tokens.  The 218m shape has no context rows (each
# of its passes costs ~10x; the CPU-path goals are about the shipped model and 21m).
CONTEXT_PROTOCOL = {"contexts": [64, 1024, 2048, 4000], "ctx_M": [1, 2, 5, 9, 17], "ctx_repeats": 15,
                    "ctx_gen": 64, "prefill_lengths": [512, 2048, 4000], "ngram_doc": 2048, "ngram_gen": 256}
DEFAULT_PROTOCOL = {"prompt_len": 32, "warm": 4, "gen": 16, "threads": "auto", "drafts": ["c", "mlx"],
                    "b2_repeats": 3, "peers_gen": 16, **CONTEXT_PROTOCOL}
PLACEMENT_ALPHA = 0.6  # the projected figure of the calibration table (ranking is alpha-free)
SECTIONS = ("b1", "b2", "b3", "placement", "peers", "b2ctx")
# sections measured once (in the first process run) rather than in every run
ONCE = ("b1", "peers", "b2ctx")
# sections that run in a process of their own (their interleaved rounds are the whole job)
OWN_PROCESS = ("b2ctx",)


def auto_threads() -> list:
    """Draft thread counts to measure: 1 and 2, and 4 and 6 where the cores exist
    (the original reported 1 and 4; the pool takes 1..6)."""
    cores = os.cpu_count() or 1
    return sorted({t for t in (1, 2, 4, 6) if t <= max(cores, 2)})


def protocol(params: dict, regime: str) -> dict:
    proto = {**DEFAULT_PROTOCOL, **params["per_regime"].get(regime, {}), **params.get("override", {})}
    if proto["threads"] == "auto":
        proto["threads"] = auto_threads()
    return proto


def build_jobs(level: str, params: dict) -> list:
    jobs = []
    for run_idx in range(params["runs"]):
        for i, regime in enumerate(params["regimes"]):
            proto = protocol(params, regime)
            if run_idx >= proto.get("runs", params["runs"]):
                continue
            sections = [s for s in params["sections"]
                        if (s not in ONCE or run_idx == 0) and (s != "b1" or i == 0)
                        and (s != "peers" or proto["peers_gen"] > 0)
                        and (s != "b2ctx" or proto["contexts"])]
            for group in ([s for s in sections if s not in OWN_PROCESS],
                          *[[s] for s in sections if s in OWN_PROCESS]):
                if not group:
                    continue
                jobs.append({"level": level, "run": run_idx, "regime": regime, "sections": group,
                             "b2_K": params["b2_K"], "K": params["K"], "K_ceiling": params["K_ceiling"],
                             "repeats": 1, **proto})
                jobs[-1]["runs"] = proto.get("runs", params["runs"])
    return jobs


"""Peers: mlx-lm greedy decoding of same-size models with random weights, in the same run.

Optional (the ``peers`` extra). Each row is skipped with a stated reason when mlx-lm is
not installed, and mlx-lm's refusal to speculate over a recurrent cache is reported as
such (it needs a trimmable cache; Gated-DeltaNet state is not trimmable there).

Peers are built with the SPEL shapes (d, layers, heads, head_dim, d_ff, vocab 128):
- a Llama-style transformer (every layer attention),
- its GDN hybrid (mlx-lm's qwen3_next: Gated DeltaNet with one attention layer in four,
  dense MLP, no experts) -- the closest mlx-lm relative of the SPEL target.
"""
from __future__ import annotations

from .common import NOT_AVAILABLE, SKIPPED, make_row, median, now, unavailable

SECTION = "peers"


def _shape(cfg, layers=None) -> dict:
    return {"hidden_size": cfg.d_model, "num_hidden_layers": layers or cfg.n_layers,
            "intermediate_size": cfg.d_ff, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_heads, "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.norm_eps, "vocab_size": cfg.vocab, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_seq, "tie_word_embeddings": False}


def build_llama(cfg, layers=None):
    import spel_mlx  # noqa: F401
    import mlx.core as mx
    from mlx_lm.models import llama
    args = llama.ModelArgs(model_type="llama", **_shape(cfg, layers))
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def build_gdn_hybrid(cfg, layers=None):
    import spel_mlx  # noqa: F401
    import mlx.core as mx
    from mlx_lm.models import qwen3_next
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", **_shape(cfg, layers),
        linear_num_value_heads=cfg.n_heads, linear_num_key_heads=cfg.n_heads,
        linear_key_head_dim=cfg.head_dim, linear_value_head_dim=cfg.head_dim,
        linear_conv_kernel_dim=3,  # SPEL's 3-tap causal conv
        num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1,
        shared_expert_intermediate_size=0, mlp_only_layers=[], moe_intermediate_size=0,
        partial_rotary_factor=1.0, full_attention_interval=cfg.attn_period)
    model = qwen3_next.Model(args)
    mx.eval(model.parameters())
    return model


def param_count(model) -> int:
    from mlx.utils import tree_flatten
    return int(sum(v.size for _, v in tree_flatten(model.parameters())))


def greedy_decode_rate(model, prompt, n_tokens: int) -> tuple:
    """(tok/s over the decoded tokens, tokens). Times from the first yielded token to the
    last, so prompt processing is excluded, as in the SPEL decode rows."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    toks, t_first = [], None
    for i, (tok, _) in enumerate(generate_step(mx.array(prompt, dtype=mx.uint32), model,
                                               max_tokens=n_tokens + 1)):
        if i == 0:
            t_first = now()
        toks.append(int(tok))
    dt = now() - t_first
    return (len(toks) - 1) / dt, toks


def speculative_decode_rate(model, draft, prompt, n_tokens: int, K: int) -> tuple:
    """(tok/s, accepted-from-draft count, tokens) of mlx-lm's own speculative decoding."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step
    toks, from_draft, t_first = [], 0, None
    for i, (tok, _, by_draft) in enumerate(speculative_generate_step(
            mx.array(prompt, dtype=mx.uint32), model, draft, num_draft_tokens=K,
            max_tokens=n_tokens + 1)):
        if i == 0:
            t_first = now()
        else:
            from_draft += int(bool(by_draft))
        toks.append(int(tok))
    dt = now() - t_first
    return (len(toks) - 1) / dt, from_draft, toks


def mlx_lm_version():
    try:
        import mlx_lm
        return getattr(mlx_lm, "__version__", "?")
    except Exception:
        return None


def run(job: dict) -> list:
    """Rows for one regime. ``job``: regime, cfg (ModelConfig), prompt (token list),
    gen_tokens, repeats, K."""
    regime, cfg, prompt = job["regime"], job["cfg"], job["prompt"]
    n, reps, K = job["gen_tokens"], job["repeats"], job["K"]
    common = dict(regime=regime, placement="mlx-lm on " + job.get("device", "cpu"))
    names = {"llama": "mlx-lm Llama-style greedy (random weights)",
             "gdn": "mlx-lm GDN hybrid (qwen3_next) greedy (random weights)",
             "spec": f"mlx-lm speculative, Llama target + {cfg.n_draft}-layer Llama draft",
             "oracle": "mlx-lm speculative, Llama target as its own draft",
             "gdn_spec": "mlx-lm speculative, GDN hybrid target + draft"}
    try:
        import mlx_lm  # noqa: F401
    except Exception as e:
        reason = f"mlx-lm not installed ({type(e).__name__}); `pip install spel-mlx[peers]`"
        return [unavailable(SECTION, nm, reason, status=SKIPPED, mode=m, **common)
                for m, nm in names.items()]
    version = mlx_lm_version()
    rows = []
    models = {}
    for kind, builder in (("llama", build_llama), ("gdn", build_gdn_hybrid)):
        try:
            model = builder(cfg)
            models[kind] = model
            greedy_decode_rate(model, prompt[:8], 4)  # warm: first-call setup
            rates = [greedy_decode_rate(model, prompt, n)[0] for _ in range(reps)]
            rows.append(make_row(SECTION, names[kind], mode="ar", primary="tok_s",
                                 metrics={"tok_s": median(rates), "params": param_count(model)},
                                 samples=rates, note=f"mlx-lm {version}", **common))
        except Exception as e:
            rows.append(unavailable(SECTION, names[kind], f"failed: {type(e).__name__}: {e}",
                                    status="error", mode="ar", **common))
    # mlx-lm's speculative decoding: a small random draft (alpha ~ 0: systems behaviour) and
    # the target as its own draft (alpha = 1: the ceiling, like SPEL's full-target oracle).
    if "llama" in models:
        target = models["llama"]
        for mode, draft_builder in (("spec", lambda: build_llama(cfg, cfg.n_draft)),
                                    ("oracle", lambda: target)):
            try:
                draft = draft_builder()
                speculative_decode_rate(target, draft, prompt[:8], 4, K)
                res = [speculative_decode_rate(target, draft, prompt, n, K) for _ in range(reps)]
                rates = [r[0] for r in res]
                alpha = res[-1][1] / max(1, len(res[-1][2]) - 1)
                rows.append(make_row(SECTION, names[mode], mode=mode, K=K, primary="tok_s",
                                     metrics={"tok_s": median(rates),
                                              "draft_token_share": alpha},
                                     samples=rates, note=f"mlx-lm {version}", **common))
            except Exception as e:
                rows.append(unavailable(SECTION, names[mode], f"failed: {type(e).__name__}: {e}",
                                        status="error", mode=mode, K=K, **common))
    if "gdn" in models:
        try:
            draft = build_gdn_hybrid(cfg, cfg.n_draft)
            speculative_decode_rate(models["gdn"], draft, prompt, 4, K)
            rows.append(make_row(SECTION, names["gdn_spec"], mode="gdn_spec", K=K,
                                 note="unexpectedly ran; not timed", **common))
        except ValueError as e:
            rows.append(unavailable(SECTION, names["gdn_spec"],
                                    f"refused by mlx-lm {version}: {e}",
                                    status=NOT_AVAILABLE, mode="gdn_spec", K=K, **common))
        except Exception as e:
            rows.append(unavailable(SECTION, names["gdn_spec"], f"failed: {type(e).__name__}: {e}",
                                    status="error", mode="gdn_spec", K=K, **common))
    return rows

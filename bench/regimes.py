"""The regimes a benchmark measures (the shipped checkpoint, the 21m and 218m shapes, a
tiny smoke shape): their configs, weights and where those came from, and the prompts."""
from __future__ import annotations

import os

from .common import REPO

REGIME_LABELS = {
    "shipped": "the shipped trained checkpoint (or the one SPEL_WEIGHTS names)",
    "21m": "21m shape (the original's default)",
    "218m": "218m shape, synthetic random weights (systems behaviour only)",
    "tiny": "tiny shape, synthetic random weights (smoke test only)",
}
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "head_dim", "d_ff", "attn_period")


def regime_config(name: str):
    from spel_mlx.config import PRESETS, ModelConfig
    if name == "shipped":
        return PRESETS["21m"]  # its stand-in shape when no checkpoint is installed
    if name == "tiny":
        return ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=32, d_ff=128,
                           max_seq=256, draft_map=(0, 3))
    if name in PRESETS:
        return PRESETS[name]
    raise ValueError(f"unknown regime {name!r} (known: shipped, 21m, 218m, tiny)")


def shipped_checkpoint_dir() -> str:
    import spel_mlx
    return os.path.join(os.path.dirname(os.path.abspath(spel_mlx.__file__)), "assets", "default")


def synthetic_weights(cfg, seed: int = 0) -> dict:
    """Random weights for a systems-only regime, drawn tensor by tensor exactly as
    ``python -m spel_mlx.synth`` draws them (same seed -> same model as its file)."""
    from spel_mlx.layout import tensor_specs
    try:
        from spel_mlx.synth import synth_tensor
    except ImportError:  # older trees: the model's own initialiser (same scales)
        from spel_mlx.model import init_weights
        return init_weights(cfg, seed=seed)
    return {spec.name: synth_tensor(spec, seed, i) for i, spec in enumerate(tensor_specs(cfg))}


def trained_checkpoint() -> tuple:
    """(Checkpoint, None) for the shipped default (or $SPEL_WEIGHTS), else (None, reason)."""
    try:
        from spel_mlx.reader import load_checkpoint
        return load_checkpoint(None), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def same_shape(a, b) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in SHAPE_FIELDS)


def shape_text(cfg) -> str:
    return (f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, d_ff {cfg.d_ff}, "
            f"vocab {cfg.vocab}, {cfg.target_params() / 1e6:.2f}M target parameters")


def resolve_regimes(regimes: list) -> tuple:
    """(regimes, notes): the 21m row is left out when it would repeat the shipped one
    (the shipped checkpoint has the 21m shape, or there is none and its stand-in is 21m)."""
    if "shipped" not in regimes or "21m" not in regimes:
        return regimes, []
    ck, why = trained_checkpoint()
    if ck is None:
        return [r for r in regimes if r != "21m"], [
            "21m: not run separately: no trained checkpoint, so the shipped regime already "
            "runs the 21m shape with synthetic weights"]
    if same_shape(ck.cfg, regime_config("21m")):
        return [r for r in regimes if r != "21m"], [
            "21m: not run separately: the shipped checkpoint has the 21m shape"]
    return regimes, []


def load_regime(name: str) -> dict:
    """cfg, weights, and labels saying where the weights came from."""
    cfg = regime_config(name)
    if name in ("shipped", "21m"):
        ck, why = trained_checkpoint()
        if ck is not None and (name == "shipped" or same_shape(ck.cfg, cfg)):
            src = os.path.relpath(ck.source, REPO) if ck.source.startswith(REPO) else ck.source
            tok = os.path.join(ck.source, "tokenizer.model") if os.path.isdir(ck.source) else None
            return {"name": name, "cfg": ck.cfg, "weights": ck.weights, "systems_only": False,
                    "weights_source": f"trained checkpoint {src} ({ck.format}, stored "
                                      f"{ck.stored_dtype}; {shape_text(ck.cfg)})",
                    "tokenizer": tok if tok and os.path.isfile(tok) else None,
                    "label": REGIME_LABELS[name] if name == "shipped" else
                    "21m shape, the shipped trained checkpoint"}
        if name == "shipped":
            return {"name": name, "cfg": cfg, "weights": synthetic_weights(cfg), "systems_only": True,
                    "weights_source": "synthetic random weights: no trained checkpoint could be "
                                      f"loaded ({why})",
                    "label": "no shipped checkpoint: the 21m shape with synthetic weights stands "
                             "in (systems behaviour only)"}
        return {"name": name, "cfg": cfg, "weights": synthetic_weights(cfg), "systems_only": True,
                "weights_source": "synthetic random weights (the shipped checkpoint has another "
                                  "shape" + (f": {shape_text(ck.cfg)})" if ck is not None else ")"),
                "label": "21m shape, synthetic random weights (systems behaviour only)"}
    return {"name": name, "cfg": cfg, "weights": synthetic_weights(cfg), "systems_only": True,
            "weights_source": "synthetic random weights", "label": REGIME_LABELS[name]}


FALLBACK_TEXT = (
    "It was the best part of the morning, and the family had gathered in the small parlour "
    "to hear the news that the letter had brought. Nobody spoke at first; then the eldest "
    "daughter set down her work and asked, with a composure she did not feel, whether the "
    "gentleman intended to return before the end of the summer. ")


def heldout_text() -> tuple:
    """(text, label): held-out prose the model never trained on.

    Looked for, in order: data/corpus/heldout.txt (``python -m spel_mlx.corpus``), a
    heldout.txt beside the shipped checkpoint, the corpus sources split on the fly;
    otherwise a fixed English paragraph, labelled as such."""
    for path in (os.path.join(REPO, "data", "corpus", "heldout.txt"),
                 os.path.join(shipped_checkpoint_dir(), "heldout.txt")):
        if os.path.isfile(path):
            with open(path, encoding="ascii", errors="replace") as f:
                text = f.read(1 << 16)
            if len(text) > 256:
                return text, f"held-out text ({os.path.relpath(path, REPO)})"
    try:
        from spel_mlx.training import corpus
        _, held = corpus.split_heldout(corpus.load_source("austen"))
        if len(held) > 256:
            return held, "held-out text (austen, split on the fly)"
    except Exception:
        pass
    return FALLBACK_TEXT * 8, "fixed English paragraph (held-out corpus not available)"


def prompt_tokens(cfg, n: int, tokenizer_path=None) -> tuple:
    """(tokens, label): n tokens of held-out text for the trained regime; for synthetic
    weights the text matters little, but the same source keeps the rows comparable."""
    text, label = heldout_text()
    # start after the first line break: a prompt that begins on a whole line
    cut = text.find("\n")
    if 0 <= cut < len(text) // 2:
        text = text[cut + 1:]
    try:
        from spel_mlx.tokenizer import load_tokenizer
        tok = load_tokenizer(cfg.vocab, tokenizer_path)
        ids = list(tok.encode(text[: 8 * n + 64]))
    except Exception as e:
        ids = [o if o < 128 else 63 for o in map(ord, text[: 8 * n + 64])]
        label += f"; tokenizer unavailable ({type(e).__name__}), ASCII byte ids"
    ids = [i % cfg.vocab for i in ids]
    return ids[:n], label


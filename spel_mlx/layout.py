"""The one list of model tensors: names, shapes, and SPELW001 order (SPEC 6).

Every component that touches weights (the MLX model, the SPELW001 reader and
writer, the safetensors converters, the C draft, the trainer) takes names and
shapes from here.  Names are the MLX module parameter paths of
``spel_mlx.model.SpelModel``, so a flat dict from this layout loads directly.

Target layer i / draft layer j use the same per-layer names under the prefixes
``layers.{i}.`` and ``draft.layers.{j}.``; draft layer j has the layer type of
target layer ``draft_map[j]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ModelConfig

GOLDEN_TOKENS = "golden.tokens"            # uint32 [n]
GOLDEN_TARGET = "golden.target_logits"     # float32 [n, V]
GOLDEN_DRAFT = "golden.draft_logits"       # float32 [n, V]


# SPEC 2-3: the draft's projections are q8, its MLP ternary (the other tensors FP32)
DRAFT_MIXER_QUANT, DRAFT_MLP_QUANT = "q8", "ternary"
_DRAFT_QUANT = {"mixer.wqkv.weight": DRAFT_MIXER_QUANT, "mixer.wo.weight": DRAFT_MIXER_QUANT,
                "mlp.w1.weight": DRAFT_MLP_QUANT, "mlp.w3.weight": DRAFT_MLP_QUANT, "mlp.w2.weight": DRAFT_MLP_QUANT}


def draft_quant(name: str) -> str | None:
    """The quantization a tensor gets at load ("q8", "ternary"), or None (kept FP32)."""
    if not name.startswith("draft.layers."):
        return None
    return _DRAFT_QUANT.get(name.split(".", 3)[3])


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:  # FP32 on disk
        return 4 * self.numel


def layer_specs(cfg: ModelConfig, prefix: str, kind: str) -> list:
    d, inner, H, ff = cfg.d_model, cfg.inner, cfg.n_heads, cfg.d_ff
    out = [TensorSpec(prefix + "attn_norm.weight", (d,))]
    if kind == "gdn":
        out += [TensorSpec(prefix + "mixer.conv", (3, d)),
                TensorSpec(prefix + "mixer.wqkv.weight", (3 * inner, d)),
                TensorSpec(prefix + "mixer.wo.weight", (d, inner)),
                TensorSpec(prefix + "mixer.decay_logit", (H,)),
                TensorSpec(prefix + "mixer.beta_logit", (H,))]
    else:
        out += [TensorSpec(prefix + "mixer.wqkv.weight", (3 * inner, d)),
                TensorSpec(prefix + "mixer.wo.weight", (d, inner))]
    out += [TensorSpec(prefix + "ffn_norm.weight", (d,)),
            TensorSpec(prefix + "mlp.w1.weight", (ff, d)),
            TensorSpec(prefix + "mlp.w3.weight", (ff, d)),
            TensorSpec(prefix + "mlp.w2.weight", (d, ff))]
    return out


def target_specs(cfg: ModelConfig) -> list:
    out = [TensorSpec("tok_emb.weight", (cfg.vocab, cfg.d_model))]
    for i in range(cfg.n_layers):
        out += layer_specs(cfg, f"layers.{i}.", cfg.layer_kind(i))
    out += [TensorSpec("final_norm.weight", (cfg.d_model,)),
            TensorSpec("lm_head.weight", (cfg.vocab, cfg.d_model))]
    return out


def draft_specs(cfg: ModelConfig) -> list:
    out = []
    for j, src in enumerate(cfg.draft_map):
        out += layer_specs(cfg, f"draft.layers.{j}.", cfg.layer_kind(src))
    return out


def draft_engine_names(cfg: ModelConfig) -> list:
    """The tensors a draft engine outside the MLX model reads (the C draft): its layers
    and the embedding, final norm and head it shares with the target."""
    return ["tok_emb.weight", "final_norm.weight", "lm_head.weight"] + [t.name for t in draft_specs(cfg)]


def tensor_specs(cfg: ModelConfig) -> list:
    """All tensors in SPELW001 file order."""
    return target_specs(cfg) + draft_specs(cfg)


def weights_nbytes(cfg: ModelConfig) -> int:
    return sum(t.nbytes for t in tensor_specs(cfg))

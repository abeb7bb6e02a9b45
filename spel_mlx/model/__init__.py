"""The hybrid Gated-DeltaNet + RoPE-attention model of SPEC 2, in MLX, and its ops.

    ops.py          the ops interface (MLXOps: plain MLX), what backends replace
    functional.py   L2 norm, exp-free SwiGLU gate and softmax, RoPE table
    delta_rule.py   the delta rule: recurrence and chunked closed form
    linear.py       Linear and its CPU weight layout
    layers.py       RMSNorm, MLP, GatedDeltaNet, Attention, Block (SPEC 2)
    spel_model.py   SpelModel: weights, decoding forward, training forward
    passes.py       the compiled decoding pass and its per-layer caches
    state.py        DecodeState: the KV caches and GDN rings a pass reads and writes (SPEC 4)
    training_ops.py the training forward's ops, SPEC 3 fake quantization
    init.py         initial weights
    cpu_ops.py, metal_ops.py   fused CPU primitives, Metal kernels as ops
    backends.py     which ops run (auto_ops, select, describe)
"""
from .backends import auto_ops, describe, select
from .functional import l2_normalize, masked_softmax, rope_table, silu_mul
from .init import copy_target_to_draft, init_params, init_weights
from .layers import MLP, Attention, Block, DraftStack, GatedDeltaNet, RMSNorm
from .linear import Linear
from .ops import MLXOps
from .spel_model import SpelModel

__all__ = ["Attention", "Block", "DraftStack", "GatedDeltaNet", "Linear", "MLP", "MLXOps", "RMSNorm",
           "SpelModel", "auto_ops", "copy_target_to_draft", "describe", "init_params", "init_weights",
           "l2_normalize", "masked_softmax", "rope_table", "select", "silu_mul"]

"""One rank's slice of the target: ``StageModel`` and the checkpoint tensors it reads.

A stage runs the same compiled decoding pass as the whole model (model/passes.py)
over its own layers: the first stage from token ids (embedding first), the others
from the activations [M, d] the previous rank sent; the last stage ends with the
final norm and LM head, the others hand their activations on.  Its decoding state
is a ``DecodeState`` over its layers only, committed by indices as the whole
model's is (SPEC 4).  A stage reads only its own tensors from the checkpoint:
SPELW001 through the reader's memory map, safetensors one tensor at a time.
"""
from __future__ import annotations

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from ..checkpoints import CheckpointError, is_spelw, read_spelw
from ..decoding.loop import DecodeError
from ..model.backends import device_name, runs_on
from ..model.layers import Block, RMSNorm
from ..model.linear import Linear
from ..model.passes import run_pass
from ..model.state import DecodeState
from .split import Stage


class CheckpointTensors:
    """A checkpoint opened without reading its tensors: ``cfg``, ``get(name)`` (float32
    numpy, a view of the map where the file stores F32) and ``release(name)``."""

    def __init__(self, path: str):
        self.source = path
        if not is_spelw(path):
            from ..converters import SafetensorsModel
            st = SafetensorsModel(path)
            self.cfg, self.get, self.release = st.cfg, st.f32, st.release
            self._stored = lambda name: st.entries[name].file.raw(name)
        else:
            sp = read_spelw(path)
            self.cfg, self.release = sp.cfg, sp.release_tensor
            self.get = self._stored = sp.tensors.__getitem__

    def first_row(self, name: str) -> bytes:
        """The stored bytes of a tensor's first row (reads one row, not the tensor)."""
        return self._stored(name)[0].tobytes()


class StageModel(nn.Module):
    """Target layers [stage.start, stage.end) with the embedding (first stage) or the
    final norm and LM head (last stage).  Duck-types what ``run_pass`` needs of a model."""

    def __init__(self, cfg, stage: Stage):
        super().__init__()
        self.cfg, self.stage = cfg, stage
        if stage.first:
            self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = [Block(cfg, cfg.layer_kind(i)) for i in stage.layers]
        if stage.last:
            self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.lm_head = Linear(cfg.d_model, cfg.vocab)
        else:
            object.__setattr__(self, "lm_head", None)
        object.__setattr__(self, "_ops", None)
        object.__setattr__(self, "compile", True)
        object.__setattr__(self, "_compiled", {})     # (stack, M, window, device) -> pass
        object.__setattr__(self, "passes_built", 0)   # as SpelModel's (passes.run_pass counts)

    def load_stage_weights(self, tensors: CheckpointTensors) -> None:
        """Copy this stage's tensors in (layer i of the file is this stage's i - start),
        dropping each one's mapped pages once copied."""
        items = []
        for name, shape in self.tensor_shapes().items():
            src = self.file_name(name)
            a = tensors.get(src)
            if tuple(a.shape) != tuple(shape):
                raise CheckpointError(tensors.source, f"shape {list(a.shape)}, expected {list(shape)}", field=src)
            items.append((name, mx.array(np.asarray(a, dtype=np.float32))))
            mx.eval(items[-1][1])
            tensors.release(src)
        self.load_weights(items, strict=True)

    def tensor_shapes(self) -> dict:
        from mlx.utils import tree_flatten
        return {name: a.shape for name, a in tree_flatten(self.parameters())}

    def file_name(self, name: str) -> str:
        """The checkpoint's name of this module's parameter `name`."""
        if name.startswith("layers."):
            i, rest = name[len("layers."):].split(".", 1)
            return f"layers.{int(i) + self.stage.start}.{rest}"
        return name

    # --- what run_pass reads of a model --------------------------------------------
    @property
    def ops(self):
        return self._ops

    def set_ops(self, ops, device=None) -> None:
        """The ops the stage runs with on `device` ("cpu" | "gpu", None: the default
        device): a rank computes on one device."""
        if not runs_on(ops, device_name(device)):
            raise ValueError(f"ops {type(ops).__name__} cannot run on the {device_name(device)} device")
        object.__setattr__(self, "_ops", ops)
        object.__setattr__(self, "compile", not ops.requires_eager)
        self._compiled.clear()

    def stack_layers(self, stack: str) -> list:
        if stack != "target":
            raise DecodeError(f"a pipeline stage holds target layers only, not the {stack!r} stack: "
                              f"with --pipeline the draft is the C draft or n-gram lookup")
        return self.layers

    def stack_logits(self, inputs, layers: list, caches: list, ops):
        """The stage's output: logits on the last stage, activations [M, d] before."""
        x = self.tok_emb(inputs) if self.stage.first else inputs
        for blk, cache in zip(layers, caches):
            x = blk(x, cache, ops)
        if self.lm_head is None:
            return x
        return ops.linear(ops.rms_norm(x, self.final_norm.weight, self.final_norm.eps), self.lm_head)

    # --- decoding ------------------------------------------------------------------
    def new_state(self, stack: str = "target", ring: int = 2) -> DecodeState:
        self.stack_layers(stack)
        return DecodeState(self.cfg, "target", ring, layers=self.stage.layers)

    def forward(self, inputs, state: DecodeState, strict: bool = False) -> mx.array:
        """Run M rows (token ids on the first stage, activations [M, d] after it) on
        the state, nothing committed.  strict: row by row, so every row has the bits
        of the single-token pass as the whole model's strict rows have."""
        if self.stage.first:
            inputs = [int(t) for t in inputs]
        M = len(inputs) if self.stage.first else inputs.shape[0]
        state.check_room(M)
        if M == 1 or not strict:
            return run_pass(self, inputs, state)[0]
        return mx.concatenate([run_pass(self, inputs[j:j + 1], state)[0] for j in range(M)], axis=0)

"""What a training run is told (TrainConfig) and the trainer's one error type."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig, parse_config_string

# the shipped default's shape (spel-21m; spel-8m: d_model=256,n_layers=8,n_heads=4,d_ff=768,draft_map=0:2:3:5)
DEFAULT_SHAPE = ("d_model=384,n_layers=12,n_heads=6,head_dim=64,d_ff=896,vocab=2048,"
                 "max_seq=4096,draft_map=0:3:6:9")


class TrainError(RuntimeError):
    """Bad arguments, missing inputs or an unreadable run directory."""


def model_config(overrides: str, **fields) -> ModelConfig:
    """ModelConfig's defaults with a ``k=v,...`` string, then ``fields``, over them; validated."""
    d = {**ModelConfig().to_dict(), **parse_config_string(overrides), **fields}
    d["draft_map"] = tuple(d["draft_map"])
    return ModelConfig(**d).validate()


@dataclass
class TrainConfig:
    mode: str = "target"          # target | draft
    steps: int = 1000
    budget_min: float = 0.0       # >0: set steps from measured speed to fit this many minutes
    batch: int = 8
    seq: int = 256
    # schedule (see schedule.Controller)
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 50
    # AdamW
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    # instability and plateau control
    clip: float = 1.0
    spike_factor: float = 4.0
    plateau_patience: int = 3
    plateau_factor: float = 0.5
    plateau_min_delta: float = 0.01
    # cadence
    eval_every: int = 100
    eval_tokens: int = 16384
    ckpt_every: int = 100
    log_every: int = 10
    seed: int = 0
    chunk: int = 64
    # inputs
    data: str = "data/corpus"
    tokenizer: str = ""           # default: spel_mlx/assets/tokenizer.model
    init: str = ""                # a target or draft run, or an exported model: where a draft (or a continued target) starts
    draft_map: str = ""           # draft mode from a target run: its layers ("0:3:6"; "": the run's)
    onpolicy: str = ""            # draft mode: .npy of target-generated windows [n, seq+1]
    onpolicy_frac: float = 0.5    # share of each draft batch drawn from them
    # draft mode: the loss is KL(target_T || draft_T), logits divided by T, with
    # distill_t1_weight of it the plain KL (T = 1); see steps.distill_loss
    distill_temperature: float = 1.0
    distill_t1_weight: float = 0.0

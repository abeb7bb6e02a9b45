"""Model configuration: presets, ``--config k=v,...`` strings, SPEL_* env vars.

Precedence (SPEC 1): preset defaults < SPEL_CONFIG < individual SPEL_* vars <
``--config``; a configuration read from a checkpoint header replaces the
defaults, and an *explicit* override that contradicts it is an error.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass

from .settings import raw as raw_setting

MAX_DRAFT = 8  # SPELW001 header has 8 draft_map bytes

# Upper bounds of the integer fields, far above any real model.  Every ModelConfig is
# checked against them (validate), so a checkpoint's header or config.json is refused
# before anything is sized from it, and no configuration is written that the readers
# would refuse.  d_model and n_heads*head_dim stay <= 2^17 so that every q8 dot
# product (127 * 127 * columns) is exact in int32 in the C draft.
LIMITS = {"d_model": 1 << 17, "n_layers": 4096, "n_heads": 1 << 16, "head_dim": 1 << 16,
          "d_ff": 1 << 22, "vocab": 1 << 24, "max_seq": 1 << 24, "attn_period": 1 << 16, "spec_k": 16}
MAX_INNER = 1 << 17        # n_heads * head_dim
MAX_DRAFT_SOURCE = 254     # draft_map entries are u8 in the header, 0xFF meaning unused


class ConfigError(ValueError):
    """A configuration value is unknown, malformed or inconsistent; ``field`` names it."""

    def __init__(self, msg: str, field: str | None = None):
        super().__init__(msg)
        self.field = field


def _f32_positive(v) -> bool:
    """v is a finite number whose float32 (as SPELW001 stores it) is finite and > 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0] > 0
    except OverflowError:
        return False


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 384
    n_layers: int = 12
    n_heads: int = 6
    head_dim: int = 64
    d_ff: int = 1024
    vocab: int = 128
    max_seq: int = 4096
    attn_period: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    draft_map: tuple = (0, 3, 6, 9)
    spec_k: int = 4

    # --- derived -------------------------------------------------------
    @property
    def n_draft(self) -> int:
        return len(self.draft_map)

    @property
    def inner(self) -> int:
        """H * hd, the width of q, k and v."""
        return self.n_heads * self.head_dim

    def is_attention(self, layer: int) -> bool:
        return layer % self.attn_period == self.attn_period - 1

    def layer_kind(self, layer: int) -> str:
        return "attn" if self.is_attention(layer) else "gdn"

    @property
    def attention_layers(self) -> list:
        return [i for i in range(self.n_layers) if self.is_attention(i)]

    @property
    def gdn_layers(self) -> list:
        return [i for i in range(self.n_layers) if not self.is_attention(i)]

    # --- parameter counts (SPEC 2) --------------------------------------
    def mixer_params(self, kind: str) -> int:
        d, inner, H = self.d_model, self.inner, self.n_heads
        proj = 3 * inner * d + d * inner
        return proj + 3 * d + 2 * H if kind == "gdn" else proj

    def layer_params(self, layer: int) -> int:
        d = self.d_model
        return 2 * d + 3 * d * self.d_ff + self.mixer_params(self.layer_kind(layer))

    def target_params(self) -> int:
        d, V = self.d_model, self.vocab
        return 2 * V * d + d + sum(self.layer_params(i) for i in range(self.n_layers))

    def draft_params(self) -> int:
        """Draft's own parameters (shared embedding, final norm, head excluded)."""
        return sum(self.layer_params(i) for i in self.draft_map)

    def validate(self) -> "ModelConfig":
        """Check every field against LIMITS; returns self or raises ConfigError naming it."""
        for name, cap in LIMITS.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}={v!r}: must be a positive integer", name)
            if v > cap:
                raise ConfigError(f"{name}={v} out of range 1..{cap}", name)
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim}: must be even (RoPE rotates pairs)", "head_dim")
        if self.inner > MAX_INNER:
            raise ConfigError(f"n_heads*head_dim={self.inner} out of range 1..{MAX_INNER}", "n_heads")
        for name in ("rope_theta", "norm_eps"):
            v = getattr(self, name)
            if not _f32_positive(v):
                raise ConfigError(f"{name}={v!r}: must be finite and positive as a float32", name)
        dmap = self.draft_map
        if not isinstance(dmap, (tuple, list)):
            raise ConfigError(f"draft_map={dmap!r}: must be a list of layer indices", "draft_map")
        if len(dmap) > MAX_DRAFT:
            raise ConfigError(f"n_draft={len(dmap)}: at most {MAX_DRAFT} draft layers", "draft_map")
        if not dmap:
            raise ConfigError("draft_map is empty: the draft needs at least one layer", "draft_map")
        top = min(self.n_layers - 1, MAX_DRAFT_SOURCE)
        for i, j in enumerate(dmap):
            if not isinstance(j, int) or isinstance(j, bool) or not (0 <= j <= top):
                raise ConfigError(f"draft_map[{i}]={j!r} out of range 0..{top}", f"draft_map[{i}]")
        return self

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw).validate()

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["draft_map"] = list(self.draft_map)
        return d


PRESETS = {
    "21m": ModelConfig(),
    "218m": ModelConfig(d_model=1024, n_layers=16, n_heads=16, head_dim=64, d_ff=3072),
}

FIELDS = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
_ENV = {f"SPEL_{k.upper()}": k for k in ("d_model", "n_layers", "n_heads", "head_dim", "d_ff",
                                         "vocab", "max_seq", "attn_period", "spec_k", "draft_map")}


def _parse_value(key: str, raw: str):
    raw = raw.strip()
    try:
        if key == "draft_map":
            parts = [p for p in raw.replace("[", "").replace("]", "").replace(":", " ")
                     .replace("/", " ").replace(";", " ").replace(",", " ").split() if p]
            return tuple(int(p) for p in parts)
        if key in ("rope_theta", "norm_eps"):
            return float(raw)
        return int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r}: not a valid {'list of integers' if key == 'draft_map' else 'number'}") from None


def parse_config_string(s: str) -> dict:
    """``"d_model=1024,n_layers=16,draft_map=0:3:6:9"`` -> dict.

    draft_map entries are separated by ':' ';' '/' or spaces (',' separates keys).
    """
    out: dict = {}
    if not s or not s.strip():
        return out
    for item in s.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ConfigError(f"config item {item!r}: expected key=value")
        k, v = item.split("=", 1)
        k = k.strip().lower()
        if k == "n_draft":
            raise ConfigError("n_draft is derived from draft_map; set draft_map instead")
        if k not in FIELDS:
            raise ConfigError(f"unknown config key {k!r} (known: {', '.join(FIELDS)})")
        out[k] = _parse_value(k, v)
    return out


def env_overrides(environ=None) -> dict:
    out = dict(parse_config_string(raw_setting("SPEL_CONFIG", environ)))
    for var, key in _ENV.items():
        text = raw_setting(var, environ)
        if text:
            out[key] = _parse_value(key, text)
    return out


def resolve_config(preset: str | None = "21m", overrides: str | dict | None = None,
                   checkpoint: ModelConfig | None = None, environ=None,
                   use_env: bool = True) -> ModelConfig:
    """Build the effective configuration.

    ``checkpoint``: the config read from a file header. Explicit overrides (env or
    --config) that contradict it raise ConfigError; spec_k, the only runtime-only
    field, may always be set.
    """
    explicit = env_overrides(environ) if use_env else {}
    if isinstance(overrides, str):
        explicit.update(parse_config_string(overrides))
    elif overrides:
        explicit.update(overrides)
    if checkpoint is not None:
        for k, v in explicit.items():
            if k == "spec_k":
                continue
            if getattr(checkpoint, k) != v:
                raise ConfigError(f"{k}={v!r} contradicts the checkpoint's {k}={getattr(checkpoint, k)!r}")
        base = checkpoint
    else:
        if preset is None:
            preset = "21m"
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        base = PRESETS[preset]
    try:
        cfg = dataclasses.replace(base, **explicit)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    return cfg.validate()

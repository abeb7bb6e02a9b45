"""The rules both checkpoint readers share, and the errors they raise.

A SPELW001 header and a safetensors folder's config describe the same fields; both
readers turn them into a ModelConfig here (``config_from_fields``), bounded by
``spel_mlx.config.LIMITS``, so nothing is sized from an unchecked claim, and the
writers validate the same way before writing, so nothing is written that the readers
would refuse.  Also here: JSON parsing with named errors, the golden token count, and
the memory a checkpoint implies against what the machine has.
"""
from __future__ import annotations

import json
import os
import resource

from ..config import ConfigError, ModelConfig

# Config fields a checkpoint stores (spec_k is runtime-only), in SPELW001 header order.
STORED_FIELDS = ("d_model", "n_layers", "n_heads", "head_dim", "d_ff", "vocab", "max_seq",
                 "attn_period", "rope_theta", "norm_eps", "draft_map")
FLOAT_FIELDS = ("rope_theta", "norm_eps")
MAX_GOLDEN = 1 << 20      # golden tokens a footer may hold (and never more than max_seq)


class CheckpointError(ValueError):
    """A checkpoint is malformed or inconsistent.

    The message names the file, the field or tensor and the byte offset, on one line.
    """

    def __init__(self, path, what: str, offset: int | None = None, field: str | None = None):
        self.path, self.field, self.offset = str(path), field, offset
        where = ""
        if field is not None and offset is not None:
            where = f" [{field} at byte {offset}]"
        elif field is not None:
            where = f" [{field}]"
        elif offset is not None:
            where = f" [at byte {offset}]"
        super().__init__(f"{path}: {what}{where}")


class CheckpointTooLarge(CheckpointError):
    """Loading the checkpoint would need more memory than this machine (or process) has."""


class NonFiniteWeightsWarning(UserWarning):
    """A checkpoint's weights hold NaN or infinity (loaded, but its outputs are garbage)."""


def config_from_fields(d, path, field: str, offset: int | None = None, offsets: dict | None = None) -> ModelConfig:
    """ModelConfig from the stored fields (a parsed config.json / metadata object, or
    a SPELW001 header's values): exact types, then ``ModelConfig.validate``.  An error
    names the field and, with ``offsets`` (field -> byte), where it is stored."""
    if not isinstance(d, dict):
        raise CheckpointError(path, "config must be a JSON object", offset=offset, field=field)
    offsets = offsets or {}
    kw = {}
    for k in STORED_FIELDS:
        if k not in d:
            raise CheckpointError(path, f"config lacks {k!r}", offset=offset, field=field)
        v = d[k]
        if k == "draft_map":
            ok = isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            v = tuple(v) if ok else v
        elif k in FLOAT_FIELDS:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        else:
            ok = isinstance(v, int) and not isinstance(v, bool)
        if not ok:
            raise CheckpointError(path, f"config {k}={_brief(v)} has the wrong type", offset=offsets.get(k, offset),
                                  field=field if k not in offsets else k)
        kw[k] = v
    try:
        if any(not isinstance(kw[k], float) for k in FLOAT_FIELDS):   # an int too big for a float
            kw.update({k: float(kw[k]) for k in FLOAT_FIELDS})
        return ModelConfig(**kw).validate()
    except OverflowError:
        raise CheckpointError(path, "config rope_theta / norm_eps is too large for a float",
                              offset=offset, field=field) from None
    except ConfigError as e:
        at = offsets.get(e.field, offset)
        raise CheckpointError(path, f"invalid config: {e}", offset=at,
                              field=e.field if e.field in offsets else field) from None


def _brief(v) -> str:
    """A short repr for messages (a hostile value may be huge or deeply nested)."""
    try:
        r = repr(v)
    except (RecursionError, ValueError):
        return f"<{type(v).__name__}>"
    return r if len(r) <= 40 else r[:37] + "..."


def load_json(raw, path, field: str, offset: int | None = None):
    """json.loads with every failure a CheckpointError: bad UTF-8, bad syntax (with
    its byte offset), nesting too deep for the parser, numbers Python refuses."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        return json.loads(text)
    except UnicodeDecodeError as e:
        raise CheckpointError(path, f"bad JSON {field}: not UTF-8 ({e.reason})", offset=(offset or 0) + e.start,
                              field=field) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(path, f"bad JSON {field}: {e.msg}", offset=(offset or 0) + e.pos, field=field) from None
    except RecursionError:
        raise CheckpointError(path, f"bad JSON {field}: nested too deeply", offset=offset, field=field) from None
    except ValueError as e:          # e.g. an integer literal beyond Python's digit limit
        raise CheckpointError(path, f"bad JSON {field}: {str(e).splitlines()[0]}", offset=offset, field=field) from None


def read_json_file(path, field: str, max_bytes: int):
    """A small JSON file (config.json, a shard index), refusing one larger than max_bytes."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror or e}", field=field) from None
    if len(raw) > max_bytes:
        raise CheckpointError(path, f"larger than {max_bytes} bytes: not a {field}", field=field)
    return load_json(raw, path, field)


def check_golden_count(n: int, cfg: ModelConfig, path, offset: int | None = None, field: str = "golden.tokens"):
    """The golden tokens are fed one per position from reset: at most max_seq of them."""
    top = min(MAX_GOLDEN, cfg.max_seq)
    if not 1 <= n <= top:
        why = f"max_seq={cfg.max_seq}" if n > cfg.max_seq else f"the limit {MAX_GOLDEN}"
        raise CheckpointError(path, f"golden token count n={n} out of range 1..{top} ({why})",
                              offset=offset, field=field)


# --------------------------------------------------------------------------- memory

def implied_memory(cfg: ModelConfig) -> dict:
    """Bytes that loading a checkpoint for decoding allocates up front, by part.

    The KV caches are not in it: they grow with the positions used (spel_mlx.model.state,
    neon/draft.c), and so do the RoPE tables (spel_mlx.model.functional.rope_table), except
    the one the CPU pass plan captures for every position where max_seq <= 2^16
    (functional.ROPE_ALL_ROWS): built in float64 then float32, about 40 bytes per
    (position, frequency).
    """
    n_gdn = len(cfg.gdn_layers) + sum(1 for j in cfg.draft_map if not cfg.is_attention(j))
    ring = (cfg.spec_k + 1) * n_gdn * (cfg.n_heads * cfg.head_dim ** 2 + 2 * cfg.d_model) * 4
    return {"weights": 4 * (cfg.target_params() + cfg.draft_params()),
            "C draft": 4 * (2 * cfg.vocab * cfg.d_model + cfg.d_model) + cfg.draft_params(),
            "RoPE table": 40 * (cfg.max_seq if cfg.max_seq <= 1 << 16 else 64) * (cfg.head_dim // 2),
            "GDN state rings": 2 * ring}


def _memory_available() -> int | None:
    """MemAvailable (Linux): what can be allocated without swapping; else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _address_space_left() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        used = 0
    return max(soft - used, 0)


def _cgroup_left() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            raw = f.read().strip()
        if raw == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return max(int(raw) - int(f.read().strip()), 0)
    except (OSError, ValueError):
        return None


def machine_memory() -> int | None:
    """What this process may allocate: the least of the memory available, what its
    address space limit (RLIMIT_AS) leaves, and what its cgroup leaves; None if unknown."""
    known = [v for v in (_memory_available(), _address_space_left(), _cgroup_left()) if v is not None]
    return min(known) if known else None


def check_memory(cfg: ModelConfig, path):
    """Refuse (CheckpointTooLarge) a configuration whose implied memory exceeds the machine's."""
    have = machine_memory()
    parts = implied_memory(cfg)
    need = sum(parts.values())
    if have is not None and need > have:
        gib = 2 ** 30
        detail = ", ".join(f"{k} {v / gib:.2f}" for k, v in parts.items())
        raise CheckpointTooLarge(path, f"loading it needs about {need / gib:.2f} GiB ({detail}) but this "
                                 f"process can allocate {have / gib:.2f} GiB", field="memory")

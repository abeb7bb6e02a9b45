"""What the NoteBank report measures: storage in bytes beside the KV caches it is
compared with, and whether notes and retrievals cover known token ranges."""
from __future__ import annotations

import numpy as np

from .writer import Note

# Per-note header stored beside the coordinates: span start (u32), span length (u32),
# chunk index (u32), span distinctiveness (f32).
NOTE_HEADER_BYTES = 16
BF16_BYTES = 2
FP32_BYTES = 4


def gdn_channel_count(model_cfg) -> int:
    """C = (GDN layers) x heads: the channels a note stores coordinates for."""
    return len(model_cfg.gdn_layers) * model_cfg.n_heads


def note_bytes(n_channels: int, coords: int = 16) -> int:
    """Bytes of one note: C channels x coords BF16 + the 16-byte header."""
    return n_channels * coords * BF16_BYTES + NOTE_HEADER_BYTES


def notes_storage_bytes(n_notes: int, n_channels: int, coords: int = 16) -> int:
    return n_notes * note_bytes(n_channels, coords)


def dense_kv_bytes(model_cfg, n_tokens: int) -> int:
    """FP32 K and V for every layer as if all were attention: T x L x 2 x H*hd x 4."""
    return n_tokens * model_cfg.n_layers * 2 * model_cfg.inner * FP32_BYTES


def hybrid_kv_bytes(model_cfg, n_tokens: int) -> int:
    """FP32 K and V of the attention layers only (what the hybrid model keeps)."""
    return n_tokens * len(model_cfg.attention_layers) * 2 * model_cfg.inner * FP32_BYTES


def native_payload_bytes(model_cfg) -> int:
    """FP32 size of one note's native-replay payload: the span's S over all GDN layers."""
    return len(model_cfg.gdn_layers) * model_cfg.n_heads * model_cfg.head_dim ** 2 * FP32_BYTES


def recurrent_state_bytes(model_cfg) -> int:
    """FP32 size of one committed GDN state (S and conv tail over all GDN layers)."""
    per = model_cfg.n_heads * model_cfg.head_dim ** 2 + 2 * model_cfg.d_model
    return len(model_cfg.gdn_layers) * per * FP32_BYTES


def contains(note: Note, lo: int, hi: int) -> bool:
    """True when the note's span covers the whole token range [lo, hi)."""
    return note.start <= lo and hi <= note.end


def containment(notes: list, needles: list) -> int:
    """How many needle ranges [(lo, hi)] are wholly inside some note span."""
    return sum(any(contains(n, lo, hi) for n in notes) for lo, hi in needles)


def hit_at_r(top: list, lo: int, hi: int) -> bool:
    return any(contains(n, lo, hi) for n in top)


def token_rank(logits: np.ndarray, token: int) -> int:
    """1-based rank of ``token`` under ``logits`` (1 = argmax; ties count in its favour)."""
    logits = np.asarray(logits, np.float32)
    return int((logits > logits[token]).sum()) + 1


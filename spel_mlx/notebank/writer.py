"""The writer: notes from captured keys (SPEC 7).

Per chunk, key distinctiveness ``1 - <k_hat_t, mu_hat>`` (mu_hat = normalized chunk-mean
key); greedy non-overlapping span selection; per channel 16 BF16 coordinates from a fixed,
seeded sparse projection of the span key. numpy only."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .config import NoteBankConfig, NoteBankError


def to_bf16_bits(x) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # rounding could carry a NaN payload into Inf; force a quiet NaN
        out[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return out


def from_bf16_bits(b) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    b = np.ascontiguousarray(b, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)

def sparse_projection(n_channels: int, head_dim: int, coords: int = 16, seed: int = 0x5E1):
    """The fixed sparse projection, one per channel: ``[C, coords, head_dim]`` float32.

    Each input coordinate feeds exactly one output coordinate with a random sign
    (a balanced signed hashing: every output sums ``head_dim / coords`` inputs when
    that divides), so that inner products and norms are preserved in expectation. Channel c draws from ``default_rng([seed, c])``: the
    projection is a pure function of (seed, C, head_dim, coords) and is never stored.
    """
    if head_dim < 1 or coords < 1 or n_channels < 0:
        raise NoteBankError(f"projection shape C={n_channels} hd={head_dim} coords={coords} invalid")
    proj = np.zeros((n_channels, coords, head_dim), np.float32)
    base = np.arange(head_dim) % coords  # balanced bucket sizes
    for c in range(n_channels):
        rng = np.random.default_rng([seed, c])
        bucket = rng.permutation(base)
        sign = rng.integers(0, 2, head_dim) * 2 - 1
        proj[c, bucket, np.arange(head_dim)] = sign
    return proj


def unit(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """x / |x| along axis; a zero vector stays zero (it then scores 0 everywhere)."""
    x = np.asarray(x, np.float32)
    n = np.sqrt(np.einsum("...i,...i->...", x, x) if axis in (-1, x.ndim - 1)
                else (x * x).sum(axis=axis))
    n = np.expand_dims(n, axis)
    return np.divide(x, n, out=np.zeros_like(x), where=n > 0)


@dataclass
class Note:
    start: int                 # absolute position of the first span token
    end: int                   # one past the last span token
    chunk: int                 # chunk index the span came from
    score: float               # mean key distinctiveness over the span
    coords: np.ndarray         # uint16 BF16 bits [C, coords]
    replay_state: object = None  # optional native-replay payload (glue.NoteBank.span_state)

    @property
    def length(self) -> int:
        return self.end - self.start

    def vectors(self) -> np.ndarray:
        return from_bf16_bits(self.coords)


def key_distinctiveness(k: np.ndarray) -> np.ndarray:
    """``1 - <k_hat_t, mu_hat>`` per position and channel for one chunk.

    k: ``[n, C, hd]`` native (already normalized) keys. Returns ``[n, C]`` float32.
    mu_hat is the normalized mean key of the chunk per channel.
    """
    k = np.asarray(k, np.float32)
    if k.ndim != 3:
        raise NoteBankError(f"keys must be [n, C, hd], got shape {k.shape}")
    if k.shape[0] == 0:
        return np.zeros((0, k.shape[1]), np.float32)
    k_hat = unit(k)
    mu_hat = unit(k_hat.mean(axis=0))
    return (1.0 - np.einsum("nch,ch->nc", k_hat, mu_hat)).astype(np.float32)


def position_scores(dist: np.ndarray, channel_top: float = 1.0) -> np.ndarray:
    """Per-position score: the mean distinctiveness of the position's top
    ``ceil(channel_top * C)`` channels. dist ``[n, C]`` -> ``[n]``.

    A rare token tends to stand out strongly in a few layer-heads rather than in all;
    the plain channel mean (``channel_top=1``) dilutes that."""
    dist = np.asarray(dist, np.float32)
    if dist.shape[0] == 0:
        return np.zeros(0, np.float32)
    m = max(1, int(np.ceil(channel_top * dist.shape[1] - 1e-9)))
    if m >= dist.shape[1]:
        return dist.mean(axis=1)
    return np.partition(dist, dist.shape[1] - m, axis=1)[:, -m:].mean(axis=1)


def select_spans(dist: np.ndarray, span: int, count: int) -> list:
    """Greedy non-overlapping windows of length ``min(span, n)`` with the largest sum
    of per-position excess distinctiveness ``max(0, dist - median(dist))``; ties go to
    the earlier window. The excess (not the raw value) is summed so that ordinary
    positions weigh nothing and a window is placed by where the distinctive positions
    are. Returns ``[(start, end, mean_dist)]`` in selection order (best first)."""
    dist = np.asarray(dist, np.float64)
    n = dist.shape[0]
    if n == 0:
        return []
    L = min(span, n)
    excess = np.clip(dist - np.median(dist), 0, None)
    csum = np.concatenate([[0.0], np.cumsum(excess)])
    raw = np.concatenate([[0.0], np.cumsum(dist)])
    window = csum[L:] - csum[:-L]          # window[s] = sum dist[s:s+L]
    alive = np.ones(window.shape[0], bool)
    out = []
    for _ in range(count):
        if not alive.any():
            break
        masked = np.where(alive, window, -np.inf)
        s = int(np.argmax(masked))           # argmax returns the first maximum
        out.append((s, s + L, float((raw[s + L] - raw[s]) / L)))
        alive[max(0, s - L + 1):s + L] = False  # windows overlapping [s, s+L)
    return out


def span_key(k_span: np.ndarray, dist_span: np.ndarray) -> np.ndarray:
    """One key per channel for a span: the distinctiveness-weighted mean of its
    normalized keys (plain mean when no position is distinctive), normalized.
    k_span ``[L, C, hd]``, dist_span ``[L, C]`` -> ``[C, hd]``."""
    w = np.clip(np.asarray(dist_span, np.float32), 0, None)
    total = w.sum(axis=0)                                   # [C]
    w = np.where(total > 0, w / np.where(total > 0, total, 1), 1.0 / max(1, w.shape[0]))
    return unit(np.einsum("lc,lch->ch", w, unit(np.asarray(k_span, np.float32))))


class NoteWriter:
    """Turns captured keys into notes, chunk by chunk.

    ``write(k)`` takes ``[T, C, hd]`` keys of a whole context (or call ``write_chunk``
    per chunk as captures arrive). Timing of the writer math is kept in
    ``seconds`` (capture/forward cost is not included)."""

    def __init__(self, cfg: NoteBankConfig, n_channels: int, head_dim: int):
        self.cfg = cfg.validate()
        self.n_channels = n_channels
        self.head_dim = head_dim
        self.projection = sparse_projection(n_channels, head_dim, cfg.coords, cfg.seed)
        self.notes: list = []
        self.seconds = 0.0

    def _check(self, k):
        k = np.asarray(k, np.float32)
        if k.ndim != 3 or k.shape[1:] != (self.n_channels, self.head_dim):
            raise NoteBankError(f"keys shape {k.shape}: expected [n, {self.n_channels}, "
                                f"{self.head_dim}]")
        return k

    def write_chunk(self, k, start: int, chunk_index: int) -> list:
        """Select spans in one chunk of keys starting at absolute position ``start``."""
        k = self._check(k)
        t0 = time.perf_counter()
        new = []
        if k.shape[0]:
            dist = key_distinctiveness(k)
            per_pos = position_scores(dist, self.cfg.channel_top)
            for s, e, score in select_spans(per_pos, self.cfg.span, self.cfg.notes_per_chunk):
                key = span_key(k[s:e], dist[s:e])                         # [C, hd]
                proj = np.einsum("cph,ch->cp", self.projection, key)      # [C, coords]
                new.append(Note(start + s, start + e, chunk_index, score, to_bf16_bits(proj)))
        self.seconds += time.perf_counter() - t0
        self.notes.extend(new)
        return new

    def write(self, k, start: int = 0) -> list:
        k = self._check(k)
        out = []
        for ci, c0 in enumerate(range(0, k.shape[0], self.cfg.chunk)):
            out += self.write_chunk(k[c0:c0 + self.cfg.chunk], start + c0, ci)
        return out

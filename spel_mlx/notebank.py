"""NoteBank: sparse episodic notes over the recurrent (GDN) layers' keys (SPEC 7).

Pieces, in the order a reader meets them:

* writer    - chunked over the captured native k of every GDN layer-head channel;
              key distinctiveness ``1 - <k_hat_t, mu_hat>`` (mu_hat = normalized chunk-mean
              key); greedy non-overlapping span selection; per channel 16 BF16 coordinates
              from a fixed, seeded sparse projection of the span key.
* addressing- query vectors from the last Q positions (native q by default), per-channel
              cosine similarity in the projected space, summed ranking (default) or the
              per-channel integer vote ranker (opt-in), top-R.
* branching - ``state.snapshot()`` / ``state.restore()`` around a retrieval branch.
* replay    - token re-prefill of the selected spans before the query (default), or the
              opt-in native replay that adds each span's own recurrent state into the
              committed ring slot instead of re-prefilling tokens.

The pure parts (writer math, projection, ranking, storage arithmetic) work on numpy
arrays; the model glue (capture runs, branching, replay, demo) is at the bottom and
imports the model lazily. Decisions the spec leaves open are written down in
docs/notebank.md.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

# Per-note header stored beside the coordinates: span start (u32), span length (u32),
# chunk index (u32), span distinctiveness (f32).
NOTE_HEADER_BYTES = 16
BF16_BYTES = 2
FP32_BYTES = 4


class NoteBankError(ValueError):
    """Bad NoteBank input: a wrong shape, an unknown option, an out-of-range value."""


# --------------------------------------------------------------------------- BF16
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


# --------------------------------------------------------------------------- config
RANKERS = ("summed", "votes")
QUERY_SOURCES = ("q", "k")


@dataclass(frozen=True)
class NoteBankConfig:
    chunk: int = 128            # writer chunk length in tokens
    span: int = 16              # note span length in tokens (shorter when the chunk is)
    notes_per_chunk: int = 2    # spans selected per chunk (fewer if they do not fit)
    coords: int = 16            # projected coordinates per channel, stored as BF16
    seed: int = 0x5E1          # seeds the fixed sparse projection
    query_positions: int = 4    # Q: query vectors come from the last Q positions
    top_r: int = 2              # R: notes returned by addressing
    ranker: str = "summed"      # "summed" (default) or "votes" (diagnostic)
    query_source: str = "q"     # which captured vector addresses notes: native q or k

    def validate(self) -> "NoteBankConfig":
        for name in ("chunk", "span", "notes_per_chunk", "coords", "query_positions", "top_r"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise NoteBankError(f"NoteBank {name}={v!r}: must be a positive integer")
        if self.ranker not in RANKERS:
            raise NoteBankError(f"NoteBank ranker={self.ranker!r}: expected one of {RANKERS}")
        if self.query_source not in QUERY_SOURCES:
            raise NoteBankError(f"NoteBank query_source={self.query_source!r}: "
                                f"expected one of {QUERY_SOURCES}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise NoteBankError(f"NoteBank seed={self.seed!r}: must be a non-negative integer")
        return self

    def replace(self, **kw) -> "NoteBankConfig":
        return dataclasses.replace(self, **kw).validate()


# --------------------------------------------------------------------------- projection
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


def _unit(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """x / |x| along axis; a zero vector stays zero (it then scores 0 everywhere)."""
    n = np.linalg.norm(x, axis=axis, keepdims=True)
    return np.where(n > 0, x / np.where(n > 0, n, 1), 0).astype(np.float32)


# --------------------------------------------------------------------------- writer
@dataclass
class Note:
    start: int                 # absolute position of the first span token
    end: int                   # one past the last span token
    chunk: int                 # chunk index the span came from
    score: float               # mean key distinctiveness over the span
    coords: np.ndarray         # uint16 BF16 bits [C, coords]
    replay_state: object = None  # optional native-replay payload (see native_replay)

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
    k_hat = _unit(k)
    mu_hat = _unit(k_hat.mean(axis=0))
    return (1.0 - np.einsum("nch,ch->nc", k_hat, mu_hat)).astype(np.float32)


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
    return _unit(np.einsum("lc,lch->ch", w, _unit(np.asarray(k_span, np.float32))))


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
            per_pos = dist.mean(axis=1)
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


# --------------------------------------------------------------------------- addressing
def query_vectors(qs: np.ndarray, q_positions: int) -> np.ndarray:
    """Normalized mean of the last ``q_positions`` query vectors per channel.
    qs ``[M, C, hd]`` -> ``[C, hd]`` (zeros when M == 0)."""
    qs = np.asarray(qs, np.float32)
    if qs.ndim != 3:
        raise NoteBankError(f"query vectors must be [M, C, hd], got shape {qs.shape}")
    if qs.shape[0] == 0:
        return np.zeros(qs.shape[1:], np.float32)
    return _unit(_unit(qs[-q_positions:]).mean(axis=0))


def channel_similarity(query_proj: np.ndarray, note_vectors: np.ndarray) -> np.ndarray:
    """Cosine similarity per note and channel in the projected space.
    query_proj ``[C, P]``, note_vectors ``[N, C, P]`` -> ``[N, C]`` float32."""
    return np.einsum("cp,ncp->nc", _unit(query_proj), _unit(note_vectors)).astype(np.float32)


def rank_summed(sim: np.ndarray) -> np.ndarray:
    """Note indices by summed channel similarity, best first; ties -> lower index."""
    sim = np.asarray(sim, np.float32)
    if sim.shape[0] == 0:
        return np.zeros(0, np.int64)
    total = sim.astype(np.float64).sum(axis=1)
    return np.lexsort((np.arange(sim.shape[0]), -total))


def channel_votes(sim: np.ndarray) -> np.ndarray:
    """Integer votes: each channel gives one vote to every note at its maximum similarity."""
    sim = np.asarray(sim, np.float32)
    if sim.shape[0] == 0:
        return np.zeros(0, np.int64)
    return (sim == sim.max(axis=0, keepdims=True)).sum(axis=1).astype(np.int64)


def rank_votes(sim: np.ndarray) -> np.ndarray:
    """Note indices by channel votes, best first; ties -> summed similarity -> lower index."""
    sim = np.asarray(sim, np.float32)
    if sim.shape[0] == 0:
        return np.zeros(0, np.int64)
    total = sim.astype(np.float64).sum(axis=1)
    return np.lexsort((np.arange(sim.shape[0]), -total, -channel_votes(sim)))


@dataclass
class Retrieval:
    order: np.ndarray          # note indices, best first (all notes)
    top: list                  # the top-R notes
    similarity: np.ndarray     # [N, C]
    seconds: float


def address(notes: list, qs: np.ndarray, projection: np.ndarray, cfg: NoteBankConfig,
            ranker: str | None = None) -> Retrieval:
    """Rank notes for query vectors ``qs [M, C, hd]`` (the captured q or k of the query)."""
    ranker = ranker or cfg.ranker
    if ranker not in RANKERS:
        raise NoteBankError(f"ranker={ranker!r}: expected one of {RANKERS}")
    t0 = time.perf_counter()
    qv = query_vectors(qs, cfg.query_positions)
    if qv.shape[0] != projection.shape[0]:
        raise NoteBankError(f"query has {qv.shape[0]} channels, projection {projection.shape[0]}")
    if not notes:
        return Retrieval(np.zeros(0, np.int64), [], np.zeros((0, qv.shape[0]), np.float32),
                         time.perf_counter() - t0)
    qp = np.einsum("cph,ch->cp", projection, qv)
    sim = channel_similarity(qp, np.stack([n.vectors() for n in notes]))
    order = rank_summed(sim) if ranker == "summed" else rank_votes(sim)
    top = [notes[i] for i in order[:cfg.top_r]]
    return Retrieval(order, top, sim, time.perf_counter() - t0)


# --------------------------------------------------------------------------- storage
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


def recurrent_state_bytes(model_cfg) -> int:
    """FP32 size of one committed GDN state (S and conv tail over all GDN layers)."""
    per = model_cfg.n_heads * model_cfg.head_dim ** 2 + 2 * model_cfg.d_model
    return len(model_cfg.gdn_layers) * per * FP32_BYTES


# --------------------------------------------------------------------------- metrics
def contains(note: Note, lo: int, hi: int) -> bool:
    """True when the note's span covers the whole token range [lo, hi)."""
    return note.start <= lo and hi <= note.end


def containment(notes: list, needles: list) -> int:
    """How many needle ranges [(lo, hi)] are wholly inside some note span."""
    return sum(any(contains(n, lo, hi) for n in notes) for lo, hi in needles)


def hit_at_r(top: list, lo: int, hi: int) -> bool:
    return any(contains(n, lo, hi) for n in top)

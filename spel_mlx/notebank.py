"""NoteBank: sparse episodic notes over the recurrent (GDN) layers' keys (SPEC 7).

Pieces, in the order a reader meets them:

* writer    - chunked over the captured native k of every GDN layer-head channel;
              key distinctiveness ``1 - <k_hat_t, mu_hat>`` (mu_hat = normalized chunk-mean
              key); greedy non-overlapping span selection; per channel 16 BF16 coordinates
              from a fixed, seeded sparse projection of the span key.
* addressing- query vectors from the last Q positions (the query's captured k by default,
              native q opt-in), per-channel cosine similarity in the projected space,
              summed ranking (default) or the per-channel integer vote ranker (opt-in), top-R.
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
    query_source: str = "k"     # which captured vector addresses notes: the query's k or q
    channel_top: float = 1.0    # a position's score: mean distinctiveness of its most
                                # distinctive channels (this fraction of C; 1.0 = all)

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
        if not (isinstance(self.channel_top, (int, float)) and 0.0 < self.channel_top <= 1.0):
            raise NoteBankError(f"NoteBank channel_top={self.channel_top!r}: must be in (0, 1]")
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
    x = np.asarray(x, np.float32)
    n = np.sqrt(np.einsum("...i,...i->...", x, x) if axis in (-1, x.ndim - 1)
                else (x * x).sum(axis=axis))
    n = np.expand_dims(n, axis)
    return np.divide(x, n, out=np.zeros_like(x), where=n > 0)


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


# --------------------------------------------------------------------------- addressing
def query_vectors(qs: np.ndarray, q_positions: int) -> np.ndarray:
    """Normalized mean of the last ``q_positions`` query vectors (captured k or q) per channel.
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


# =========================================================================== model glue
# Everything below runs the MLX model (spel_mlx.model / state); imported lazily so the
# pure parts above stay usable without it.

def gdn_channel_count(model_cfg) -> int:
    """C = (GDN layers) x heads: the channels a note stores coordinates for."""
    return len(model_cfg.gdn_layers) * model_cfg.n_heads


def _stack_capture(capture: dict, gdn_layers: list):
    """capture[layer] = {"q","k"} [M,H,hd] -> numpy q, k [M, C, hd], channel = g*H + h."""
    import mlx.core as mx
    qs = [capture[i]["q"] for i in gdn_layers]
    ks = [capture[i]["k"] for i in gdn_layers]
    mx.eval(qs, ks)
    q = np.concatenate([np.asarray(a, np.float32).reshape(a.shape[0], -1, a.shape[-1]) for a in qs], 1)
    k = np.concatenate([np.asarray(a, np.float32).reshape(a.shape[0], -1, a.shape[-1]) for a in ks], 1)
    return q, k


def run_captured(model, state, tokens, strict: bool = False, on_piece=None, keep: bool = True):
    """Feed ``tokens`` through the target in pieces of at most the ring size, with
    activation capture, committing each piece. Returns ``(q, k, last_logits)``:
    q, k numpy ``[T, C, hd]`` over the GDN channels (empty when ``keep`` is False),
    last logits numpy ``[V]`` (None for no tokens). ``on_piece(start, q, k)`` sees each
    piece as it arrives."""
    import mlx.core as mx
    tokens = [int(t) for t in tokens]
    C, hd = gdn_channel_count(model.cfg), model.cfg.head_dim
    gdn = state.gdn_layers
    qs, ks, logits = [], [], None
    for i in range(0, len(tokens), state.ring):
        piece = tokens[i:i + state.ring]
        cap: dict = {}
        out = model.forward(piece, state, strict=strict, capture=cap)
        state.commit(len(piece))
        q, k = _stack_capture(cap, gdn)
        if on_piece is not None:
            on_piece(i, q, k)
        if keep:
            qs.append(q)
            ks.append(k)
        logits = out
    if logits is not None:
        mx.eval(logits)
        logits = np.asarray(logits[-1], np.float32)
    empty = np.zeros((0, C, hd), np.float32)
    return (np.concatenate(qs) if qs else empty), (np.concatenate(ks) if ks else empty), logits


def feed(model, state, tokens, strict: bool = False):
    """Prefill ``tokens`` (committing them) and return the last logits as numpy [V]."""
    import mlx.core as mx
    tokens = [int(t) for t in tokens]
    if not tokens:
        return None
    out = model.prefill(tokens, state, strict=strict)
    mx.eval(out)
    return np.asarray(out, np.float32)


def token_rank(logits: np.ndarray, token: int) -> int:
    """1-based rank of ``token`` under ``logits`` (1 = argmax; ties count in its favour)."""
    logits = np.asarray(logits, np.float32)
    return int((logits > logits[token]).sum()) + 1


class Branch:
    """``with Branch(state):`` snapshots the committed state and restores it on exit,
    so whatever the block feeds (retrieval, replay, reading) leaves no trace."""

    def __init__(self, state):
        self.state = state
        self.snap = None

    def __enter__(self):
        self.snap = self.state.snapshot()
        return self

    def __exit__(self, *exc):
        self.state.restore(self.snap)
        return False


@dataclass
class WriteReport:
    tokens: int
    chunks: int
    notes: int
    forward_s: float           # model forward with capture
    writer_s: float            # writer math over the captured keys
    native_s: float = 0.0      # extra cost of native-replay payloads (opt-in)


class NoteBank:
    """Episodic memory over one target model.

    ``write(state, tokens)`` prefills the context into ``state`` (committing it) with
    capture and writes notes chunk by chunk; ``retrieve(state, query)`` runs the query
    in a branch with capture and ranks the notes; ``replay_tokens`` / ``replay_native``
    put selected notes back in front of a query (inside a branch when the caller wants
    the committed state untouched)."""

    def __init__(self, model, cfg: NoteBankConfig | None = None, native_payload: bool = False,
                 strict: bool = False, keep_keys: bool = False):
        self.model = model
        self.keep_keys = keep_keys   # keep the captured keys (for re-timing the writer)
        self.keys: list = []
        self.cfg = (cfg or NoteBankConfig()).validate()
        self.strict = strict
        self.native_payload = native_payload
        self.writer = NoteWriter(self.cfg, gdn_channel_count(model.cfg), model.cfg.head_dim)
        self.tokens: list = []       # the written context (spans index into it)

    @property
    def notes(self) -> list:
        return self.writer.notes

    @property
    def projection(self) -> np.ndarray:
        return self.writer.projection

    def storage_bytes(self) -> int:
        return notes_storage_bytes(len(self.notes), self.writer.n_channels, self.cfg.coords)

    def write(self, state, tokens) -> WriteReport:
        """Prefill ``tokens`` after the state's committed position, writing notes over
        chunks of ``cfg.chunk`` tokens (positions are absolute in ``self.tokens``)."""
        tokens = [int(t) for t in tokens]
        base = len(self.tokens)
        if state.pending:
            raise NoteBankError(f"state has {state.pending} uncommitted token(s): commit or discard first")
        if state.pos != base:
            raise NoteBankError(f"state is at position {state.pos} but the bank has {base} tokens: "
                                "write into the state the bank was written from")
        chunk = self.cfg.chunk
        pend_k: list = []            # keys of the chunk being filled
        at = [base]                  # absolute position of the next captured key
        n_before = len(self.notes)
        w0 = self.writer.seconds

        def on_piece(start, q, k):
            if self.keep_keys:
                self.keys.append(k)
            # split each ring-sized piece at chunk boundaries; write a chunk once complete
            while k.shape[0]:
                room = chunk - at[0] % chunk
                pend_k.append(k[:room])
                at[0] += min(room, k.shape[0])
                k = k[room:]
                if at[0] % chunk == 0:
                    flush()

        def flush():
            keys = np.concatenate(pend_k)
            start = at[0] - keys.shape[0]
            self.writer.write_chunk(keys, start, start // chunk)
            pend_k.clear()

        t0 = time.perf_counter()
        run_captured(self.model, state, tokens, strict=self.strict, on_piece=on_piece, keep=False)
        if pend_k:
            flush()
        total = time.perf_counter() - t0
        self.tokens += tokens
        writer_s = self.writer.seconds - w0
        native_s = 0.0
        if self.native_payload:
            t1 = time.perf_counter()
            for n in self.notes[n_before:]:
                n.replay_state = self.span_state(n)
            native_s = time.perf_counter() - t1
        n_chunks = -(-len(tokens) // chunk) if tokens else 0
        return WriteReport(len(tokens), n_chunks, len(self.notes) - n_before,
                           total - writer_s, writer_s, native_s)

    def span_tokens(self, note: Note) -> list:
        return self.tokens[note.start:note.end]

    def retrieve(self, state, query_tokens, ranker: str | None = None) -> Retrieval:
        """Retrieval branch: snapshot, run the query with capture, restore, rank."""
        with Branch(state):
            q, k, _ = run_captured(self.model, state, query_tokens, strict=self.strict)
        vecs = q if self.cfg.query_source == "q" else k
        return address(self.notes, vecs, self.projection, self.cfg, ranker)

    def replay_order(self, notes: list) -> list:
        """Replay order: the best note last, nearest the query (choice; see docs)."""
        return list(reversed(notes))

    def replay_tokens(self, state, notes: list):
        """Token replay: re-prefill the selected spans (committing them)."""
        toks = [t for n in self.replay_order(notes) for t in self.span_tokens(n)]
        return feed(self.model, state, toks, strict=self.strict)

    def span_state(self, note: Note) -> dict:
        """Native-replay payload: the span's own recurrent state, i.e. the committed
        GDN S of every layer after running the span from an empty state."""
        fresh = self.model.new_state("target")
        feed(self.model, fresh, self.span_tokens(note), strict=self.strict)
        snap = fresh.snapshot()
        return {i: snap.gdn[i][0] for i in fresh.gdn_layers}

    def replay_native(self, state, notes: list) -> None:
        """Native replay: add each span's recurrent state into the committed ring slot
        (S <- S + S_span per GDN layer; conv tail, KV and position unchanged), instead
        of re-prefilling tokens. Goes through snapshot/restore, the state's own API."""
        import mlx.core as mx
        snap = state.snapshot()
        gdn = dict(snap.gdn)
        for n in self.replay_order(notes):
            payload = n.replay_state if n.replay_state is not None else self.span_state(n)
            for i, S_span in payload.items():
                S, tail = gdn[i]
                gdn[i] = (S + S_span, tail)
        mx.eval([v[0] for v in gdn.values()])
        state.restore(dataclasses.replace(snap, gdn=gdn))


# =========================================================================== demo
FILLER_WORDS = ("a an at on no so to tea ten net sat eat oat nose tone stone seat east "
                "toes notes").split()


def toy_config():
    """The toy shape of the original's NoteBank table: 128d / 8 layers (6 GDN + 2 attention)."""
    from .config import ModelConfig
    return ModelConfig(d_model=128, n_layers=8, n_heads=4, head_dim=32, d_ff=256,
                       vocab=128, max_seq=1024, draft_map=(0, 3, 4, 6))


def toy_model(seed: int = 0, tie_qk: bool = True):
    """A random-weight toy model over the byte vocabulary.

    With independent random q and k projections, q.k carries no association at all,
    so addressing by q is chance. ``tie_qk`` copies every GDN layer's k rows of wqkv
    into its q rows, which gives the toy the q/k geometry a trained associative
    memory has (a query token reads where the same token was written). The demo and
    docs report this choice; ``tie_qk=False`` is the honest-chance control."""
    from .model import SpelModel, init_weights
    cfg = toy_config()
    w = init_weights(cfg, seed=seed)
    if tie_qk:
        inner = cfg.inner
        for i in cfg.gdn_layers:
            wqkv = w[f"layers.{i}.mixer.wqkv.weight"]
            wqkv[:inner] = wqkv[inner:2 * inner]
    return SpelModel.from_weights(cfg, w)


@dataclass
class Needle:
    key: str
    value: str
    start: int                 # token range of "KEY_n=VALUE;" in the document
    end: int
    query: list                # tokens of "?KEY_n="
    value_token: int           # first token of the value after the query


def needle_document(tokenizer, n_tokens: int = 384, n_needles: int = 3, chunk: int = 128,
                    seed: int = 0):
    """Filler text over a small common alphabet with ``n_needles`` ``KEY_n=VALUE;``
    needles planted, one per chunk (or per equal share of the context when
    ``n_needles`` chunks do not fit) at a seeded offset. Segments are tokenized
    separately so every needle's token range is exact. Returns (tokens, needles)."""
    rng = np.random.default_rng(seed)

    def filler(n):
        toks: list = []
        while len(toks) < n:
            toks += tokenizer.encode(" ".join(FILLER_WORDS[i] for i in
                                              rng.integers(0, len(FILLER_WORDS), 8)) + " ")
        return toks[:n]

    # one needle per chunk when the chunks fit, else evenly spread
    span = chunk if n_needles * chunk <= n_tokens else max(1, n_tokens // max(1, n_needles))
    tokens: list = []
    needles = []
    for i in range(n_needles):
        key = f"KEY_{i + 1}"
        value = str(int(rng.integers(1000, 10000)))
        text = tokenizer.encode(f"{key}={value};")
        at = i * span + int(rng.integers(span // 8, max(span // 8 + 1, span - len(text) - span // 8)))
        tokens += filler(at - len(tokens))
        q = tokenizer.encode(f"?{key}=")
        full = tokenizer.encode(f"?{key}={value}")
        # the query ends where the value's first token starts in the joint tokenization
        # (a subword tokenizer may merge across "=" and the value)
        j = 0
        while j < min(len(q), len(full) - 1) and q[j] == full[j]:
            j += 1
        q, vt = (full[:j], full[j]) if j else (q, tokenizer.encode(value)[0])
        needles.append(Needle(key, value, len(tokens), len(tokens) + len(text), q, vt))
        tokens += text
    tokens += filler(n_tokens - len(tokens))
    return tokens, needles


def run_demo(model, tokenizer, cfg: NoteBankConfig | None = None, n_tokens: int = 384,
             seed: int = 0, spec_tokens: int = 16) -> dict:
    """The needle experiment (SPEC 7 report). Returns a dict of everything measured."""
    cfg = (cfg or NoteBankConfig()).validate()
    mcfg = model.cfg
    tokens, needles = needle_document(tokenizer, n_tokens, 3, cfg.chunk, seed)
    ranges = [(n.start, n.end) for n in needles]
    bank = NoteBank(model, cfg, native_payload=True, keep_keys=True)
    state = model.new_state("target")
    wr = bank.write(state, tokens)
    # the writer math alone, warm, best of 3 (the in-line figure includes first-call costs)
    keys = np.concatenate(bank.keys)
    warm = []
    for _ in range(3):
        w = NoteWriter(cfg, keys.shape[1], keys.shape[2])
        w.write(keys)
        warm.append(w.seconds)
    res: dict = {
        "context_tokens": wr.tokens, "chunks": wr.chunks, "notes": wr.notes,
        "forward_capture_ms": wr.forward_s * 1e3, "writer_inline_ms": wr.writer_s * 1e3,
        "writer_ms": min(warm) * 1e3,
        "native_payload_ms": wr.native_s * 1e3,
        "containment": containment(bank.notes, ranges), "needles": len(needles),
        "spans": [(n.start, n.end) for n in bank.notes], "needle_ranges": ranges,
    }
    address_ms = {"summed": [], "votes": []}
    hits = {"summed": 0, "votes": 0}
    ranks = {"none": [], "tokens": [], "native": []}
    replay_ms = {"tokens": [], "native": []}
    per_needle = []
    for nd in needles:
        row = {"key": nd.key, "value": nd.value}
        tops = {}
        for ranker in ("summed", "votes"):
            r = bank.retrieve(state, nd.query, ranker)
            address_ms[ranker].append(r.seconds * 1e3)
            hit = hit_at_r(r.top, nd.start, nd.end)
            hits[ranker] += hit
            tops[ranker] = r.top
            row[ranker] = [(n.start, n.end) for n in r.top]
        with Branch(state):
            ranks["none"].append(token_rank(feed(model, state, nd.query), nd.value_token))
        with Branch(state):
            t0 = time.perf_counter()
            bank.replay_tokens(state, tops["summed"])
            replay_ms["tokens"].append((time.perf_counter() - t0) * 1e3)
            ranks["tokens"].append(token_rank(feed(model, state, nd.query), nd.value_token))
        with Branch(state):
            t0 = time.perf_counter()
            bank.replay_native(state, tops["summed"])
            replay_ms["native"].append((time.perf_counter() - t0) * 1e3)
            ranks["native"].append(token_rank(feed(model, state, nd.query), nd.value_token))
        per_needle.append(row)
    C = gdn_channel_count(mcfg)
    res.update({
        "address_ms": {k: (min(v), max(v)) for k, v in address_ms.items()},
        "recall_summed": hits["summed"], "recall_votes": hits["votes"], "top_r": cfg.top_r,
        "query_positions": cfg.query_positions,
        "note_storage_bytes": bank.storage_bytes(),
        "note_bytes_each": note_bytes(C, cfg.coords), "channels": C,
        "dense_kv_bytes": dense_kv_bytes(mcfg, wr.tokens),
        "hybrid_kv_bytes": hybrid_kv_bytes(mcfg, wr.tokens),
        "native_payload_bytes_each": len(mcfg.gdn_layers) * mcfg.n_heads * mcfg.head_dim ** 2 * FP32_BYTES,
        "rank_no_replay": ranks["none"], "rank_token_replay": ranks["tokens"],
        "rank_native_replay": ranks["native"],
        "replay_ms": {k: (min(v), max(v)) for k, v in replay_ms.items()},
        "per_needle": per_needle,
    })
    try:
        res["spec"] = _demo_spec(model, bank, tokens, needles[0], tokenizer, spec_tokens)
    except Exception as e:  # noqa: BLE001  the engine is another part; report, keep the table
        res["spec"] = {"skipped": f"speculative run failed: {type(e).__name__}: {e}"}
    return res


def _demo_spec(model, bank, tokens, needle, tokenizer, n: int) -> dict:
    """Speculative greedy run on the answer of the first needle's read branch
    (context + token replay of its top notes + query), checked against AR."""
    try:
        from . import decoding as spec
    except ImportError as e:  # the engine is a separate part; the demo works without it
        return {"skipped": f"spel_mlx.decoding unavailable: {e}"}
    if n <= 0:
        return {"skipped": "--spec-tokens 0"}
    state = model.new_state("target")
    feed(model, state, tokens)
    top = bank.retrieve(state, needle.query, "summed").top
    replay = [t for nt in bank.replay_order(top) for t in bank.span_tokens(nt)]
    prompt = list(tokens) + replay + list(needle.query)
    if len(prompt) + n + 1 > model.cfg.max_seq:
        return {"skipped": f"prompt of {len(prompt)} tokens + {n} exceeds max_seq"}
    K = model.cfg.spec_k
    ar = spec.SpeculativeDecoder(model, None, mode="ar", k=K)
    ar_out = ar.generate(prompt, n)
    # the C ternary/q8 draft (SPEC 3) when it is built, else the FP32 MLX draft layers
    try:
        draft, draft_name = spec.make_proposer("c", model, model.weights_dict(), k=K), "C ternary/q8"
    except (ImportError, OSError, ValueError):
        draft, draft_name = spec.make_proposer("mlx", model, k=K), "MLX FP32"
    sd = spec.SpeculativeDecoder(model, draft, mode="spec", k=K)
    try:
        t0 = time.perf_counter()
        sp_out = sd.generate(prompt, n)
        dt = time.perf_counter() - t0
    finally:
        sd.close()
    st = sd.stats
    return {"tokens": len(sp_out), "matches_ar": sp_out == ar_out, "draft": draft_name, "k": K,
            "agree": sum(a == b for a, b in zip(sp_out, ar_out)),
            "alpha": float(st.alpha), "tokens_per_round": float(st.tokens_per_round),
            "seconds": dt, "answer": tokenizer.decode(sp_out), "value": needle.value,
            "answer_starts_with_value": tokenizer.decode(sp_out).startswith(needle.value)}


def format_table(res: dict, label: str) -> str:
    """The demo's report as a two-column text table."""
    def ms(pair):
        lo, hi = pair
        return f"{lo:.3f} ms" if abs(hi - lo) < 5e-4 else f"{lo:.3f}-{hi:.3f} ms"

    dense, hyb, notes = res["dense_kv_bytes"], res["hybrid_kv_bytes"], res["note_storage_bytes"]
    rows = [
        ("context / chunks / notes", f"{res['context_tokens']} / {res['chunks']} / {res['notes']}"),
        ("forward with capture", f"{res['forward_capture_ms']:.1f} ms"),
        ("writer time (warm, best of 3)", f"{res['writer_ms']:.3f} ms "
                                          f"(in-line {res['writer_inline_ms']:.3f} ms)"),
        (f"address time (Q={res['query_positions']}, R={res['top_r']}) summed",
         ms(res["address_ms"]["summed"])),
        ("address time votes", ms(res["address_ms"]["votes"])),
        ("writer needle containment", f"{res['containment']}/{res['needles']}"),
        (f"summed-similarity recall@{res['top_r']}", f"{res['recall_summed']}/{res['needles']}"),
        (f"vote-ranker recall@{res['top_r']}", f"{res['recall_votes']}/{res['needles']}"),
        ("note storage", f"{notes:,} B ({res['notes']} x {res['note_bytes_each']:,} B, "
                         f"{res['channels']} channels)"),
        ("dense KV, all layers (FP32)", f"{dense:,} B ({dense / max(1, notes):.1f}x)"),
        ("hybrid attention KV (FP32)", f"{hyb:,} B ({hyb / max(1, notes):.1f}x)"),
        ("value rank, no replay", "/".join(map(str, res["rank_no_replay"]))),
        ("value rank, token replay", "/".join(map(str, res["rank_token_replay"]))),
        ("value rank, native replay", "/".join(map(str, res["rank_native_replay"]))),
        ("token replay time", ms(res["replay_ms"]["tokens"])),
        ("native replay time (payload cached)", ms(res["replay_ms"]["native"])),
        ("native payload / note", f"{res['native_payload_bytes_each']:,} B (FP32 S, all GDN layers)"),
        ("native payloads, compute at write", f"{res['native_payload_ms']:.1f} ms"),
    ]
    sp = res.get("spec", {})
    if "skipped" in sp:
        rows.append(("spec run on the answer", "skipped: " + sp["skipped"]))
    elif sp:
        rows.append(("spec run on the answer",
                     f"{sp['agree']}/{sp['tokens']} tokens = AR; alpha={sp['alpha']:.3f}; "
                     f"{sp['tokens_per_round']:.2f} tok/round ({sp['draft']} draft, K={sp['k']})"))
        rows.append(("spec answer", repr(sp["answer"][:40]) + f" (value {sp['value']})"))
    w = max(len(a) for a, _ in rows)
    out = [f"NoteBank needle demo: {label}", "-" * (w + 40)]
    out += [f"{a:<{w}}  {b}" for a, b in rows]
    return "\n".join(out)


def _write_json_atomic(path: str, obj) -> None:
    import json
    import os
    import tempfile
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".notebank-", suffix=".json", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _load_for_demo(args):
    """(model, tokenizer, label) for --toy or a checkpoint (default: the shipped one)."""
    from .tokenizer import ByteTokenizer, load_tokenizer
    if args.toy:
        tie = not args.toy_untied
        label = (f"toy 128d/8L random weights (seed {args.model_seed}, "
                 f"{'GDN q tied to k' if tie else 'independent q/k'})")
        return toy_model(args.model_seed, tie_qk=tie), ByteTokenizer(), label
    import os
    from .checkpoints import load_checkpoint
    from .model import SpelModel
    ck = load_checkpoint(args.checkpoint)
    tok_path = None
    if os.path.isdir(ck.source) and os.path.isfile(os.path.join(ck.source, "tokenizer.model")):
        tok_path = os.path.join(ck.source, "tokenizer.model")
    tok = load_tokenizer(ck.cfg.vocab, tok_path)
    c = ck.cfg
    label = f"{ck.source} ({c.d_model}d/{c.n_layers}L, vocab {c.vocab}, {tok.name})"
    return SpelModel.from_weights(ck.cfg, ck.weights), tok, label


def main(argv=None) -> int:
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog="python -m spel_mlx.notebank",
                                 description="NoteBank episodic memory: the needle demo.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="three planted KEY_n=VALUE; needles, notes, query ?KEY_n=")
    d.add_argument("--checkpoint", help="SPELW001 file or safetensors folder "
                   "(default: $SPEL_WEIGHTS, else the shipped spel_mlx/assets/default)")
    d.add_argument("--toy", action="store_true", help="random-weight 128d/8L toy model, byte vocab")
    d.add_argument("--toy-untied", action="store_true",
                   help="toy with independent random q/k (addressing by q is then chance)")
    d.add_argument("--model-seed", type=int, default=0)
    d.add_argument("--seed", type=int, default=0, help="seed of the filler and needle values")
    d.add_argument("--tokens", type=int, default=384, help="context length in tokens")
    d.add_argument("--chunk", type=int, default=128)
    d.add_argument("--span", type=int, default=16)
    d.add_argument("--notes-per-chunk", type=int, default=2)
    d.add_argument("--query-positions", type=int, default=4)
    d.add_argument("--top-r", type=int, default=2)
    d.add_argument("--query-source", choices=QUERY_SOURCES, default="k")
    d.add_argument("--channel-top", type=float, default=1.0,
                   help="fraction of channels whose distinctiveness scores a position (1 = mean)")
    d.add_argument("--spec-tokens", type=int, default=16, help="speculative run length (0: skip)")
    d.add_argument("--json", help="also write the measurements to this JSON file (atomically)")
    args = ap.parse_args(argv)
    if args.toy_untied:
        args.toy = True
    try:
        cfg = NoteBankConfig(chunk=args.chunk, span=args.span, notes_per_chunk=args.notes_per_chunk,
                             query_positions=args.query_positions, top_r=args.top_r,
                             query_source=args.query_source,
                             channel_top=args.channel_top).validate()
        if args.tokens < 3 * 16:
            raise NoteBankError(f"--tokens={args.tokens}: need at least 48 to plant three needles")
        model, tok, label = _load_for_demo(args)
        if args.tokens + 64 > model.cfg.max_seq:
            raise NoteBankError(f"--tokens={args.tokens}: the model's max_seq is {model.cfg.max_seq}")
        res = run_demo(model, tok, cfg, args.tokens, args.seed, args.spec_tokens)
    except (ValueError, OSError) as e:  # config, checkpoint, tokenizer and state errors
        print(f"notebank demo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("notebank demo: interrupted", file=sys.stderr)
        return 130
    res["label"] = label
    print(format_table(res, label))
    if args.json:
        try:
            _write_json_atomic(args.json, res)
        except OSError as e:
            print(f"notebank demo: error: cannot write {args.json}: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

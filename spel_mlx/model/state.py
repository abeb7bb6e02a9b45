"""Decoding state of one stack (target or draft), kept apart from the model.

* attention layer: K and V caches ``[rows, H, hd]`` (rotated k, v; float32, or float16
  when asked for: ``KV_DTYPES``) that grow with the
  positions used, never past max_seq (``kv_rows``: the next power of two from 64, so a
  pass's attention window always fits and growth copies O(1) per token amortized);
* GDN layer: a ring of R slots (R = K+1 by default), each slot holding the
  recurrent state S ``[H, hd, hd]`` and the conv tail ``[2, d]``.

The committed state is ring slot ``read`` and KV rows ``[0, pos)``.  A forward
writes the state after its j-th token into slot ``(read + pending + 1 + j) % R``
and KV row ``pos + pending + j``; ``pending`` counts tokens forwarded since the
last commit, so several forwards (e.g. a draft proposing one token at a time)
chain without committing.  ``commit(n)`` then moves ``read`` and ``pos``: no
array is copied or created, rejected tokens are simply overwritten later
(KV rows past ``pos`` are masked).  Writing R pending tokens reuses the
committed slot itself (SPEC 4: a K+1 batch fills all K+1 slots), so after that
only ``commit`` (n >= 1) or ``restore`` is allowed, not ``discard``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..platform import huge_pages
from ..config import ModelConfig

import mlx.core as mx  # noqa: E402  (spel_mlx is imported first: BLAS loaded)


KV_MIN_ROWS = 64
# the K/V caches' element type by name: float32 is SPEC's exact model; float16 halves
# the bytes a long context streams per token (k and v rounded once, as written)
KV_DTYPES = {"float32": mx.float32, "float16": mx.float16}


class StateError(ValueError):
    """Misuse of a DecodeState (commit out of range, past max_seq, ...)."""


def kv_rows(n: int, max_seq: int) -> int:
    """KV cache rows for n positions: the next power of two from KV_MIN_ROWS, capped at
    max_seq.  Never less than the window a pass over n positions reads (model.passes.window:
    powers of two to 1024, then multiples of 512)."""
    rows = KV_MIN_ROWS
    while rows < n:
        rows *= 2
    return min(rows, max_seq)


@dataclass
class Snapshot:
    """Committed state: references to the committed GDN slot arrays and
    copies of the KV rows [0, pos)."""
    stack: str
    pos: int
    gdn: dict     # layer -> (S, tail), the committed slot's own arrays
    kv: dict      # layer -> (K [pos,H,hd], V [pos,H,hd])


class _Row:
    """Row j of a pass's stacked [M, ...] output, sliced only when its slot is read
    (a K+1 verify writes K+1 slots per GDN layer and the next pass reads one)."""
    __slots__ = ("stack", "j")

    def __init__(self, stack, j: int):
        self.stack, self.j = stack, j

    def get(self):
        a, j = self.stack, self.j
        return a[j:j + 1].reshape(a.shape[1:])   # a view (integer indexing would gather)


class DecodeState:
    def __init__(self, cfg: ModelConfig, stack: str = "target", ring: int | None = None, layers=None,
                 kv: str = "float32"):
        """``layers``: the target layers this state covers (a pipeline stage's slice,
        indexed from 0 here); None: the whole stack.  ``kv``: the K/V caches' dtype."""
        if kv not in KV_DTYPES:
            raise StateError(f"KV cache dtype {kv!r}: expected one of {', '.join(KV_DTYPES)}")
        self.kv_cache, self.kv_dtype = kv, KV_DTYPES[kv]
        if stack == "target":
            kinds = [cfg.layer_kind(i) for i in (range(cfg.n_layers) if layers is None else layers)]
        elif stack == "draft":
            kinds = [cfg.layer_kind(i) for i in cfg.draft_map]
        else:
            raise StateError(f"stack must be 'target' or 'draft', not {stack!r}")
        ring = cfg.spec_k + 1 if ring is None else int(ring)
        if ring < 2:
            raise StateError(f"ring={ring}: needs at least 2 slots (K >= 1)")
        self.cfg, self.stack, self.ring, self.kinds = cfg, stack, ring, kinds
        self.max_seq = cfg.max_seq
        H, hd, d = cfg.n_heads, cfg.head_dim, cfg.d_model
        self.gdn_layers = [i for i, k in enumerate(kinds) if k == "gdn"]
        self.attn_layers = [i for i, k in enumerate(kinds) if k == "attn"]
        # every slot holds arrays from the start: commit never has to create one
        self.ring_S = {i: [mx.zeros((H, hd, hd)) for _ in range(ring)] for i in self.gdn_layers}
        self.ring_tail = {i: [mx.zeros((2, d)) for _ in range(ring)] for i in self.gdn_layers}
        self.kv_capacity = kv_rows(1, self.max_seq)
        self.k_cache = {i: mx.zeros((self.kv_capacity, H, hd), self.kv_dtype) for i in self.attn_layers}
        self.v_cache = {i: mx.zeros((self.kv_capacity, H, hd), self.kv_dtype) for i in self.attn_layers}
        mx.eval(list(self.k_cache.values()), list(self.v_cache.values()),
                [s for v in self.ring_S.values() for s in v], [t for v in self.ring_tail.values() for t in v])
        self.read = 0       # ring slot of the committed GDN state
        self.pos = 0        # committed tokens (= KV rows in use)
        self.pending = 0    # tokens forwarded since the last commit

    # --- what the model uses ----------------------------------------------------
    def check_room(self, M: int) -> None:
        if M < 1:
            raise StateError("forward needs at least one token")
        if self.pending + M > self.ring:
            raise StateError(f"{M} token(s) on top of {self.pending} pending exceed the ring of "
                             f"{self.ring} slots: commit first (or use a larger ring)")
        if self.pos + self.pending + M > self.max_seq:
            raise StateError(f"position {self.pos + self.pending + M - 1} is past max_seq={self.max_seq}")
        self.reserve(self.pos + self.pending + M)

    def reserve(self, n: int) -> None:
        """Grow the KV caches to hold n positions (rows past the old capacity are zero)."""
        rows = kv_rows(n, self.max_seq)
        if rows <= self.kv_capacity:
            return
        for cache in (self.k_cache, self.v_cache):
            for i, a in cache.items():
                cache[i] = mx.concatenate([a, mx.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])
        mx.eval(list(self.k_cache.values()), list(self.v_cache.values()))
        huge_pages.back(list(self.k_cache.values()) + list(self.v_cache.values()))
        self.kv_capacity = rows

    def slot_gdn(self, layer: int, slot: int):
        """(S, tail) held by a ring slot (made an array when first read)."""
        S, tail = self.ring_S[layer][slot], self.ring_tail[layer][slot]
        if isinstance(S, _Row):
            S = self.ring_S[layer][slot] = S.get()
        if isinstance(tail, _Row):
            tail = self.ring_tail[layer][slot] = tail.get()
        return S, tail

    def current_gdn(self, layer: int):
        """(S, tail) the next token starts from: the last written slot."""
        return self.slot_gdn(layer, (self.read + self.pending) % self.ring)

    def current_gdn_rows(self, layer: int) -> tuple:
        """``current_gdn`` without slicing a stacked slot: ((S, tail), (S row, tail row)),
        where a row >= 0 is the row of a pass's stacked output the slot holds and -1 an
        array of its own (a backend reading rows in place makes no slice nodes)."""
        slot = (self.read + self.pending) % self.ring
        arrays, rows = [], []
        for a in (self.ring_S[layer][slot], self.ring_tail[layer][slot]):
            arrays.append(a.stack if isinstance(a, _Row) else a)
            rows.append(a.j if isinstance(a, _Row) else -1)
        return arrays, rows

    def write_gdn(self, layer: int, S_list, tail_list) -> None:
        """Store the states after each new token in the slots after the current one."""
        for j, (S, tail) in enumerate(zip(S_list, tail_list)):
            slot = (self.read + self.pending + 1 + j) % self.ring
            self.ring_S[layer][slot] = S
            self.ring_tail[layer][slot] = tail

    def write_gdn_rows(self, layer: int, S_all, tails_all) -> None:
        """write_gdn from stacked arrays: S_all [M, H, hd, hd], tails_all [M, 2, d]."""
        for j in range(S_all.shape[0]):
            slot = (self.read + self.pending + 1 + j) % self.ring
            self.ring_S[layer][slot] = _Row(S_all, j)
            self.ring_tail[layer][slot] = _Row(tails_all, j)

    def kv(self, layer: int):
        return self.k_cache[layer], self.v_cache[layer]

    def set_kv(self, layer: int, k_cache, v_cache) -> None:
        self.k_cache[layer], self.v_cache[layer] = k_cache, v_cache

    def advance(self, M: int) -> None:
        self.pending += M

    # --- transactions -------------------------------------------------------------
    def commit(self, n: int) -> None:
        """Accept the first n pending tokens: moves indices only."""
        self._accept(n, "commit")
        self.pending = 0

    def commit_keep(self, n: int) -> None:
        """Accept the first n pending tokens and keep the ones written after them pending
        (a pass built ahead of its round's result: ``mark`` / ``forget``)."""
        self._accept(n, "commit_keep")
        self.pending -= n

    def _accept(self, n: int, what: str) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.pending:
            raise StateError(f"{what}({n!r}): must be in 1..{self.pending} (tokens pending)")
        self.read = (self.read + n) % self.ring
        self.pos += n

    def mark(self) -> tuple:
        """The KV cache arrays and ring slots now: ``forget`` puts them back when a pass
        built after this is dropped without running, so that nothing holds that pass's
        graph (which holds the caches it reads: MLX then could not update them in place)."""
        return (dict(self.k_cache), dict(self.v_cache), {i: list(s) for i, s in self.ring_S.items()},
                {i: list(t) for i, t in self.ring_tail.items()})

    def forget(self, m: int, mark: tuple | None = None) -> None:
        """Drop the last m pending tokens; with ``mark``, what they were built on."""
        if not isinstance(m, int) or not 0 <= m <= self.pending:
            raise StateError(f"forget({m!r}): must be in 0..{self.pending} (tokens pending)")
        self.pending -= m
        if mark is not None:
            k_cache, v_cache, ring_S, ring_tail = mark
            self.k_cache, self.v_cache = dict(k_cache), dict(v_cache)
            self.ring_S = {i: list(s) for i, s in ring_S.items()}
            self.ring_tail = {i: list(t) for i, t in ring_tail.items()}

    def discard(self) -> None:
        """Drop all pending tokens (commit nothing)."""
        if self.pending >= self.ring:
            raise StateError(f"discard: the {self.pending} pending tokens overwrote the committed "
                             f"slot (ring of {self.ring}); commit at least one or restore a snapshot")
        self.pending = 0

    def committed_gdn(self, layer: int):
        """(S, tail) of the committed slot: the slot's own array objects."""
        return self.slot_gdn(layer, self.read)

    def snapshot(self) -> Snapshot:
        if self.pending:
            raise StateError("snapshot needs a committed state (commit or discard the pending tokens)")
        gdn = {i: self.committed_gdn(i) for i in self.gdn_layers}
        # own copies of the rows in use (x * 1.0 is exact, -0.0 included), not views
        # pinning the whole max_seq cache buffer while the snapshot lives
        kv = {i: (self.k_cache[i][:self.pos] * 1.0, self.v_cache[i][:self.pos] * 1.0)
              for i in self.attn_layers} if self.pos else {i: None for i in self.attn_layers}
        mx.eval([a for p in kv.values() if p for a in p])
        return Snapshot(self.stack, self.pos, gdn, kv)

    def restore(self, snap: Snapshot) -> None:
        if snap.stack != self.stack or set(snap.gdn) != set(self.gdn_layers) or set(snap.kv) != set(self.attn_layers):
            raise StateError("restore: the snapshot belongs to another stack/config")
        for i, (S, tail) in snap.gdn.items():
            self.ring_S[i][self.read] = S
            self.ring_tail[i][self.read] = tail
        if snap.pos:
            self.reserve(snap.pos)
            for i, (K, V) in snap.kv.items():
                self.k_cache[i][:snap.pos] = K
                self.v_cache[i][:snap.pos] = V
        self.pos, self.pending = snap.pos, 0

    def reset(self) -> None:
        """Back to the empty state (position 0, zero S and conv tails)."""
        H, hd, d = self.cfg.n_heads, self.cfg.head_dim, self.cfg.d_model
        self.read = self.pos = self.pending = 0
        for i in self.gdn_layers:
            self.ring_S[i][0] = mx.zeros((H, hd, hd))
            self.ring_tail[i][0] = mx.zeros((2, d))
        # KV rows past pos are masked: nothing to clear

    def __repr__(self):
        return (f"DecodeState(stack={self.stack!r}, pos={self.pos}, pending={self.pending}, "
                f"read={self.read}, ring={self.ring})")

"""The C draft engine (neon/, loaded by ``clib``): the Python wrapper.

``CDraft`` quantizes a checkpoint's draft tensors at load (q8 wqkv/wo, ternary
w1/w3/w2, SPEC 3) and runs the draft step in C on a persistent worker pool, with
the KV cache and a (K+1)-slot GDN state ring whose commit only moves indices.

Also here: thin wrappers of the C quantizers and raw integer kernels (tests,
benchmarks), the pool, and a standalone quantized matrix for the kernel benchmark.
"""
from __future__ import annotations


import numpy as np

from ..config import ModelConfig
from ..platform.cpu_features import simd_cap
from ..settings import setting
from .clib import ffi, lib
from .clib import require as _lib

KERNELS = ("scalar", "avx2", "dotprod", "addsub", "vnni")   # index = C kernel id
MAX_THREADS = 6


class DraftBusyError(RuntimeError):
    """A CDraft was called from a second thread while a call ran (one thread at a time)."""


def kernel_id(kernel) -> int:
    """'auto' | 'scalar' | 'avx2' | 'vnni' | 'dotprod' | 'addsub' (or an int id) -> C id."""
    if isinstance(kernel, (int, np.integer)):
        return int(kernel)
    if kernel in (None, "auto"):
        cap = simd_cap()
        return KERNELS.index("scalar") if cap == "none" else KERNELS.index("avx2") if cap == "avx2" else -1
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: expected auto or one of {', '.join(KERNELS)}")
    return KERNELS.index(kernel)


def kernel_name(kid: int) -> str:
    return ffi.string(_lib().spel_kernel_name(kid)).decode()


def available_kernels() -> list:
    L = _lib()
    return [k for i, k in enumerate(KERNELS) if L.spel_kernel_available(i)]


def auto_kernel() -> str:
    return kernel_name(_lib().spel_kernel_resolve(-1))


def _resolve(kernel) -> int:
    kid = _lib().spel_kernel_resolve(kernel_id(kernel))
    if kid < 0:
        raise ValueError(f"kernel {kernel!r} is not available on this CPU "
                         f"(available: {', '.join(available_kernels())})")
    return kid


def threads_from_env(threads) -> int:
    if threads is None:
        threads = setting("SPEL_DRAFT_THREADS") or 1
    threads = int(threads)
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"draft threads={threads}: must be in 1..{MAX_THREADS}")
    return threads


def _f32(a, shape=None, name="array") -> np.ndarray:
    if type(a).__module__.startswith("mlx"):
        # an MLX array (a GPU target's weights, say): host float32 first, since numpy
        # cannot read bfloat16 buffers
        import mlx.core as mx
        a = np.asarray(a.astype(mx.float32))
    a = np.ascontiguousarray(a, dtype=np.float32)
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a


def _ptr(ctype, a):
    return ffi.from_buffer(ctype + "[]", a)


# --------------------------------------------------------------- quantizers

def _quantize_rows(quantize, w):
    """(int8 codes [R, C], float32 row scales [R]) of w by a C row quantizer."""
    w = _f32(w)
    R, C = w.shape
    codes = np.zeros((R, C), np.int8)
    s = np.zeros(R, np.float32)
    quantize(_ptr("float", w), R, C, _ptr("int8_t", codes), _ptr("float", s))
    return codes, s


def c_quantize_q8(w):
    return _quantize_rows(_lib().spel_quantize_q8, w)


def c_quantize_ternary(w):
    return _quantize_rows(_lib().spel_quantize_ternary, w)


def c_pack_ternary(t):
    t = np.ascontiguousarray(t, dtype=np.int8)
    R, C = t.shape
    out = np.zeros((R, int(_lib().spel_ternary_row_bytes(C))), np.uint8)
    lib.spel_pack_ternary(_ptr("int8_t", t), R, C, _ptr("uint8_t", out))
    return out


def c_quantize_activation(x):
    x = _f32(x).reshape(-1)
    xq = np.zeros(x.shape[0], np.int8)
    s = _lib().spel_quantize_activation(_ptr("float", x), x.shape[0], _ptr("int8_t", xq))
    return xq, np.float32(s)


def dot_ternary(kernel, packed, cols: int, xq) -> np.ndarray:
    """Exact int32 dots of packed ternary rows with int8 xq using one kernel."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    xq = np.ascontiguousarray(xq, dtype=np.int8)
    out = np.zeros(packed.shape[0], np.int32)
    rc = _lib().spel_dot_ternary(_resolve(kernel), _ptr("uint8_t", packed), packed.shape[0], cols,
                                 _ptr("int8_t", xq), _ptr("int32_t", out))
    if rc:
        raise RuntimeError(f"spel_dot_ternary failed ({rc})")
    return out


def dot_q8(kernel, q, xq) -> np.ndarray:
    q = np.ascontiguousarray(q, dtype=np.int8)
    xq = np.ascontiguousarray(xq, dtype=np.int8)
    out = np.zeros(q.shape[0], np.int32)
    rc = _lib().spel_dot_q8(_resolve(kernel), _ptr("int8_t", q), q.shape[0], q.shape[1],
                            _ptr("int8_t", xq), _ptr("int32_t", out))
    if rc:
        raise RuntimeError(f"spel_dot_q8 failed ({rc})")
    return out


# --------------------------------------------------------------------- pool

class Pool:
    """The persistent worker pool on its own (benchmarks, stress tests)."""

    def __init__(self, threads: int = 1):
        threads = threads_from_env(threads)
        self._p = _lib().spel_pool_create(threads)
        if self._p == ffi.NULL:
            raise RuntimeError(f"could not create a {threads}-thread pool")
        self.threads = threads

    def stress(self, dispatches: int, blocks: int) -> int:
        return int(lib.spel_pool_stress(self._p, dispatches, blocks))

    def close(self):
        if self._p is not None and self._p != ffi.NULL:
            lib.spel_pool_destroy(self._p)
        self._p = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if lib is not None:
            self.close()


class QMatrix:
    """A quantized matrix (ternary or q8) with y = W x on a pool (kernel benchmark)."""

    def __init__(self, w, ternary: bool = True):
        w = _f32(w)
        self.rows, self.cols = w.shape
        self.ternary = ternary
        self._m = _lib().spel_matrix_new(_ptr("float", w), self.rows, self.cols, int(ternary))
        if self._m == ffi.NULL:
            raise MemoryError("spel_matrix_new failed")

    def gemv(self, x, pool: Pool, kernel="auto", out=None):
        x = _f32(x).reshape(-1)
        y = np.empty(self.rows, np.float32) if out is None else out
        if lib.spel_matrix_gemv(self._m, pool._p, _resolve(kernel), _ptr("float", x), _ptr("float", y)):
            raise RuntimeError("spel_matrix_gemv failed")
        return y

    def close(self):
        if self._m is not None:
            lib.spel_matrix_free(self._m)
        self._m = None

    def __del__(self):
        if lib is not None:
            self.close()


def f32_gemv(pool: Pool, w, x, out=None):
    """The engine's FP32 GEMV (the LM head path) on a pool."""
    w, x = _f32(w), _f32(x).reshape(-1)
    y = np.empty(w.shape[0], np.float32) if out is None else out
    _lib().spel_f32_gemv(pool._p, _ptr("float", w), w.shape[0], w.shape[1], _ptr("float", x), _ptr("float", y))
    return y


# -------------------------------------------------------------------- draft

_LAYER_FIELDS = ("attn_norm.weight", "mixer.conv", "mixer.wqkv.weight", "mixer.wo.weight",
                 "mixer.decay_logit", "mixer.beta_logit", "ffn_norm.weight",
                 "mlp.w1.weight", "mlp.w3.weight", "mlp.w2.weight")


class CDraft:
    """The quantized draft in C.

    ``CDraft(cfg, weights, threads=None, kernel="auto", ring=cfg.spec_k+1, q8_head=False)``
    takes the FP32 weights dict (``draft.layers.{j}.*`` plus the shared ``tok_emb``,
    ``final_norm``, ``lm_head``); threads defaults to SPEL_DRAFT_THREADS (else 1).
    """

    def __init__(self, cfg: ModelConfig, weights: dict, threads=None, kernel="auto",
                 ring: int | None = None, q8_head: bool = False):
        L = _lib()
        self.cfg = cfg
        self.ring = int(cfg.spec_k + 1 if ring is None else ring)
        if self.ring < 2:
            raise ValueError(f"ring={self.ring}: needs at least 2 slots")
        self.threads = threads_from_env(threads)
        kid = _resolve(kernel)
        self.q8_head = bool(q8_head)
        d, H, hd, ff, V, inner = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff, cfg.vocab, cfg.inner
        c = ffi.new("spel_draft_config *", dict(
            d_model=d, n_heads=H, head_dim=hd, d_ff=ff, vocab=V, max_seq=cfg.max_seq,
            n_layers=cfg.n_draft, ring=self.ring, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
            threads=self.threads, kernel=kid, q8_head=int(self.q8_head)))
        kinds = [0 if cfg.layer_kind(src) == "gdn" else 1 for src in cfg.draft_map]
        self._d = L.spel_draft_new(c, ffi.new("int[]", kinds))
        if self._d == ffi.NULL:
            raise MemoryError("spel_draft_new failed")
        try:
            self._check(0 if not ffi.string(L.spel_draft_error(self._d)) else -1)

            def get(name, shape):
                if name not in weights:
                    raise KeyError(f"weights lack {name!r} (needed by the C draft)")
                return _f32(weights[name], shape, name)

            shared = [get("tok_emb.weight", (V, d)), get("final_norm.weight", (d,)),
                      get("lm_head.weight", (V, d))]
            self._check(L.spel_draft_set_shared(self._d, *[_ptr("float", a) for a in shared]))
            for j, src in enumerate(cfg.draft_map):
                p = f"draft.layers.{j}."
                gdn = cfg.layer_kind(src) == "gdn"
                shapes = {"attn_norm.weight": (d,), "mixer.conv": (3, d), "mixer.wqkv.weight": (3 * inner, d),
                          "mixer.wo.weight": (d, inner), "mixer.decay_logit": (H,), "mixer.beta_logit": (H,),
                          "ffn_norm.weight": (d,), "mlp.w1.weight": (ff, d), "mlp.w3.weight": (ff, d),
                          "mlp.w2.weight": (d, ff)}
                args = []
                for f in _LAYER_FIELDS:
                    if not gdn and f in ("mixer.conv", "mixer.decay_logit", "mixer.beta_logit"):
                        args.append(ffi.NULL)
                    else:
                        args.append(_ptr("float", get(p + f, shapes[f])))
                self._check(L.spel_draft_set_layer(self._d, j, *args))
            self._check(L.spel_draft_ready(self._d))
        except BaseException:
            self.close()
            raise
        self.kernel = kernel_name(L.spel_draft_kernel(self._d))
        self._logits = np.empty((self.ring, V), np.float32)

    # --- helpers
    def _check(self, rc):
        if rc == lib.SPEL_BUSY:
            raise DraftBusyError("C draft: in use by another thread (one thread at a time per CDraft)")
        if rc == lib.SPEL_ASYNC_PENDING:
            raise ValueError("C draft: an asynchronous proposal is running: wait for it first")
        if rc != 0:
            raise ValueError("C draft: " + ffi.string(lib.spel_draft_error(self._d)).decode())

    def _live(self):
        if self._d is None:
            raise RuntimeError("the draft is closed")
        return self._d

    def _tokens(self, tokens):
        toks = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).reshape(-1))
        if toks.size and (toks.min() < 0 or toks.max() >= self.cfg.vocab):
            bad = toks[(toks < 0) | (toks >= self.cfg.vocab)][0]
            raise ValueError(f"token {int(bad)} out of range 0..{self.cfg.vocab - 1}")
        return toks.astype(np.int32)

    def _token(self, t) -> int:
        t = int(t)
        if not 0 <= t < self.cfg.vocab:
            raise ValueError(f"token {t} out of range 0..{self.cfg.vocab - 1}")
        return t

    def _proposal_buffer(self):
        # one int32 buffer per engine for proposals (k + 1 <= ring): no array per round
        buf = self.__dict__.get("_prop_buf")
        if buf is None:
            buf = self._prop_buf = ffi.new("int32_t[]", int(self.ring) + 2)
        return buf

    # --- API
    @property
    def pos(self) -> int:
        return int(lib.spel_draft_pos(self._live()))

    def step(self, token: int) -> np.ndarray:
        """Forward one token and commit it; logits [V] (a fresh array)."""
        out = np.empty(self.cfg.vocab, np.float32)
        self._check(lib.spel_draft_step(self._live(), int(self._tokens([token])[0]), _ptr("float", out)))
        return out

    def forward(self, tokens, start: int = 0, logits: bool = True):
        """Forward tokens as offsets start.. of the uncommitted batch (start=0 starts a new
        batch; start=j continues one that already holds j tokens). No commit. [M, V]
        logits, or None with ``logits=False`` (the state only: no final norm and head)."""
        toks = self._tokens(tokens)
        m = toks.shape[0]
        out = np.empty((m, self.cfg.vocab), np.float32) if logits else None
        self._check(lib.spel_draft_forward_from(self._live(), _ptr("int32_t", toks), m, int(start),
                                                _ptr("float", out) if logits else ffi.NULL))
        return out

    def propose(self, pending: int, k: int) -> list:
        """Greedy d_0..d_{k-1} from pending: k+1 forwards (the last one covers d_{k-1}), no commit."""
        out = self._proposal_buffer()
        self._check(lib.spel_draft_propose(self._live(), self._token(pending), int(k), out))
        return ffi.unpack(out, int(k))

    def propose_at(self, pending: int, k: int, start: int, guess: bool = False) -> list:
        """propose continuing the uncommitted batch at offset ``start`` (the k+1
        forwards take offsets start..start+k).  ``guess``: the last forward also runs
        the head and the result has k+1 tokens, the last being the draft's guess at
        the token after d_{k-1}."""
        out = self._proposal_buffer()
        self._check(lib.spel_draft_propose_at(self._live(), self._token(pending), int(k), int(start),
                                              int(bool(guess)), out))
        return ffi.unpack(out, int(k) + (1 if guess else 0))

    def propose_at_async(self, pending: int, k: int, start: int, guess: bool = False) -> None:
        """Start propose_at on the draft's own native thread and return at once (no
        Python thread, so it starts while the caller holds the GIL); ``wait`` gives
        the result.  Until then every other call fails."""
        self._check(lib.spel_draft_propose_at_async(self._live(), self._token(pending), int(k), int(start),
                                                    int(bool(guess))))
        self._async = int(k) + (1 if guess else 0)

    def prefill_async(self, tokens, background: bool = False) -> None:
        """Feed and commit ``tokens`` (from a committed state, in batches of the ring
        size: the state ``forward`` + ``commit`` leave, bit for bit) on the draft's own
        native thread, and return at once; ``wait`` blocks until it is done.
        `background`: at the lowest priority (SCHED_IDLE) until a ``wait`` lifts it."""
        toks = self._tokens(tokens)
        self._check(lib.spel_draft_prefill_async(self._live(), _ptr("int32_t", toks), toks.shape[0],
                                                 int(bool(background))))
        self._async = 0

    def shadow_async(self, tokens, pending: int, k: int) -> None:
        """Feed and commit ``tokens`` (a catch-up, as ``prefill_async``), then propose k
        tokens from ``pending`` (``propose_at(pending, k, 0)``), on the draft's own thread at
        the lowest priority; ``wait`` gives the k tokens.  The batch stays uncommitted."""
        toks = self._tokens(tokens)
        self._check(lib.spel_draft_shadow_async(self._live(), _ptr("int32_t", toks), toks.shape[0],
                                                self._token(pending), int(k)))
        self._async = int(k)

    def wait(self, timeout: float | None = None) -> list | None:
        """The tokens of the proposal started by propose_at_async, [] after prefill_async
        (blocks until done, or at most `timeout` seconds: TimeoutError when it is still
        running, and it stays out); None when ``cancel`` stopped a proposal first."""
        n = getattr(self, "_async", 0)
        out = self._proposal_buffer()
        if timeout is None:
            rc = lib.spel_draft_wait(self._live(), out)
        else:
            rc = lib.spel_draft_wait_for(self._live(), out, max(0, int(timeout * 1e6)))
            if rc == lib.SPEL_TIMEOUT:
                raise TimeoutError(f"the draft's proposal is still running after {timeout:.6f} s")
        self._async = 0
        if rc == lib.SPEL_CANCELLED:
            return None
        self._check(rc)
        return ffi.unpack(out, n)

    def cancel(self):
        """Stop the proposal started by propose_at_async after its current forward (its
        result is not wanted); ``wait`` still ends the request.  The batch before its
        offset stays uncommitted as it was."""
        self._check(lib.spel_draft_cancel(self._live()))

    def set_sampling(self, temperature=None, top_p=1.0, penalty=1.0, top_k=0, window=0, seed=0,
                     want_q=False):
        """Proposals become samples (the coupled choice of neon/sampling.c: argmax over the
        support of logit/T + the stream's Gumbel noise; temperature 0: the argmax of the
        penalized logits) instead of the argmax; ``temperature=None`` switches back.
        ``want_q`` keeps each proposal's distribution (``probs``)."""
        if temperature is None:
            self._check(lib.spel_draft_set_sampling(self._live(), ffi.NULL, 0))
            return
        s = ffi.new("spel_sampling *", dict(temperature=float(temperature), top_p=float(top_p),
                                            penalty=float(penalty), top_k=int(top_k), window=int(window),
                                            seed=int(seed) & ((1 << 64) - 1)))
        self._check(lib.spel_draft_set_sampling(self._live(), s, int(bool(want_q))))

    def set_context(self, ctx, index: int):
        """Before a sampled proposal: the tokens before its pending token (the penalty's
        window is their end) and that token's sequence index (the noise's position)."""
        toks = self._tokens(ctx) if len(ctx) else np.zeros(1, np.int32)
        self._check(lib.spel_draft_set_context(self._live(), _ptr("int32_t", toks), len(ctx), int(index)))

    def probs(self, offset: int) -> np.ndarray:
        """The distribution the token at batch offset ``offset`` was sampled from."""
        out = np.empty(self.cfg.vocab, np.float64)
        self._check(lib.spel_draft_probs(self._live(), int(offset), _ptr("double", out)))
        return out

    def commit(self, n: int):
        self._check(lib.spel_draft_commit(self._live(), int(n)))

    def commit_keep(self, n: int):
        """Commit n tokens and keep the rest of the batch uncommitted (at offsets 0..)."""
        self._check(lib.spel_draft_commit_keep(self._live(), int(n)))

    def reset(self):
        self._check(lib.spel_draft_reset(self._live()))

    def forward_logits(self, tokens) -> np.ndarray:
        """Logits [n, V] of tokens fed one per position with a commit each (from the current state)."""
        return np.stack([self.step(t) for t in self._tokens(tokens)])

    def packed_bytes(self) -> dict:
        d = self._live()
        return {"q8": int(lib.spel_draft_packed_bytes(d, 0)), "ternary": int(lib.spel_draft_packed_bytes(d, 1))}

    def close(self):
        if getattr(self, "_d", None) is not None and lib is not None:
            lib.spel_draft_free(self._d)
        self._d = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

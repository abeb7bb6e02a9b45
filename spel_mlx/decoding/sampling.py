"""Token selection: greedy, temperature / top-k / top-p / repetition penalty, the
coupled choice of a position's token, and the lossless residual rule.

Everything here works on one position's logits (vocabularies are small), so
draft and target distributions go through exactly the same code: the same
`SamplingParams`, the same history, the same float64 arithmetic (numpy, or the
C transforms of neon/sampling.c that follow it step for step).  That is what
keeps speculative sampling lossless when a repetition penalty is on.

Two lossless rules (``SamplingParams.accept``, docs/decoding.md):
* coupled: the token at sequence index i is argmax over the support of
  logit/T + g(seed, i, token), Gumbel noise from the per-position stream (noise.py);
  draft and target use the same noise, a proposal is accepted when it equals the
  target's token, so every emitted token is the target's own sample;
* residual (Leviathan et al. / Chen et al.; the default): the draft samples d from q;
  the target accepts it with probability min(1, p(d)/q(d)); on rejection the
  replacement is drawn from normalize(max(0, p - q)).  The emitted token is then
  distributed as p.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..native import clib
from . import noise

ACCEPT_RULES = ("coupled", "residual")
DEFAULT_ACCEPT = "coupled"      # under its cost governor, the faster of the two here (docs/decoding.md)


class SamplingError(ValueError):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0        # 0 = greedy (argmax)
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0              # 1 = off
    repetition_penalty: float = 1.0  # 1 = off; CTRL-style: positive logits / r, negative * r
    repetition_window: int = 64     # how many recent tokens the penalty looks at
    seed: int | None = None
    accept: str = DEFAULT_ACCEPT    # the lossless rule of sampled speculation: ACCEPT_RULES

    def validate(self) -> "SamplingParams":
        if not (_real(self.temperature) and self.temperature >= 0.0):
            raise SamplingError(f"temperature={self.temperature!r}: must be a number >= 0")
        if not _integer(self.top_k) or self.top_k < 0:
            raise SamplingError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 = off)")
        if not (_real(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p={self.top_p!r}: must be a number in (0, 1]")
        if not (_real(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise SamplingError(f"repetition_penalty={self.repetition_penalty!r}: must be a number > 0")
        if not _integer(self.repetition_window) or self.repetition_window < 0:
            raise SamplingError(f"repetition_window={self.repetition_window!r}: must be >= 0")
        # checked here: a negative seed only fails later, deep inside numpy's SeedSequence
        if self.seed is not None and (not _integer(self.seed) or self.seed < 0):
            raise SamplingError(f"seed={self.seed!r}: must be an integer >= 0")
        if self.accept not in ACCEPT_RULES:
            raise SamplingError(f"accept={self.accept!r}: expected one of {', '.join(ACCEPT_RULES)}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalty(self) -> bool:
        return self.repetition_penalty != 1.0 and self.repetition_window > 0

    @property
    def plain_greedy(self) -> bool:
        """Each token is its row's argmax (no sampling, no penalty)."""
        return self.greedy and not self.uses_penalty

    @property
    def window(self) -> int:
        """How many recent tokens the penalty sees (0 without a penalty)."""
        return self.repetition_window if self.uses_penalty else 0


GREEDY = SamplingParams()


def _integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _real(x) -> bool:
    """A finite number (not a bool, a string, or an int too large for a float)."""
    if not (_integer(x) or isinstance(x, (float, np.floating))):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def make_rng(seed: int | None) -> np.random.Generator:
    """A numpy generator (tests and benchmarks; decoding draws from the noise stream)."""
    return np.random.Generator(np.random.PCG64(seed))


def penalize(logits: np.ndarray, recent_tokens, penalty: float) -> np.ndarray:
    """Repetition penalty on a copy of `logits` for every distinct token in `recent_tokens`."""
    out = np.array(logits, dtype=np.float64, copy=True)
    if penalty == 1.0 or len(recent_tokens) == 0:
        return out
    idx = np.asarray(recent_tokens, dtype=np.int64)
    seen = np.zeros(out.shape[-1], dtype=bool)      # each distinct token once (a set)
    seen[idx[(idx >= 0) & (idx < out.shape[-1])]] = True
    vals = out[seen]
    out[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def recent(history, params: SamplingParams):
    """The window of history the penalty sees (same rule for draft and target)."""
    if not params.uses_penalty:
        return ()
    w = params.repetition_window
    return history[-w:] if len(history) > w else history


def adjusted_logits(logits, history, params: SamplingParams) -> np.ndarray:
    """Logits after the repetition penalty (float64)."""
    return penalize(logits, recent(history, params), params.repetition_penalty)


def greedy_token(logits, history, params: SamplingParams) -> int:
    if params.uses_penalty:
        return int(np.argmax(adjusted_logits(logits, history, params)))
    return int(np.argmax(logits))


# the C transforms (neon/sampling.c) when the extension is built and has them
_C_SAMPLER = clib.lib if clib.lib is not None and hasattr(clib.lib, "spel_sample_probs") else None


def probabilities(logits, history, params: SamplingParams) -> np.ndarray:
    """The sampling distribution (float64, sums to 1) after penalty, temperature,
    top-k and top-p.  Greedy params give the one-hot argmax distribution.  Float32
    logits (the models') go through the C transforms when they are built (the same
    steps, faster: docs/decoding.md), anything else through ``probabilities_reference``."""
    lib = _C_SAMPLER if not params.greedy and getattr(logits, "dtype", None) == np.float32 else None
    if lib is not None:
        ffi = clib.ffi
        x = np.ascontiguousarray(logits).reshape(-1)
        out = np.empty(x.shape[0], np.float64)
        rec = recent(history, params)
        r = np.asarray(rec, dtype=np.int32) if len(rec) else np.zeros(1, np.int32)
        rc = lib.spel_sample_probs(ffi.from_buffer("float[]", x), x.shape[0], ffi.from_buffer("int32_t[]", r),
                                   len(rec), float(params.repetition_penalty), float(params.temperature),
                                   int(params.top_k), float(params.top_p), ffi.from_buffer("double[]", out))
        if rc == 0:
            return out
    return probabilities_reference(logits, history, params)


def probabilities_reference(logits, history, params: SamplingParams) -> np.ndarray:
    """probabilities in numpy (the reference of the C version)."""
    z = adjusted_logits(logits, history, params)
    V = z.shape[-1]
    if params.greedy:
        p = np.zeros(V)
        p[int(np.argmax(z))] = 1.0
        return p
    z = z * (1.0 / params.temperature)
    if params.top_k and params.top_k < V:
        # keep the k largest; ties at the boundary are kept (stable, order-free)
        kth = np.partition(z, V - params.top_k)[V - params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    z = z - np.max(z)
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        order, csum = _descending_mass(p, params.top_p - 1e-12)
        # smallest prefix whose mass reaches top_p (always at least one token;
        # the 1e-12 absorbs summation rounding at an exact boundary)
        keep = int(np.searchsorted(csum, params.top_p - 1e-12, side="left")) + 1
        mask = np.zeros(V, dtype=bool)
        mask[order[:keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


NUCLEUS_CANDIDATES = 256


def _descending_mass(p: np.ndarray, need: float):
    """(order, cumsum of p[order]) for the tokens by descending p (ties by index:
    a stable sort), as far as the mass reaches ``need``.  Only the top
    NUCLEUS_CANDIDATES (all tokens tied with the last one included) are sorted
    when their mass suffices, else everything: the prefix is the same either
    way, as every other token has a smaller p, and a full argsort of the
    vocabulary is the costly step of a sampled round (docs/decoding.md)."""
    V = p.shape[0]
    if V > NUCLEUS_CANDIDATES:
        t = np.partition(p, V - NUCLEUS_CANDIDATES)[V - NUCLEUS_CANDIDATES]
        cand = np.flatnonzero(p >= t)
        order = cand[np.argsort(-p[cand], kind="stable")]
        csum = np.cumsum(p[order])
        if csum[-1] >= need:
            return order, csum
    order = np.argsort(-p, kind="stable")
    return order, np.cumsum(p[order])


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a normalized distribution by inverse CDF (one uniform)."""
    return draw_at(p, rng.random())


def draw_at(p: np.ndarray, u: float) -> int:
    """The token of a normalized distribution at uniform u in [0, 1) (inverse CDF)."""
    c = np.cumsum(p)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return min(i, p.shape[0] - 1)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """normalize(max(0, p - q)); falls back to p when p == q (cannot reject then)."""
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    if s <= 0.0:
        return p
    return r / s


def accept_or_resample(p: np.ndarray, q: np.ndarray, token: int, u_accept: float, u_draw: float) -> tuple:
    """The residual rule for one drafted `token` ~ q against target p, with the two
    uniforms it may use: (True, token) on acceptance, else (False, replacement ~ residual)."""
    qt = q[token]
    if qt > 0.0 and u_accept < min(1.0, p[token] / qt):
        return True, token
    return False, draw_at(residual(p, q), u_draw)    # qt = 0: the draft could not have drawn it


def residual_round(probs, qs, proposal, seed: int, index0: int):
    """The residual rule along a round: (n accepted, the correction), or (m, None) when
    all m were accepted (the caller takes the target's own sample of the next row).
    Proposal j sits at sequence index index0 + j; its uniforms are the stream's there."""
    for j, tok in enumerate(proposal):
        ok, fix = accept_or_resample(probs[j], qs[j], tok, noise.uniform(seed, index0 + j, noise.ACCEPT),
                                     noise.uniform(seed, index0 + j, noise.DRAW))
        if not ok:
            return j, fix
    return len(proposal), None


# --- the rows of a round at once -------------------------------------------------

_C_ROWS = clib.lib if clib.lib is not None and hasattr(clib.lib, "spel_sample_rows") else None


def sample_rows(rows, seq, n_ctx: int, params: SamplingParams, noise_at: tuple, want_probs: bool = False):
    """(tokens, probs) of M positions in one step: row j of `rows` [M, V] is the position
    of sequence index index0 + j (`noise_at` = (seed, index0): where in the call's noise
    stream row 0 draws), and its penalty sees the window of seq[:n_ctx + j] (seq: the
    context, then the tokens of rows 0..M-2).  tokens[j] is the coupled sample
    (temperature 0: the argmax of the penalized logits); probs [M, V] the distributions
    (want_probs).  The C transforms for float32 rows, else ``sample_rows_reference``."""
    rows = np.asarray(rows)
    if _C_ROWS is None or rows.dtype != np.float32:
        return sample_rows_reference(rows, seq, n_ctx, params, noise_at, want_probs)
    seed, index0 = noise_at
    ffi = clib.ffi
    rows = np.ascontiguousarray(rows)
    M, V = rows.shape
    sq = np.asarray(seq, dtype=np.int32) if len(seq) else np.zeros(1, np.int32)
    toks = np.empty(M, np.int32)
    probs = np.empty((M, V), np.float64) if want_probs else None
    cp = ffi.new("spel_sampling *", dict(temperature=params.temperature, top_p=params.top_p,
                                         penalty=params.repetition_penalty, top_k=params.top_k,
                                         window=params.window, seed=seed & noise._MASK))
    rc = _C_ROWS.spel_sample_rows(ffi.from_buffer("float[]", rows), M, V, ffi.from_buffer("int32_t[]", sq),
                                  int(n_ctx), int(index0), cp, ffi.from_buffer("int32_t[]", toks),
                                  ffi.from_buffer("double[]", probs) if want_probs else ffi.NULL)
    if rc == -3:
        raise ValueError("a row of logits holds no finite value")
    if rc:
        raise ValueError(f"spel_sample_rows failed ({rc})")
    return toks.tolist(), probs


def sample_rows_reference(rows, seq, n_ctx, params: SamplingParams, noise_at: tuple, want_probs=False):
    """sample_rows in numpy (the reference of the C version)."""
    seed, index0 = noise_at
    seq = [int(t) for t in seq]
    toks, probs = [], []
    for j, row in enumerate(np.asarray(rows)):
        history = seq[:n_ctx + j]
        p = probabilities_reference(row, history, params)
        z = adjusted_logits(row, history, params)
        if params.greedy:
            toks.append(int(np.argmax(z)))
        else:
            support = np.flatnonzero(p > 0)
            if support.size == 0:
                raise ValueError("a row of logits holds no finite value")
            score = z[support] * (1.0 / params.temperature) + noise.gumbel_reference(seed, index0 + j, support)
            toks.append(int(support[int(np.argmax(score))]))
        probs.append(p)
    return toks, (np.stack(probs) if want_probs else None)


def one_hot(token: int, V: int) -> np.ndarray:
    """Draft distribution of a deterministic proposer (n-gram, greedy draft)."""
    q = np.zeros(V)
    q[token] = 1.0
    return q

"""Decoding passes: one ``mx.compile``d function of a whole stack over M rows.

A pass is compiled per (stack, M, attention window, device); ops that read only the
cache rows each query sees (``ops.windowed`` False) have no window.  Its inputs are the
tokens (a pipeline stage after the first: activations), the position of row 0 (an
int32 scalar, so positions do not retrace), the GDN slot arrays and the full KV
caches; its outputs the logits (a stage before the last: activations), the states
after each row, the updated caches and the GDN q/k.  Weight layouts and gate
constants are built before tracing, so the pass captures them as constants.
A single-token forward is the M=1 pass; strict rows run it row by row.
"""
from __future__ import annotations

import mlx.core as mx

from ..platform import huge_pages

MIN_WINDOW = 64  # smallest attention window of a pass


def window(n: int, max_seq: int) -> int:
    """Attention window covering n positions: powers of two from MIN_WINDOW to
    1024, then multiples of 512 (past 1k tokens attention costs about as much as
    the weights), so at most ~1.5x what is needed, for a handful of shapes."""
    w = MIN_WINDOW
    while w < n and w < 1024:
        w *= 2
    if w < n:
        w = -(-n // 512) * 512
    return min(w, max_seq)


class GDNCache:
    """A GDN layer inside a pass: the state S [H,hd,hd] and conv tail [2,d] before
    row 0; the mixer leaves the states and tails after each row and the unit q, k."""

    def __init__(self, S, tail):
        self.S, self.tail = S, tail
        self.states = self.tails = self.q = self.k = None

    def outputs(self, M: int) -> list:
        """Stacked states (one [M,H,hd,hd] array) go out with the stacked tails;
        a list of lazy per-row states goes out row by row, tails too."""
        if isinstance(self.states, mx.array):
            return [self.states, self.tails]
        return list(self.states) + rows(self.tails, M)


class KVCache:
    """An attention layer inside a pass: the full K/V caches [rows,H,hd]; this
    batch's rows go in at ``pos``, attention reads the first ``window`` rows (all of
    them when window is None: the ops read only the rows each query sees)."""

    def __init__(self, keys, values, pos, window: int | None):
        self.keys, self.values, self.pos, self.window = keys, values, pos, window

    def write(self, k, v) -> None:
        if self.keys.dtype != k.dtype:     # a half-precision cache: rounded to nearest even
            k, v = k.astype(self.keys.dtype), v.astype(self.values.dtype)
        self.keys = mx.slice_update(self.keys, k, self.pos, axes=(0,))
        self.values = mx.slice_update(self.values, v, self.pos, axes=(0,))

    def update_and_fetch(self, k, v):
        self.write(k, v)
        if self.window is None:
            return self.keys, self.values
        return self.keys[:self.window], self.values[:self.window]


def rows(a, M: int) -> list:
    """[a[0], ..., a[M-1]] as slice+reshape views (integer indexing would gather)."""
    shape = a.shape[1:]
    return [a[j:j + 1].reshape(shape) for j in range(M)] if M > 1 else [a.reshape(shape)]


def prepare_stack(model, stack: str, M: int, pages_soon: bool = False) -> list:
    """Build what an M-row pass over ``stack`` captures as constants: the gate
    constants and the weight layouts (on huge pages; ``pages_soon``: mapped that way
    on a background thread).  Kept once built, so a load can pay for them before the
    first call.  Returns the stack's layers."""
    ops = model.ops
    layers = model.stack_layers(stack)
    for blk in layers:
        if blk.kind == "gdn":
            blk.mixer.gates(M)
    # lm_head None: a pipeline stage before the last
    lins = [lin for blk in layers for lin in blk.linears()] + [model.lm_head] * (model.lm_head is not None)
    for lin in lins:
        ops.prepare_linear(lin, M)
    (huge_pages.back_soon if pages_soon else huge_pages.back)([a for lin in lins for a in lin.layouts()])
    return layers


def make_pass(model, stack: str, M: int, win: int | None, pages_soon: bool = False):
    """The function of one M-row pass over ``stack`` with attention window ``win``
    (None: the whole cache), and whether it is the backend's plan (``ops.pass_plan``),
    which takes the GDN slots as (arrays, rows) and reads stacked rows in place;
    ``pages_soon``: see prepare_stack."""
    ops = model.ops
    layers = prepare_stack(model, stack, M, pages_soon)   # constants built now, captured by the trace
    plan = ops.pass_plan(model, layers, M)
    if plan is not None:
        return plan, True

    def one_pass(tokens, pos, gdn_in, kv_in):
        gdn_it, kv_it = iter(gdn_in), iter(kv_in)
        caches = [GDNCache(next(gdn_it), next(gdn_it)) if blk.kind == "gdn" else
                  KVCache(next(kv_it), next(kv_it), pos, win) for blk in layers]
        logits = model.stack_logits(tokens, layers, caches, ops)
        gdn = [c for c in caches if isinstance(c, GDNCache)]
        kv = [c for c in caches if isinstance(c, KVCache)]
        return (logits, [a for c in gdn for a in c.outputs(M)], [a for c in kv for a in (c.keys, c.values)],
                [a for c in gdn for a in (c.q, c.k)])

    return (mx.compile(one_pass) if model.compile else one_pass), False


def get_pass(model, stack: str, M: int, end: int, kv_dtype, pages_soon: bool = False):
    """The M-row pass over ``stack`` whose rows end at position ``end`` (it decides the
    attention window), made once per key; ``pages_soon``: see prepare_stack."""
    win = window(end, model.cfg.max_seq) if model.ops.windowed else None
    # device: row blocks are CPU-only
    key = (stack, M, win, str(mx.default_device()), kv_dtype)
    made = model._compiled.get(key)
    if made is None:
        made = model._compiled[key] = make_pass(model, stack, M, win, pages_soon)
        model.passes_built += 1
    return made


def run_pass(model, toks, state, dispatch: bool = True, capture: bool = False):
    """One pass of M rows after the state's last written position; writes the new
    KV rows and GDN slots into the state.  ``toks``: M token ids (a list, or an int32
    [M] array that may not be computed yet), or the input activations [M, d] of a
    pipeline stage after the first.  Returns the stack's output (logits) and the q/k
    of each GDN layer.  ``dispatch=False`` builds the pass without starting it: the
    caller evaluates the logits later (the KV caches are then updated in place only if
    no earlier pass still holds them).  ``capture``: also return the GDN layers' q/k
    ({} otherwise: the backend's plan then makes no arrays for them)."""
    inputs = toks if isinstance(toks, mx.array) else mx.array(toks, dtype=mx.int32)
    M = inputs.shape[0]
    state.check_room(M)   # a dynamic slice_update writes the KV rows in place, unchecked
    base = state.pos + state.pending
    fn, plan = get_pass(model, state.stack, M, base + M, state.kv_dtype)
    gdn_in, gdn_rows, kv_in = [], [], []
    for li in state.gdn_layers:
        if plan:
            arrays, rows_ = state.current_gdn_rows(li)
            gdn_in.extend(arrays)
            gdn_rows.extend(rows_)
        else:
            gdn_in.extend(state.current_gdn(li))
    for li in state.attn_layers:
        kv_in.extend(state.kv(li))
    pos = mx.array(base, dtype=mx.int32)
    if plan:
        logits, gdn_out, kv_out, qk = fn(inputs, pos, gdn_in, gdn_rows, kv_in, capture)
    else:
        logits, gdn_out, kv_out, qk = fn(inputs, pos, gdn_in, kv_in)
    del kv_in   # only the pass may reference the old caches: MLX then updates them in place
    for n, li in enumerate(state.attn_layers):
        state.set_kv(li, kv_out[2 * n], kv_out[2 * n + 1])
    captured, at = {}, 0
    for n, li in enumerate(state.gdn_layers):
        if gdn_out[at].ndim == 4:
            state.write_gdn_rows(li, gdn_out[at], gdn_out[at + 1])
            at += 2
        else:
            state.write_gdn(li, gdn_out[at:at + M], gdn_out[at + M:at + 2 * M])
            at += 2 * M
        if capture:
            captured[li] = {"q": qk[2 * n], "k": qk[2 * n + 1]}
    state.advance(M)
    # the GDN slots stay lazy: the next pass evaluates the one it starts from, and a
    # rejected token's state (chunked delta rule) is never computed
    if dispatch:
        mx.async_eval(logits, kv_out)
    return logits, captured

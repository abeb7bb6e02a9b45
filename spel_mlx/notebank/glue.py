"""NoteBank over a model: capture runs, branches, writing and replay (SPEC 7).

A branch is ``state.snapshot()`` / ``state.restore()`` around a retrieval. Replay is a token
re-prefill of the selected spans before the query (default), or the opt-in native replay
that adds each span's own recurrent state into the committed ring slot."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .addressing import Retrieval, address
from .config import NoteBankConfig, NoteBankError
from .measures import gdn_channel_count, notes_storage_bytes
from .writer import Note, NoteWriter


def _stack_capture(capture: dict, gdn_layers: list):
    """capture[layer] = {"q","k"} [M,H,hd] -> numpy q, k [M, C, hd], channel = g*H + h."""
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
    tokens = [int(t) for t in tokens]
    if not tokens:
        return None
    out = model.prefill(tokens, state, strict=strict)
    mx.eval(out)
    return np.asarray(out, np.float32)


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
        snap = state.snapshot()
        gdn = dict(snap.gdn)
        for n in self.replay_order(notes):
            payload = n.replay_state if n.replay_state is not None else self.span_state(n)
            for i, S_span in payload.items():
                S, tail = gdn[i]
                gdn[i] = (S + S_span, tail)
        mx.eval([v[0] for v in gdn.values()])
        state.restore(dataclasses.replace(snap, gdn=gdn))


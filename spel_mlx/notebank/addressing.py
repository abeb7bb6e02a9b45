"""Addressing: rank notes for a query (SPEC 7).

Query vectors come from the last Q positions (the query's captured k by default, native q
opt-in); per-channel cosine similarity in the projected space; summed ranking (default) or
the per-channel integer vote ranker (opt-in); top-R. numpy only."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .config import RANKERS, NoteBankConfig, NoteBankError
from .writer import unit


def query_vectors(qs: np.ndarray, q_positions: int) -> np.ndarray:
    """Normalized mean of the last ``q_positions`` query vectors (captured k or q) per channel.
    qs ``[M, C, hd]`` -> ``[C, hd]`` (zeros when M == 0)."""
    qs = np.asarray(qs, np.float32)
    if qs.ndim != 3:
        raise NoteBankError(f"query vectors must be [M, C, hd], got shape {qs.shape}")
    if qs.shape[0] == 0:
        return np.zeros(qs.shape[1:], np.float32)
    return unit(unit(qs[-q_positions:]).mean(axis=0))


def channel_similarity(query_proj: np.ndarray, note_vectors: np.ndarray) -> np.ndarray:
    """Cosine similarity per note and channel in the projected space.
    query_proj ``[C, P]``, note_vectors ``[N, C, P]`` -> ``[N, C]`` float32."""
    return np.einsum("cp,ncp->nc", unit(query_proj), unit(note_vectors)).astype(np.float32)


def channel_votes(sim: np.ndarray) -> np.ndarray:
    """Integer votes: each channel gives one vote to every note at its maximum similarity."""
    sim = np.asarray(sim, np.float32)
    if sim.shape[0] == 0:
        return np.zeros(0, np.int64)
    return (sim == sim.max(axis=0, keepdims=True)).sum(axis=1).astype(np.int64)


def _rank(sim: np.ndarray, by_votes: bool) -> np.ndarray:
    sim = np.asarray(sim, np.float32)
    if sim.shape[0] == 0:
        return np.zeros(0, np.int64)
    # np.lexsort sorts by its last key first
    keys = [np.arange(sim.shape[0]), -sim.astype(np.float64).sum(axis=1)]
    if by_votes:
        keys.append(-channel_votes(sim))
    return np.lexsort(keys)


def rank_summed(sim: np.ndarray) -> np.ndarray:
    """Note indices by summed channel similarity, best first; ties -> lower index."""
    return _rank(sim, by_votes=False)


def rank_votes(sim: np.ndarray) -> np.ndarray:
    """Note indices by channel votes, best first; ties -> summed similarity -> lower index."""
    return _rank(sim, by_votes=True)


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

"""Speculative decoding (SPEC 5): the round, its proposers, the governor, sampling.

    loop.py          SpeculativeDecoder: the round loop, modes
    call.py          a call's state from round to round (Call), what a round reports (RoundResult)
    target.py        the target's state and verification batches (SPEC 4)
    proposer.py      the Proposer protocol (what a round asks of a draft)
    mlx_proposer.py  the FP32 MLX draft layers, or the whole target (oracle)
    c_proposer.py    the C draft, plain or drafting ahead during verification
    ngram.py         prompt lookup: the n-gram index and its proposer
    auto.py          n-gram, else a model proposer behind a gate
    factory.py       proposers by --draft name
    governor.py      suspends drafting when acceptance falls
    shadow.py        the governor's shadow probes: unverified proposals during AR rounds
    stats.py         DecodeStats (the --stats JSON, c and v)
    sampling.py      transforms and the lossless residual rule
    placement.py     calibrates target/draft placements by the cost model
"""
from .factory import PROPOSER_KINDS, DraftOptions, make_proposer
from .governor import Governor, GovernorConfig
from .call import RoundResult
from .loop import MODES, DecodeError, DecodeOptions, SpeculativeDecoder
from .proposer import Proposer
from .sampling import GREEDY, SamplingParams
from .stats import DecodeStats

__all__ = ["DecodeError", "DecodeOptions", "DecodeStats", "DraftOptions", "GREEDY", "Governor", "GovernorConfig",
           "MODES", "PROPOSER_KINDS", "Proposer", "RoundResult", "SamplingParams", "SpeculativeDecoder",
           "make_proposer"]

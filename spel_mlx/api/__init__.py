"""The Python API: ``load``, ``generate``, ``stream_generate`` (see generation.py)."""
from .engine import GovernorConfig
from .generation import (DEFAULT_MAX_TOKENS, DEFAULT_REPETITION_PENALTY, DEFAULT_TEMPERATURE, DEFAULT_TOP_P,
                         GenerationError, GenerationResponse, Request, generate, prepare, stream_generate)
from .loading import LoadedModel, LoadError, NoCheckpoint, load

__all__ = ["load", "generate", "stream_generate", "prepare", "Request", "GenerationResponse",
           "GenerationError", "LoadError", "NoCheckpoint", "LoadedModel", "GovernorConfig",
           "DEFAULT_MAX_TOKENS", "DEFAULT_TEMPERATURE", "DEFAULT_TOP_P", "DEFAULT_REPETITION_PENALTY"]

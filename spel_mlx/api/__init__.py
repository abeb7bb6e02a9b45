"""The Python API, as mlx-lm's: ``load``, ``generate``, ``stream_generate``,
``make_prompt_cache`` (see generation.py; docs/api.md)."""
from .cache import PrefixCache, PromptCache, make_prefix_cache, make_prompt_cache
from .engine import GovernorConfig
from .errors import GenerationError
from .generation import GenerationResponse, generate, stream_generate
from .loading import LoadedModel, LoadError, NoCheckpoint, load
from .options import (DEFAULT_MAX_TOKENS, DEFAULT_REPETITION_PENALTY, DEFAULT_TEMPERATURE, DEFAULT_TOP_P,
                      prepare)
from .request import Request, RoundResponse

__all__ = ["load", "generate", "stream_generate", "make_prompt_cache", "make_prefix_cache", "prepare", "Request",
           "GenerationResponse", "RoundResponse", "PromptCache", "PrefixCache", "GenerationError", "LoadError",
           "NoCheckpoint", "LoadedModel", "GovernorConfig", "DEFAULT_MAX_TOKENS", "DEFAULT_TEMPERATURE",
           "DEFAULT_TOP_P", "DEFAULT_REPETITION_PENALTY"]

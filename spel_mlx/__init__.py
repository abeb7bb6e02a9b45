"""spel-mlx: low-bit speculative decoding and episodic memory for a hybrid
Gated-DeltaNet + attention language model, on MLX."""
from .platform.blas import blas_info, ensure_blas, set_blas_threads
from .platform.heap import tune as _tune_heap
from .settings import SettingError

try:
    ensure_blas()  # must run before anything imports mlx.core
    _tune_heap()   # before MLX allocates its first buffers (spel_mlx/platform/heap.py)
    _bad_setting = None
except SettingError as e:   # a bad SPEL_* value: raised by the API's first use, a command's one-line error
    _bad_setting = e

__version__ = "0.1.0"
_API = ("load", "generate", "stream_generate", "make_prompt_cache")
__all__ = ["blas_info", "ensure_blas", "set_blas_threads", "__version__", *_API]


def __getattr__(name):
    # the generation API on first use, so `import spel_mlx` stays cheap (the command
    # `python -m spel_mlx.generate` runs spel_mlx/generate.py without importing it)
    if name in _API:
        if _bad_setting is not None:
            raise _bad_setting
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


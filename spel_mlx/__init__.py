"""spel-mlx: low-bit speculative decoding and episodic memory for a hybrid
Gated-DeltaNet + attention language model, on MLX."""
from ._blas import blas_info, ensure_blas, set_blas_threads

ensure_blas()  # must run before anything imports mlx.core

__version__ = "0.1.0"
__all__ = ["blas_info", "ensure_blas", "set_blas_threads", "__version__"]

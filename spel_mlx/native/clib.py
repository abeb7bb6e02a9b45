"""The cffi library built from neon/ (``spel_mlx._spel_draft``), loaded in one place.

Both the C draft (``cdraft``) and the C sampling transforms
(``spel_mlx.decoding.sampling``) take ``ffi`` and ``lib`` from here; ``lib`` is None
when the extension is not built, and ``require()`` then says how to build it.
"""
from __future__ import annotations

try:
    from .._spel_draft import ffi, lib
except ImportError as _e:  # pragma: no cover - depends on the build
    ffi = lib = None
    IMPORT_ERROR = _e
else:
    IMPORT_ERROR = None


def require():
    """``lib``, or ImportError when the extension is not built."""
    if lib is None:
        raise ImportError(
            "spel_mlx._spel_draft (the C draft engine) is not built: run "
            f"`pip install -e .` in the project root ({IMPORT_ERROR})")
    return lib


def available() -> bool:
    return lib is not None

import os

import pytest

import spel_mlx  # noqa: F401  (loads the fast BLAS before any test imports mlx)


def require_or_skip(ok: bool, why: str):
    """Skip when a tool is missing, unless CI demands it (SPEL_REQUIRE_CROSS=1)."""
    if ok:
        return
    if os.environ.get("SPEL_REQUIRE_CROSS") == "1":
        pytest.fail(why + " (SPEL_REQUIRE_CROSS=1: this test must not skip)")
    pytest.skip(why)

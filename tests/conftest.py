import os

import pytest

import spel_mlx  # noqa: F401  (loads the fast BLAS before any test imports mlx)


def require_or_skip(ok: bool, why: str, env: str = "SPEL_REQUIRE_CROSS"):
    """Skip when a tool is missing, unless CI demands it (`env`=1: SPEL_REQUIRE_CROSS for
    the cross compiler and qemu, SPEL_REQUIRE_SERVER for the server extras and Chromium)."""
    if ok:
        return
    if os.environ.get(env) == "1":
        pytest.fail(f"{why} ({env}=1: this test must not skip)")
    pytest.skip(why)

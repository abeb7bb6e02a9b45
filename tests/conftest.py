import os

import pytest

import spel_mlx  # noqa: F401  (loads the fast BLAS before any test imports mlx)

# the suite never reads or writes the user's governor store (its own tests point it at a
# temporary folder): a stored verdict would make one test's calls depend on another's
os.environ.setdefault("SPEL_GOVERNOR_STORE", "0")
# the suite decodes with the small shipped pair (2.7x cheaper per token than the default);
# the default pair has its own tests (test_cli_weights, the README's samples, the wheel)
os.environ.setdefault("SPEL_WEIGHTS", "spel-8m")


def served_model_id() -> str:
    """The id a server started without --model/--model-id gives the model the suite uses."""
    from spel_mlx.checkpoints.load import resolve_checkpoint_path
    from spel_mlx.cli.server import model_name
    return model_name(resolve_checkpoint_path())


def require_or_skip(ok: bool, why: str, env: str = "SPEL_REQUIRE_CROSS"):
    """Skip when a tool is missing, unless CI demands it (`env`=1: SPEL_REQUIRE_CROSS for
    the cross compiler and qemu, SPEL_REQUIRE_SERVER for the server extras and Chromium)."""
    if ok:
        return
    if os.environ.get(env) == "1":
        pytest.fail(f"{why} ({env}=1: this test must not skip)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def shipped_c_run():
    """(checkpoint, model, prompt, its 60-token AR output): the shipped model for tests of
    the C draft's proposers (skipped when the C draft is not built)."""
    import numpy as np
    from spel_mlx.reader import load_checkpoint
    from spel_mlx.decoding import SpeculativeDecoder
    from spel_mlx.model import SpelModel
    from spel_mlx.native import clib
    if not clib.available():
        pytest.skip(f"C draft unavailable: {clib.IMPORT_ERROR}")
    ck = load_checkpoint()
    model = SpelModel.from_weights(ck.cfg, ck.weights)
    prompt = [int(t) for t in np.arange(40) * 37 % ck.cfg.vocab]
    return ck, model, prompt, SpeculativeDecoder(model, None, "ar").generate(prompt, 60)

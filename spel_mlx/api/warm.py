"""One-time costs paid at load rather than inside the first call (docs/never_slower.md).

``load(prepare="spec")`` builds the default C draft on another thread (``start_draft``,
called once the checkpoint is open; its C code runs without the GIL) while this thread
reads the target's weights and then, in ``warm_up``, builds the target's passes (or
their weight layouts) for its step and its verification; their mapping onto huge pages
runs on a third thread, which the first call does not wait for (and which waits for the
first call's first token, or HOLD_S, before it starts).
``"ar"`` builds the step's only.  The first call takes the prepared draft (``take_draft``)
instead of building one; the text is the same either way (a prepared draft is an
ordinary one, built earlier).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

from ..decoding.ahead import usable_cpus
from ..decoding.factory import c_draft_ring, default_draft_threads
from ..model.backends import device_scope
from ..model.passes import get_pass, prepare_stack
from ..model.state import KV_DTYPES
from ..native import clib
from ..platform import heap, huge_pages

PREPARE = ("spec", "ar", "none")   # load(prepare=...)


def c_draft_plan(threads: int | None, draft_ahead: str) -> tuple:
    """(threads, ahead) of a C draft for these settings: ahead "auto" (while it pays,
    decoding.ahead) with 2+ CPUs and one draft thread, unless forced on or off."""
    threads = threads or default_draft_threads()
    if draft_ahead == "auto":
        return threads, ("auto" if usable_cpus() >= 2 and threads == 1 else False)
    return threads, draft_ahead == "on"


def start_draft(cfg, weights, mode: str = "spec") -> dict:
    """Start building the default C draft of `cfg` from `weights` (the checkpoint's float32
    arrays) on another thread when `mode` is "spec": ``{(threads, ring): Future}`` for
    ``LoadedModel.prepared``, else {}.  ``load`` starts it as soon as the checkpoint is
    open, so the draft's quantization runs beside the reading of the target's weights."""
    if mode != "spec" or not clib.available() or cfg.n_draft <= 0 or not weights:
        return {}
    threads, ahead = c_draft_plan(None, "auto")
    ring = c_draft_ring(cfg.spec_k, ahead)
    built: Future = Future()

    def build():
        try:
            from ..native.cdraft import CDraft
            built.set_result(CDraft(cfg, weights, threads=threads, ring=ring))
        except BaseException as e:  # noqa: BLE001 - handed to whoever takes it
            built.set_exception(e)

    threading.Thread(target=build, name="spel-prepare-draft", daemon=True).start()
    return {(threads, ring): built}


def warm_up(loaded, mode: str = "spec") -> None:
    """Pay the target's one-time costs of the first call in `mode` now (one of PREPARE,
    which ``load`` checks; the C draft is ``start_draft``'s; see the module)."""
    if mode == "none" or loaded.pipeline is not None:
        return
    k = loaded.cfg.spec_k
    if loaded.device != "cpu":     # a GPU's layouts are views MLX builds in the pass
        return
    model = loaded.model
    huge_pages.hold_soon()          # the first call's first token comes before the collapses
    with device_scope("cpu"):
        for M in sorted({1, k + 1}) if mode == "spec" else (1,):
            if model.ops.windowed:       # a pass per attention window: the layouts only
                prepare_stack(model, "target", M, pages_soon=True)
            else:                        # one pass for every position: the pass itself
                get_pass(model, "target", M, M, KV_DTYPES[model.kv_cache], pages_soon=True)
    heap.release_free()


def take_draft(loaded, threads: int, ring: int):
    """The C draft prepared for (threads, ring), waiting for it if it is still being
    built; None when there is none or its build failed (the caller builds one itself,
    where the error is raised)."""
    built = loaded.prepared.pop((threads, ring), None)
    if built is None:
        return None
    try:
        return built.result()
    except Exception:  # noqa: BLE001
        return None

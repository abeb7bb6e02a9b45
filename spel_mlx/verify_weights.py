"""Verify a checkpoint against its golden footer (SPEC 6).

    python -m spel_mlx verify-weights FILE [--config k=v,...]

Loads FILE (SPELW001 or a safetensors folder), runs the golden tokens one per
position from a reset state through the target (MLX) and the quantized draft,
and compares with the stored logits.  PASS iff target argmax n/n and target
max_abs < SPEL_VERIFY_TOL (default 1e-3); the draft is reported, not gated.

Exit status: 0 PASS, 1 FAIL, 2 malformed input or configuration (one line on
stderr naming the file, the field or tensor and the byte offset), 3 internal error.
"""
from __future__ import annotations

import sys

import numpy as np

from .config import ConfigError, resolve_config
from .checkpoints import CheckpointError
from .settings import SettingError, setting



def _mb(n_params: int) -> str:
    return f"{4 * n_params / 1e6:.2f} MB ({4 * n_params / 2**20:.2f} MiB)"


def compare(ref: np.ndarray, got: np.ndarray) -> tuple:
    """(max |Δlogit|, positions whose argmax agrees)."""
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    max_abs = float(diff.max()) if np.isfinite(diff).all() else float("nan")
    agree = int((np.argmax(got, axis=1) == np.argmax(ref, axis=1)).sum())
    return max_abs, agree


def tolerance(environ=None) -> float:
    try:
        return setting("SPEL_VERIFY_TOL", environ)
    except SettingError as e:
        raise ConfigError(str(e)) from None


def verify(path, config: str | None = None, draft: str = "auto", out=None, target_backend: str = "mlx") -> bool:
    from .reader import load_checkpoint
    from .golden import compute_draft, compute_target, golden_backends

    out = sys.stdout if out is None else out
    tol = tolerance()
    ck = load_checkpoint(path)
    try:
        cfg = resolve_config(checkpoint=ck.cfg, overrides=config)
    except ConfigError as e:
        raise ConfigError(f"{ck.source}: {e}") from None
    p = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    fmt = "SPELW001" if ck.format == "spelw" else f"safetensors ({ck.stored_dtype})"
    p(f"checkpoint: {ck.source} [{fmt}]")
    p("config: " + ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items() if k != "spec_k"))
    p(f"target params: {cfg.target_params():,}  FP32 {_mb(cfg.target_params())}")
    p(f"draft params:  {cfg.draft_params():,}  FP32 {_mb(cfg.draft_params())}  (shared embedding/norm/head excluded)")
    p(f"file size: {ck.file_size:,} bytes ({ck.file_size / 2**20:.2f} MiB)")
    if ck.golden is None:
        p("golden: none (no SPELV001 footer / golden.* tensors)")
        p("FAIL: nothing to verify against")
        return False
    g = ck.golden
    n = g.n
    tokens = np.asarray(g.tokens)
    p(f"golden: n={n} tokens")
    target = compute_target(cfg, ck.page_dropping_weights(), tokens, prefer=target_backend)
    ck.release_pages()  # the MLX model holds its own copy now
    t_abs, t_agree = compare(g.target_logits, target)
    p(f"target ({golden_backends()['target']}): max_abs={t_abs:.3e}  argmax {t_agree}/{n}")
    draft_l = compute_draft(cfg, ck.weights, tokens, prefer=draft)
    d_abs, d_agree = compare(g.draft_logits, draft_l)
    p(f"draft (quantized, {golden_backends()['draft']}): max_abs={d_abs:.3e}  argmax {d_agree}/{n}")
    ok = t_agree == n and t_abs < tol
    p(f"tolerance: {tol:g}")
    p("PASS" if ok else "FAIL")
    return ok


if __name__ == "__main__":       # python -m spel_mlx.verify_weights: the verify-weights command
    from .cli.verify_weights import main
    sys.exit(main())

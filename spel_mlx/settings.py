"""Every SPEL_* environment variable, declared once: its kind, default and meaning.

The package reads the environment only through `setting(name)`, which parses a value
the one way its declaration says; a bad value is a `SettingError` naming the variable,
the value and what was expected (a command prints it as one line, exit 2: every
command's parser calls `check()` first).  `table()` is the README's table (a test keeps
it current); `python -m spel_mlx info` prints `effective()`.

Kinds: switch (1/on or 0/off), int and float (with bounds), choice, path, text, and
config (a model-config value, parsed and checked by spel_mlx/config.py).  A variable
that is unset or blank has its default.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


class SettingError(ValueError):
    """A SPEL_* variable holds a value its declaration does not allow."""


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str                   # switch | int | float | choice | path | text | config
    default: object
    meaning: str
    choices: tuple = ()
    low: float | None = None    # int, float: the smallest value allowed
    high: float | None = None   # int: the largest
    scope: str = "run"          # run | build (setup.py) | test suite | bench (bench/device_check.sh)

    def parse(self, raw: str):
        text = raw.strip()
        if self.kind == "switch":
            if text.lower() not in ("0", "1", "off", "on"):
                raise self._bad(text, "0 or 1")
            return text.lower() in ("1", "on")
        if self.kind in ("int", "float"):
            try:
                value = int(text) if self.kind == "int" else float(text)
            except ValueError:
                raise self._bad(text, "an integer" if self.kind == "int" else "a number") from None
            # an int's low bound is allowed, a float's is not (a timeout, a tolerance: > 0)
            below = self.low is not None and (value < self.low if self.kind == "int" else not value > self.low)
            if below or (self.high is not None and value > self.high):
                raise self._bad(text, self._range())
            return value
        if self.kind == "choice":
            if text.lower() not in self.choices:
                raise self._bad(text, "one of " + ", ".join(self.choices))
            return text.lower()
        return text

    def _range(self) -> str:
        if self.high is not None:
            return f"an integer in {self.low:g}..{self.high:g}"
        return f"a number > 0" if self.low == 0 and self.kind == "float" else f"at least {self.low:g}"

    def _bad(self, text: str, expected: str) -> SettingError:
        return SettingError(f"{self.name}={text!r}: expected {expected}")

    def describe(self) -> str:
        """The allowed values, for the table."""
        if self.kind == "switch":
            return "0 or 1"
        if self.kind == "choice":
            return " \\| ".join(self.choices)
        if self.kind in ("int", "float") and self.low is not None:
            return self._range()
        return {"path": "a path", "text": "text", "config": "see Configuration", "int": "an integer",
                "float": "a number"}[self.kind]


def _config(field: str, what: str) -> Setting:
    return Setting(f"SPEL_{field.upper()}", "config", None, f"the model config's {field} ({what}); "
                   "overrides SPEL_CONFIG, --config overrides it")


_DECLARED = (
    Setting("SPEL_WEIGHTS", "path", None, "the checkpoint a command or `load()` uses when none is given: a path, or "
            "a shipped model's short name (`spel-21m`, `spel-8m`; default: the shipped `spel-21m`)"),
    Setting("SPEL_CONFIG", "config", None, "model config overrides `k=v,...`, as --config (which wins)"),
    _config("d_model", "width"), _config("n_layers", "layers"), _config("n_heads", "heads"),
    _config("head_dim", "per-head width"), _config("d_ff", "FFN width"), _config("vocab", "vocabulary"),
    _config("max_seq", "longest sequence"), _config("attn_period", "every n-th layer is attention"),
    _config("spec_k", "draft proposals per round, also --spec-k"),
    _config("draft_map", "the target layers the draft copies, e.g. 0:3:6:9"),
    Setting("SPEL_DRAFT_THREADS", "int", None, "C draft worker threads when none are asked for "
            "(--draft-threads wins; default 1)", low=1, high=6),
    Setting("SPEL_GOVERNOR_STORE", "switch", True, "the cost governor's verdicts are kept across processes "
            "(in SPEL_CACHE_DIR) and a fresh process's first call starts from them"),
    Setting("SPEL_CACHE_DIR", "path", None, "where spel_mlx keeps what outlives a process (the governor's "
            "store; default XDG_CACHE_HOME/spel-mlx)"),
    Setting("SPEL_KERNELS", "choice", "auto", "the target's ops: the fused CPU primitives, plain MLX, "
            "the Metal kernels or their C++ emulation", choices=("auto", "mlx", "cpu", "metal", "emulated")),
    Setting("SPEL_SIMD", "choice", "auto", "caps the SIMD level of the C and C++ kernels "
            "(to run the paths of CPUs without AVX-512 or without SIMD)", choices=("auto", "avx512", "avx2", "none")),
    Setting("SPEL_ATTENTION_HELPER", "switch", True, "past 512 cached tokens the target's attention shares "
            "key chunks with a helper thread (the same bits either way)"),
    Setting("SPEL_HALF_WEIGHTS", "switch", True, "weights that are exactly binary16 values are read as "
            "float16 blocks by the linear tiles (AVX-512, or AVX2 with FMA and F16C: the same bits, half the bytes)"),
    Setting("SPEL_TRAIN_FUSED", "switch", True, "the training forward uses the fused CPU bodies "
            "(and their backward) where they are built"),
    Setting("SPEL_HUGE_PAGES", "switch", True, "map the target's weights and KV caches with 2 MB pages (Linux)"),
    Setting("SPEL_HEAP_TUNING", "switch", True, "set glibc's malloc thresholds at import so freed MLX "
            "buffers stay mapped (Linux)"),
    Setting("SPEL_BLAS", "choice", "auto", "which optimized BLAS MLX's Linux CPU build uses: numpy's "
            "OpenBLAS through the shim, the system's, or the reference", choices=("auto", "numpy", "system", "reference")),
    Setting("SPEL_BLAS_THREADS", "int", None, "OpenBLAS threads (default OPENBLAS_NUM_THREADS, else 1)", low=1),
    Setting("SPEL_PIPELINE_TIMEOUT", "float", 30.0, "seconds a pipeline rank waits for a message "
            "before it reports the link lost", low=0),
    Setting("SPEL_VERIFY_TOL", "float", 1e-3, "verify-weights: the largest target logit difference that passes",
            low=0),
    Setting("SPEL_API_KEY", "text", None, "the server's key: requests need `Authorization: Bearer KEY` "
            "(--api-key wins)"),
    Setting("SPEL_DEBUG", "switch", False, "an internal error re-raises with its traceback instead of one line"),
    Setting("SPEL_METAL_EMU_CACHE", "path", None, "where the Metal emulation's C++ builds are cached "
            "(default XDG_CACHE_HOME/spel_mlx)"),
    Setting("SPEL_METAL_EMU_OPT", "text", "-O1", "the compiler's optimization flag for the Metal emulation"),
    Setting("SPEL_METAL_EMU_ASAN", "switch", False, "build the Metal emulation with AddressSanitizer"),
    Setting("SPEL_REQUIRE_CPU_EXT", "switch", False, "the fused CPU primitives must build and load "
            "(else the build fails; the tests fail instead of skipping)", scope="build"),
    Setting("SPEL_REQUIRE_CROSS", "switch", False, "the cross-compiled NEON tests must run, not skip", scope="test suite"),
    Setting("SPEL_REQUIRE_SERVER", "switch", False, "the server, load and browser tests must run, not skip",
            scope="test suite"),
    Setting("SPEL_REQUIRE_WHEEL", "switch", False, "the sdist and wheel tests must run (pip reaching an "
            "index), not skip", scope="test suite"),
    Setting("SPEL_SCREENSHOT", "path", None, "the page test also saves its screenshot here", scope="test suite"),
    Setting("SPEL_DC_BUDGET_S", "float", None, "the GPU check's time budget in seconds", low=0, scope="bench"),
    Setting("SPEL_DC_PYTHON", "path", None, "the GPU check's python (default python3)", scope="bench"),
    Setting("SPEL_DC_CARRIED", "path", None, "where the GPU check finds its carried wheels (default .whl)",
            scope="bench"),
    Setting("SPEL_DC_STAGE", "path", None, "the GPU check's staging folder for the payload", scope="bench"),
    Setting("SPEL_DC_WORK", "path", None, "the GPU check's work folder (kept after a dry run)", scope="bench"),
    Setting("SPEL_DC_CONFIG", "text", None, "the GPU check's training shape, k=v,...", scope="bench"),
    Setting("SPEL_DC_TARGET_MIN", "float", None, "the GPU check's target training minutes", low=0, scope="bench"),
    Setting("SPEL_DC_DRAFT_MIN", "float", None, "the GPU check's draft training minutes", low=0, scope="bench"),
)
SETTINGS = {s.name: s for s in _DECLARED}


def raw(name: str, environ=None) -> str:
    """The variable's text as set ("" when unset)."""
    return (os.environ if environ is None else environ).get(SETTINGS[name].name, "").strip()


def setting(name: str, environ=None):
    """The variable's value, parsed; its default when unset or blank (SettingError when bad)."""
    s = SETTINGS[name]
    text = raw(name, environ)
    return s.default if not text else s.parse(text)


def check(environ=None, scopes=("run",)) -> None:
    """Raise SettingError for the first bad value among the variables of `scopes`."""
    for s in _DECLARED:
        if s.scope in scopes:
            setting(s.name, environ)


def effective(environ=None) -> list:
    """[(name, value, "set" | "default")] of the run-time variables (a bad value: its error)."""
    out = []
    for s in _DECLARED:
        if s.scope != "run":
            continue
        text = raw(s.name, environ)
        try:
            value = s.default if not text else s.parse(text)
        except SettingError as e:
            value = f"bad: {e}"
        shown = "(unset)" if value is None else ("***" if s.name == "SPEL_API_KEY" else value)
        out.append((s.name, shown, "set" if text else "default"))
    return out


def table() -> str:
    """The Markdown table of every variable (README.md, between its settings marks)."""
    rows = ["| variable | values | default | what it does |", "|---|---|---|---|"]
    for s in _DECLARED:
        default = {None: "", True: "1", False: "0"}.get(s.default, s.default) if not isinstance(s.default, float) \
            else f"{s.default:g}"
        where = "" if s.scope == "run" else f" ({'setup.py' if s.scope == 'build' else s.scope})"
        rows.append(f"| `{s.name}` | {s.describe()} | {default} | {s.meaning}{where} |")
    return "\n".join(rows)

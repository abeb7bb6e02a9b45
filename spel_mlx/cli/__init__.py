"""The command line: ``python -m spel_mlx <command> ...`` (or ``spel-mlx <command>``).

One module per command in this folder, each with ``main(argv=None) -> int``; the flags
they share are defined once in ``args.py``, the way a command ends (one line, exit
status) in ``errors.py``.  The older ``python -m spel_mlx.<command>`` paths run the
same modules.
"""
from __future__ import annotations

import importlib
import sys

from ..settings import SettingError, check


def _settings_first():
    """A bad SPEL_* value is one line and exit 2 before a command module is imported
    (some modules read theirs at import); its parser checks again for in-process calls."""
    try:
        check()
    except SettingError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


_settings_first()
# command -> (module in this package, what it does)
COMMANDS = {
    "generate": ("generate", "generate text with speculative decoding"),
    "server": ("server", "OpenAI-compatible HTTP server and the live page"),
    "info": ("info", "the checkpoint, the machine, the kernels and the SPEL_* settings in use"),
    "selftest": ("selftest", "the original's eight invariant suites on random weights"),
    "synth": ("synth", "write a random SPELW001 checkpoint with a golden footer"),
    "verify-weights": ("verify_weights", "check a checkpoint against its golden footer"),
    "convert": ("convert", "SPELW001 <-> safetensors model folder"),
    "notebank": ("notebank", "NoteBank episodic memory: the needle demo"),
    "corpus": ("corpus", "build the training corpus"),
    "tokenizer": ("tokenizer", "train or try the SentencePiece tokenizer"),
    "train": ("train", "train the target, distil the draft, export"),
    "train-report": ("train_report", "held-out loss, acceptance and samples of a trained model"),
    "distributed": ("distributed", "a batch of requests on a layer pipeline (under mlx.launch)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m spel_mlx <command> [options]   (python -m spel_mlx <command> --help)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def command_module(name: str):
    """The module of command `name` (underscores and hyphens alike); None if unknown."""
    entry = COMMANDS.get(name.replace("_", "-"))
    return None if entry is None else importlib.import_module(f"{__name__}.{entry[0]}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    module = command_module(argv[0])
    if module is None:
        print(f"spel_mlx: error: unknown command {argv[0]!r} (known: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    return module.main(argv[1:])

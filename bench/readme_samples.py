"""The README's quoted outputs, from the commands that make them.

A quote in README.md sits between ``<!-- sample: COMMAND -->`` and ``<!-- /sample -->``:
the text COMMAND prints, as quoted ("> ") lines, compared with whitespace folded.

    python bench/readme_samples.py            # run each command, print what it prints
    python bench/readme_samples.py --check    # exit 1 where a quote no longer matches
    python bench/readme_samples.py --write    # rewrite the quotes (after the default model changes)

tests/test_readme_samples.py runs the check.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"<!-- sample: (?P<command>.+?) -->\n(?P<quote>.*?)<!-- /sample -->\n", re.S)
WIDTH = 88


def samples(text: str) -> list:
    """[(command, quoted text)] of every sample block in `text`."""
    return [(m["command"], unquote(m["quote"])) for m in BLOCK.finditer(text)]


def unquote(quote: str) -> str:
    return "\n".join(line[2:] if line.startswith("> ") else line.lstrip(">") for line in quote.splitlines())


def folded(text: str) -> str:
    return " ".join(text.split())


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("SPEL_")}


def run(command: str, timeout: float = 600) -> str:
    """What `command` (run from the repository root, "python" being this interpreter) prints,
    as a newcomer's shell runs it: no SPEL_* variables set."""
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    out = subprocess.run(argv, cwd=README.parent, capture_output=True, text=True, timeout=timeout, env=clean_env())
    if out.returncode:
        raise RuntimeError(f"{command!r} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return out.stdout


def quoted(text: str) -> str:
    """`text` as quoted lines, paragraphs kept, each wrapped at WIDTH."""
    lines = []
    for para in text.strip().splitlines():
        lines += ["> " + w for w in textwrap.wrap(para, WIDTH - 2)] or [">"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/readme_samples.py", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare with the README's quotes")
    mode.add_argument("--write", action="store_true", help="rewrite the README's quotes")
    a = ap.parse_args(argv)
    text = README.read_text()
    stale = 0

    def replace(m):
        nonlocal stale
        out = run(m["command"])
        if folded(out) != folded(unquote(m["quote"])):
            stale += 1
            print(f"stale: {m['command']}", file=sys.stderr)
        if not (a.check or a.write):
            print(f"$ {m['command']}\n{out}")
        return f"<!-- sample: {m['command']} -->\n{quoted(out)}<!-- /sample -->\n"

    new = BLOCK.sub(replace, text)
    if a.write and new != text:
        README.write_text(new)
        print(f"rewrote {stale} quote(s) in {README}")
    return 1 if a.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())

"""What the command-line tools share."""
from __future__ import annotations

import os
import sys


def internal_error(prog: str, exc: BaseException, note: str = "") -> int:
    """Report an unexpected exception as one line on stderr and return exit code 3.

    SPEL_DEBUG=1 re-raises it instead, with its traceback, for bug reports.
    """
    if os.environ.get("SPEL_DEBUG") == "1":
        raise exc
    text = str(exc)
    first = text.splitlines()[0] if text else ""
    print(f"{prog}: internal error{note}: {type(exc).__name__}: {first}", file=sys.stderr)
    return 3

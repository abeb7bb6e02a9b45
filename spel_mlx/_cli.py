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


def guarded(body, errors: tuple, prog: str = "", interrupted: str = "interrupted") -> int:
    """Run ``body()`` and return its exit status. An expected error (one of ``errors``)
    becomes ``PROG: error: ...`` on stderr and status 2; Ctrl-C becomes ``interrupted``
    and 130: a user mistake or an interruption is one line, never a traceback."""
    prefix = f"{prog}: " if prog else ""
    try:
        return body()
    except errors as e:
        print(f"{prefix}error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prefix}{interrupted}", file=sys.stderr)
        return 130

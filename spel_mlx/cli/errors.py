"""How a command ends: a user mistake or an interruption is one line on stderr, never a
traceback; an unexpected exception is one line too (SPEL_DEBUG=1 re-raises it)."""
from __future__ import annotations

import sys

from ..settings import setting


class UsageError(ValueError):
    """A bad command line or input: one line, exit 2."""


def internal_error(prog: str, exc: BaseException, note: str = "") -> int:
    """Report an unexpected exception as one line on stderr and return exit code 3.

    SPEL_DEBUG=1 re-raises it instead, with its traceback, for bug reports.
    """
    if setting("SPEL_DEBUG"):
        raise exc
    text = str(exc)
    first = text.splitlines()[0] if text else ""
    print(f"{prog}: internal error{note}: {type(exc).__name__}: {first}", file=sys.stderr)
    return 3


def guarded(body, errors: tuple, prog: str = "", interrupted: str = "interrupted",
            internal: str | None = None) -> int:
    """Run ``body()`` and return its exit status. An expected error (one of ``errors``,
    or a UsageError) becomes ``PROG: error: ...`` on stderr and status 2; Ctrl-C becomes
    ``interrupted`` and 130: a user mistake or an interruption is one line, never a
    traceback.  ``internal`` (a note, may be ""): any other exception is an internal
    error, exit 3."""
    prefix = f"{prog}: " if prog else ""
    try:
        return body()
    except (UsageError, *errors) as e:
        print(f"{prefix}error: {describe(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prefix}{interrupted}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - reported as one line (SPEL_DEBUG=1 re-raises)
        if internal is None:
            raise
        return internal_error(prog, e, internal)


def describe(e: BaseException) -> str:
    """An OS error as "path: reason" (its errno text), anything else as its message."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)

"""What every command line of the stack shares for bad input: one way to report it, one
check per kind of path, argument types that refuse nonsense.

Used by data_pipeline's CLIs, pretrain (config validation and `python -m pretrain`),
launch and checkpoints_tools. It lives here because data_pipeline imports no other folder
of ours, while the others may import it (as data_pipeline.processes).

The contract (docs/reliability.md): bad input is refused before any expensive work with
one line `error: <what is wrong and how to fix it>` on stderr and exit status 2, no
traceback; an environment failure during the work (disk full, file-size limit) is one
line too, exit status 1, and loses nothing (outputs are written atomically).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import tempfile
from typing import Callable, Optional

BAD_INPUT = 2
FAILED = 1
INTERRUPTED = 130


class WorkFailed(RuntimeError):
    """The work stopped for a reason outside the input (a full disk, a file-size limit):
    `run_cli` reports it in one line with exit status 1. The message says what was kept."""


def print_error(message: object, *, file=None) -> None:
    """`error: ` + the message's first line; later lines (more problems, details) indented."""
    file = file or sys.stderr
    lines = str(message).strip().splitlines() or ["(no message)"]
    print(f"error: {lines[0]}", file=file, flush=True)
    for line in lines[1:]:
        print(f"  {line.strip()}", file=file, flush=True)


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError: what failed on which path, and the usual fix."""
    where = f" {exc.filename}" if exc.filename else ""
    what = exc.strerror or str(exc)
    hint = {errno.ENOSPC: "free space or write elsewhere",
            errno.EFBIG: "the file-size limit (ulimit -f) or the filesystem's maximum was reached",
            errno.EDQUOT: "your disk quota is exhausted",
            errno.EROFS: "the filesystem is read-only",
            errno.EACCES: "check the permissions", errno.EPERM: "check the permissions"}.get(exc.errno)
    return f"{what}{':' if where else ''}{where}" + (f" ({hint})" if hint else "")


def run_cli(body: Callable[[], int], *, bad_input: tuple[type[BaseException], ...] = (),
            on_interrupt: Optional[str] = None) -> int:
    """Run a CLI body: `bad_input` exceptions -> `error: ...`, exit 2; WorkFailed or an
    OSError that escaped (disk full, file-size limit, permissions) -> `error: ...`, exit 1; Ctrl-C /
    SIGTERM raised as KeyboardInterrupt -> `on_interrupt`, exit 130. Anything else is a
    bug and keeps its traceback."""
    try:
        return body()
    except bad_input as exc:
        print_error(exc)
        return BAD_INPUT
    except WorkFailed as exc:
        print_error(exc)
        return FAILED
    except OSError as exc:
        print_error(describe_os_error(exc))
        return FAILED
    except KeyboardInterrupt:
        if on_interrupt is None:
            raise
        print(on_interrupt, file=sys.stderr, flush=True)
        return INTERRUPTED


# --- paths ---------------------------------------------------------------------------


def writable_dir_problem(path: str) -> Optional[str]:
    """Why `path` cannot be (created as) a directory this process writes into, or None.

    An existing directory must accept a new file; a missing one, its nearest existing
    ancestor must be a directory that accepts a new directory. Tested by creating and
    removing a probe, since os.access says yes where root cannot write (/sys, read-only
    mounts). Leaves nothing behind.
    """
    path = os.path.abspath(path)
    probe_in, missing = path, []
    while not os.path.lexists(probe_in):
        missing.append(os.path.basename(probe_in))
        probe_in = os.path.dirname(probe_in)
    if not os.path.isdir(probe_in):
        kind = "a file" if os.path.isfile(probe_in) else "not a directory"
        return f"{probe_in} is {kind}, so {path} cannot be a directory"
    try:
        if missing:
            os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=probe_in))
        else:
            fd, name = tempfile.mkstemp(prefix=".write-test-", dir=probe_in)
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        verb = f"create {path} in {probe_in}" if missing else f"write into {path}"
        return f"cannot {verb}: {exc.strerror or exc}"
    return None


# --- argument types --------------------------------------------------------------------


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {'at least 1' if least == 1 else '0 or more'}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a count of processes, nodes, tokens, ...)."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0 (warm-up steps, rows to show, ...)."""
    return _int_at_least(text, 0)


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1] (an efficiency, a share)."""
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value:g}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value

"""The one helper the bad-input suites share: run a CLI on bad input, then check that it
refused the way every command of the stack must.

    result = run_cli("pretrain", ["--recipe", "tiny-llama", "optimizer.lr=inf", "--dry-run"], cwd=tmp_path)
    expect_refusal(result, code=2, names=["optimizer.lr"], watch=tmp_path)

What "refused" means (`outcome(...) == "clear"`):
  - the exit code is the expected one (2 for bad input),
  - one line starting `error:` names the problem (every fragment of `names` is on it),
  - no Python traceback, no hang (subprocess runs have a timeout),
  - nothing was written, changed or removed under `watch` (no half-written output that
    looks valid, no good output overwritten), beyond the paths the case allows.

Other outcomes, for the before/after table of issue 19: `traceback`, `hang`, `silent`
(exit 0: the bad input was accepted), `unclear` (refused, but the error line does not name
the problem or the exit code differs), `lost` (something under `watch` was written,
changed or removed).

Runs are in-process by default (the stack's imports are paid once per session), with
`torch.distributed.init_process_group` made to fail loudly: a refusal must come before
any process group exists. `subprocess=True` (signals, resource limits, anything that might
hang) runs `python -m module` with this checkout first on the path. Environment knobs:
BAD_INPUT_SUBPROCESS=1 runs every case in a subprocess; BAD_INPUT_RECORD=FILE appends
each case's outcome as a JSON line (the issue-19 table is made from such files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import importlib
import io
import json
import os
import subprocess as sp
import sys
import traceback
from pathlib import Path
from typing import Iterable, Optional

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT = float(os.environ.get("BAD_INPUT_TIMEOUT", "180"))


@dataclasses.dataclass
class Result:
    code: Optional[int]  # None: it did not finish within the timeout (hang)
    output: str  # stdout and stderr
    crash: Optional[str] = None  # an in-process exception that escaped main(), with traceback

    @property
    def error_lines(self) -> list[str]:
        """`error: ...` lines, and argparse's `prog: error: ...` (after its usage lines)."""
        lines = [line.strip() for line in self.output.splitlines()]
        return [line for line in lines if line.startswith("error:") or (": error: " in line and
                                                                         line.startswith("python -m "))]


class ProcessGroupStarted(AssertionError):
    """Raised in place of torch.distributed.init_process_group during in-process runs."""


def _main_of(module: str):
    try:
        return importlib.import_module(f"{module}.__main__").main
    except ModuleNotFoundError as exc:
        if exc.name != f"{module}.__main__":
            raise
        return importlib.import_module(module).main


@contextlib.contextmanager
def _no_process_group():
    import torch.distributed as dist

    original = dist.init_process_group

    def refuse(*args, **kwargs):
        raise ProcessGroupStarted("a process group was started before the bad input was refused")

    dist.init_process_group = refuse
    try:
        yield
    finally:
        dist.init_process_group = original


def run_cli(module: str, argv: Iterable, *, cwd: Optional[Path] = None, subprocess: bool = False,
            timeout: float = DEFAULT_TIMEOUT, env: Optional[dict] = None,
            file_size_limit: Optional[int] = None) -> Result:
    """Run `python -m module argv...` (in this process unless `subprocess`)."""
    argv = [str(a) for a in argv]
    if subprocess or file_size_limit is not None or os.environ.get("BAD_INPUT_SUBPROCESS") == "1":
        return _run_subprocess(module, argv, cwd=cwd, timeout=timeout, env=env, file_size_limit=file_size_limit)
    out = io.StringIO()
    old_cwd = os.getcwd()
    old_env = dict(os.environ)
    try:
        if cwd is not None:
            os.chdir(cwd)
        os.environ.update(env or {})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), _no_process_group():
            try:
                code = _main_of(module)(argv)
            except SystemExit as exc:  # argparse
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - an escaped exception is the finding
                return Result(code=1, output=out.getvalue(), crash=traceback.format_exc())
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
    return Result(code=int(code or 0), output=out.getvalue())


def _run_subprocess(module, argv, *, cwd, timeout, env, file_size_limit) -> Result:
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    full_env.setdefault("OMP_NUM_THREADS", "1")

    def limit():
        if file_size_limit is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    proc = sp.Popen([sys.executable, "-m", module, *argv], cwd=cwd, env=full_env, stdout=sp.PIPE,
                    stderr=sp.STDOUT, text=True, preexec_fn=limit, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return Result(code=proc.returncode, output=output)
    except sp.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return Result(code=None, output=output)


# --- what a refusal may leave behind -------------------------------------------------


def snapshot(root: Path) -> dict[str, str]:
    """relative path -> content hash (directories as 'dir') of everything under root."""
    root = Path(root)
    found = {}
    if not root.exists():
        return found
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink() or not path.is_file():
            found[rel] = "dir" if path.is_dir() else "other"
        else:
            try:
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            except OSError:
                found[rel] = "unreadable"
    return found


def changes(before: dict[str, str], after: dict[str, str], allow: Iterable[str] = ()) -> list[str]:
    allow = list(allow)
    diffs = []
    for rel in sorted(set(before) | set(after)):
        if any(fnmatch.fnmatch(rel, pattern) for pattern in allow):
            continue
        if rel not in after:
            diffs.append(f"removed {rel}")
        elif rel not in before:
            diffs.append(f"new {rel}")
        elif before[rel] != after[rel]:
            diffs.append(f"changed {rel}")
    return diffs


# --- classification ---------------------------------------------------------------------


def outcome(result: Result, *, code: int, names: Iterable[str], diffs: list[str]) -> tuple[str, str]:
    """(outcome, detail) for the table: clear, traceback, hang, silent, unclear or lost."""
    first = result.error_lines[0] if result.error_lines else ""
    tail = (result.output.strip().splitlines() or [""])[-1]
    if result.code is None:
        return "hang", f"no exit within the timeout; last line: {tail[:200]}"
    if diffs:
        return "lost", "; ".join(diffs[:5])
    if result.crash or "Traceback (most recent call last)" in result.output:
        last = (result.crash or result.output).strip().splitlines()[-1]
        return "traceback", last[:200]
    if result.code == 0:
        return "silent", f"exit 0; last line: {tail[:200]}"
    if result.code != code or not all(name.lower() in first.lower() for name in names):
        return "unclear", f"exit {result.code}; {first[:200] or tail[:200]}"
    return "clear", first[:200]


def _record(case: str, verdict: str, detail: str, result: Result) -> None:
    path = os.environ.get("BAD_INPUT_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case, "outcome": verdict, "exit": result.code, "detail": detail}) + "\n")


def expect_refusal(module: str, argv: Iterable, *, names: Iterable[str], watch: Optional[Path] = None,
                   allow: Iterable[str] = (), code: int = 2, cwd: Optional[Path] = None, **run_kwargs) -> Result:
    """Run the CLI and assert a clear refusal (see the module docstring); returns the result.

    `names`: fragments the `error:` line must contain (case-insensitive): the key, path or
    value at fault. `watch`: a directory where nothing may change (default: `cwd`).
    `allow`: glob patterns (relative to `watch`) that may change.
    """
    names = list(names)
    watch = Path(watch if watch is not None else cwd) if (watch or cwd) else None
    before = snapshot(watch) if watch else {}
    result = run_cli(module, argv, cwd=cwd, **run_kwargs)
    diffs = changes(before, snapshot(watch), allow) if watch else []
    verdict, detail = outcome(result, code=code, names=names, diffs=diffs)
    _record(os.environ.get("PYTEST_CURRENT_TEST", module).rsplit(" ", 1)[0], verdict, detail, result)
    assert verdict == "clear", (
        f"{verdict}: {detail}\nexpected exit {code} and an 'error:' line naming {names}\n"
        f"--- output (exit {result.code}) ---\n{result.output[-4000:]}" + (f"\n--- escaped ---\n{result.crash}"
                                                                         if result.crash else ""))
    return result

"""The one helper that spawns gloo ranks from pytest.

`run_ranks(n, "package.module:function", **kwargs)` starts n fresh Python processes with
torchrun-style environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT),
calls `function(**kwargs)` in each and returns every rank's JSON-serialisable result.
Fresh processes, because Megatron-Core's parallel_state is process-global.

Each rank is forked from a multiprocessing forkserver that imported torch, Megatron-Core and
the training code once per pytest session (`PRELOAD`): the fork is a process that has run
nothing yet, like a fresh interpreter, without the ~4.6 s of CPU those imports cost every
rank (the suite starts hundreds of ranks on two cores). The forkserver is started with the
environment every rank gets (OMP_NUM_THREADS=1, warnings ignored: both read at start-up);
each rank then takes its own environment, working directory and log file. A call with its
own `env` (read at import time, e.g. CUDA_VISIBLE_DEVICES) starts fresh interpreters instead.
A forked rank ends as multiprocessing ends its children, with os._exit: atexit handlers do
not run, so what a rank opens it closes itself (the trackers, the process group: _BOOT).
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

from launch.ports import free_port

REPO = Path(__file__).resolve().parents[1]

_BOOT = r"""
import importlib, json, os, sys, traceback
target, kwargs_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
module, func = target.split(":")
kwargs = json.load(open(kwargs_file))
result = getattr(importlib.import_module(module), func)(**kwargs)
with open(out + ".tmp", "w") as f:
    json.dump(result, f)
os.replace(out + ".tmp", out)
# Tear the process group down together: a rank that exits while its peers' gloo threads
# still talk to it has aborted with "terminate called without an active exception".
dist = sys.modules.get("torch.distributed")
if dist is not None and dist.is_initialized():
    from pretrain.runtime import shutdown
    shutdown()
"""


# Imported once in the forkserver; a rank imports anything else itself. `pretrain` before
# megatron.core, as in a real rank: megatron_fixes.import_cost must see megatron.core's import.
# torch._dynamo: torch.optim's step imports it (for a graph break) in every rank that trains,
# 1.1 of a tiny 4-step TP2 rank's 3.0 CPU-s.
PRELOAD = ["torch", "torch.distributed", "pretrain", "megatron.core", "pretrain.loop", "pretrain.runtime",
           "torch._dynamo", "tests.pretrain.workers", "tests.checkpoints_tools.workers"]
# The environment read when an interpreter starts (or torch loads): the forkserver's.
_STARTUP_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
_forkserver = None


def _forked_context():
    """The forkserver context, its server started (once) with the ranks' start-up environment."""
    global _forkserver
    if _forkserver is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        with mock.patch.dict(os.environ, _STARTUP_ENV):
            from multiprocessing import forkserver

            forkserver.ensure_running()
        _forkserver = context
    return _forkserver


def _become(stdout: str, stderr: str, env: dict, cwd: str | Path, argv: list[str]) -> None:
    """A process forked from the forkserver takes its own output files (the same path: one
    file for both), environment, working directory and argv."""
    out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    # One open file for both when they share a path: one offset, so neither overwrites the other.
    err = out if stderr == stdout else os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for source, fd in ((out, 1), (err, 2)):
        os.dup2(source, fd)
    os.close(out)
    if err != out:
        os.close(err)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = argv


def _forked_rank(target: str, kwargs_file: str, out: str, log_path: str, env: dict) -> None:
    """A rank in a process forked from the forkserver: what _BOOT does in a fresh one."""
    _become(log_path, log_path, env, REPO, ["-c", target, kwargs_file, out])
    exec(compile(_BOOT, "<rank>", "exec"), {"__name__": "__rank__"})


def _forked_module(module: str, argv: list[str], out: str, err: str, env: dict, cwd: str) -> None:
    """`python -m module *argv` in a process forked from the forkserver (see run_module)."""
    import atexit
    import runpy
    import traceback

    _become(out, err, env, cwd, [module, *argv])
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # as the interpreter turns it into an exit status
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught exception: traceback, status 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ModuleProcess:
    """`python -m module *argv` in a process forked from the forkserver: the same command
    without its ~6 CPU-s of imports, with the Popen calls the tests make. Its start-up
    environment is the forkserver's (_STARTUP_ENV), the rest is `env` (default: this
    process's), with this checkout on PYTHONPATH. Output: stdout and stderr together, as
    Popen(stdout=PIPE, stderr=STDOUT, text=True) gives them, unless `stderr_apart`."""

    def __init__(self, module: str, argv: list[str], *, cwd: Path = REPO, env: dict | None = None,
                 stderr_apart: bool = False):
        env = dict(os.environ if env is None else env)
        env.update(PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", **_STARTUP_ENV)
        self._tmp = tempfile.TemporaryDirectory(prefix="module-")
        self._out = Path(self._tmp.name) / "output"
        self._err = Path(self._tmp.name) / "stderr" if stderr_apart else self._out
        self.args = [sys.executable, "-m", module, *map(str, argv)]
        self._process = _forked_context().Process(target=_forked_module, daemon=False, args=(
            module, self.args[3:], str(self._out), str(self._err), env, str(cwd)))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    @property
    def stdout(self):
        """The output so far (read() it), as Popen's pipe gives it at the end."""
        return io.StringIO(self._out.read_text() if self._out.exists() else "")

    @property
    def stderr_text(self) -> str:
        return self._err.read_text() if self._err.exists() else ""

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.stdout.read(), None


def run_module(module: str, argv: list[str], *, cwd: Path = REPO, env: dict | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m module *argv` as subprocess.run(capture_output=True, text=True) returns it,
    forked (ModuleProcess). Timeout: killed, subprocess.TimeoutExpired."""
    process = ModuleProcess(module, argv, cwd=cwd, env=env, stderr_apart=True)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise subprocess.TimeoutExpired(process.args, timeout, process.stdout.read(), process.stderr_text) from None
    return subprocess.CompletedProcess(process.args, process.returncode, process.stdout.read(), process.stderr_text)


class RankFailure(AssertionError):
    pass


def run_ranks(nproc: int, target: str, *, timeout: float = 600, env: dict | None = None, **kwargs: Any) -> list[Any]:
    """Run `target(**kwargs)` on nproc gloo ranks; return the per-rank results in rank order."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        tmpdir = Path(tmp)
        kwargs_file = tmpdir / "kwargs.json"
        kwargs_file.write_text(json.dumps(kwargs))
        port = free_port()
        rank_envs = []
        for rank in range(nproc):
            rank_env = dict(os.environ)
            rank_env.update(
                RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                PYTHONPATH=f"{REPO}{os.pathsep}{rank_env.get('PYTHONPATH', '')}", **_STARTUP_ENV,
            )
            rank_envs.append(dict(rank_env, **(env or {})))
        args = [(target, str(kwargs_file), str(tmpdir / f"rank{r}.json"), str(tmpdir / f"rank{r}.log"))
                for r in range(nproc)]
        procs = _fresh(args, rank_envs) if env else _forked(args, rank_envs)
        _wait_all(procs, timeout, tmpdir)
        return [json.loads((tmpdir / f"rank{r}.json").read_text()) for r in range(nproc)]


class _Forked:
    """A forked rank with the Popen calls _wait_all makes."""

    def __init__(self, process):
        self.process = process

    def poll(self):
        return self.process.exitcode

    @property
    def returncode(self):
        return self.process.exitcode

    def kill(self):
        self.process.kill()

    def wait(self):
        self.process.join()


def _forked(args: list[tuple], envs: list[dict]) -> list:
    context = _forked_context()
    procs = []
    for rank_args, env in zip(args, envs):
        process = context.Process(target=_forked_rank, args=(*rank_args, env), daemon=False)
        process.start()
        procs.append(_Forked(process))
    return procs


def _fresh(args: list[tuple], envs: list[dict]) -> list[subprocess.Popen]:
    procs = []
    for (target, kwargs_file, out, log_path), env in zip(args, envs):
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", _BOOT, target, kwargs_file, out],
                                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait_all(procs: list[subprocess.Popen], timeout: float, tmpdir: Path) -> None:
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()
            rank = failed[0] if failed else 0
            why = f"rank {rank} exited with {procs[rank].returncode}" if failed else f"timeout after {timeout}s"
            tail = (tmpdir / f"rank{rank}.log").read_text()[-4000:]
            raise RankFailure(f"{why}; its output ends with:\n{tail}")
        time.sleep(0.05)
    codes = [p.returncode for p in procs]
    if any(codes):
        rank = next(r for r, c in enumerate(codes) if c)
        tail = (tmpdir / f"rank{rank}.log").read_text()[-4000:]
        raise RankFailure(f"rank {rank} exited with {codes[rank]}; its output ends with:\n{tail}")

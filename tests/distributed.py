"""The one helper that spawns gloo ranks from pytest.

`run_ranks(n, "package.module:function", **kwargs)` starts n fresh Python processes with
torchrun-style environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT),
calls `function(**kwargs)` in each and returns every rank's JSON-serialisable result.
Fresh processes, because Megatron-Core's parallel_state is process-global.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(AssertionError):
    pass


def run_ranks(nproc: int, target: str, *, timeout: float = 600, env: dict | None = None, **kwargs: Any) -> list[Any]:
    """Run `target(**kwargs)` on nproc gloo ranks; return the per-rank results in rank order."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        tmpdir = Path(tmp)
        kwargs_file = tmpdir / "kwargs.json"
        kwargs_file.write_text(json.dumps(kwargs))
        port = free_port()
        procs, logs = [], []
        for rank in range(nproc):
            rank_env = dict(os.environ)
            rank_env.update(
                RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                PYTHONPATH=f"{REPO}{os.pathsep}{rank_env.get('PYTHONPATH', '')}",
                PYTHONWARNINGS="ignore",
            )
            rank_env.update(env or {})
            log = open(tmpdir / f"rank{rank}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _BOOT, target, str(kwargs_file), str(tmpdir / f"rank{rank}.json")],
                cwd=REPO, env=rank_env, stdout=log, stderr=subprocess.STDOUT,
            ))
        _wait_all(procs, timeout, tmpdir)
        for log in logs:
            log.close()
        return [json.loads((tmpdir / f"rank{r}.json").read_text()) for r in range(nproc)]


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

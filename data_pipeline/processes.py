"""Lifetime of helper processes: they die with the process that started them.

Used by the preprocessing workers (data_pipeline.workers) and by training's checkpoint
helpers (pretrain.checkpointing.async_writer, and every process forked from a rank:
pretrain.runtime). It lives here because data_pipeline imports no other folder of ours,
while pretrain may import data_pipeline.
"""

from __future__ import annotations

import os
import queue
import signal
import sys


def die_with_parent() -> None:
    # Linux: the kernel SIGKILLs us when the parent dies, even by SIGKILL.
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass  # the getppid() poll in worker_main still catches it


def get_unless_orphaned(tasks, parent_pid: int, poll: float = 1.0):
    """The next item of `tasks`, or None once the process that started us is gone (a
    backstop where die_with_parent is unavailable)."""
    while True:
        try:
            return tasks.get(timeout=poll)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return None

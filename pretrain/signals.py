"""Stop requests: SIGTERM/SIGUSR1 (what Slurm sends before a time limit or on preemption)
and an optional wall-clock limit. The loop finishes the current step, saves, exits 0.

In the loop the handler only sets a flag, so a second signal during the save changes
nothing: the save completes (or, on SIGKILL, the atomic save protocol keeps the previous
checkpoint). During setup there is nothing to save, so a stop request ends setup: before
the process group exists the handler raises StopDuringSetup at once (nothing to agree
on); after, setup asks `check_setup()` between its phases, which every rank calls in the
same order, so all ranks stop together when any of them was signalled.
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from pretrain.runtime import collective_device


class StopDuringSetup(Exception):
    """A stop request arrived before step 1: nothing was trained, so nothing is saved."""


class StopRequest:
    def __init__(self, exit_after_minutes: Optional[float] = None):
        self.signal_name: Optional[str] = None
        self._setting_up = True
        self._deadline = time.monotonic() + exit_after_minutes * 60 if exit_after_minutes else None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        if self._setting_up and not dist.is_initialized():
            raise StopDuringSetup(f"signal {self.signal_name}")

    @contextlib.contextmanager
    def interruptible(self):
        """A long set-up step (checksums, checkpoint loading, dataset indices): a stop signal
        (or Ctrl-C) ends the process at once, with the signal's default action. Those steps run C++
        (Megatron's index helpers, torch's readers) and collectives, where a Python handler
        would run only after they return: minutes, or never (a rank waiting in a barrier for
        a peer that spins). Nothing is trained yet, so there is nothing to save."""
        if not self._setting_up or not dist.is_initialized():
            yield  # before the process group the handler already raises at once
            return
        # SIGINT too: Python's KeyboardInterrupt would also wait for the C++ call to return.
        previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def check_setup(self) -> None:
        """Between setup phases (a collective once the process group exists): end setup
        on every rank if any rank was asked to stop."""
        reason = self.reason()
        if reason is not None:
            raise StopDuringSetup(reason)

    def training_started(self) -> None:
        """From here a signal only sets the flag: the loop saves after its step and stops."""
        self._setting_up = False

    def reason(self) -> Optional[str]:
        """Agreed across ranks: any rank's signal or deadline stops every rank."""
        local = 1.0 if self.signal_name else 0.0
        if self._deadline is not None and time.monotonic() > self._deadline:
            local = max(local, 0.5)
        if dist.is_initialized():
            flag = torch.tensor([local], device=collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = flag.item()
        if local >= 1.0:
            return f"signal {self.signal_name or 'on another rank'}"
        if local > 0:
            return "checkpoint.exit_after_minutes reached"
        return None

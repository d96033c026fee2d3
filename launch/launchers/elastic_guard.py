"""What srun starts on each node of an elastic job: torchrun, and a check when it fails.

    srun --no-kill --kill-on-bad-exit=0 python -m launch.launchers.elastic_guard -- \\
        python -m torch.distributed.run --nnodes=2:$SLURM_JOB_NUM_NODES ... -m pretrain ...

Why: the first node of the allocation runs the batch script and hosts torchrun's c10d
rendezvous store (MASTER_ADDR). When it is lost, the torchruns left exit ("The connection
to the C10d store has failed"), and under --no-kill Slurm merely drops the node: the job
stays RUNNING with nothing training until its time limit, and no batch script is left to
notice. So each torchrun's wrapper, on a node that is not the batch host, asks Slurm
whether the batch host is down when its torchrun exits non-zero (or, while it runs, when
the rendezvous store stops answering); if so it requeues the job
(which asks for MIN-MAX nodes, so it starts again on the nodes left and resumes from the
last complete checkpoint) or, with requeue off, cancels it, each with one line in the node's
log saying why. A batch host that is alive (its slurmd answers) is left to handle the
failure itself, and a step that Slurm or the user ends (a signal) is left to end.

Limit: scontrol must be on the node's PATH where the guard runs (inside the container with
--container-image); without it the guard prints that it could not check, and the job stays
as before.

Standard library only: it starts before, and outside of, the training's imports.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

PREFIX = "[launch.slurm]"
# Slurm marks a node DOWN about SlurmdTimeout after it stopped answering (plus its ping
# interval, up to ~SlurmdTimeout/3): the wait for that is SlurmdTimeout + this much.
DOWN_MARGIN_S = 60
POLL_S = 2.0
# How often a survivor probes the rendezvous store while torchrun runs: one connection per
# node per 10 s to the batch host's torchrun (10 per second with a hundred nodes).
WATCH_S = 10.0
# slurmstepd signals every process of the step (torchrun gets them itself): the guard
# outlives them to see how torchrun ended, and forwards nothing (that would signal twice).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
# Set by those signals: Slurm (or the user) is ending the step, and SIGKILL follows KillWait
# (30 s by default) later: the guard stops waiting and leaves the job alone.
ENDING = threading.Event()
# How long the watcher gives torchrun to exit after the store stopped answering.
STORE_GRACE_S = 10.0


def parse_fields(text: str) -> dict[str, str]:
    """`scontrol show job|node --oneliner` output: KEY=VALUE words (values without spaces)."""
    return dict(word.split("=", 1) for word in text.split() if "=" in word)


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config`: `Key = value` lines."""
    return {k.strip(): v.strip() for k, _, v in (ln.partition("=") for ln in text.splitlines()) if _}


def is_down(node_state: str) -> bool:
    """A node Slurm has given up on: DOWN (with flags, e.g. DOWN+NOT_RESPONDING) or FAIL.
    NOT_RESPONDING alone (a missed ping) is not enough: the node may still answer."""
    base = node_state.split("+")[0].rstrip("*")
    return base in ("DOWN", "FAIL", "FAILING")


def seconds(text: str, default: int) -> int:
    """SlurmdTimeout as `scontrol show config` prints it ("10 sec", "300 sec")."""
    head = text.split()[0] if text.split() else ""
    return int(head) if head.isdigit() else default


def scontrol(*args: str) -> str:
    out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise RuntimeError(f"scontrol {' '.join(args)}: {(out.stderr or out.stdout).strip()}")
    return out.stdout


def slurmd_answers(address: str, port: int, timeout: float = 5.0) -> bool:
    """True when something accepts a connection on the node's slurmd port: the node is up
    (a crashed node's port refuses or times out). Asked first, so a failure on a healthy
    cluster is not held up for SlurmdTimeout. Only once a failure is seen: slurmd logs each
    such empty connection as an error ("Zero Bytes were transmitted or received")."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until_down(state_of: Callable[[], str], timeout: float, every: float = POLL_S,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Optional[Callable[[float], None]] = None,
                    ending: Callable[[], bool] = lambda: False) -> tuple[bool, str]:
    """Poll the node's state until Slurm marks it down, `timeout` passes or the step is
    `ending` (no time left to wait): (down, last state)."""
    sleep = sleep or time.sleep
    deadline = clock() + timeout
    while True:
        state = state_of()
        if is_down(state) or clock() >= deadline or ending():
            return is_down(state), state
        sleep(every)


def act(job: dict[str, str], host: str, state: str) -> tuple[str, list[str]]:
    """The message and the command once the batch host `host` is down: requeue (the job asks
    for MIN-MAX nodes, so it starts again on the nodes left), or cancel when the job may not
    be requeued (launch.slurm --no-requeue)."""
    job_id = job["JobId"]
    if job.get("Requeue") == "1":
        return (f"{PREFIX} the batch host {host} is down (State={state}): requeueing job {job_id} to resume "
                "from the last checkpoint on the nodes left", ["scontrol", "requeue", job_id])
    return (f"{PREFIX} the batch host {host} is down (State={state}) and job {job_id} may not be requeued "
            "(--no-requeue): cancelling it; resubmit to resume from the last checkpoint", ["scancel", job_id])


def harmless(stderr: str) -> bool:
    """What scontrol says when another survivor has requeued the job first ("Job is pending
    execution for job 1", seen on Slurm 22.05): nothing to undo."""
    text = stderr.lower()
    return any(s in text for s in ("pending", "presently disabled", "already completing", "completed"))


def _alive(host: str, node: dict[str, str], config: dict[str, str]) -> bool:
    port = (config.get("SlurmdPort") or "x").split()[0]
    if is_down(node.get("State", "")) or not port.isdigit():
        return False
    return slurmd_answers(node.get("NodeAddr", host), int(port))


def check_batch_host(job_id: str, me: str, log: Callable[[str], None] = print) -> bool:
    """After this node's torchrun failed (or the rendezvous store stopped answering): requeue
    (or cancel) the job if its batch host is down. True when it did. A signal (ENDING: Slurm
    or the user is ending the step: scancel, time limit, preemption) cuts the wait short and
    does nothing: a lost batch host does not make Slurm signal the other nodes' steps (Slurm
    22.05: none of the guard's logs on the namespace cluster shows one, since its crash cuts the
    node's link first; before, the dying srun's shepherd sometimes had the step SIGKILLed)."""
    job = parse_fields(scontrol("show", "job", "--oneliner", job_id))
    host = job.get("BatchHost", "")
    if not host or host == me:
        return False  # this node runs the batch script, which sees srun end
    config = parse_config(scontrol("show", "config"))
    if _alive(host, parse_fields(scontrol("show", "node", "--oneliner", host)), config):
        log(f"{PREFIX} {me}: the batch host {host} answers; its script handles this")
        return False
    timeout = seconds(config.get("SlurmdTimeout", ""), 300) + DOWN_MARGIN_S
    log(f"{PREFIX} {me}: the batch host {host} does not answer; waiting up to "
        f"{timeout} s for Slurm to mark it down")
    down, state = wait_until_down(
        lambda: parse_fields(scontrol("show", "node", "--oneliner", host)).get("State", ""), timeout,
        ending=ENDING.is_set)
    if not down:
        why = "the step is being ended" if ENDING.is_set() else f"still State={state} after {timeout} s"
        log(f"{PREFIX} {me}: the batch host {host}: {why}; leaving the job as it is")
        return False
    _run(*act(job, host, state), log)
    return True


def _run(message: str, command: list[str], log: Callable[[str], None]) -> None:
    log(message)
    out = subprocess.run(command, capture_output=True, text=True, timeout=30)
    said = (out.stderr or out.stdout).strip()
    if out.returncode and not (command[1:2] == ["requeue"] and harmless(said)):
        log(f"{PREFIX} {' '.join(command)} failed: {said}")


def store_address(environ: dict[str, str]) -> Optional[tuple[str, int]]:
    """The rendezvous store torchrun's c10d backend serves on the batch host (the script's
    MASTER_ADDR:MASTER_PORT, which it passes as --rdzv-endpoint)."""
    addr, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    return (addr, int(port)) if addr and port.isdigit() else None


def watch_batch_host(job_id: str, me: str, running: Callable[[], bool], log: Callable[[str], None],
                     every: float = WATCH_S, store: Optional[tuple[str, int]] = None,
                     grace: float = STORE_GRACE_S) -> bool:
    """While torchrun runs: probe the rendezvous store on the batch host (a TCP connect, which
    neither the store nor slurmctld logs) and, once it answered and then stops answering while
    torchrun still runs (after `grace`: at the end of a run the store goes first), do what
    check_batch_host does; a batch host that answers is watched on. Why not only after
    torchrun exits: in 1 of 13 runs of tests/launch/test_multinode_batch_host.py the
    survivors' torchruns did not exit after their workers failed. True when it acted."""
    store = store if store is not None else store_address(dict(os.environ))
    armed = False  # the store is torchrun's: it answers only some seconds after the start
    while store is not None and not ENDING.is_set() and running():
        if slurmd_answers(*store):
            armed = True
        elif armed:
            ENDING.wait(grace)
            if ENDING.is_set() or not running():
                return False  # a stop, or the end of the run: main() sees torchrun's status
            if check_batch_host(job_id, me, log):
                return True
            armed = False
        ENDING.wait(every)
    return False


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    log_dir = None
    if argv[:1] == ["--log-dir"] and len(argv) > 1:
        log_dir, argv = argv[1], argv[2:]
    command = argv[1:] if argv[:1] == ["--"] else []
    if not command:
        print("usage: python -m launch.launchers.elastic_guard [--log-dir DIR] -- TORCHRUN_COMMAND...",
              file=sys.stderr)
        return 2
    received: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: (received.append(signum), ENDING.set()))
    child = subprocess.Popen(command)  # caught signals are reset to default by exec
    job_id = os.environ.get("SLURM_JOB_ID")
    me = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    log = _logger(f"{log_dir}/{job_id or 'nojob'}-guard-{me}.log" if log_dir else None)
    if job_id:
        threading.Thread(target=_guarded, args=(watch_batch_host, job_id, me, lambda: child.poll() is None, log),
                         daemon=True).start()
    while True:
        try:
            rc = child.wait()
            break
        except InterruptedError:
            continue
    if rc == 0 or not job_id:
        return rc
    if received:  # Slurm or the user is ending the step (scancel, time limit, preemption)
        log(f"{PREFIX} {me}: torchrun exited with status {rc} after "
            f"{', '.join(signal.Signals(n).name for n in received)}: the step is being ended")
        return rc
    log(f"{PREFIX} {me}: torchrun exited with status {rc}")
    _guarded(check_batch_host, job_id, me, log)
    return rc


def _logger(path: Optional[str]) -> Callable[[str], None]:
    """Each line to `path` (appended, opened per line) and to stdout. Why a file of its own:
    the step's stdout is a pipe to slurmstepd, which can close it when srun (on the lost batch
    host) goes: in 1 of 12 loaded runs of tests/launch/test_multinode_batch_host.py nothing of
    the survivors' reached their node logs after the crash and their guards ended within 6 s,
    unheard, without a requeue: a print into a broken pipe raises, which would end the guard
    before its check. A line that cannot be written is dropped."""
    lock = threading.Lock()  # the watcher thread and the main thread: one line at a time

    def log(line: str) -> None:
        with lock:
            if path:
                try:
                    with open(path, "a") as f:
                        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
                except OSError:
                    pass
            try:
                print(line, flush=True)
            except OSError:  # BrokenPipeError included
                pass
    return log


_CHECKING = threading.Lock()  # the watcher's check and the one after torchrun ended: one at a time
_ACTED: list[bool] = []  # a requeue (or cancel) was run: no second one


def _guarded(check: Callable[..., bool], job_id: str, me: str, *args) -> None:
    log = args[-1]
    try:
        with _CHECKING:
            if not _ACTED and check(job_id, me, *args):
                _ACTED.append(True)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log(f"{PREFIX} {me}: could not check the batch host: {exc}")


if __name__ == "__main__":
    sys.exit(main())

"""launch.launchers.elastic_guard without a cluster: its reading of scontrol and its decision.

The scontrol texts in fixtures/scontrol/ were captured on the namespace cluster (Slurm
22.05.8, `ci_cluster start --nodes 3`): a `--no-kill --requeue` job on mn[1-2], its batch
host mn1 crashed (`ci_cluster crash --node 1`): mn1 MIXED, then DOWN+NOT_RESPONDING at ~+27 s,
when the job, still RUNNING, had dropped it (NodeList=mn2, BatchHost=mn1 unchanged); a second
`scontrol requeue` of the requeued job (exit 1). The job on the cluster is
tests/launch/test_multinode_batch_host.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launch.launchers import elastic_guard as guard
from launch.launchers.slurm import main as slurm_main

FIXTURES = Path(__file__).parent / "fixtures" / "scontrol"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _not_ending():
    """guard.ENDING is the process's "a signal came" flag: each test starts without one."""
    guard.ENDING.clear()
    yield
    guard.ENDING.clear()


def _text(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_reads_the_job_node_and_config_as_scontrol_prints_them():
    job = guard.parse_fields(_text("job_running.txt"))
    assert (job["JobId"], job["JobState"], job["BatchHost"], job["Requeue"], job["NodeList"]) == (
        "1", "RUNNING", "mn1", "1", "mn[1-2]")
    assert guard.parse_fields(_text("job_batch_host_dropped.txt"))["NodeList"] == "mn2"
    up, down = guard.parse_fields(_text("node_up.txt")), guard.parse_fields(_text("node_down.txt"))
    assert (up["State"], up["NodeAddr"]) == ("MIXED", "10.235.253.11")
    assert down["State"] == "DOWN+NOT_RESPONDING"
    config = guard.parse_config(_text("config_excerpt.txt"))
    assert guard.seconds(config["SlurmdTimeout"], 300) == 10 and config["SlurmdPort"] == "20311"
    assert guard.seconds("", 300) == 300


@pytest.mark.parametrize("state, down", [
    ("MIXED", False), ("MIXED+NOT_RESPONDING", False),  # a missed ping: it may still answer
    ("DOWN+NOT_RESPONDING", True), ("DOWN", True), ("DOWN*", True), ("FAIL", True), ("IDLE", False), ("", False)])
def test_only_a_node_slurm_gave_up_on_counts_as_down(state, down):
    assert guard.is_down(state) is down


def test_waits_for_down_and_gives_up_at_the_deadline():
    now = [0.0]
    states = iter(["MIXED", "MIXED+NOT_RESPONDING", "DOWN+NOT_RESPONDING"])
    got = guard.wait_until_down(lambda: next(states), timeout=70, clock=lambda: now[0],
                                sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert got == (True, "DOWN+NOT_RESPONDING") and now[0] == 2 * guard.POLL_S
    now[0] = 0.0
    got = guard.wait_until_down(lambda: "MIXED", timeout=10, clock=lambda: now[0],
                                sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert got == (False, "MIXED") and now[0] >= 10


def test_requeues_or_cancels_without_requeue():
    job = guard.parse_fields(_text("job_batch_host_dropped.txt"))
    message, command = guard.act(job, "mn1", "DOWN+NOT_RESPONDING")
    assert message == ("[launch.slurm] the batch host mn1 is down (State=DOWN+NOT_RESPONDING): requeueing job 1 "
                       "to resume from the last checkpoint on the nodes left")
    assert command == ["scontrol", "requeue", "1"]
    message, command = guard.act(dict(job, Requeue="0"), "mn1", "DOWN")
    assert "may not be requeued (--no-requeue): cancelling it" in message and command == ["scancel", "1"]


def test_a_second_survivors_requeue_is_harmless_other_errors_are_not():
    assert guard.harmless(_text("requeue_pending.txt"))
    assert not guard.harmless("scontrol: error: Invalid job id specified")
    assert not guard.harmless("Access/permission denied")


def _fake_slurm(monkeypatch, node_states: list[str], answers: bool) -> list[list[str]]:
    """scontrol answering from the fixtures; the commands the guard ran are returned."""
    states = iter(node_states)
    ran: list[list[str]] = []

    def scontrol(*args: str) -> str:
        if args[:2] == ("show", "job"):
            return _text("job_batch_host_dropped.txt")
        if args[:2] == ("show", "node"):
            return _text("node_up.txt").replace("State=MIXED", f"State={next(states, node_states[-1])}")
        if args[:2] == ("show", "config"):
            return _text("config_excerpt.txt")
        if args[:2] == ("show", "hostnames"):
            return "mn2\n"
        raise AssertionError(args)

    def run(command, **_):
        ran.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(guard, "scontrol", scontrol)
    monkeypatch.setattr(guard, "slurmd_answers", lambda address, port: answers)
    monkeypatch.setattr(guard.subprocess, "run", run)
    monkeypatch.setattr(guard.time, "sleep", lambda s: None)
    return ran


def test_a_survivor_requeues_when_the_batch_host_is_down(monkeypatch):
    ran = _fake_slurm(monkeypatch, ["MIXED", "MIXED+NOT_RESPONDING", "DOWN+NOT_RESPONDING"], answers=False)
    lines: list[str] = []
    guard.check_batch_host("1", "mn2", log=lines.append)
    assert ran == [["scontrol", "requeue", "1"]]
    assert "waiting up to 70 s for Slurm to mark it down" in lines[0] and "requeueing job 1" in lines[1], lines
    assert len(lines) == 2, lines


def test_a_second_survivor_finding_the_job_requeued_says_nothing_more(monkeypatch):
    ran = _fake_slurm(monkeypatch, ["DOWN+NOT_RESPONDING"], answers=False)
    monkeypatch.setattr(guard.subprocess, "run", lambda c, **_: ran.append(c) or subprocess.CompletedProcess(
        c, 1, "", _text("requeue_pending.txt")))
    lines: list[str] = []
    guard.check_batch_host("1", "mn3", log=lines.append)
    assert ran == [["scontrol", "requeue", "1"]] and len(lines) == 2 and "requeueing job 1" in lines[1], lines
    monkeypatch.setattr(guard.subprocess, "run", lambda c, **_: subprocess.CompletedProcess(c, 1, "", "Invalid job id"))
    guard.check_batch_host("1", "mn3", log=lines.append)
    assert lines[-1] == "[launch.slurm] scontrol requeue 1 failed: Invalid job id", lines


def test_nothing_is_done_when_the_batch_host_answers_or_is_this_node(monkeypatch):
    ran = _fake_slurm(monkeypatch, ["MIXED"], answers=True)
    lines: list[str] = []
    guard.check_batch_host("1", "mn2", log=lines.append)
    guard.check_batch_host("1", "mn1", log=lines.append)  # the batch host itself: its script sees srun end
    assert ran == [] and lines == ["[launch.slurm] mn2: the batch host mn1 answers; its script handles this"]


def test_passes_torchruns_exit_status_through(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    for code in (0, 3):
        assert guard.main(["--", sys.executable, "-c", f"raise SystemExit({code})"]) == code
    assert guard.main([sys.executable]) == 2  # the command comes after --


def test_the_elastic_script_runs_torchrun_under_the_guard_and_asks_for_every_node(capsys, tmp_path):
    common = ["--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "2", "--launcher", "torchrun",
              "--run-dir", str(tmp_path / "run"),
              "--partition", "debug", "--time", "10", "--dry-run", "checkpoint.resume=auto",
              "checkpoint.save_interval=2", "schedule.micro_batch_size=2", "--nodes", "4",
              "schedule.global_batch_size=48"]
    assert slurm_main(common + ["--elastic-min-nodes", "2"]) == 0
    script = capsys.readouterr().out
    # MIN-MAX, so a requeued job starts on the nodes left; MAX tasks spread, so the first
    # start gets MAX nodes (--ntasks-per-node with a range gets MIN: Slurm 22.05, nodes idle).
    for line in ("#SBATCH --nodes=2-4\n", "#SBATCH --ntasks=4 ", "#SBATCH --spread-job ", "#SBATCH --cpus-per-task=2\n",
                 '--ntasks="$SLURM_JOB_NUM_NODES" \\\n    --ntasks-per-node=1 \\\n'):
        assert line in script, line
    assert "#SBATCH --ntasks-per-node" not in script
    assert f"-m launch.launchers.elastic_guard --log-dir {tmp_path}/run/logs -- \\\n    " in script
    assert script.index("elastic_guard") < script.index("-m torch.distributed.run")
    assert slurm_main(common) == 0
    plain = capsys.readouterr().out
    assert "elastic_guard" not in plain and "#SBATCH --nodes=4\n" in plain and "#SBATCH --ntasks-per-node=1 " in plain


def test_a_survivor_whose_torchrun_hangs_still_requeues(monkeypatch):
    """The watcher: the rendezvous store answered, then stops answering while torchrun still
    runs (after the grace), and the batch host's slurmd does not answer either."""
    ran = _fake_slurm(monkeypatch, ["MIXED+NOT_RESPONDING", "DOWN+NOT_RESPONDING"], answers=False)
    answers = iter([True, False])  # the store: up, then gone; then the slurmd probe: gone
    monkeypatch.setattr(guard, "slurmd_answers", lambda address, port: next(answers, False))
    lines: list[str] = []
    store = ("10.235.253.11", 29500)  # the rendezvous store on mn1 (MASTER_ADDR:MASTER_PORT)
    assert guard.watch_batch_host("1", "mn2", running=lambda: True, log=lines.append, every=0, store=store, grace=0)
    assert ran == [["scontrol", "requeue", "1"]] and "requeueing job 1" in lines[-1], lines


def test_the_watcher_waits_for_the_store_and_leaves_a_live_batch_host_alone(monkeypatch):
    """A store not up yet (torchrun starts it some seconds in) is no loss: in 2 of 2 loaded runs
    of the batch-host test a watcher that probed at once found the store missing, the batch host
    alive, and took no later look. A store that goes while the batch host answers is watched on;
    at the end of a run the store goes first and torchrun exits within the grace."""
    ran = _fake_slurm(monkeypatch, ["MIXED"], answers=False)
    store, lines = ("10.235.253.11", 29500), []
    probes = iter([False, False, False])  # never up: nothing asked of Slurm
    monkeypatch.setattr(guard, "slurmd_answers", lambda address, port: next(probes))
    alive = iter([True, True, True, False])
    assert not guard.watch_batch_host("1", "mn2", running=lambda: next(alive), log=lines.append, every=0, store=store)
    assert ran == [] and lines == []
    # Up, gone (the batch host's slurmd answers: watched on), up again, then torchrun ends.
    probes = iter([True, False, True, True, True])  # the third: the check's probe of the batch host's slurmd
    monkeypatch.setattr(guard, "slurmd_answers", lambda address, port: next(probes))
    alive = iter([True] * 5 + [False])
    assert not guard.watch_batch_host("1", "mn2", running=lambda: next(alive), log=lines.append, every=0, store=store,
                                      grace=0)
    assert ran == [] and lines == ["[launch.slurm] mn2: the batch host mn1 answers; its script handles this"]
    # The end of a run: the store goes, torchrun exits within the grace; main() sees status 0.
    probes = iter([True, False])
    alive = iter([True, True, False])
    assert not guard.watch_batch_host("1", "mn2", running=lambda: next(alive), log=lines.append, every=0, store=store,
                                      grace=0)
    assert ran == [] and len(lines) == 1
    assert guard.store_address({"MASTER_ADDR": "mn1", "MASTER_PORT": "29411"}) == ("mn1", 29411)
    assert guard.store_address({"MASTER_ADDR": "mn1"}) is None


def test_a_signal_during_the_wait_for_down_leaves_the_job_alone(monkeypatch):
    """Slurm or the user is ending the step (scancel, time limit): no requeue of a job being
    ended, and no wait the step's SIGKILL would cut."""
    ran = _fake_slurm(monkeypatch, ["MIXED+NOT_RESPONDING"], answers=False)
    fake, shown = guard.scontrol, []

    def signal_at_the_third_poll(*args: str) -> str:  # the check shows the node once, then polls
        if args[:2] == ("show", "node"):
            shown.append(args)
            if len(shown) == 4:
                guard.ENDING.set()
        return fake(*args)
    monkeypatch.setattr(guard, "scontrol", signal_at_the_third_poll)
    monkeypatch.setattr(guard, "POLL_S", 0.0)
    lines: list[str] = []
    assert not guard.check_batch_host("1", "mn2", log=lines.append)
    assert ran == [] and len(shown) == 4, shown
    assert lines[-1] == "[launch.slurm] mn2: the batch host mn1: the step is being ended; leaving the job as it is"


def _fake_scontrol_bin(tmp_path: Path, slurmd_port: int, state: str) -> Path:
    """An `scontrol` on PATH answering from the fixtures (the batch host mn1 at 127.0.0.1,
    `slurmd_port`, `state`) and writing each call to calls.txt; `scancel` likewise."""
    (tmp_path / "job.txt").write_text(_text("job_running.txt"))
    (tmp_path / "node.txt").write_text(_text("node_up.txt").replace("NodeAddr=10.235.253.11", "NodeAddr=127.0.0.1")
                                       .replace("State=MIXED", f"State={state}"))
    (tmp_path / "config.txt").write_text(_text("config_excerpt.txt").replace("20311", str(slurmd_port)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f"""#!{sys.executable}
import sys
from pathlib import Path
d = Path({str(tmp_path)!r})
with open(d / "calls.txt", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
what = {{"job": "job.txt", "node": "node.txt", "config": "config.txt"}}
if sys.argv[1:2] == ["show"]:
    print((d / what[sys.argv[2]]).read_text())
""")
    script.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("case", ["lost", "lost-stdout-broken", "alive", "signalled"])
def test_the_guard_as_srun_runs_it(tmp_path, case):
    """The guard's process, torchrun's place taken by a child that fails after 2 s ("lost",
    "alive") or sleeps until the step is ended with SIGTERM to every process ("signalled").
    The batch host's slurmd is a listening socket here, closed and DOWN in Slurm ("lost",
    "signalled") or open ("alive"); scontrol answers from the fixtures. Only "lost" requeues."""
    import os
    import signal
    import socket
    import time

    slurmd = socket.create_server(("127.0.0.1", 0))
    port = slurmd.getsockname()[1]
    bin_dir = _fake_scontrol_bin(tmp_path, port, "MIXED" if case == "alive" else "DOWN+NOT_RESPONDING")
    if case != "alive":
        slurmd.close()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="1", SLURMD_NODENAME="mn2",
               PYTHONPATH=str(REPO))
    child = "import time; time.sleep(120)" if case == "signalled" else "import time; time.sleep(2); raise SystemExit(1)"
    proc = subprocess.Popen([sys.executable, "-m", "launch.launchers.elastic_guard", "--log-dir", str(tmp_path), "--",
                             sys.executable, "-c", child],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    if case == "lost-stdout-broken":  # slurmstepd closed the step's pipe: lines only in the guard's file
        proc.stdout.close()
        assert proc.wait(timeout=60) != 0
        assert "requeue 1" in (tmp_path / "calls.txt").read_text()
        assert "requeueing job 1" in (tmp_path / "1-guard-mn2.log").read_text()
        return
    if case == "signalled":
        time.sleep(3)
        assert proc.poll() is None, proc.communicate()[0]
        os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    slurmd.close()
    calls = (tmp_path / "calls.txt").read_text() if (tmp_path / "calls.txt").exists() else ""
    requeued = [c for c in calls.splitlines() if c.startswith("requeue")]
    assert proc.returncode != 0, out
    own = (tmp_path / "1-guard-mn2.log").read_text()  # the same lines, timestamped
    assert [ln.split(" ", 1)[1] for ln in own.splitlines()] == [ln for ln in out.splitlines() if "[launch.slurm]" in ln]
    if case == "lost":
        assert requeued == ["requeue 1"], calls
        assert "[launch.slurm] mn2: torchrun exited with status 1\n" in out
        assert "the batch host mn1 is down (State=DOWN+NOT_RESPONDING): requeueing job 1" in out, out
    elif case == "alive":
        assert requeued == [] and "[launch.slurm] mn2: the batch host mn1 answers; its script handles this" in out, out
    else:
        assert requeued == [] and calls == "", calls
        assert "[launch.slurm] mn2: torchrun exited with status -15 after SIGTERM: the step is being ended" in out, out

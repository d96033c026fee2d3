"""Render a readable, commented sbatch script from a `JobSpec` (pure: no I/O, no clock).

Quoting: everything that comes from the user goes through one of three functions, one per
context it lands in: `shlex.quote` in the bash body, `sbatch_quote` on `#SBATCH` lines
(sbatch's own tokenizer: quotes group, backslash escapes, `#` starts a comment) and
`comment_safe` inside comments (a newline there would start a command line).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import textwrap
from pathlib import Path
from typing import Literal, Optional

from pretrain.observe.watchdog import EXIT_HANG, HANG_DIR

SCRIPT_NAME = "job.sh"
CONFIG_NAME = "config.yaml"
# torchrun forwards only these signals to its workers unless told; USR1 is Slurm's warning.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_./:@%+,=-]+")


@dataclasses.dataclass(frozen=True)
class EnvVar:
    name: str
    value: str
    why: str


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything the script needs, already validated and resolved to absolute paths."""

    recipe: str
    job_name: str
    layout: str  # e.g. "TP8xPP4xVPP5xDP2xSP"
    nodes: int
    tasks_per_node: int  # ranks per node: GPUs per node, or CPU ranks with --cpu
    gpus_per_node: int  # 0 on CPU
    partition: str
    time: str
    account: Optional[str]
    run_dir: str  # as the batch script on the node sees it (host path)
    job_run_dir: str  # as the training sees it (inside the container, if any)
    workdir: str  # where the training runs; relative config paths resolve here
    python: str
    launcher: Literal["srun", "torchrun"]
    env: tuple[EnvVar, ...]
    container_image: Optional[str] = None
    container_mounts: tuple[str, ...] = ()
    signal_seconds: int = 300  # 0: no warning signal before the time limit
    requeue: bool = True
    logs: Literal["node", "rank"] = "node"
    cpus_per_task: Optional[int] = None
    command_line: str = ""  # the launch.slurm command that wrote the script
    config_notes: tuple[str, ...] = ()  # config values launch.slurm set, shown in the header
    hang_requeues: int = 3  # requeues after the hang watchdog stopped the ranks (0: none)
    # torchrun only: keep training on at least this many nodes when nodes are lost (None: off).
    elastic_min_nodes: Optional[int] = None
    elastic_restarts: int = 3  # torchrun --max-restarts: re-formations of the group per agent

    @property
    def ranks(self) -> int:
        return self.nodes * self.tasks_per_node


def comment_safe(text: str) -> str:
    """Text that stays inside one `#` comment line: control characters become escapes."""
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode()
                   for ch in text)


def sbatch_quote(value: str) -> str:
    """One argument on a `#SBATCH` line, read back verbatim by sbatch's tokenizer."""
    if "\n" in value or "\r" in value or "\0" in value:
        raise ValueError(f"{value!r}: a line break cannot be passed on an #SBATCH line")
    if _SBATCH_PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def output_pattern(path: str) -> str:
    """Slurm expands %j, %N, ... in --output; a literal % in a path must be written %%."""
    return path.replace("%", "%%")


def _directive(option: str, value: Optional[str] = None, why: str = "") -> str:
    line = f"#SBATCH --{option}" + (f"={sbatch_quote(value)}" if value is not None else "")
    return f"{line:<44} # {why}" if why else line


def _command_comment(command: str, width: int = 84) -> list[str]:
    """The command as comment lines, broken between arguments (a flag stays with its value)."""
    tokens = [shlex.quote(t) for t in shlex.split(command)]
    groups: list[str] = []
    for token in tokens:
        if groups and groups[-1].startswith("--") and " " not in groups[-1] and not token.startswith("--"):
            groups[-1] += " " + token
        else:
            groups.append(token)
    lines, current = [], ""
    for group in groups:
        if current and len(current) + 1 + len(group) > width:
            lines.append(current + " \\")
            current = "    " + group
        else:
            current = f"{current} {group}" if current else group
    lines.append(current)
    return [f"#   {comment_safe(line)}" for line in lines]


def _header(spec: JobSpec) -> list[str]:
    devices = (f"{spec.nodes} node(s) x {spec.gpus_per_node} GPUs" if spec.gpus_per_node
               else f"{spec.nodes} node(s) x {spec.tasks_per_node} CPU ranks")
    lines = [
        "#!/bin/bash",
        f"# {comment_safe(spec.recipe)} on {devices} = {spec.ranks} ranks, layout {spec.layout}.",
        "# Written by launch.slurm; regenerate (or change nodes, layout, ...) with:",
        *_command_comment(spec.command_line),
        f"# The training reads only {CONFIG_NAME} beside this script: the recipe with your",
        "# overrides, resolved. Edit it to change this run without regenerating.",
    ]
    if spec.config_notes:
        lines.append("# launch.slurm set in it: " + comment_safe(", ".join(spec.config_notes)))
    lines.append(f"# Submit: sbatch {comment_safe(shlex.quote(spec.run_dir + '/' + SCRIPT_NAME))}")
    return lines + [""]


def _elastic_size(spec: JobSpec, unit: str) -> list[str]:
    """MIN-MAX nodes, so that a job requeued after losing its first node (the batch host;
    launch/launchers/elastic_guard.py) starts on the nodes left. One task per node, but not
    --ntasks-per-node: with it Slurm 22.05 gave a MIN-MAX job MIN nodes with all MAX idle,
    and a requeued job kept asking for MAX tasks, one per node, so waited for the lost node."""
    return [
        "# Elastic: MIN-MAX nodes so that a requeued job starts on the nodes left; MAX tasks",
        "# spread one per node (srun below says --ntasks-per-node=1) make the first start take MAX.",
        _directive("nodes", f"{spec.elastic_min_nodes}-{spec.nodes}"),
        _directive("ntasks", str(spec.nodes), f"one torchrun per node, one worker per {unit}"),
        _directive("spread-job", why="over as many nodes as there are tasks"),
    ]


def _directives(spec: JobSpec) -> list[str]:
    out = output_pattern(spec.run_dir) + "/logs/slurm-%j.out"
    lines = [
        _directive("job-name", spec.job_name),
        _directive("partition", spec.partition),
    ]
    if spec.account:
        lines.append(_directive("account", spec.account))
    lines.append(_directive("time", spec.time))
    unit = "GPU" if spec.gpus_per_node else "CPU rank"
    cpus_per_task = spec.cpus_per_task
    if spec.elastic_min_nodes:
        lines += _elastic_size(spec, unit)
    elif spec.launcher == "srun":
        lines += [_directive("nodes", str(spec.nodes)),
                  _directive("ntasks-per-node", str(spec.tasks_per_node), f"one task per {unit}")]
    else:
        lines += [_directive("nodes", str(spec.nodes)),
                  _directive("ntasks-per-node", "1", f"one torchrun per node, one worker per {unit}")]
    if spec.launcher == "torchrun":
        if not spec.gpus_per_node and not cpus_per_task:
            cpus_per_task = spec.tasks_per_node  # the node's share of CPUs goes to torchrun's task
    if cpus_per_task:
        lines.append(_directive("cpus-per-task", str(cpus_per_task)))
    if spec.gpus_per_node:
        lines += [
            _directive("gpus-per-node", str(spec.gpus_per_node)),
            _directive("exclusive", why="whole nodes: all NVLink peers and NICs"),
            _directive("mem", "0", "all of each node's memory"),
        ]
    lines += [
        _directive("output", out, "this script's own log; ranks log per " + spec.logs),
        _directive("open-mode", "append", "a requeued attempt appends, keeps the first"),
    ]
    if spec.signal_seconds:
        lines += [
            "# Preemption: Slurm sends USR1 to this script (B:) this many seconds before the",
            "# time limit (it checks about every 30 s, so it can come a little earlier). The",
            "# trap below forwards it to every rank, which finishes its step, saves a checkpoint",
            "# and exits 0; the script then requeues the job, which resumes from that checkpoint",
            "# (checkpoint.resume=auto).",
            _directive("signal", f"B:USR1@{spec.signal_seconds}"),
        ]
    if spec.requeue:
        lines += [
            "# Requeue on node failure or preemption by Slurm (SIGTERM reaches the ranks, which",
            "# save within KillWait / GraceTime); the restarted job resumes the same way.",
            _directive("requeue"),
        ]
    else:
        lines.append(_directive("no-requeue"))
    if spec.elastic_min_nodes:
        lines += [
            "# Elastic: losing a node does not end the job; the torchruns left (at least",
            f"# {spec.elastic_min_nodes}) re-form the group and resume from the last checkpoint.",
            _directive("no-kill", why="a failed node leaves the allocation running"),
        ]
    return lines + [""]


def _environment(spec: JobSpec) -> list[str]:
    lines = ["# ---- Environment (override or add with launch.slurm --env KEY=VALUE) ----"]
    for var in spec.env:
        lines += [f"# {line}" for line in textwrap.wrap(comment_safe(var.why), 86)]
        lines.append(f"export {var.name}={shlex.quote(var.value)}")
    if spec.launcher == "srun":
        lines += [
            "# Ranks come from Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); torchrun's",
            "# variables inherited from the submitting shell would take precedence, so drop them.",
            "unset RANK WORLD_SIZE LOCAL_RANK",
        ]
    return lines + [""]


def _free_port_program() -> list[str]:
    """launch/ports.py without its docstring: run by the batch host's python3 (docs/launching.md)."""
    from launch import ports

    return Path(ports.__file__).read_text().split('"""', 2)[2].strip().splitlines()


def _rendezvous(spec: JobSpec) -> list[str]:
    # With a container the interpreter is inside the image; this script runs on the host.
    python = "python3" if spec.container_image else shlex.quote(spec.python)
    return [
        "# ---- Rendezvous: rank 0 runs on the first node of the allocation, where this script",
        "# runs (the batch host). The port is one found free there now, so two jobs sharing a",
        "# node do not collide, as ports derived from job ids could; drawn below the kernel's",
        "# ephemeral range, where no outgoing connection takes it before rank 0 binds it",
        "# (launch/ports.py). ----",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_ADDR",
        f"if ! MASTER_PORT=$({python} - <<'PY'",
        *_free_port_program(),
        "PY",
        "); then",
        "    MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        '    echo "[launch.slurm] warning: could not pick a free port on $(hostname); using $MASTER_PORT (job id)"',
        "fi",
        "export MASTER_PORT",
        "",
    ]


def _srun_options(spec: JobSpec) -> list[str]:
    pattern = "%j-node%n-%N.log" if spec.logs == "node" else "%j-rank%t.log"
    opts = [f"--output={shlex.quote(output_pattern(spec.run_dir) + '/logs/' + pattern)}",
            "--open-mode=append", "--label"]
    # Elastic: a lost node's torchrun must not end the step (the others re-form without it).
    opts += ["--no-kill", "--kill-on-bad-exit=0"] if spec.elastic_min_nodes else ["--kill-on-bad-exit=1"]
    if spec.elastic_min_nodes:  # the job asked for tasks, not tasks per node: one torchrun per node
        opts += ['--ntasks="$SLURM_JOB_NUM_NODES"', "--ntasks-per-node=1"]
    if spec.container_image:
        opts.append(f"--container-image={shlex.quote(spec.container_image)}")
        if spec.container_mounts:
            opts.append(f"--container-mounts={shlex.quote(','.join(spec.container_mounts))}")
        opts.append(f"--container-workdir={shlex.quote(spec.workdir)}")
        # pyxis lets the image's own values win unless a variable is named here.
        names = [var.name for var in spec.env] + ["MASTER_ADDR", "MASTER_PORT"]
        opts.append(f"--container-env={','.join(names)}")
    return opts


def _program(spec: JobSpec) -> list[str]:
    """The command srun starts, as lines (torchrun's own options one per line)."""
    config = shlex.quote(f"{spec.job_run_dir}/{CONFIG_NAME}")
    train = f"-m pretrain --recipe {shlex.quote(spec.recipe)} --config {config}"
    python = shlex.quote(spec.python)
    if spec.launcher == "srun":
        return [f"{python} {train}"]
    # torchrun: one agent per node; c10d rendezvous on the first node assigns node ranks.
    nnodes = '--nnodes="$SLURM_JOB_NUM_NODES"'
    elastic: tuple[str, ...] = ()
    if spec.elastic_min_nodes:
        nnodes = f'--nnodes="{spec.elastic_min_nodes}:$SLURM_JOB_NUM_NODES"'
        # last_call_timeout: how long a rendezvous waits for more nodes once the minimum has
        # joined, at the first formation as after a loss. torch's default, 30 s: with 5 s a
        # loaded 2-node test job once formed on its first node alone (the second node's torchrun
        # joined later and waited), training at half the DP it was given.
        elastic = (f"--max-restarts={spec.elastic_restarts}", "--rdzv-conf=last_call_timeout=30")
    # Elastic: the guard runs torchrun and, when it fails because this script's node (the
    # batch host, which also holds the rendezvous store) is lost, requeues or cancels the job.
    # Its lines also go to logs/<job>-guard-<node>.log: the step's stdout can break with srun.
    logs = shlex.quote(spec.run_dir + "/logs")
    guard = [f"{python} -m launch.launchers.elastic_guard --log-dir {logs} --"] if spec.elastic_min_nodes else []
    return guard + [f"{python} -m torch.distributed.run"] + ["    " + opt for opt in (
        nnodes, *elastic, f"--nproc-per-node={spec.tasks_per_node}",
        "--rdzv-backend=c10d", '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
        '--rdzv-id="$SLURM_JOB_ID"',
        # Forward Slurm's USR1 to the workers and give them the warning time to save.
        f"--signals-to-handle={TORCHRUN_SIGNALS}",
        f"--shutdown-timeout={max(spec.signal_seconds, 30)}",
        train)]


def _elastic_env(spec: JobSpec) -> list[str]:
    if not spec.elastic_min_nodes:
        return []
    return [
        "# torchrun shares its rendezvous store with the ranks, and keeps it across a re-formed",
        "# group: the ranks of the new group then read the old group's addresses and fail",
        "# (pytorch/pytorch#135712). A store of their own per group avoids it.",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        "# This node holds the store and runs this script: if it is lost, nothing is left to",
        "# end the job. Each node's launch.launchers.elastic_guard then sees its torchrun fail",
        "# (or, while it runs, the rendezvous store here stop answering), checks with Slurm that",
        "# this node is down, and requeues the job (it resumes on the nodes left) or, with",
        "# --no-requeue, cancels it; a line in the node's log says which.",
        "",
    ]


def _launch(spec: JobSpec) -> list[str]:
    what = ("one task per rank (srun)" if spec.launcher == "srun"
            else f"one torchrun per node, {spec.tasks_per_node} workers each")
    forward = ("srun forwards it to every task" if spec.launcher == "srun"
               else "srun -> each torchrun -> its workers")
    prefix = "its task id (= rank)" if spec.launcher == "srun" else "its node's task id"
    lines = [
        f"# ---- Training: {what} ----",
        f"# Output: logs/ in the run directory, one file per {spec.logs}, each line prefixed with",
        f"# {prefix}. --kill-on-bad-exit: one failed task ends the step instead of leaving",
        "# the others blocked in a collective.",
        "PREEMPTED=0",
        "forward_usr1() {",
        "    PREEMPTED=1",
        '    echo "[launch.slurm] USR1: asking the ranks to save a checkpoint and exit"',
        f'    kill -USR1 "$TRAIN_PID" 2>/dev/null  # {forward}',
        "}",
        "trap forward_usr1 USR1",
        'echo "[launch.slurm] job $SLURM_JOB_ID attempt ${SLURM_RESTART_COUNT:-0}:' 
        ' $SLURM_JOB_NUM_NODES node(s), rendezvous $MASTER_ADDR:$MASTER_PORT, $(date -Is)"',
    ]
    stamp = shlex.quote(spec.run_dir + "/logs/.attempt-") + '"$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"'
    lines += ["# Marks this attempt's start: hang reports newer than it are this attempt's.",
              f"ATTEMPT_STAMP={stamp}", 'touch "$ATTEMPT_STAMP"']
    lines.append(" \\\n    ".join(["srun"] + _srun_options(spec) + _program(spec)) + " &")
    lines += [
        "TRAIN_PID=$!",
        "# A trap runs only between commands, so wait in the background-and-wait form; a",
        "# wait interrupted by the trap (status > 128) is resumed until srun really ends.",
        'wait "$TRAIN_PID"; RC=$?',
        'while (( RC > 128 )) && kill -0 "$TRAIN_PID" 2>/dev/null; do wait "$TRAIN_PID"; RC=$?; done',
        "",
        "if (( PREEMPTED )); then",
        '    echo "[launch.slurm] ranks stopped (exit $RC) after USR1; requeueing job $SLURM_JOB_ID to resume"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "fi",
        *_hang_handling(spec),
        'echo "[launch.slurm] training exited with status $RC"',
        'exit "$RC"  # the job\'s exit code is the training\'s',
        "",
    ]
    return lines


def _hang_handling(spec: JobSpec) -> list[str]:
    """A rank's hang watchdog exits EXIT_HANG after writing its stacks to <run dir>/hang/;
    srun may report another code (the peers it then kills), so a new report counts too."""
    hang_dir = shlex.quote(f"{spec.run_dir}/{HANG_DIR}")
    counter = shlex.quote(f"{spec.run_dir}/logs/.hang-requeues")
    lines = [
        "# Hang watchdog (pretrain.observe.watchdog): a rank whose step made no progress within",
        f"# watchdog.timeout dumped its stacks into {comment_safe(spec.run_dir)}/{HANG_DIR}/ and exited {EXIT_HANG}.",
        f"HANG_REPORT=$(find {hang_dir} -name 'rank_*.txt' -newer \"$ATTEMPT_STAMP\" 2>/dev/null | head -n 1)",
        f'if (( RC == {EXIT_HANG} )) || [[ -n "$HANG_REPORT" ]]; then',
    ]
    if not (spec.requeue and spec.hang_requeues):
        return lines + [
            '    echo "[launch.slurm] the hang watchdog stopped the ranks (exit $RC); stacks: $HANG_REPORT; '
            'not requeueing (requeue is off)"',
            f"    exit {EXIT_HANG}",
            "fi",
        ]
    return lines + [
        f"    HANGS=$(cat {counter} 2>/dev/null || echo 0)",
        f"    if (( HANGS < {spec.hang_requeues} )); then  # launch.slurm --hang-requeues",
        f"        echo $((HANGS + 1)) > {counter}",
        '        echo "[launch.slurm] the hang watchdog stopped the ranks (exit $RC); stacks: $HANG_REPORT; '
        f'requeueing job $SLURM_JOB_ID (hang requeue $((HANGS + 1)) of {spec.hang_requeues}) to resume from '
        'the last checkpoint"',
        '        scontrol requeue "$SLURM_JOB_ID"',
        "        exit 0",
        "    fi",
        f'    echo "[launch.slurm] the hang watchdog stopped the ranks (exit $RC) after {spec.hang_requeues} '
        'hang requeue(s) already; not requeueing: see $HANG_REPORT"',
        f"    exit {EXIT_HANG}",
        "fi",
    ]


def render(spec: JobSpec) -> str:
    body = ["set -uo pipefail  # no -e: the training's exit status is collected below"]
    if spec.container_image:
        body.append("# The ranks run in --container-workdir (below): relative paths in the config resolve there.")
    else:
        body += ["# Relative paths in the config resolve here; python -m pretrain imports from here.",
                 f"cd {shlex.quote(spec.workdir)}"]
    body.append("")
    return "\n".join(_header(spec) + _directives(spec) + body + _environment(spec)
                     + _rendezvous(spec) + _elastic_env(spec) + _launch(spec))

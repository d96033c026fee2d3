"""Turn a recipe into a readable sbatch script in its run directory, validate it, submit it.

    # Llama-3 70B on 8 H100 nodes in a container (pyxis/enroot); writes the script only:
    python -m launch.slurm --recipe llama3-70b --nodes 8 --gpus-per-node 8 \
        --partition batch --time 04:00:00 --account my-project \
        --container-image nvcr.io#nvidia/pytorch:25.04-py3 --container-mounts /lustre:/lustre \
        --workdir /lustre/code/pretrain --run-dir /lustre/runs/llama3-70b/try1
    # the same, printed instead of written:            add --dry-run
    # written and submitted with sbatch:                add --submit
    # CPU ranks (gloo), e.g. on the CI test cluster:
    python -m launch.slurm --recipe tiny-llama --cpu --nodes 1 --ntasks-per-node 4 \
        --partition debug --time 10 parallel.tensor_parallel=2 parallel.pipeline_parallel=2 --submit

The run directory (default runs/<name>/<timestamp>/) receives job.sh, config.yaml (the
recipe with your overrides, resolved: the training reads only this), logs/ and, unless the
config names another, checkpoints/. One srun task per GPU (or --launcher torchrun: one
torchrun per node). USR1 before the time limit -> ranks save and exit -> the job requeues
itself and resumes (checkpoint.resume=auto). A rank's hang watchdog (exit 75, stacks in
<run dir>/hang/) -> the job requeues and resumes from the last checkpoint, at most
--hang-requeues times. --launcher torchrun --elastic-min-nodes N: a lost node does not end
the job; the nodes left (at least N) re-form and resume at a smaller DP size. Nothing is
written or submitted when a check
fails: layout vs nodes x GPUs, data paths, run directory, time limit vs warning signal.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from data_pipeline.checks import BAD_INPUT, writable_dir_problem
from launch.launchers.sbatch_template import CONFIG_NAME, SCRIPT_NAME, EnvVar, JobSpec, render, sbatch_quote
from pretrain.cli import resolve_config
from pretrain.config import ConfigError, ExperimentConfig, dump_yaml, validate_for_world

REPO_ROOT = Path(__file__).resolve().parents[2]
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


class LaunchError(ValueError):
    """One or more checks failed; each line names the value and the fix."""


@dataclasses.dataclass
class Checks:
    errors: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True)
    p.add_argument("--config", help="YAML overrides file, layered over the recipe")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    where = p.add_argument_group("allocation")
    where.add_argument("--nodes", type=int, default=1, help="nodes (at least 1)")
    where.add_argument("--gpus-per-node", type=int, default=8, help="one rank per GPU (default 8)")
    where.add_argument("--cpu", action="store_true", help="CPU ranks over gloo, no GPUs requested")
    where.add_argument("--ntasks-per-node", type=int, help="ranks per node with --cpu")
    where.add_argument("--partition", required=True)
    where.add_argument("--time", required=True, help="Slurm time limit: MIN, HH:MM:SS, D-HH:MM, ...")
    where.add_argument("--account")
    where.add_argument("--job-name", help="default: the config's name")
    where.add_argument("--cpus-per-task", type=int)
    job = p.add_argument_group("job")
    job.add_argument("--run-dir", help="default: runs/<name>/<timestamp> under the current directory")
    job.add_argument("--workdir", help="where the job runs `python -m pretrain` (default: this "
                     "repository; with a container: its path inside the container)")
    job.add_argument("--python", help="interpreter (default: this one; `python` in a container)")
    job.add_argument("--launcher", choices=["srun", "torchrun"], default="srun",
                     help="srun: one task per rank (default); torchrun: one torchrun per node")
    job.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                     help="set or override an environment variable (repeatable)")
    job.add_argument("--container-image", help="pyxis/enroot image for srun")
    job.add_argument("--container-mounts", action="append", default=[], metavar="SRC:DST[,...]")
    job.add_argument("--signal-seconds", type=int, default=300,
                     help="USR1 this long before the time limit: save and requeue (0: off)")
    job.add_argument("--no-requeue", action="store_true")
    job.add_argument("--hang-requeues", type=int, default=3, metavar="N",
                     help="requeue at most N times after the hang watchdog stopped the ranks (default 3; 0: never)")
    job.add_argument("--elastic-min-nodes", type=int, metavar="N",
                     help="--launcher torchrun: when nodes are lost, keep training on the N or more left "
                     "(smaller data parallelism, same global batch) instead of ending the job")
    job.add_argument("--elastic-restarts", type=int, default=3, metavar="K",
                     help="with --elastic-min-nodes: how often the group may re-form (default 3)")
    job.add_argument("--logs", choices=["node", "rank"], default="node", help="one log file per ...")
    job.add_argument("--no-path-check", action="store_true",
                     help="skip data-path checks (paths this machine cannot see)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the script; write nothing")
    mode.add_argument("--submit", action="store_true", help="write the script and sbatch it")
    return p


# ---------------------------------------------------------------- pure helpers

def slurm_time_seconds(text: str) -> Optional[int]:
    """Seconds in a Slurm time limit; None for UNLIMITED. Raises ValueError if malformed."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = _TIME.fullmatch(text)
    if not match:
        raise ValueError(text)
    days, a, b, c = match.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-HH[:MM[:SS]]
        h, m, s = (nums + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + s
    if len(nums) == 1:  # minutes
        return nums[0] * 60
    if len(nums) == 2:  # MM:SS
        return nums[0] * 60 + nums[1]
    return nums[0] * 3600 + nums[1] * 60 + nums[2]


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:64] or "pretrain"


def parse_mounts(items: list[str], checks: Checks) -> list[tuple[str, str]]:
    """pyxis mounts `SRC[:DST[:FLAGS]]`, comma separated; (src, dst) pairs."""
    mounts = []
    for item in ",".join(items).split(","):
        if not item:
            continue
        parts = item.split(":")
        src, dst = parts[0], parts[1] if len(parts) > 1 and parts[1] else parts[0]
        if not (src.startswith("/") and dst.startswith("/")):
            checks.errors.append(f"--container-mounts entry {item!r} must be /host/path[:/container/path"
                                 "[:flags]] with absolute paths (paths may not contain ',' or ':')")
            continue
        mounts.append((src.rstrip("/") or "/", dst.rstrip("/") or "/"))
    return mounts


def _remap(path: str, pairs: list[tuple[str, str]]) -> Optional[str]:
    """Map `path` through the longest matching (from, to) prefix; None if none matches."""
    best = None
    for frm, to in pairs:
        if path == frm or path.startswith(frm.rstrip("/") + "/"):
            if best is None or len(frm) > len(best[0]):
                best = (frm, to)
    if best is None:
        return None
    rest = path[len(best[0]):].lstrip("/")
    return str(Path(best[1]) / rest) if rest else best[1]


@dataclasses.dataclass(frozen=True)
class PathView:
    """Host paths (the launcher, slurmstepd) vs the paths the training sees (container)."""

    mounts: Optional[list[tuple[str, str]]]  # None: no container, both views are the same

    def to_job(self, host: str) -> Optional[str]:
        return host if self.mounts is None else _remap(host, self.mounts)

    def to_host(self, job: str) -> Optional[str]:
        return job if self.mounts is None else _remap(job, [(d, s) for s, d in self.mounts])


def default_env(config: ExperimentConfig, cpu: bool, user: list[str], checks: Checks) -> tuple[EnvVar, ...]:
    """H100 defaults (each with the reason), then the user's --env KEY=VALUE on top."""
    env = [EnvVar("PYTHONUNBUFFERED", "1", "log lines reach the log files as they are printed")]
    if cpu:
        env += [
            EnvVar("OMP_NUM_THREADS", "1", "ranks already use every core; more threads per rank thrash"),
            EnvVar("PYTHONWARNINGS", "ignore:Transformer Engine and Apex are not installed,"
                   "ignore:Apex is not installed",
                   "Megatron-Core warns on every rank that TE/Apex are missing: expected on CPU"),
        ]
    else:
        layout = config.parallel
        env.append(EnvVar("OMP_NUM_THREADS", "1", "as torchrun sets it: 8 ranks x all cores would oversubscribe the CPUs"))
        if layout.tensor_parallel > 1 or layout.context_parallel > 1:
            env.append(EnvVar("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                              "one hardware queue keeps kernel order, so TP/SP/CP communication is "
                              "issued before the compute it overlaps with (Megatron-Core expects it)"))
        env += [
            EnvVar("TORCH_NCCL_AVOID_RECORD_STREAMS", "1",
                   "free buffers of async collectives when they finish, not when the allocator "
                   "notices: lower peak memory with overlapped grad reduce / param gather"),
            EnvVar("NCCL_NVLS_ENABLE", "0",
                   "NVLink SHARP reserves GPU memory for every communicator; many TP/DP/PP "
                   "groups add up to GBs. Set 1 if your all-reduces measure faster with it"),
            EnvVar("NCCL_DEBUG", "WARN", "NCCL errors (IB link down, timeouts) with their cause in the rank logs"),
        ]
    for item in user:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name):
            checks.errors.append(f"--env {item!r} is not KEY=VALUE with KEY a shell variable name "
                                 "(letters, digits, _; e.g. --env NCCL_IB_TIMEOUT=22)")
            continue
        env = [v for v in env if v.name != name] + [EnvVar(name, value, f"--env {name}")]
    return tuple(env)


# ---------------------------------------------------------------- checks

def check_layout(config: ExperimentConfig, nodes: int, per_node: int, cpu: bool, checks: Checks) -> None:
    world = nodes * per_node
    unit = "CPU ranks" if cpu else "GPUs"
    try:
        validate_for_world(config, world)
    except ConfigError as exc:
        checks.errors.append(f"{nodes} node(s) x {per_node} {unit} = {world} ranks: {exc}. "
                             "Change --nodes / the per-node count, or the parallel.* overrides")
        return
    tp = config.parallel.tensor_parallel
    if tp > per_node:
        checks.warnings.append(
            f"TP={tp} exceeds the {per_node} {unit} of a node: every tensor-parallel all-reduce "
            f"crosses the inter-node network (InfiniBand), several times slower than NVLink. "
            f"Prefer parallel.tensor_parallel<={per_node} and more pipeline or data parallelism")
    elif per_node % tp:
        checks.warnings.append(f"{per_node} {unit} per node is not a multiple of TP={tp}: some TP "
                               "groups span two nodes; choose TP dividing the per-node count")


def check_elastic(config: ExperimentConfig, args: argparse.Namespace, per_node: int, checks: Checks) -> None:
    """Every node count torchrun may re-form with (min..nodes) must be a valid world."""
    low = args.elastic_min_nodes
    if args.launcher != "torchrun":
        checks.errors.append("--elastic-min-nodes needs --launcher torchrun (srun cannot re-form a group)")
        return
    if not 1 <= low < args.nodes:
        checks.errors.append(f"--elastic-min-nodes {low} must be at least 1 and below --nodes {args.nodes}")
        return
    if args.elastic_restarts < 1:
        checks.errors.append(f"--elastic-restarts {args.elastic_restarts} must be at least 1")
    if config.checkpoint.resume != "auto" or config.checkpoint.save_interval < 1:
        checks.errors.append("--elastic-min-nodes resumes from the last checkpoint: it needs "
                             "checkpoint.resume=auto and checkpoint.save_interval > 0")
    bad = []
    for nodes in range(low, args.nodes):
        try:
            validate_for_world(config, nodes * per_node)
        except ConfigError as exc:
            bad.append(f"{nodes} node(s) = {nodes * per_node} ranks: {exc}")
    if bad:
        checks.errors.append("--elastic-min-nodes {}: the job may go on with any node count from {} to {}, "
                             "and these do not fit the layout (raise --elastic-min-nodes, or choose a "
                             "global batch divisible by micro batch x every DP size): {}".format(
                                 low, low, args.nodes, "; ".join(bad)))


def check_time(time_text: str, signal_seconds: int, checks: Checks) -> None:
    try:
        limit = slurm_time_seconds(time_text)
    except ValueError:
        checks.errors.append(f"--time {time_text!r} is not a Slurm time limit; use MINUTES, "
                             "HH:MM:SS, D-HH:MM:SS or UNLIMITED (e.g. --time 04:00:00)")
        return
    if signal_seconds < 0:
        checks.errors.append(f"--signal-seconds {signal_seconds} must be >= 0 (0 turns the warning off)")
    elif limit is not None and signal_seconds and signal_seconds >= limit:
        checks.errors.append(
            f"--signal-seconds {signal_seconds} is not shorter than --time {time_text} ({limit} s): "
            "the save-and-requeue signal would come at the start. Raise --time or lower --signal-seconds")


def check_data_paths(config: ExperimentConfig, workdir: str, view: PathView, checks: Checks) -> None:
    """Indexed datasets (`prefix.bin` + `.idx`) and the tokenizer file, as the job sees them."""
    wanted: list[tuple[str, str]] = []
    for _, prefix in config.data.blend or []:
        wanted += [(f"data.blend prefix {prefix!r}", prefix + ext) for ext in (".bin", ".idx")]
    tok = config.data.tokenizer
    if tok and tok != "byte":
        wanted.append((f"data.tokenizer {tok!r}", tok.removeprefix("tiktoken:")))
    for what, path in wanted:
        job_path = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
        host = view.to_host(job_path)
        if host is None:
            checks.warnings.append(f"{what}: {job_path} is not under a --container-mounts "
                                   "destination, so it cannot be checked here (inside the image?)")
        elif not os.path.exists(host):
            checks.errors.append(f"{what}: {host} does not exist. Fix the path (relative paths "
                                 f"resolve against --workdir {workdir}), or pass --no-path-check "
                                 "if only the compute nodes can see it")


# What a run leaves in its run directory (a Slurm job, or a local run: python -m pretrain).
RUN_FILES = (SCRIPT_NAME, CONFIG_NAME, "metrics.jsonl", "checkpoints", "tensorboard")


def check_writable(run_dir: Path, checks: Checks) -> None:
    """The run directory is new or empty of any run's files, and can be created. Writes
    nothing (the probe of writable_dir_problem leaves nothing behind)."""

    if (run_dir / SCRIPT_NAME).exists():
        checks.errors.append(f"run directory {run_dir} already holds a {SCRIPT_NAME}: to continue "
                             f"that run, `sbatch {shlex.quote(str(run_dir / SCRIPT_NAME))}`; for a "
                             "new run choose another --run-dir (the default is timestamped)")
        return
    used = [name for name in RUN_FILES if (run_dir / name).exists()]
    if used:
        checks.errors.append(f"run directory {run_dir} already holds a run ({', '.join(used)}); writing the job "
                             f"there would replace its {CONFIG_NAME}: choose another --run-dir (the default is "
                             "timestamped)")
        return
    problem = writable_dir_problem(str(run_dir))
    if problem:
        checks.errors.append(f"run directory {run_dir} is not writable ({problem}); pass "
                             "--run-dir on a filesystem you and the compute nodes can write")


# ---------------------------------------------------------------- plan

@dataclasses.dataclass
class Plan:
    spec: JobSpec
    config: ExperimentConfig
    run_dir: Path
    warnings: list[str]


def _argv_for_header(argv: list[str]) -> str:
    shown = [a for a in argv if a not in ("--dry-run", "--submit")]
    return "python -m launch.slurm " + shlex.join(shown)


def plan_job(args: argparse.Namespace, argv: list[str]) -> Plan:
    """Resolve, validate and describe the job; raises LaunchError listing every problem."""
    checks = Checks()
    try:
        config = resolve_config(args.recipe, args.config, args.overrides)
    except (ConfigError, ValueError) as exc:
        raise LaunchError(str(exc)) from None
    if any(o.split("=", 1)[0].strip() == "logging.run_dir" for o in args.overrides):
        checks.errors.append("set the run directory with --run-dir, not logging.run_dir=...")
    per_node = _per_node(args, checks)
    mounts = parse_mounts(args.container_mounts, checks) if args.container_image else None
    if args.container_mounts and not args.container_image:
        checks.errors.append("--container-mounts needs --container-image")
    view = PathView(mounts)
    run_dir = Path(args.run_dir or Path("runs") / slug(config.name) / time.strftime("%Y%m%d-%H%M%S")).absolute()
    job_run_dir = view.to_job(str(run_dir))
    if job_run_dir is None:
        checks.errors.append(f"run directory {run_dir} is not inside any --container-mounts source, so "
                             f"the ranks could not write to it; add --container-mounts {run_dir}:{run_dir}")
        job_run_dir = str(run_dir)
    workdir = _workdir(args, view, checks)
    notes = [f"logging.run_dir={job_run_dir}"]
    config.logging.run_dir = job_run_dir
    if config.checkpoint.dir is None:
        # A requeued job must find what the preempted one saved.
        config.checkpoint.dir = f"{job_run_dir}/checkpoints"
        notes.append(f"checkpoint.dir={config.checkpoint.dir}")
    elif not config.checkpoint.dir.startswith("/"):
        checks.warnings.append(f"checkpoint.dir={config.checkpoint.dir} is relative: it resolves against "
                               f"--workdir {workdir}; for checkpoints beside this run's logs set "
                               f"checkpoint.dir={job_run_dir}/checkpoints")
    check_layout(config, args.nodes, per_node, args.cpu, checks)
    check_time(args.time, args.signal_seconds, checks)
    if args.elastic_min_nodes is not None:
        check_elastic(config, args, per_node, checks)
    if args.hang_requeues < 0:
        checks.errors.append(f"--hang-requeues {args.hang_requeues} must be >= 0 (0: never requeue after a hang)")
    if not args.no_path_check:
        check_data_paths(config, workdir, view, checks)
    if not args.no_requeue and config.checkpoint.resume != "auto":
        checks.warnings.append(f"checkpoint.resume={config.checkpoint.resume!r}: a requeued job will "
                               "not continue from its own latest checkpoint; use checkpoint.resume=auto")
    env = default_env(config, args.cpu, args.env, checks)
    spec = JobSpec(
        recipe=args.recipe, job_name=args.job_name or slug(config.name),
        layout=config.parallel.describe(args.nodes * per_node), nodes=args.nodes,
        tasks_per_node=per_node, gpus_per_node=0 if args.cpu else per_node,
        partition=args.partition, time=args.time, account=args.account, run_dir=str(run_dir),
        job_run_dir=job_run_dir, workdir=workdir,
        python=args.python or ("python" if args.container_image else sys.executable),
        launcher=args.launcher, env=env, container_image=args.container_image,
        container_mounts=tuple(",".join(args.container_mounts).split(",")) if args.container_mounts else (),
        signal_seconds=0 if args.no_requeue else args.signal_seconds, requeue=not args.no_requeue,
        logs=args.logs, cpus_per_task=args.cpus_per_task, command_line=_argv_for_header(argv),
        config_notes=tuple(notes), hang_requeues=args.hang_requeues,
        elastic_min_nodes=args.elastic_min_nodes, elastic_restarts=args.elastic_restarts,
    )
    _check_directive_values(spec, checks)
    if checks.errors:
        raise LaunchError("\n".join(checks.errors))
    return Plan(spec, config, run_dir, checks.warnings)


def _per_node(args: argparse.Namespace, checks: Checks) -> int:
    if args.nodes < 1:
        checks.errors.append(f"--nodes {args.nodes} must be at least 1")
    if args.cpu:
        if not args.ntasks_per_node or args.ntasks_per_node < 1:
            checks.errors.append("--cpu needs --ntasks-per-node N (CPU ranks per node), e.g. --ntasks-per-node 4")
            return 1
        return args.ntasks_per_node
    if args.gpus_per_node < 1:
        checks.errors.append(f"--gpus-per-node {args.gpus_per_node} must be at least 1; for CPU ranks "
                             "pass --cpu --ntasks-per-node N")
        return 1
    if args.ntasks_per_node and args.ntasks_per_node != args.gpus_per_node:
        checks.errors.append(f"--ntasks-per-node {args.ntasks_per_node} differs from --gpus-per-node "
                             f"{args.gpus_per_node}: on GPUs there is one rank per GPU; drop --ntasks-per-node")
    return args.gpus_per_node


def _workdir(args: argparse.Namespace, view: PathView, checks: Checks) -> str:
    if args.workdir:
        if not args.container_image and not Path(args.workdir).is_dir():
            checks.errors.append(f"--workdir {args.workdir} is not a directory")
        return args.workdir if args.container_image else str(Path(args.workdir).absolute())
    job_view = view.to_job(str(REPO_ROOT))
    if job_view is None:
        checks.errors.append(f"this repository ({REPO_ROOT}) is not inside any --container-mounts "
                             "source; pass --workdir (where the pretrain package is inside the "
                             f"image) or mount it, e.g. --container-mounts {REPO_ROOT}:/workspace/pretrain")
        return str(REPO_ROOT)
    return job_view


def _check_directive_values(spec: JobSpec, checks: Checks) -> None:
    """Values on #SBATCH lines cannot hold line breaks (they would end the directive)."""
    for flag, value in (("--job-name", spec.job_name), ("--partition", spec.partition),
                        ("--account", spec.account), ("--time", spec.time), ("--run-dir", spec.run_dir)):
        try:
            if value is not None:
                sbatch_quote(value)
        except ValueError:
            checks.errors.append(f"{flag} {value!r} contains a line break; remove it")


# ---------------------------------------------------------------- write and submit

def write_run_dir(plan: Plan) -> Path:
    (plan.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (plan.run_dir / CONFIG_NAME).write_text(dump_yaml(plan.config))
    script = plan.run_dir / SCRIPT_NAME
    script.write_text(render(plan.spec))
    script.chmod(0o755)
    return script


def submit(script: Path) -> str:
    """sbatch the script; returns the job id."""
    result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"sbatch failed (exit {result.returncode}): {result.stderr.strip()}")
    return result.stdout.strip().split(";")[0]


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_intermixed_args(argv)
    checks = Checks()
    if args.submit and shutil.which("sbatch") is None:
        print("error: sbatch not found: --submit must run where Slurm's commands are (a login "
              "node); or drop --submit and sbatch the written script there", file=sys.stderr)
        return BAD_INPUT
    try:
        plan = plan_job(args, argv)
        if not args.dry_run:
            check_writable(plan.run_dir, checks)
            if checks.errors:
                raise LaunchError("\n".join(checks.errors))
    except LaunchError as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        print("nothing was written or submitted", file=sys.stderr)
        return BAD_INPUT
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.dry_run:
        print(render(plan.spec), end="")
        return 0
    script = write_run_dir(plan)
    print(f"wrote {script} and {plan.run_dir / CONFIG_NAME}")
    if not args.submit:
        print(f"submit with: sbatch {shlex.quote(str(script))}")
        return 0
    try:
        job_id = submit(script)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    log = plan.run_dir / "logs" / f"slurm-{job_id}.out"
    print(f"submitted: job {job_id}; follow: tail -f {shlex.quote(str(log))}; cancel: scancel {job_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

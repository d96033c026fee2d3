"""Preprocess across nodes: a Slurm job array tokenises shards of the inputs, a dependent
job merges them into one dataset, byte-identical to one `data_pipeline.preprocess` run.

    python -m data_pipeline.preprocess_slurm --input 'corpus/*.jsonl.gz' --output-prefix data/corpus \\
        --tokenizer tok/sp32k.model --append-eod --shards 64 --cpus-per-task 8 \\
        --partition cpu --time 02:00:00 --submit
    # the same checks and the plan, printed, nothing written:   --dry-run
    # written, not submitted (prints the sbatch commands):      neither flag

Writes into the work directory (default PREFIX.shards/): plan.json (inputs with their
record counts, the shards), task.sh (the array: task k runs `... task PLAN k`, which
tokenises shard k into shards/shard-0000k.bin/.idx atomically, as preprocess writes),
merge.sh (`... merge PLAN`, submitted with --dependency=afterok:ARRAY, so it starts only
when every shard succeeded; it streams the shards into PREFIX.bin/.idx with memory that
does not grow with the data). A failed task requeues itself alone (--retries, default
1; bad input, exit 2, is not retried) and the merge waits for it; if a task still fails,
the merge is cancelled by Slurm (--kill-on-invalid-dep), and running the same command
again submits only the shards not finished, and a new merge. Bad input (a missing input,
more shards than records, an existing output, a tokenizer that does not load) is refused
before anything is written or submitted (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from data_pipeline.checks import positive_int
from data_pipeline.preprocess import DEFAULT_MAX_DOCUMENT_BYTES, PreprocessError
from data_pipeline.sources import InputError

REPO = Path(__file__).resolve().parents[1]
PLAN_VERSION = 1


class SlurmPlanError(ValueError):
    """A plan that cannot be made or used; the message names the problem and the fix."""


# ---------------------------------------------------------------- planning

def make_plan(args: argparse.Namespace) -> dict:
    """Every check, then the plan as JSON-ready data; raises on bad input, writes nothing."""
    from data_pipeline.output_paths import check_output_prefix, output_exists
    from data_pipeline.shares import count_records, plan_shares
    from data_pipeline.sources import check_readable, resolve_inputs
    from data_pipeline.tokenizers import TokenizerLoadError, absolute_spec, load_tokenizer

    sources = resolve_inputs(args.input)
    check_output_prefix(args.output_prefix)
    if output_exists(args.output_prefix) and not args.overwrite:
        raise SlurmPlanError(f"{args.output_prefix}.bin/.idx already exist; choose another --output-prefix "
                             "or pass --overwrite to replace them")
    tok = load_tokenizer(args.tokenizer)
    if args.append_eod and tok.eod is None:
        raise TokenizerLoadError(f"{tok.describe()} has no end-of-document token; drop --append-eod or "
                                 "use a tokenizer with an EOS token")
    for source in sources:
        check_readable(source, args.text_field)
    counts = [count_records(s) for s in sources]
    total = sum(counts)
    if args.shards > total:
        raise SlurmPlanError(f"--shards {args.shards} is more than the {total:,} records (documents) of the "
                             f"inputs; use --shards {total} or fewer")
    shards = plan_shares(sources, counts, args.shards)
    return {
        "version": PLAN_VERSION,
        "output_prefix": os.path.abspath(args.output_prefix),
        "work_dir": str(work_dir(args)),
        "inputs": [{"path": os.path.abspath(s.path), "size": s.size, "mtime_ns": s.mtime_ns, "records": n}
                   for s, n in zip(sources, counts, strict=True)],
        "shards": [[seg.to_json() for seg in shard] for shard in shards],
        "options": {"tokenizer": absolute_spec(args.tokenizer), "text_field": args.text_field,
                    "append_eod": args.append_eod, "skip_bad_records": args.skip_bad_records,
                    "max_document_bytes": args.max_document_bytes, "encoder": args.encoder,
                    "workers": args.workers if args.workers is not None else args.cpus_per_task,
                    "worker_memory_mb": args.worker_memory_mb},
    }


def work_dir(plan_or_args) -> Path:
    if isinstance(plan_or_args, dict):
        return Path(plan_or_args["work_dir"])
    return Path(os.path.abspath(plan_or_args.work_dir or plan_or_args.output_prefix + ".shards"))


def shard_prefix(directory: Path, index: int) -> str:
    return str(directory / "shards" / f"shard-{index:05d}")


def _shard_inputs(plan: dict, index: int) -> tuple[list[dict], list]:
    """The inputs shard `index` reads and its segments, renumbered into that list."""
    from data_pipeline.shares import Segment

    segments = [Segment(**s) for s in plan["shards"][index]]
    used = sorted({s.source for s in segments})
    renumber = {old: new for new, old in enumerate(used)}
    return ([plan["inputs"][i] for i in used],
            [Segment(renumber[s.source], s.first, s.count, s.offset) for s in segments])


def finished_shards(plan: dict, directory: Path) -> list[bool]:
    """Which shards a task already wrote for exactly this plan (their manifest says so)."""
    from data_pipeline.output_paths import read_manifest

    done = []
    for index in range(len(plan["shards"])):
        manifest = read_manifest(shard_prefix(directory, index)) or {}
        done.append(manifest.get("slurm_shard") == _shard_identity(plan, index))
    return done


def _shard_identity(plan: dict, index: int) -> dict:
    inputs, segments = _shard_inputs(plan, index)
    return {"inputs": inputs, "segments": [s.to_json() for s in segments],
            "options": {k: v for k, v in plan["options"].items()
                        if k not in ("workers", "encoder", "worker_memory_mb")}}  # none changes the bytes


# ---------------------------------------------------------------- scripts and submission

def _directives(args: argparse.Namespace) -> list[str]:
    lines = [f"#SBATCH --cpus-per-task={args.cpus_per_task}"]
    for flag in ("partition", "time", "account", "mem"):
        value = getattr(args, flag)
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    return lines


def _python_line(directory: Path, step: str) -> str:
    return (f"cd {shlex.quote(str(REPO))} && export PYTHONPATH={shlex.quote(str(REPO))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
            f"{shlex.quote(sys.executable)} -m data_pipeline.preprocess_slurm {step} "
            f"{shlex.quote(str(directory / 'plan.json'))}")


def _script(directory: Path, what: str, job_name: str, log: str, directives: list[str], body: list[str]) -> str:
    return "\n".join(["#!/bin/bash", f"# data_pipeline.preprocess_slurm: {what} of {directory / 'plan.json'}",
                      f"#SBATCH --job-name={job_name}", f"#SBATCH --output={directory}/logs/{log}",
                      *directives, *body, ""])


def task_script(args: argparse.Namespace, directory: Path, name: str) -> str:
    directives = ["#SBATCH --open-mode=append  # a requeued attempt appends to the first one's log",
                  "#SBATCH --requeue", *_directives(args)]
    return _script(directory, "task k tokenises shard k", f"{name}-tokenise", "task-%A_%a.out", directives, [
        "set -uo pipefail",
        'echo "[preprocess_slurm] shard $SLURM_ARRAY_TASK_ID attempt ${SLURM_RESTART_COUNT:-0} on $(hostname)"',
        _python_line(directory, "task") + ' "$SLURM_ARRAY_TASK_ID"',
        "RC=$?",
        "# Exit 2 is bad input (the same every time): not retried. Anything else (a killed",
        "# process, a full disk, a node problem) requeues this shard alone; the merge waits.",
        f'if (( RC != 0 && RC != 2 && ${{SLURM_RESTART_COUNT:-0}} < {args.retries} )); then',
        f'    echo "[preprocess_slurm] shard $SLURM_ARRAY_TASK_ID failed (exit $RC); requeueing it alone '
        f'(retry $((${{SLURM_RESTART_COUNT:-0}} + 1)) of {args.retries})"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "fi",
        'echo "[preprocess_slurm] shard $SLURM_ARRAY_TASK_ID exited with status $RC"',
        'exit "$RC"',
    ])


def merge_script(args: argparse.Namespace, directory: Path, name: str) -> str:
    directives = [line for line in _directives(args) if "cpus-per-task" not in line]
    return _script(directory, "merge the shards (after the array)", f"{name}-merge", "merge-%j.out", directives,
                   [_python_line(directory, "merge")])


def sbatch_commands(directory: Path, todo: list[int]) -> tuple[list[str], list[str]]:
    """The two sbatch command lines; ARRAY_JOB stands for the array's job id."""
    array = ["sbatch", "--parsable", f"--array={_ranges(todo)}", str(directory / "task.sh")]
    merge = ["sbatch", "--parsable", "--dependency=afterok:ARRAY_JOB", "--kill-on-invalid-dep=yes",
             str(directory / "merge.sh")]
    return array, merge


def _ranges(indices: list[int]) -> str:
    """0,1,2,5,7,8 -> 0-2,5,7-8 (Slurm's --array syntax)."""
    parts, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(parts)


def _sbatch(command: list[str]) -> str:
    print("$ " + shlex.join(command), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"sbatch failed (exit {result.returncode}): {result.stderr.strip()}")
    return result.stdout.strip().split(";")[0]


def _queued(directory: Path) -> list[str]:
    """Job ids of an earlier submission from this work directory that Slurm still holds."""
    record = directory / "jobs.json"
    if not record.is_file() or shutil.which("squeue") is None:
        return []
    jobs = json.loads(record.read_text())["jobs"]
    out = subprocess.run(["squeue", "-h", "-o", "%F", "-j", ",".join(jobs)], capture_output=True, text=True)
    return sorted(set(out.stdout.split())) if out.returncode == 0 else []


# ---------------------------------------------------------------- inside the jobs

def run_task(plan_path: str, index: int) -> int:
    """Array task `index`: tokenise one shard into its own dataset (atomic, resumable)."""
    from data_pipeline.preprocess import preprocess, print_summary

    plan = _load_plan(plan_path)
    if not 0 <= index < len(plan["shards"]):
        raise SlurmPlanError(f"shard {index} does not exist: the plan has {len(plan['shards'])}")
    inputs, segments = _shard_inputs(plan, index)
    for item in inputs:
        _check_unchanged(item)
    directory = work_dir(plan)
    prefix = shard_prefix(directory, index)
    if finished_shards(plan, directory)[index]:
        print(f"shard {index}: {prefix} is already complete for this plan; nothing to do")
        return 0
    options = plan["options"]
    summary = preprocess([i["path"] for i in inputs], tokenizer=options["tokenizer"], output_prefix=prefix,
                         text_field=options["text_field"], append_eod=options["append_eod"],
                         workers=options["workers"], skip_bad_records=options["skip_bad_records"],
                         overwrite=True, max_document_bytes=options["max_document_bytes"],
                         encoder=options["encoder"], segments=segments,
                         # None (not given, or a plan from before the option): preprocess's
                         # default for the task's worker count
                         worker_memory_mb=options.get("worker_memory_mb"))
    _stamp_shard(prefix, _shard_identity(plan, index))
    from rich.console import Console

    print_summary(Console(stderr=True), summary)
    return 0


def _stamp_shard(prefix: str, identity: dict) -> None:
    """Record the plan's shard in the manifest (after the pair; written whole, then renamed)."""
    from data_pipeline.output_paths import manifest_path

    path = manifest_path(prefix)
    manifest = json.loads(Path(path).read_text())
    manifest["slurm_shard"] = identity
    Path(path + ".partial").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(path + ".partial", path)


def run_merge(plan_path: str) -> int:
    """The dependent job: every shard complete for this plan -> one streamed merge."""
    from data_pipeline.merge import merge

    plan = _load_plan(plan_path)
    directory = work_dir(plan)
    missing = [i for i, done in enumerate(finished_shards(plan, directory)) if not done]
    if missing:
        raise SlurmPlanError(f"shards {_ranges(missing)} are not complete for this plan; run the "
                             "submitting command again (it submits only those, and a new merge)")
    prefixes = [shard_prefix(directory, i) for i in range(len(plan["shards"]))]
    manifest = merge(prefixes, plan["output_prefix"], overwrite=True, documents_required=True)
    print(f"merged {len(prefixes)} shards: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
          f"into {plan['output_prefix']}.bin/.idx")
    return 0


def _load_plan(path: str) -> dict:
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SlurmPlanError(f"cannot read the plan {path}: {exc}") from None
    if plan.get("version") != PLAN_VERSION:
        raise SlurmPlanError(f"{path} is not a version-{PLAN_VERSION} preprocess_slurm plan")
    return plan


def _check_unchanged(item: dict) -> None:
    try:
        stat = os.stat(item["path"])
    except OSError as exc:
        raise InputError(f"input {item['path']} is gone since planning ({exc.strerror})") from None
    if (stat.st_size, stat.st_mtime_ns) != (item["size"], item["mtime_ns"]):
        raise InputError(f"input {item['path']} changed since planning (size or mtime): the shards no "
                         "longer fit it; plan again (the submitting command with --overwrite)")


# ---------------------------------------------------------------- the command

def build_parser() -> argparse.ArgumentParser:
    from data_pipeline.checks import nonnegative_int

    p = argparse.ArgumentParser(prog="python -m data_pipeline.preprocess_slurm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", "-i", nargs="+", required=True, metavar="PATH_OR_GLOB",
                   help=".jsonl, .jsonl.gz or .parquet files or globs (quote globs)")
    p.add_argument("--output-prefix", "-o", required=True, help="the merged PREFIX.bin/.idx")
    p.add_argument("--tokenizer", "-t", required=True, help="as for data_pipeline.preprocess")
    p.add_argument("--shards", type=positive_int, required=True,
                   help="array tasks: the inputs' records cut into this many contiguous shards")
    p.add_argument("--text-field", default="text")
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--skip-bad-records", action="store_true")
    p.add_argument("--max-document-bytes", type=positive_int, default=DEFAULT_MAX_DOCUMENT_BYTES)
    p.add_argument("--encoder", choices=("auto", "reference", "gigatoken"), default="auto")
    p.add_argument("--worker-memory-mb", type=positive_int, default=None,
                   help="as for data_pipeline.preprocess: a worker grown by more is replaced "
                        "(default: preprocess's for the task's --workers)")
    p.add_argument("--workers", type=nonnegative_int, default=None,
                   help="tokenising processes per task (default: --cpus-per-task)")
    p.add_argument("--cpus-per-task", type=positive_int, default=1)
    p.add_argument("--partition")
    p.add_argument("--time", help="per task and for the merge, Slurm's format")
    p.add_argument("--account")
    p.add_argument("--mem", help="per task and for the merge, e.g. 8G")
    p.add_argument("--retries", type=nonnegative_int, default=1,
                   help="times a failed task requeues itself (default 1; exit 2, bad input, never)")
    p.add_argument("--job-name", default=None, help="default: the output prefix's name")
    p.add_argument("--work-dir", help="plan, scripts, shards, logs (default PREFIX.shards)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output, or a work directory planned by a different command")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="check and print the plan; write nothing")
    mode.add_argument("--submit", action="store_true", help="write and sbatch the array and the merge")
    return p


def _prepare(args: argparse.Namespace, plan: dict) -> tuple[Path, list[int]]:
    """Write plan.json and the scripts (or reuse an identical plan); the shards still to do."""
    directory = work_dir(args)
    plan_path = directory / "plan.json"
    if plan_path.is_file():
        old = json.loads(plan_path.read_text())
        if old != plan:
            if not args.overwrite:
                raise SlurmPlanError(f"{directory} holds the plan of a different command (other inputs, "
                                     "shards or options); pass --overwrite to replace it, or --work-dir")
            shutil.rmtree(directory / "shards", ignore_errors=True)
    queued = _queued(directory)
    if queued:
        raise SlurmPlanError(f"jobs {', '.join(queued)} from an earlier submission are still queued or "
                             f"running; wait for them or scancel them first")
    (directory / "logs").mkdir(parents=True, exist_ok=True)
    (directory / "shards").mkdir(exist_ok=True)
    plan_path.write_text(json.dumps(plan, indent=1) + "\n")
    name = args.job_name or os.path.basename(args.output_prefix)
    for script, text in (("task.sh", task_script(args, directory, name)),
                         ("merge.sh", merge_script(args, directory, name))):
        (directory / script).write_text(text)
        (directory / script).chmod(0o755)
    todo = [i for i, done in enumerate(finished_shards(plan, directory)) if not done]
    return directory, todo


def _print_plan(plan: dict) -> None:
    shards = plan["shards"]
    sizes = [sum(s["count"] for s in shard) for shard in shards]
    print(f"{len(plan['inputs'])} input(s), {sum(i['records'] for i in plan['inputs']):,} records -> "
          f"{len(shards)} shards of {min(sizes):,}-{max(sizes):,} records -> {plan['output_prefix']}.bin/.idx")


def submit_plan(args: argparse.Namespace, plan: dict) -> int:
    directory, todo = _prepare(args, plan)
    _print_plan(plan)
    if not todo:
        print("every shard is complete: submitting the merge only")
    array_cmd, merge_cmd = sbatch_commands(directory, todo)
    if not args.submit:
        print(f"wrote {directory}/plan.json, task.sh, merge.sh; submit with:")
        if todo:
            print(f"ARRAY_JOB=$({shlex.join(array_cmd)})")
            print(shlex.join(merge_cmd).replace("ARRAY_JOB", "$ARRAY_JOB"))
        else:
            print(shlex.join([c for c in merge_cmd if "ARRAY_JOB" not in c and "invalid-dep" not in c]))
        return 0
    jobs = []
    if todo:
        array_job = _sbatch(array_cmd)
        print(f"submitted: array job {array_job} (shards {_ranges(todo)})")
        merge_cmd = [c.replace("ARRAY_JOB", array_job) for c in merge_cmd]
        jobs.append(array_job)
    else:
        merge_cmd = [c for c in merge_cmd if "ARRAY_JOB" not in c and "invalid-dep" not in c]
    merge_job = _sbatch(merge_cmd)
    jobs.append(merge_job)
    (directory / "jobs.json").write_text(json.dumps({"jobs": jobs}) + "\n")
    print(f"submitted: merge job {merge_job} (after the array succeeds); logs: {directory}/logs/")
    return 0


def main(argv: list[str] | None = None) -> int:
    import signal

    from data_pipeline.checks import BAD_INPUT, print_error, run_cli
    from data_pipeline.output_paths import OutputError
    from data_pipeline.merge import MergeError
    from data_pipeline.tokenizers import TokenizerLoadError

    argv = list(sys.argv[1:] if argv is None else argv)
    bad_input = (InputError, OutputError, TokenizerLoadError, PreprocessError, SlurmPlanError, MergeError)
    if argv[:1] in (["task"], ["merge"]):  # the steps the scripts run inside the jobs
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # preemption: clean up temporaries
        step = run_task if argv[0] == "task" else run_merge
        return run_cli(lambda: step(*argv[1:2], *[int(a) for a in argv[2:3]]), bad_input=bad_input,
                       on_interrupt="interrupted: no output was written (temporary files removed)")
    args = build_parser().parse_args(argv)
    if args.submit and shutil.which("sbatch") is None:
        print_error("sbatch not found: --submit must run where Slurm's commands are (a login node); or "
                    "drop --submit and run the printed sbatch commands there")
        return BAD_INPUT

    def body() -> int:
        plan = make_plan(args)
        if args.dry_run:
            _print_plan(plan)
            directory = work_dir(args)
            name = args.job_name or os.path.basename(args.output_prefix)
            print(f"--- {directory}/task.sh\n{task_script(args, directory, name)}--- {directory}/merge.sh\n"
                  f"{merge_script(args, directory, name)}--- would run:")
            for command in sbatch_commands(directory, list(range(len(plan["shards"])))):
                print(shlex.join(command))
            return 0
        try:
            return submit_plan(args, plan)
        except RuntimeError as exc:
            print_error(exc)
            return 1

    return run_cli(body, bad_input=bad_input)


if __name__ == "__main__":
    sys.exit(main())

"""Tokenise jsonl / jsonl.gz / parquet text into Megatron-Core indexed datasets.

    python -m data_pipeline.preprocess \\
        --input 'corpus/*.jsonl.gz' --output-prefix data/corpus \\
        --tokenizer data_pipeline/assets/demo_sp.model --append-eod --workers 2

One output per input instead of one merged output: `--output-dir data/shards`
(writes data/shards/<input name>.bin/.idx). Other options: --text-field NAME
(default text), --skip-bad-records, --overwrite, --no-progress, --encoder
auto|reference|gigatoken (see fast_encoders; same output bytes either way),
--worker-memory-mb (a worker grown by more is replaced: workers.retire_after).

Workers: `--workers N` processes tokenise, N >= 2; with 0 or 1 the main process
does (one worker process beside it only added the hand-over: see IN_PROCESS_WORKERS).
Streaming: the main process cuts inputs into ~1 MiB chunks, at most 3 per
worker are in flight, and results are written in input order, so memory does
not grow with input size (besides 12 bytes per document for the index).
Outputs appear atomically (see index_file); re-running the same command
skips outputs that are complete, and after a crash rewrites them byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from data_pipeline.checks import nonnegative_int, positive_int
from data_pipeline.sources import InputError, InputFile, check_readable, iter_chunks, resolve_inputs
from data_pipeline.tokenizers import TokenizerLoadError, absolute_spec, load_tokenizer

DEFAULT_CHUNK_BYTES = 1 << 20
# A tokenizer holds a whole document at once, at many times its size: one 50 MB document
# peaked at 2.7 GB with SentencePiece (0.34 GB for the same text as 20 kB documents), 0.64
# GB with Llama-3's tiktoken (data_pipeline.benchmark's sampler; docs/benchmarks.md). Longer documents
# are bad records, so memory per worker stays bounded whatever the input holds.
DEFAULT_MAX_DOCUMENT_BYTES = 8 << 20
# A worker that grew by more is replaced (workers.retire_after): gigatoken's cache of encoded
# pieces only grows. Real text grows it slowly (Llama-3's tokenizer: +62 MiB over the 108 MB
# Debian corpus, levelling off; Mistral's SentencePiece ~150 MiB), random distinct words by
# ~6.5 MB per MB of text. A worker process is replaced by a fork (milliseconds): at 64 MiB,
# Mistral -j2 on that corpus peaked at 587 MB against 672 at 256, same MB per CPU-second (3
# runs each; Llama-3's workers never reach 64). Where the main process encodes (-j0/-j1) a
# replacement reloads the encoder (Llama-3's: ~0.6 CPU-s), so it is left more room there.
DEFAULT_WORKER_MEMORY_MB = 64
DEFAULT_INLINE_MEMORY_MB = 256
MAX_EXAMPLES = 10  # bad records quoted in the summary
# --workers up to this tokenise in the main process. One worker process beside a main process
# that only reads ranges and writes ids cost Llama-3 9% more CPU (Mistral 3%) for 1-2% in wall
# time (data_pipeline.benchmark on 108 MB, b1 vs b, medians of 3: 33.92 vs 37.13 MB per
# CPU-second, 35.15 vs 34.66 MB/s; Mistral 19.91 vs 20.42, 20.28 vs 19.85 MB/s): the ids and
# the chunk's pages cross between processes, and the main process's share of the work is ~5%.
IN_PROCESS_WORKERS = 1


class PreprocessError(RuntimeError):
    """A run that stopped: the message names the file, the record and the fix."""


@dataclass
class OutputStats:
    prefix: str
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    disk_bytes: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    up_to_date: bool = False  # finished by an earlier identical run, not rewritten


@dataclass
class RunSummary:
    outputs: list[OutputStats]
    seconds: float
    dtype: str
    # CPU seconds of this process and of the (reaped) workers during the run: unlike
    # `seconds`, a measure of the work that other jobs on the machine do not inflate.
    main_cpu_seconds: float = 0.0
    worker_cpu_seconds: float = 0.0
    replaced_workers: int = 0  # workers replaced (or, with -j0/-j1, encoders reloaded) for their memory
    # CPU seconds of this process before the first chunk (checks, tokenizer and encoder
    # loads, the encoder probe, starting workers): the part that does not grow with the input.
    startup_cpu_seconds: float = 0.0
    worker_memory_mb: int | None = None  # the --worker-memory-mb used (None: nothing to encode)

    def total(self, name: str) -> int:
        return sum(getattr(o, name) for o in self.outputs if not o.up_to_date)

    @property
    def skipped(self) -> Counter:
        return sum((o.skipped for o in self.outputs), Counter())

    def to_json(self) -> dict:
        totals = {name: self.total(name) for name in ("documents", "tokens", "text_bytes")}
        return {**totals, "seconds": self.seconds, "dtype": self.dtype,
                "main_cpu_seconds": self.main_cpu_seconds,
                "worker_cpu_seconds": self.worker_cpu_seconds,
                "replaced_workers": self.replaced_workers,
                "startup_cpu_seconds": self.startup_cpu_seconds,
                "worker_memory_mb": self.worker_memory_mb,
                "skipped": dict(self.skipped),
                "outputs": [{"prefix": o.prefix, "up_to_date": o.up_to_date,
                             "documents": o.documents, "tokens": o.tokens} for o in self.outputs]}


@dataclass
class _Job:
    prefix: str
    sources: list[InputFile]
    segments: list | None = None  # shares.Segment list: only these records (a preprocess_slurm task)


def plan_outputs(sources: list[InputFile], output_prefix: str | None,
                 output_dir: str | None) -> list[_Job]:
    """One merged output, or one per input named after the input file."""
    from data_pipeline.output_paths import check_output_prefix

    if (output_prefix is None) == (output_dir is None):
        raise PreprocessError("pass exactly one of --output-prefix (one merged output) or "
                              "--output-dir (one output per input)")
    if output_prefix is not None:
        check_output_prefix(output_prefix)
        return [_Job(output_prefix, sources)]
    jobs, seen = [], {}
    for source in sources:
        prefix = os.path.join(output_dir, _stem(source.path))
        if prefix in seen:
            raise PreprocessError(f"inputs {seen[prefix]!r} and {source.path!r} would both write "
                                  f"{prefix}.bin; rename one or use --output-prefix to merge them")
        seen[prefix] = source.path
        check_output_prefix(prefix)
        jobs.append(_Job(prefix, [source]))
    return jobs


def _stem(path: str) -> str:
    name = os.path.basename(path)
    for suffix in (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".parquet"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def _request(job: _Job, tokenizer, text_field: str, append_eod: bool, skip_bad: bool,
             max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> dict:
    """Everything the output bytes depend on; equal requests give equal bytes. The
    tokenizer counts by content, so another path to the same file is the same request.
    The document-size limit changes the bytes only when too-long documents are skipped
    (without --skip-bad-records one stops the run), so only then is it part of it."""
    request = {
        "tokenizer": dict(tokenizer.unique_identifiers),
        "text_field": text_field,
        "append_eod": append_eod,
        "skip_bad_records": skip_bad,
        "inputs": [{"path": os.path.abspath(s.path), "size": s.size, "mtime_ns": s.mtime_ns}
                   for s in job.sources],
    }
    if skip_bad and max_document_bytes != DEFAULT_MAX_DOCUMENT_BYTES:
        request["max_document_bytes"] = max_document_bytes
    if job.segments is not None:
        request["segments"] = [s.to_json() for s in job.segments]
    return request


def preprocess(inputs: list[str], *, tokenizer: str, output_prefix: str | None = None,
               output_dir: str | None = None, text_field: str = "text", append_eod: bool = False,
               workers: int | None = None, skip_bad_records: bool = False, overwrite: bool = False,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: bool = False,
               max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES, encoder: str = "auto",
               segments: list | None = None, console=None,
               worker_memory_mb: int | None = None) -> RunSummary:
    """Tokenise `inputs` into indexed dataset(s); see the module docstring.

    Every check that can fail fast (inputs, outputs, tokenizer, encoder) runs before
    any worker starts. `encoder`: auto, reference or gigatoken (fast_encoders; the
    output bytes are the same with either). Raises InputError, OutputError,
    TokenizerLoadError (EncoderUnavailable) or PreprocessError naming the problem.
    `segments` (shares.Segment, indices into the resolved inputs; with output_prefix):
    tokenise only those records, as one task of preprocess_slurm does. `worker_memory_mb`:
    a worker whose memory grew by more is replaced after its chunk (workers.retire_after);
    None: DEFAULT_WORKER_MEMORY_MB for worker processes, DEFAULT_INLINE_MEMORY_MB where this
    process encodes.
    """
    from rich.console import Console

    from data_pipeline.fast_encoders import ENCODERS, choose_encoder, input_sample
    from data_pipeline.heap import return_freed_memory
    from data_pipeline.output_paths import output_exists, read_manifest, token_dtype
    from data_pipeline.progress import byte_progress
    from data_pipeline.workers import InlinePool, WorkerConfig, WorkerPool

    console = console or Console(stderr=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    children_start = _children_cpu()
    if workers is not None and workers < 0:
        raise PreprocessError(f"--workers must be >= 0 (0 or 1: tokenise in this process), got {workers}")
    if encoder not in ENCODERS:
        raise PreprocessError(f"--encoder must be one of {', '.join(ENCODERS)}, got {encoder!r}")
    if chunk_bytes < 1:
        raise PreprocessError(f"--chunk-bytes must be >= 1, got {chunk_bytes}")
    if max_document_bytes < 1:
        raise PreprocessError(f"--max-document-bytes must be >= 1, got {max_document_bytes}")
    if worker_memory_mb is not None and worker_memory_mb < 1:
        raise PreprocessError(f"--worker-memory-mb must be >= 1, got {worker_memory_mb}")
    sources = resolve_inputs(inputs)
    jobs = plan_outputs(sources, output_prefix, output_dir)
    if segments is not None:
        if output_prefix is None:
            raise PreprocessError("segments need --output-prefix (one output for the share)")
        jobs[0].segments = list(segments)
    tok = load_tokenizer(tokenizer)
    if append_eod and tok.eod is None:
        raise TokenizerLoadError(f"{tok.describe()} has no end-of-document token; "
                                 "drop --append-eod or use a tokenizer with an EOS token")
    for source in sources:
        check_readable(source, text_field)
    dtype = token_dtype(tok.vocab_size)

    # Outputs finished by an identical earlier run are skipped (stats stay in job order).
    stats = [OutputStats(job.prefix, up_to_date=True) for job in jobs]
    todo = []
    for index, job in enumerate(jobs):
        request = _request(job, tok, text_field, append_eod, skip_bad_records, max_document_bytes)
        manifest = read_manifest(job.prefix)
        if manifest is not None and manifest.get("request") == request:
            continue
        if output_exists(job.prefix) and not overwrite:
            raise PreprocessError(f"{job.prefix}.bin/.idx already exist (made by a different "
                                  "command or inputs); pass --overwrite to replace them")
        todo.append((index, job, request))

    if todo:
        # Compared on the first input's first 256 KiB too; logged, since it decides the speed.
        encoding, why = choose_encoder(tok, encoder, input_sample(todo[0][1].sources, text_field))
        console.print(why)
        if encoding is not tok:  # before workers fork: they would share its tables for nothing
            tok.release_tables()
            return_freed_memory()
        n_workers = _available_cpus() if workers is None else workers
        if worker_memory_mb is None:
            worker_memory_mb = (DEFAULT_WORKER_MEMORY_MB if n_workers > IN_PROCESS_WORKERS
                                else DEFAULT_INLINE_MEMORY_MB)
        config = WorkerConfig(text_field, dtype.__name__, tok.eod if append_eod else None,
                              skip_bad_records, max_document_bytes, worker_memory_mb << 20)
        pool = (WorkerPool(config, encoding, n_workers, chunk_bytes=chunk_bytes)
                if n_workers > IN_PROCESS_WORKERS else InlinePool(config, encoding))
        try:
            startup_cpu = time.process_time() - cpu_start
            with byte_progress(console, progress) as bar:
                total = sum(s.size for _, job, _ in todo for s in job.sources)
                task = bar.add_task("tokenising", total=total, text_bytes=0, documents=0, tokens=0)
                done: list[OutputStats] = []
                for index, job, request in todo:
                    stats[index] = _write_output(job, request, absolute_spec(tok.spec), dtype,
                                                 pool, chunk_bytes, bar, task, done)
                    done.append(stats[index])
        finally:
            pool.close()
        replaced = pool.replaced
    else:
        replaced, startup_cpu = 0, time.process_time() - cpu_start
    return RunSummary(stats, time.perf_counter() - start, dtype.__name__,
                      time.process_time() - cpu_start, _children_cpu() - children_start, replaced,
                      startup_cpu, worker_memory_mb)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # workers count once reaped
    return usage.ru_utime + usage.ru_stime


def _available_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _write_output(job: _Job, request: dict, tokenizer_spec: str, dtype, pool, chunk_bytes: int,
                  bar, task, earlier: list[OutputStats]) -> OutputStats:
    """Stream one output's inputs through the pool and commit it; nothing visible on error."""
    stats = OutputStats(job.prefix)
    try:
        return _stream_and_commit(job, request, tokenizer_spec, dtype, pool, chunk_bytes, bar, task, earlier,
                                  stats)
    except OSError as exc:  # ENOSPC, EFBIG (ulimit -f), EIO: AtomicIndexedDataset removed its temporaries
        from data_pipeline.checks import WorkFailed, describe_os_error

        raise WorkFailed(f"writing {job.prefix}.bin/.idx failed: {describe_os_error(exc)}; no output was "
                         "left that looks valid (temporary files removed)") from None


def _stream_and_commit(job: _Job, request: dict, tokenizer_spec: str, dtype, pool, chunk_bytes: int,
                       bar, task, earlier: list[OutputStats], stats: OutputStats) -> OutputStats:
    from data_pipeline.index_file import AtomicIndexedDataset

    with AtomicIndexedDataset(job.prefix, dtype) as out:
        pending, next_seq, submitted = {}, 0, 0
        # The number of the record after the last one written, per input: where a chunk
        # whose start the main process did not count (a plain .jsonl range) starts.
        next_record: dict[int, int] = {}
        if job.segments is None:
            chunks = iter_chunks(job.sources, chunk_bytes, request["text_field"])
        else:
            from data_pipeline.shares import iter_share_chunks

            chunks = iter_share_chunks(job.sources, job.segments, chunk_bytes, request["text_field"])
        exhausted = False
        while True:
            while not exhausted and submitted - next_seq < pool.max_inflight:
                chunk = next(chunks, None)
                if chunk is None:
                    exhausted = True
                else:
                    pool.submit(chunk)
                    submitted += 1
            if exhausted and next_seq == submitted:
                break
            result = pool.get()
            pending[result.seq] = result
            while next_seq in pending:  # write in input order, whatever order workers finish
                result = pending.pop(next_seq)
                first = (next_record.get(result.source, 1) if result.first_record is None
                         else result.first_record)
                next_record[result.source] = first + result.records
                _absorb(result, first, job, request, out, stats)
                next_seq += 1
                _advance(bar, task, stats, earlier)
        # A share of a preprocess_slurm run may hold only skipped records; the merge checks the total.
        if stats.documents == 0 and job.segments is None:
            raise PreprocessError(f"no documents for {job.prefix}: every record of "
                                  f"{', '.join(s.path for s in job.sources)} was skipped or empty")
        out.commit({"request": request, "tokenizer_spec": tokenizer_spec,
                    "documents": stats.documents, "tokens": stats.tokens,
                    "text_bytes": stats.text_bytes, "dtype": dtype.__name__,
                    "skipped": dict(stats.skipped)})
    return stats


def _absorb(result, first: int, job: _Job, request: dict, out, stats: OutputStats) -> None:
    """Check one chunk's result (stop or count bad records) and append its documents;
    `first`: the number of the chunk's first record in its input."""
    source = job.sources[result.source]
    where = "row" if source.kind == "parquet" else "line"
    if result.fatal:
        raise PreprocessError(f"{source.path}: {result.fatal}")
    if result.failed:
        lo, hi, detail = result.failed
        span = f"{where} {first + lo}" if lo == hi else f"{where}s {first + lo}-{first + hi}"
        raise PreprocessError(f"{source.path}: {span}: {detail}")
    for index, kind, detail in result.bad:
        message = f"{source.path} {where} {first + index}: {detail}"
        if not request["skip_bad_records"]:
            raise PreprocessError(f"{message}\n(fix the input, or pass --skip-bad-records to "
                                  "skip and count such records)")
        stats.skipped[kind] += 1
        if len(stats.examples) < MAX_EXAMPLES:
            stats.examples.append(message)
    if len(result.lengths):
        out.builder.add_documents(result.tokens, result.lengths)
    stats.documents += len(result.lengths)
    stats.tokens += int(result.lengths.sum())
    stats.text_bytes += result.text_bytes
    stats.disk_bytes += result.disk_bytes


def _advance(bar, task, stats: OutputStats, earlier: list[OutputStats]) -> None:
    runs = earlier + [stats]
    bar.update(task, completed=sum(s.disk_bytes for s in runs),
               text_bytes=sum(s.text_bytes for s in runs),
               documents=sum(s.documents for s in runs), tokens=sum(s.tokens for s in runs))


def print_summary(console, summary: RunSummary) -> None:
    from rich.table import Table

    from data_pipeline.progress import rates

    table = Table(title="preprocess summary", show_header=True)
    for column in ("output", "documents", "tokens", "text MB", "skipped"):
        table.add_column(column, justify="left" if column == "output" else "right")
    for o in summary.outputs:
        if o.up_to_date:
            table.add_row(o.prefix, "up to date", "", "", "")
        else:
            table.add_row(o.prefix, f"{o.documents:,}", f"{o.tokens:,}",
                          f"{o.text_bytes / 1e6:,.2f}", f"{sum(o.skipped.values()):,}")
    console.print(table)
    if all(o.up_to_date for o in summary.outputs):
        console.print("every output is up to date (made by this same command): nothing to do")
        return
    documents, tokens, text = (summary.total(n) for n in ("documents", "tokens", "text_bytes"))
    console.print(f"{documents:,} documents, {tokens:,} tokens ({summary.dtype}), "
                  f"{text / 1e6:,.2f} MB of text in {summary.seconds:.1f} s: "
                  f"{rates(text, documents, tokens, summary.seconds)} (CPU: "
                  f"{summary.main_cpu_seconds:.1f} s main, {summary.worker_cpu_seconds:.1f} s "
                  "workers)")
    if summary.replaced_workers:
        console.print(f"{summary.replaced_workers:,} times a worker outgrew --worker-memory-mb "
                      f"{summary.worker_memory_mb} and was replaced (gigatoken's cache of encoded "
                      "pieces only grows)")
    skipped = summary.skipped
    if skipped:
        kinds = ", ".join(f"{n:,} {kind}" for kind, n in sorted(skipped.items()))
        console.print(f"[yellow]skipped {sum(skipped.values()):,} bad records: {kinds}")
        for o in summary.outputs:
            for example in o.examples:
                console.print(f"  {example}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.preprocess",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", "-i", nargs="+", required=True, metavar="PATH_OR_GLOB",
                        help=".jsonl, .jsonl.gz or .parquet files or globs (quote globs)")
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--output-prefix", "-o", help="write one merged PREFIX.bin/.idx")
    out.add_argument("--output-dir", help="write DIR/<input name>.bin/.idx per input")
    parser.add_argument("--tokenizer", "-t", required=True,
                        help="SentencePiece .model, tokenizer.json (or its dir), tiktoken:PATH, byte")
    parser.add_argument("--text-field", default="text", help="JSON field / parquet column")
    parser.add_argument("--append-eod", action="store_true", help="end every document with EOD")
    parser.add_argument("--encoder", choices=("auto", "reference", "gigatoken"), default="auto",
                        help="auto (default): gigatoken where it gives the reference tokenizer's ids "
                             "(checked on probe strings and the input's first 256 KiB), else the reference")
    parser.add_argument("--workers", "-j", type=nonnegative_int, default=None,
                        help="CPU cores tokenising, with either encoder: N >= 2 worker processes, 0 or 1 "
                             "the main process itself (default: one per CPU)")
    parser.add_argument("--skip-bad-records", action="store_true",
                        help="skip and count bad records instead of stopping at the first")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace outputs made by a different command")
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                        help=argparse.SUPPRESS)
    parser.add_argument("--max-document-bytes", type=positive_int, default=DEFAULT_MAX_DOCUMENT_BYTES,
                        help="longer documents are bad records: tokenising one holds it whole, at many times "
                             f"its size in memory (default {DEFAULT_MAX_DOCUMENT_BYTES >> 20} MiB)")
    parser.add_argument("--worker-memory-mb", type=positive_int, default=None,
                        help="replace a worker once its memory has grown by this many MiB (gigatoken "
                             f"caches every piece it encodes; default {DEFAULT_WORKER_MEMORY_MB}; with "
                             "-j0/-j1 the encoder is reloaded instead, default "
                             f"{DEFAULT_INLINE_MEMORY_MB})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--summary-json", metavar="PATH",
                        help="also write the summary as JSON (for scripts and benchmarks)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from data_pipeline.checks import run_cli
    from data_pipeline.heap import keep_large_buffers_unmapped
    from data_pipeline.output_paths import OutputError

    args = build_parser().parse_args(argv)
    # Before the tokenizer loads: the heap workers fork with is then less holed (docs/benchmarks.md).
    keep_large_buffers_unmapped()
    console = Console(stderr=True)
    # Slurm preemption and `kill` send SIGTERM: unwind like Ctrl-C so temporaries go away.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def body() -> int:
        summary = preprocess(
            args.input, tokenizer=args.tokenizer, output_prefix=args.output_prefix,
            output_dir=args.output_dir, text_field=args.text_field, append_eod=args.append_eod,
            workers=args.workers, skip_bad_records=args.skip_bad_records,
            overwrite=args.overwrite, chunk_bytes=args.chunk_bytes,
            max_document_bytes=args.max_document_bytes, progress=not args.no_progress,
            encoder=args.encoder, console=console, worker_memory_mb=args.worker_memory_mb)
        print_summary(console, summary)
        if args.summary_json:
            with open(args.summary_json, "w", encoding="utf-8") as f:
                json.dump(summary.to_json(), f, indent=2)
        return 0

    return run_cli(body, bad_input=(InputError, OutputError, TokenizerLoadError, PreprocessError),
                   on_interrupt="interrupted: no output was written (temporary files removed)")


if __name__ == "__main__":
    sys.exit(main())

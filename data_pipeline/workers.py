"""Tokenising worker processes and the bounded, order-keeping pool the preprocessor drives.

On Linux, from a process with no other Python thread, workers are forked: they
start in milliseconds with the already-loaded tokenizer (as Megatron-LM's own
preprocessing pool does). Elsewhere they are spawned and load the tokenizer from
its spec (~0.5 s). Either way they die with their parent, so a SIGKILLed
preprocess leaves no orphan burning CPU.

Worker model: `--workers N` is N processes, each encoding on one thread, with either
encoder, for N >= 2; with 0 or 1 the main process encodes (InlinePool: see
preprocess.IN_PROCESS_WORKERS for why not one worker process). gigatoken could
instead spread one process's batches over Rust threads, but the JSON parsing and the
checks of every record are Python and would stay on one core in that process; as
processes they scale with the rest. gigatoken encodes one document per call, on the
calling thread, so its thread pool never starts (and a fork cannot inherit a pool
without its threads). The benchmark measures both (t2:gigatoken against
a2:gigatoken; docs/benchmarks.md).

Ids come back through shared memory where workers are forked (`TokenSlots`): a worker
writes a chunk's ids into the slot of that chunk and sends only their count and the
document lengths; the main process writes the output from the slot. Pickled through
the result queue, 114 MB of Llama-3 text's int32 ids cost ~0.25 CPU-s in the main
process and ~0.1 in the worker (copies into and out of the pipe); through the slots,
~0.06 and ~0.03 (docs/benchmarks.md).
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field, replace

import numpy as np

from data_pipeline.heap import keep_large_buffers_unmapped
from data_pipeline.processes import die_with_parent, get_unless_orphaned
from data_pipeline.sources import BadRecord, Chunk, FileRange, InputError, iter_records, text_utf8


@dataclass(frozen=True)
class WorkerConfig:
    text_field: str
    dtype: str  # numpy dtype name of the output tokens
    append_eod: int | None  # id appended to every document, or None
    skip_bad_records: bool
    # Longer documents are bad records (see preprocess.DEFAULT_MAX_DOCUMENT_BYTES).
    max_document_bytes: int = 1 << 62
    # A worker whose resident memory grew by more than this many bytes since it started is
    # replaced by a fresh one after its chunk (None: never): see `retire_after`.
    memory_growth_limit: int | None = None


@dataclass
class ChunkResult:
    seq: int
    source: int
    disk_bytes: int
    first_record: int | None = None  # the chunk's (None: after the previous chunk of its input)
    records: int = 0  # records (lines or rows) the chunk holds, good and bad
    tokens: np.ndarray | None = None
    lengths: np.ndarray | None = None
    text_bytes: int = 0
    # (index of the record in the chunk, kind, detail) of every bad record (all of them only
    # when skipping); the main process, which knows where the chunk starts, numbers them.
    bad: list[tuple[int, str, str]] = field(default_factory=list)
    # (first, last index, detail): the records a tokenizer failure is pinned to.
    failed: tuple[int, int, str] | None = None
    fatal: str | None = None  # an unexpected exception in the worker, with traceback
    # The ids are in the chunk's TokenSlots slot (this many), not in `tokens`, until the
    # pool's get() puts a view of the slot there.
    slot_tokens: int | None = None
    retired_pid: int | None = None  # the worker that made it has left the pool (see retire_after)


class TokenSlots:
    """Shared memory for the ids of the chunks in flight: chunk `seq` writes slot `seq %
    count`, which is free again once the main process has written chunk `seq` (it keeps at
    most `count` chunks in flight and writes them in order). Anonymous shared memory, so
    only forked workers see it; pages are allocated as they are first written, so a slot
    sized for the worst case costs what its largest chunk used. A chunk whose ids do not
    fit sends them through the queue."""

    def __init__(self, count: int, slot_bytes: int) -> None:
        self.count, self.slot_bytes = count, slot_bytes
        self._memory = mmap.mmap(-1, count * slot_bytes)  # MAP_SHARED | MAP_ANONYMOUS

    def view(self, seq: int, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        return np.frombuffer(self._memory, dtype=dtype, count=self.slot_bytes // dtype.itemsize,
                             offset=(seq % self.count) * self.slot_bytes)


def too_long(size: int, limit: int) -> str:
    return (f"document of {size:,} bytes exceeds --max-document-bytes {limit:,}: tokenising one document "
            "takes memory in proportion to its length (~45 bytes per byte with SentencePiece); split "
            "such documents, raise the limit, or pass --skip-bad-records")


def tokenize_chunk(chunk: Chunk, tokenizer, config: WorkerConfig,
                   slot: np.ndarray | None = None) -> ChunkResult:
    """Documents of one chunk as one token array plus per-document lengths. `tokenizer`
    is a data_pipeline.tokenizers Tokenizer or a fast_encoders.GigatokenEncoder: one
    `encode_documents` call per chunk, which writes the ids straight into the output dtype,
    into `slot` (the chunk's TokenSlots view) where they fit."""
    result = ChunkResult(chunk.seq, chunk.source, chunk.disk_bytes, chunk.first_record)
    if isinstance(chunk.payload, FileRange):  # read here, not piped from the main process
        try:
            chunk = replace(chunk, payload=chunk.payload.read())
        except InputError as err:
            result.fatal = str(err)  # the main process names the file
            return result
    texts, utf8, indices, text_bytes, index = [], [], [], 0, -1
    for index, text in iter_records(chunk, config.text_field):
        try:
            if isinstance(text, BadRecord):
                raise text
            data = text_utf8(text)
            size = len(text) if data is None else len(data)
            if size > config.max_document_bytes:
                raise BadRecord("document too long", too_long(size, config.max_document_bytes))
            text_bytes += size
        except BadRecord as bad:
            result.bad.append((index, bad.kind, bad.detail))
            if not config.skip_bad_records:
                break  # the run stops at this record; the rest of the chunk is never written
            continue
        texts.append(text)
        utf8.append(data)
        indices.append(index)
    result.records = index + 1
    try:
        # Straight into the output dtype, EOD included: one copy of the ids.
        tokens, lengths = tokenizer.encode_documents(texts, np.dtype(config.dtype), config.append_eod,
                                                     into=slot, utf8=utf8)
    except Exception:  # a tokenizer bug or limit: find and name the record that hit it
        result.failed = _failing_record(tokenizer, texts, indices)
        return result
    if slot is not None and np.may_share_memory(tokens, slot):
        result.slot_tokens = len(tokens)
    else:
        result.tokens = tokens
    result.lengths = lengths.astype(np.int32)
    result.text_bytes = text_bytes
    return result


def _failing_record(tokenizer, texts: list[str], indices: list[int]) -> tuple[int, int, str]:
    for index, text in zip(indices, texts, strict=True):
        try:
            tokenizer.encode_documents([text])
        except Exception as err:
            return index, index, f"the tokenizer failed: {type(err).__name__}: {err}"
    return indices[0], indices[-1], "the tokenizer failed on the chunk, not on one record"


def resident_bytes() -> int | None:
    """This process's resident memory (Linux), or None where /proc cannot say."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return None


def retire_after(config: WorkerConfig, baseline: int | None) -> bool:
    """Whether a worker that started at `baseline` resident bytes should now leave the pool.
    gigatoken keeps every piece it has encoded in a cache that never shrinks (Llama-3's
    tokenizer: +650 MB over 99 MB of distinct words; data_pipeline.benchmark --unique-words),
    so on an endless input a worker would grow without bound; its replacement starts from
    the tokenizer as loaded (forked again: milliseconds). Bounds any other growth too."""
    if config.memory_growth_limit is None or baseline is None:
        return False
    now = resident_bytes()
    return now is not None and now - baseline > config.memory_growth_limit


def worker_main(config: WorkerConfig, tokenizer, tasks, results, parent_pid: int,
                slots: TokenSlots | None = None) -> None:
    # Ctrl-C reaches the whole process group; the parent decides and stops us cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked worker inherits preprocess's SIGTERM-to-KeyboardInterrupt handler; the
    # parent's terminate() must simply end it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent()
    keep_large_buffers_unmapped()
    baseline = resident_bytes()
    while True:
        chunk = get_unless_orphaned(tasks, parent_pid)
        if chunk is None:
            return
        try:
            slot = None if slots is None else slots.view(chunk.seq, config.dtype)
            result = tokenize_chunk(chunk, tokenizer, config, slot)
        except Exception:
            result = ChunkResult(chunk.seq, chunk.source, 0, fatal=traceback.format_exc())
        if retire_after(config, baseline):
            result.retired_pid = os.getpid()
        results.put(result)  # flushed before the process exits
        if result.retired_pid is not None:
            return


class InlinePool:
    """The WorkerPool interface without processes (--workers 0 or 1): tokenises in the caller.
    For small corpora, debugging, and callers that should not spawn (training ranks)."""

    max_inflight = 1

    def __init__(self, config: WorkerConfig, tokenizer) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._done: list[ChunkResult] = []
        # Taken at the first chunk: what the caller allocates after making the pool (the
        # progress bar, the output's writer) is not the encoder's growth.
        self._baseline: int | None = None
        self.replaced = 0  # times the encoder was reloaded to empty its cache (retire_after)

    def submit(self, chunk: Chunk) -> None:
        if self._baseline is None:
            self._baseline = resident_bytes()
        self._done.append(tokenize_chunk(chunk, self._tokenizer, self._config))
        reset = getattr(self._tokenizer, "reset_cache", None)
        if reset is not None and retire_after(self._config, self._baseline):
            reset()  # no process to replace: the encoder is loaded afresh instead
            self.replaced += 1
            self._baseline = resident_bytes()

    def get(self) -> ChunkResult:
        return self._done.pop(0)

    def close(self) -> None:
        self._done.clear()


def default_start_method() -> str:
    # fork copies only the calling thread: with other Python threads alive it could copy a
    # held lock, so fork only when there are none (native library threads start lazily,
    # and the tokenizers' single-document encode calls never start any).
    if sys.platform.startswith("linux") and threading.active_count() == 1:
        return "fork"
    return "spawn"


class WorkerPool:
    """N worker processes; at most `max_inflight` chunks are queued, being tokenised or
    waiting to be written (the caller's loop keeps to it: chunk seq's TokenSlots slot is
    reused by chunk seq + max_inflight). `tokenizer` is inherited by forked workers and
    pickled (as its spec) to spawned ones. `chunk_bytes`: the chunks' size, which sizes
    the slots (a chunk of twice that at one id per byte fits)."""

    def __init__(self, config: WorkerConfig, tokenizer, workers: int,
                 max_inflight: int | None = None, start_method: str | None = None,
                 chunk_bytes: int = 1 << 20) -> None:
        method = start_method or default_start_method()
        ctx = mp.get_context(method)
        self.max_inflight = max_inflight or 3 * workers
        self._dtype = np.dtype(config.dtype)
        self._slots = (TokenSlots(self.max_inflight, 2 * chunk_bytes * self._dtype.itemsize)
                       if method == "fork" else None)
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._ctx, self._config, self._tokenizer = ctx, config, tokenizer
        self._procs: list = []
        self.replaced = 0  # workers that left after growing (retire_after) and were replaced
        for _ in range(workers):
            self._start_worker()

    def _start_worker(self) -> None:
        proc = self._ctx.Process(
            target=worker_main, name=f"preprocess-worker-{len(self._procs) + self.replaced}", daemon=True,
            args=(self._config, self._tokenizer, self._tasks, self._results, os.getpid(), self._slots))
        proc.start()
        self._procs.append(proc)

    def _replace(self, pid: int) -> None:
        """A worker that retired after its last chunk (which the caller has): reap it, start
        another. It exits right after putting that result, so the join is short."""
        for proc in self._procs:
            if proc.pid == pid:
                proc.join(timeout=30)
                if proc.exitcode is None:
                    proc.terminate()
                    proc.join(timeout=5)
                self._procs.remove(proc)
                break
        self.replaced += 1
        self._start_worker()

    def submit(self, chunk: Chunk) -> None:
        self._tasks.put(chunk)

    def get(self) -> ChunkResult:
        """The next finished chunk (any order; check `.fatal`); raises if a worker died."""
        while True:
            try:
                result = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self._procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(
                        f"preprocess worker {dead[0].name} died (exit code {dead[0].exitcode}): "
                        "killed, out of memory, or failed to start (its traceback, if any, is "
                        "above; spawned workers cannot start from a script read from stdin)")
                continue
            if result.retired_pid is not None:
                self._replace(result.retired_pid)
            if result.slot_tokens is not None:
                result.tokens = self._slots.view(result.seq, self._dtype)[:result.slot_tokens]
            return result

    def close(self) -> None:
        """Stop every worker and reap them; the same on success, error or Ctrl-C, since a
        worker holds no state worth flushing."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(timeout=5)
        # Queued chunks may still sit in the feeder threads; don't block exit on them.
        self._tasks.cancel_join_thread()
        self._results.cancel_join_thread()
        self._tasks.close()
        self._results.close()

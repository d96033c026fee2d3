"""Bounded memory with gigatoken, whose cache of encoded pieces only grows: a worker that
grew past --worker-memory-mb is replaced after its chunk (with -j0 the encoder is reloaded),
and the output bytes do not change."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.preprocess import preprocess
from tests.data_pipeline.conftest import write_jsonl


def _results(pool, chunks) -> list:
    """Every chunk through `pool`, at most its max_inflight at a time (as preprocess keeps
    it: a slot is reused by the chunk max_inflight later), in input order."""
    results = []
    for start in range(0, len(chunks), pool.max_inflight):
        batch = chunks[start:start + pool.max_inflight]
        for chunk in batch:
            pool.submit(chunk)
        for _ in batch:
            result = pool.get()
            result.tokens = result.tokens.copy()  # a view of a slot the next chunks reuse
            results.append(result)
    return sorted(results, key=lambda r: r.seq)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_every_worker_retiring_after_each_chunk_changes_no_id(tmp_path, texts, start_method):
    """A growth limit of -1 byte retires every worker after every chunk: each chunk is
    tokenised by a fresh worker, and the ids are those of an inline run."""
    from data_pipeline.fast_encoders import GigatokenEncoder
    from data_pipeline.sources import iter_chunks, resolve_inputs
    from data_pipeline.tokenizers import load_tokenizer
    from data_pipeline.workers import InlinePool, WorkerConfig, WorkerPool

    encoder = GigatokenEncoder(load_tokenizer("data_pipeline/assets/demo_sp.model"))
    # Spawned replacements load the tokenizer afresh (~1 s each): fewer chunks.
    path = write_jsonl(tmp_path / "a.jsonl", texts[:60] if start_method == "fork" else texts[:12])
    chunks = list(iter_chunks(resolve_inputs([path]), 4096, "text"))
    assert len(chunks) > 2
    config = WorkerConfig("text", "uint16", encoder.reference.eod, False, memory_growth_limit=-1)
    pool = WorkerPool(config, encoder, 2, max_inflight=3, start_method=start_method, chunk_bytes=4096)
    try:
        results = _results(pool, chunks)
    finally:
        pool.close()
    inline_pool = InlinePool(config, encoder)
    inline = _results(inline_pool, chunks)
    assert pool.replaced == len(chunks) and all(r.retired_pid is not None for r in results)
    # Inline, the encoder is reloaded instead (the process may also shrink: not every time).
    assert inline_pool.replaced > len(chunks) // 2
    for ours, want in zip(results, inline, strict=True):
        assert np.array_equal(ours.tokens, want.tokens) and np.array_equal(ours.lengths, want.lengths)


def test_workers_grown_by_distinct_words_are_replaced_and_the_bytes_stay(tmp_path, llama3_model):
    """Real growth: 3 MB of random distinct words grow Llama-3's gigatoken cache by ~20 MB,
    past small limits, in both workers and with -j0; the output equals an unlimited run's."""
    from data_pipeline.benchmark import unique_words

    corpus = unique_words(str(tmp_path), 3)
    spec = "tiktoken:" + llama3_model
    outputs, replaced = {}, {}
    for name, workers, limit in (("unlimited", 2, 1 << 20), ("j2", 2, 4), ("j0", 0, 12)):
        prefix = str(tmp_path / name)
        summary = preprocess([corpus], tokenizer=spec, output_prefix=prefix, append_eod=True,
                             workers=workers, encoder="gigatoken", worker_memory_mb=limit,
                             chunk_bytes=1 << 18)
        outputs[name] = [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]
        replaced[name] = summary.replaced_workers
    assert replaced["unlimited"] == 0 and replaced["j2"] >= 2 and replaced["j0"] >= 1, replaced
    assert outputs["j2"] == outputs["unlimited"] == outputs["j0"]


def test_inline_growth_is_counted_from_the_first_chunk(tmp_path, texts):
    """preprocess makes its pool, then imports megatron.core for the writer (~300 MB): with
    -j0/-j1 that is not the encoder's growth, so the in-process encoder is not reloaded for it
    (it was, once per run, before the baseline moved to the first chunk)."""
    from data_pipeline.fast_encoders import GigatokenEncoder
    from data_pipeline.sources import iter_chunks, resolve_inputs
    from data_pipeline.tokenizers import load_tokenizer
    from data_pipeline.workers import InlinePool, WorkerConfig

    encoder = GigatokenEncoder(load_tokenizer("data_pipeline/assets/demo_sp.model"))
    chunks = list(iter_chunks(resolve_inputs([write_jsonl(tmp_path / "a.jsonl", texts[:20])]), 4096, "text"))
    config = WorkerConfig("text", "uint16", None, False, memory_growth_limit=64 << 20)
    pool = InlinePool(config, encoder)
    loaded_after_the_pool = np.ones(128 << 20, np.uint8)  # touched: resident
    results = _results(pool, chunks)
    assert pool.replaced == 0 and len(results) == len(chunks) and loaded_after_the_pool[-1] == 1


def test_the_limit_must_be_positive(tmp_path, corpus):
    from data_pipeline.preprocess import PreprocessError

    with pytest.raises(PreprocessError, match="--worker-memory-mb must be >= 1"):
        preprocess([corpus], tokenizer="byte", output_prefix=str(tmp_path / "o"), worker_memory_mb=0)


def test_freed_heap_pages_go_back_to_the_system():
    """return_freed_memory (called after every gigatoken load): 96 MB of freed 4 KiB blocks
    below a live one stay resident until it runs (glibc trims only the heap's top)."""
    import subprocess
    import sys

    script = """
from data_pipeline.heap import return_freed_memory
from data_pipeline.workers import resident_bytes
blocks = [bytes(4000) for _ in range(24_000)]  # malloc'd (> 512 bytes), below mmap's threshold
pin = bytes(4000)  # keeps the heap's top in use, so free() alone cannot shrink it
del blocks
before = resident_bytes()
trimmed = return_freed_memory()
print(trimmed, before - resident_bytes())
"""
    if not sys.platform.startswith("linux"):
        pytest.skip("malloc_trim is glibc's")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    trimmed, released = out.split()
    assert trimmed == "True"
    assert int(released) > 80e6, f"only {int(released) / 1e6:.1f} MB went back"


@pytest.mark.parametrize("pinned", [False, True])
def test_freed_long_document_buffers_go_back_with_the_mmap_threshold_pinned(pinned):
    """keep_large_buffers_unmapped (preprocess's CLI, every worker): once one 16 MiB block has
    been freed, glibc serves 6 MiB buffers (a long document, its ids) from the heap and keeps
    them resident after free; with the threshold pinned (at 4 MiB) they are unmapped on free."""
    import subprocess
    import sys

    script = f"""
from data_pipeline.heap import keep_large_buffers_unmapped
from data_pipeline.workers import resident_bytes
print({pinned} and keep_large_buffers_unmapped())
big = bytearray(16 << 20); big[::4096] = b"x" * len(big[::4096]); del big  # raises the threshold
pin = bytes(4000)
buffers = [bytearray(b"y" * (6 << 20)) for _ in range(4)]
pin2 = bytes(4000)  # in use above them: free() alone cannot shrink the heap's top
before = resident_bytes()
del buffers
print(before - resident_bytes())
"""
    if not sys.platform.startswith("linux"):
        pytest.skip("mallopt is glibc's")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    applied, released = out.split()
    assert applied == str(pinned)
    if pinned:
        assert int(released) > 20e6, f"only {int(released) / 1e6:.1f} MB of 25 went back"
    else:  # the glibc behaviour the pin is for (if this fails, glibc changed: README, workers)
        assert int(released) < 5e6, f"{int(released) / 1e6:.1f} MB went back without the pin"


def test_the_default_limit_depends_on_who_encodes(tmp_path, corpus):
    """Worker processes are replaced by a fork (cheap): 64 MiB by default. Where the main
    process encodes (-j0/-j1), a replacement reloads the encoder: 256. Given, it is used."""
    from data_pipeline.preprocess import DEFAULT_INLINE_MEMORY_MB, DEFAULT_WORKER_MEMORY_MB

    assert (DEFAULT_WORKER_MEMORY_MB, DEFAULT_INLINE_MEMORY_MB) == (64, 256)
    used = {}
    for name, workers, limit in (("j0", 0, None), ("j1", 1, None), ("j2", 2, None), ("given", 2, 100)):
        summary = preprocess([corpus], tokenizer="byte", output_prefix=str(tmp_path / name),
                             workers=workers, worker_memory_mb=limit)
        used[name] = summary.worker_memory_mb
        assert summary.to_json()["worker_memory_mb"] == used[name]
    assert used == {"j0": 256, "j1": 256, "j2": 64, "given": 100}

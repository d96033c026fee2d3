"""The benchmark's measuring pieces on a small corpus (the full run is documented in the
module and takes minutes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipeline.benchmark import ONE_WORKER_PROCESS, TreeMemorySampler, run_preprocess, tokenizer_alone
from tests.data_pipeline.conftest import write_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_tokenizer_alone_counts_every_byte_and_token(tmp_path, texts):
    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:20])
    one = tokenizer_alone("byte", corpus, 1)
    two = tokenizer_alone("byte", corpus, 2)
    size = sum(len(t.encode()) for t in texts[:20])
    assert one["text_bytes"] == one["tokens"] == size  # byte tokenizer: one id per byte
    assert two["text_bytes"] == 2 * size and two["seconds"] > 0 and two["cpu_seconds"] > 0
    # The load is part of the CPU the run counts, never more than it.
    assert 0 <= one["startup_cpu_seconds"] <= one["cpu_seconds"]


_SAMPLE_TWICE = """
import os, time
from data_pipeline.benchmark import TreeMemorySampler

def peak(allocate_mb):
    sampler = TreeMemorySampler(os.getpid(), interval=0.01)
    block = bytearray(allocate_mb << 20)
    block[::4096] = b"x" * len(block[::4096])  # touched: resident
    time.sleep(0.1)
    value = sampler.stop()
    del block
    return value

print(peak(0), peak(64))
"""


def test_memory_sampler_sees_an_allocation_in_a_process():
    # In a process of its own: the sampler sums the whole tree, and pytest's tree is not still
    # (the suite installs vLLM's environment from a child of pytest meanwhile; in CI its memory
    # moved the sum by 166 MB between the two samples).
    out = subprocess.run([sys.executable, "-c", _SAMPLE_TWICE], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    baseline, grown = map(int, out.split())
    # The 64 MiB block shows up in full (its pages are private: PSS = RSS), no more.
    assert 60 << 20 <= grown - baseline <= 72 << 20, (baseline, grown)


@pytest.mark.slow
def test_run_preprocess_reports_time_cpu_and_memory(tmp_path, texts):
    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:50])
    # -j1 with a worker process (b1): -j1 itself runs in one process (preprocess.IN_PROCESS_WORKERS)
    run = run_preprocess("byte", corpus, ONE_WORKER_PROCESS, str(tmp_path), sample_memory=True,
                         sample_interval=0.01)  # the whole CLI takes ~0.2 s
    assert run["text_bytes"] == sum(len(t.encode()) for t in texts[:50])
    assert 0 < run["seconds"] < run["cli_wall_seconds"]
    assert run["cpu_seconds"] > run["worker_cpu_seconds"] > 0
    # Start-up (checks, load, worker start) is the main process's, before any document.
    assert 0 < run["startup_cpu_seconds"] < run["main_cpu_seconds"]
    # The sampled peak of the tree (PSS of the CLI + its forked worker): at least two
    # interpreters with NumPy (34-37 MB here), at most the two processes' worth of the kernel's
    # own count of the largest process (ru_maxrss from wait4, RSS: shared library pages in
    # full). That count is no lower bound: it holds the forking process's RSS before the
    # exec (545 MB inside this test suite, 45 MB from a small parent).
    assert 20e6 <= run["peak_rss"] <= 2.1 * run["kernel_max_rss"], run


def test_repeated_corpus_is_the_corpus_n_times_and_reused(tmp_path, texts):
    from data_pipeline.benchmark import repeated

    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:5])
    assert repeated(str(corpus), 1) == str(corpus)
    three = repeated(str(corpus), 3)
    data = open(corpus, "rb").read()
    assert open(three, "rb").read() == data * 3 and not os.path.exists(three + ".partial")
    mtime = os.stat(three).st_mtime_ns
    assert repeated(str(corpus), 3) == three and os.stat(three).st_mtime_ns == mtime


def test_gigatoken_reading_the_jsonl_itself_counts_the_same_tokens(tmp_path, texts):
    """The benchmark's f:gigatoken run (gigatoken's own .jsonl reader) against its
    in-memory run: the same documents, the same ids (short documents: no cuts)."""
    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:30])
    spec = "data_pipeline/assets/demo_sp.model"
    in_memory = tokenizer_alone(spec, corpus, 1, "gigatoken")
    from_file = tokenizer_alone(spec, corpus, 1, "jsonl")
    assert from_file["tokens"] == in_memory["tokens"] > 0
    assert from_file["text_bytes"] == in_memory["text_bytes"] == sum(len(t.encode()) for t in texts[:30])


@pytest.mark.slow
def test_peak_memory_runs_another_checkouts_preprocess(tmp_path, texts):
    """--rss-baseline: the other checkout's own preprocess runs (from its tree, with no
    --encoder, which trees before gigatoken lack), beside this tree's with each encoder."""
    import shutil

    from data_pipeline.benchmark import REPO, peak_memory

    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:20])
    other = tmp_path / "other"
    shutil.copytree(os.path.join(REPO, "data_pipeline"), other / "data_pipeline",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # Marks the copy: a run from REPO's tree would not leave the file.
    with open(other / "data_pipeline" / "__init__.py", "a", encoding="utf-8") as f:
        f.write(f"\nopen({str(tmp_path / 'ran-from-copy')!r}, 'w').close()\n")
    # gigatoken encodes it; given relative to this process's directory, where `other` has none
    shutil.copy(os.path.join(REPO, "data_pipeline", "assets", "demo_sp.model"), tmp_path / "tok.model")
    spec = os.path.relpath(tmp_path / "tok.model")
    result = peak_memory(spec, corpus, str(tmp_path), (1,), repeats=1, baseline=str(other),
                         sample_interval=0.01)  # each run takes ~0.3 s
    assert set(result) == {"-j1 --encoder reference", "-j1 --encoder gigatoken", f"-j1 at {other}"}
    assert (tmp_path / "ran-from-copy").exists()
    size = sum(len(t.encode()) for t in texts[:20]) / 1e6
    for row in result.values():
        assert row["text_mb"] == pytest.approx(size) and row["peak_mb"] > 10
        assert len(row["all_peak_mb"]) == 1


@pytest.mark.slow
def test_peak_memory_at_each_worker_memory_limit(tmp_path):
    """--rss-worker-memory-mb: gigatoken's runs at each limit report the workers replaced (a
    1 MiB limit on random distinct words, whose every word grows gigatoken's cache, replaces
    them; 1 TiB never does) and the MB per CPU-second beside the peak."""
    from data_pipeline.benchmark import REPO, peak_memory, unique_words

    corpus = unique_words(str(tmp_path), 2)
    spec = os.path.join(REPO, "data_pipeline", "assets", "demo_sp.model")
    result = peak_memory(spec, corpus, str(tmp_path), (2,), worker_memory=(1, 1 << 20), sample_interval=0.01)
    low, high = (result[f"-j2 --encoder gigatoken --worker-memory-mb {n}"] for n in (1, 1 << 20))
    assert low["replaced_workers"] >= 1 and high["replaced_workers"] == 0, result
    assert set(result) == {"-j2 --encoder reference", "-j2 --encoder gigatoken",
                           "-j2 --encoder gigatoken --worker-memory-mb 1",
                           f"-j2 --encoder gigatoken --worker-memory-mb {1 << 20}"}
    for row in result.values():
        assert 2 <= row["text_mb"] < 2.1 and row["mb_per_cpu_s"] > 0


def test_rss_unique_words_runs_the_peak_memory_runs_on_distinct_words(tmp_path, texts):
    """--rss-unique-words MB: the peak-memory runs read MB of random distinct words, not the
    corpus the timed runs read."""
    from data_pipeline import benchmark as bench

    write_jsonl(bench.corpus_path(str(tmp_path)), texts[:20])  # the timed runs' corpus, present
    spec = os.path.join(bench.REPO, "data_pipeline", "assets", "demo_sp.model")
    result = bench.benchmark(spec, str(tmp_path), 1, 0, keys=["a:reference"], rss_workers=(1,),
                             rss_unique_mb=1)
    assert result["rss_corpus"] == bench.unique_words(str(tmp_path), 1)
    assert set(result["rss"]) == {"-j1 --encoder reference", "-j1 --encoder gigatoken"}
    for row in result["rss"].values():
        assert 1 <= row["text_mb"] < 1.1, row
    assert result["text_mb"] < 0.1  # the timed run read the corpus

"""The benchmark's measuring pieces on a small corpus (the full run is documented in the
module and takes minutes)."""

from __future__ import annotations

import os

import pytest

from data_pipeline.benchmark import TreeMemorySampler, run_preprocess, tokenizer_alone
from tests.data_pipeline.conftest import write_jsonl


def test_tokenizer_alone_counts_every_byte_and_token(tmp_path, texts):
    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:20])
    one = tokenizer_alone("byte", corpus, 1)
    two = tokenizer_alone("byte", corpus, 2)
    size = sum(len(t.encode()) for t in texts[:20])
    assert one["text_bytes"] == one["tokens"] == size  # byte tokenizer: one id per byte
    assert two["text_bytes"] == 2 * size and two["seconds"] > 0 and two["cpu_seconds"] > 0


def test_memory_sampler_sees_this_process():
    sampler = TreeMemorySampler(os.getpid(), interval=0.01)
    block = bytearray(50 << 20)  # touched: resident
    block[::4096] = b"x" * len(block[::4096])
    import time

    time.sleep(0.1)
    assert sampler.stop() > 50e6


@pytest.mark.slow
def test_run_preprocess_reports_time_cpu_and_memory(tmp_path, texts):
    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:50])
    run = run_preprocess("byte", corpus, 1, str(tmp_path), sample_memory=True)
    assert run["text_bytes"] == sum(len(t.encode()) for t in texts[:50])
    assert 0 < run["seconds"] < run["cli_wall_seconds"] and run["peak_rss"] > 50e6
    assert run["cpu_seconds"] > run["worker_cpu_seconds"] > 0


def test_repeated_corpus_is_the_corpus_n_times_and_reused(tmp_path, texts):
    from data_pipeline.benchmark import repeated

    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:5])
    assert repeated(str(corpus), 1) == str(corpus)
    three = repeated(str(corpus), 3)
    data = open(corpus, "rb").read()
    assert open(three, "rb").read() == data * 3 and not os.path.exists(three + ".partial")
    mtime = os.stat(three).st_mtime_ns
    assert repeated(str(corpus), 3) == three and os.stat(three).st_mtime_ns == mtime

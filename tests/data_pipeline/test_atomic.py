"""Atomic, resumable output: a SIGKILL, an error during commit or Ctrl-C never leaves a
valid-looking .bin/.idx, and re-running the same command gives the same bytes."""

from __future__ import annotations

import filecmp
import os
import signal
import time

import psutil
import pytest

from data_pipeline import index_file
from data_pipeline.checks import WorkFailed
from data_pipeline.index_file import AtomicIndexedDataset
from data_pipeline.output_paths import OutputError
from data_pipeline.preprocess import preprocess
from tests.data_pipeline.conftest import kjv_texts, output_files, read_documents, write_jsonl
from tests.distributed import ModuleProcess, run_module

DEMO = "data_pipeline/assets/demo_sp.model"


def looks_valid(prefix: str) -> bool:
    return os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin")


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_gives_identical_bytes(tmp_path):
    corpus = write_jsonl(tmp_path / "kjv.jsonl", kjv_texts())  # 4.3 MB: ~1 s of work, 2 workers
    (tmp_path / "out").mkdir()
    prefix = str(tmp_path / "out" / "kjv")
    command = ["-i", corpus, "-o", prefix,
               "-t", DEMO, "--append-eod", "-j", "2", "--chunk-bytes", "65536", "--no-progress"]
    proc = ModuleProcess("data_pipeline.preprocess", command)  # forked, its imports done
    partial = prefix + ".bin.partial"
    deadline = time.time() + 120
    while not (os.path.exists(partial) and os.path.getsize(partial) > 200_000):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "preprocess never started writing"
        time.sleep(0.02)
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert workers, "expected a worker process"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, "workers outlived their killed parent"
    assert not looks_valid(prefix)  # only *.partial (and the lock file) remain
    assert os.path.exists(partial)

    rerun = run_module("data_pipeline.preprocess", command, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["kjv.bin", "kjv.idx", "kjv.meta.json"]

    preprocess([corpus], tokenizer=DEMO, output_prefix=str(tmp_path / "reference"),
               append_eod=True, workers=2)
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(prefix + ext, str(tmp_path / "reference") + ext, shallow=False)


def test_crash_between_renames_leaves_nothing_valid(tmp_path, monkeypatch, texts):
    corpus = write_jsonl(tmp_path / "in.jsonl", texts[:20])
    prefix = str(tmp_path / "x")
    preprocess([corpus], tokenizer="byte", output_prefix=prefix, workers=0)
    old_bin = open(prefix + ".bin", "rb").read()
    real_replace, calls = os.replace, []

    def crash_on_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("simulated crash during commit")
        real_replace(src, dst)

    corpus2 = write_jsonl(tmp_path / "in.jsonl", texts[20:30])  # new content, same path
    monkeypatch.setattr(index_file.os, "replace", crash_on_second_rename)
    with pytest.raises(WorkFailed, match="simulated crash"):
        preprocess([corpus2], tokenizer="byte", output_prefix=prefix, workers=0, overwrite=True)
    monkeypatch.setattr(index_file.os, "replace", real_replace)
    # The new .bin landed but the old .idx was removed first: no mismatched valid pair.
    assert not os.path.exists(prefix + ".idx")
    assert open(prefix + ".bin", "rb").read() != old_bin
    preprocess([corpus2], tokenizer="byte", output_prefix=prefix, workers=0, overwrite=True)
    assert len(read_documents(prefix)) == 10


def test_interrupt_removes_temporaries(tmp_path, monkeypatch, texts):
    corpus = write_jsonl(tmp_path / "in.jsonl", texts)
    (tmp_path / "out").mkdir()
    real_add = index_file.CompactIndexedDatasetBuilder.add_documents
    calls = []

    def interrupt_later(self, tokens, lengths):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_add(self, tokens, lengths)

    monkeypatch.setattr(index_file.CompactIndexedDatasetBuilder, "add_documents",
                        interrupt_later)
    with pytest.raises(KeyboardInterrupt):
        preprocess([corpus], tokenizer="byte", output_prefix=str(tmp_path / "out" / "x"),
                   workers=2, chunk_bytes=8192)
    assert output_files(tmp_path / "out") == []


def test_second_writer_of_a_prefix_is_refused(tmp_path):
    import numpy as np

    prefix = str(tmp_path / "x")
    with AtomicIndexedDataset(prefix, np.uint16):
        with pytest.raises(OutputError, match="another process is writing"):
            with AtomicIndexedDataset(prefix, np.uint16):
                pass
    assert output_files(tmp_path) == []

"""preprocess: exact round trips through Megatron's reader, identical bytes whatever the
input format, worker count or chunking, per-input outputs, re-runs, and the CLI."""

from __future__ import annotations

import filecmp
import gzip
import json

import numpy as np
import pytest

from data_pipeline.preprocess import PreprocessError, main, preprocess
from tests.data_pipeline.conftest import read_documents, write_jsonl, write_parquet

DEMO = "data_pipeline/assets/demo_sp.model"


def same_bytes(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + ext, b + ext, shallow=False) for ext in (".bin", ".idx"))


def test_round_trip_reproduces_every_documents_ids(tmp_path, corpus, texts, demo_tokenizer):
    summary = preprocess([corpus], tokenizer=DEMO, output_prefix=str(tmp_path / "kjv"),
                         append_eod=True, workers=2, chunk_bytes=64 << 10)
    docs = read_documents(str(tmp_path / "kjv"))
    assert len(docs) == len(texts) == summary.total("documents")
    for text, ids in zip(texts, docs, strict=True):
        assert ids.dtype == np.uint16  # vocab 4000: Megatron's smallest sufficient dtype
        assert ids.tolist() == demo_tokenizer.encode(text) + [demo_tokenizer.eod]
        assert demo_tokenizer.decode(ids[:-1].tolist()) == text
    assert summary.total("tokens") == sum(len(d) for d in docs)
    assert summary.total("text_bytes") == sum(len(t.encode()) for t in texts)


def test_bytes_independent_of_format_workers_and_chunking(tmp_path, corpus, texts):
    gz = write_jsonl(tmp_path / "kjv.jsonl.gz", texts)
    parquet = write_parquet(tmp_path / "kjv.parquet", texts)
    runs = {
        "inline": dict(inputs=[corpus], workers=0),
        "one": dict(inputs=[corpus], workers=1, chunk_bytes=4096),
        "two": dict(inputs=[gz], workers=2, chunk_bytes=100_000),
        "parquet": dict(inputs=[parquet], workers=2, chunk_bytes=50_000),
    }
    for name, run in runs.items():
        preprocess(run.pop("inputs"), tokenizer=DEMO, output_prefix=str(tmp_path / name),
                   append_eod=True, **run)
    for name in runs:
        assert same_bytes(str(tmp_path / "inline"), str(tmp_path / name)), name


def test_one_worker_tokenises_in_this_process(tmp_path, corpus, monkeypatch):
    """--workers 1 starts no worker process (preprocess.IN_PROCESS_WORKERS); 2 do."""
    from data_pipeline import workers

    started = []
    real = workers.WorkerPool

    def counted(config, tokenizer, count, **kwargs):
        started.append(count)
        return real(config, tokenizer, count, **kwargs)

    monkeypatch.setattr(workers, "WorkerPool", counted)
    for count in (1, 2):
        summary = preprocess([corpus], tokenizer=DEMO, output_prefix=str(tmp_path / f"j{count}"), workers=count)
        assert (summary.worker_cpu_seconds > 0) == (count == 2)
    assert started == [2] and same_bytes(str(tmp_path / "j1"), str(tmp_path / "j2"))


def test_llama3_vocabulary_needs_int32(tmp_path, corpus, texts, llama3_model):
    spec = "tiktoken:" + llama3_model
    preprocess([corpus], tokenizer=spec, output_prefix=str(tmp_path / "l3"), workers=1)
    from data_pipeline.tokenizers import load_tokenizer

    tok = load_tokenizer(spec)
    docs = read_documents(str(tmp_path / "l3"))
    assert docs[0].dtype == np.int32
    assert [d.tolist() for d in docs[:30]] == [tok.encode(t) for t in texts[:30]]


def test_many_inputs_merge_in_order(tmp_path, texts):
    a = write_jsonl(tmp_path / "part-b.jsonl", texts[:30])
    b = write_jsonl(tmp_path / "part-a.jsonl.gz", texts[30:50])
    preprocess([a, b], tokenizer="byte", output_prefix=str(tmp_path / "merged"), workers=2)
    docs = read_documents(str(tmp_path / "merged"))
    assert [bytes(d.astype(np.uint8)).decode() for d in docs] == texts[:50]


def test_output_per_input_and_rerun_skips_finished_outputs(tmp_path, texts):
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    for i in range(3):
        write_jsonl(tmp_path / "in" / f"shard{i}.jsonl", texts[10 * i:10 * i + 10])
    args = dict(tokenizer="byte", output_dir=str(tmp_path / "out"), workers=1)
    first = preprocess([str(tmp_path / "in" / "*.jsonl")], **args)
    assert [o.documents for o in first.outputs] == [10, 10, 10]
    for i in range(3):
        docs = read_documents(str(tmp_path / "out" / f"shard{i}"))
        assert bytes(docs[0].astype(np.uint8)).decode() == texts[10 * i]
    manifest = json.loads((tmp_path / "out" / "shard0.meta.json").read_text())
    assert manifest["documents"] == 10 and manifest["request"]["tokenizer"]["kind"] == "byte"

    again = preprocess([str(tmp_path / "in" / "*.jsonl")], **args)
    assert all(o.up_to_date for o in again.outputs)

    write_jsonl(tmp_path / "in" / "shard1.jsonl", texts[:5])  # an input changed
    with pytest.raises(PreprocessError, match="shard1.bin/.idx already exist.*--overwrite"):
        preprocess([str(tmp_path / "in" / "*.jsonl")], **args)
    third = preprocess([str(tmp_path / "in" / "*.jsonl")], overwrite=True, **args)
    assert [o.up_to_date for o in third.outputs] == [True, False, True]
    assert len(read_documents(str(tmp_path / "out" / "shard1"))) == 5


def test_per_input_name_clash_is_refused(tmp_path, texts):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        write_jsonl(tmp_path / sub / "data.jsonl", texts[:2])
    with pytest.raises(PreprocessError, match="would both write"):
        preprocess([str(tmp_path / "a/data.jsonl"), str(tmp_path / "b/data.jsonl")],
                   tokenizer="byte", output_dir=str(tmp_path))


def test_cli_writes_and_reports(tmp_path, corpus, capsys):
    code = main(["--input", corpus, "--output-prefix", str(tmp_path / "cli"), "--tokenizer", DEMO,
                 "--append-eod", "--workers", "1", "--no-progress"])
    assert code == 0
    err = capsys.readouterr().err
    assert "120 documents" in err and "MB/s" in err and "tok/s" in err
    assert len(read_documents(str(tmp_path / "cli"))) == 120


@pytest.mark.parametrize("workers", ["0", "2"])
def test_preprocess_imports_neither_megatron_nor_torch(tmp_path, texts, workers):
    """A run writes its dataset without megatron.core's import (torch and the package's
    __init__: ~370 MB and 4.5-9 CPU-s, once most of preprocess's peak beside its workers;
    index_file), and a re-run of a finished command says "up to date" without it too."""
    import subprocess
    import sys

    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:5])
    argv = ["-i", corpus, "-o", str(tmp_path / "x"), "-t", DEMO, "--append-eod", "-j", workers, "--no-progress"]
    code = ("import sys, data_pipeline.preprocess as p; rc = p.main(sys.argv[1:]); "
            "print(rc, 'megatron.core' in sys.modules, 'torch' in sys.modules)")
    for run_again in (False, True):
        run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
        assert run.stdout.split()[-3:] == ["0", "False", "False"], (run.stdout, run.stderr)
        assert ("up to date" in run.stderr) == run_again, run.stderr
    from data_pipeline.tokenizers import load_tokenizer

    tok = load_tokenizer(DEMO)
    assert [d.tolist() for d in read_documents(str(tmp_path / "x"))] == [tok.encode(t) + [tok.eod] for t in texts[:5]]


def test_same_tokenizer_by_another_path_is_up_to_date(tmp_path, texts):
    import shutil

    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:5])
    shutil.copy(DEMO, tmp_path / "copy.model")
    preprocess([corpus], tokenizer=DEMO, output_prefix=str(tmp_path / "x"), workers=0)
    again = preprocess([corpus], tokenizer=str(tmp_path / "copy.model"),
                       output_prefix=str(tmp_path / "x"), workers=0)
    assert again.outputs[0].up_to_date
    manifest = json.loads((tmp_path / "x.meta.json").read_text())
    assert manifest["tokenizer_spec"].startswith("/") and manifest["tokenizer_spec"].endswith(DEMO)


def test_spawned_workers_write_the_same_bytes_as_forked_ones(tmp_path, corpus, monkeypatch):
    from data_pipeline import workers

    preprocess([corpus], tokenizer=DEMO, output_prefix=str(tmp_path / "forked"), workers=2)
    monkeypatch.setattr(workers, "default_start_method", lambda: "spawn")
    preprocess([corpus], tokenizer=DEMO, output_prefix=str(tmp_path / "spawned"), workers=2)
    assert same_bytes(str(tmp_path / "forked"), str(tmp_path / "spawned"))


def test_plain_jsonl_ranges_hold_whole_lines_and_notice_a_changed_file(tmp_path, texts):
    """A plain .jsonl's chunks are byte ranges the workers read (sources.FileRange), cut by
    seeking: end to end they are the file, each ends at the first newline from its
    chunk_bytes-th byte (lines longer than a chunk, an unterminated last line), and they hold
    the records the .gz reader reads, in order; a file changed under a range is named."""
    from data_pipeline.sources import FileRange, iter_chunks, iter_records, resolve_inputs
    from data_pipeline.workers import WorkerConfig, tokenize_chunk

    lines = [json.dumps({"text": t}) for t in texts[:40] + ["x" * 5000] + texts[40:60]]
    raw = ("\n".join(lines)).encode()  # no trailing newline
    plain, gz = tmp_path / "a.jsonl", tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(raw))
    gz_records = [text for c in iter_chunks(resolve_inputs([str(gz)]), 4096, "text")
                  for _, text in iter_records(c, "text")]
    assert len(gz_records) == len(lines)
    for ending in (b"", b"\n"):
        plain.write_bytes(raw + ending)
        for size in (1, 100, 4096, 1 << 20):
            ranges = list(iter_chunks(resolve_inputs([str(plain)]), size, "text"))
            assert all(isinstance(r.payload, FileRange) and r.first_record is None for r in ranges)
            data = [r.payload.read() for r in ranges]
            assert b"".join(data) == raw + ending
            assert [r.disk_bytes for r in ranges] == [len(d) for d in data]
            for d in data[:-1]:
                assert d.endswith(b"\n") and b"\n" not in d[size - 1:-1] and len(d) >= size
            assert ranges[-1].payload.ends_line == (ending == b"\n")
            if size == 1:
                assert len(ranges) == len(lines)  # one line each
            assert [text for r in ranges for _, text in iter_records(r, "text")] == gz_records
    first = list(iter_chunks(resolve_inputs([str(plain)]), 100, "text"))[0]  # ends with a newline
    plain.write_bytes(raw.replace(b"\n", b" ", 3))  # same size, lines moved
    result = tokenize_chunk(first, None, WorkerConfig("text", "uint16", None, False))
    assert result.fatal.startswith("changed while it was being read (bytes 0 to ")


def test_forked_workers_return_ids_through_shared_slots_or_the_queue(tmp_path, texts, demo_tokenizer):
    """Forked workers write a chunk's ids into its shared-memory slot (workers.TokenSlots);
    ids that do not fit (a 40,000-character document in 8 KiB chunks) come through the
    result queue. Either way they are the ids an inline run computes."""
    from data_pipeline.sources import iter_chunks, resolve_inputs
    from data_pipeline.workers import WorkerConfig, WorkerPool, tokenize_chunk

    path = write_jsonl(tmp_path / "a.jsonl", texts[:30] + ["x" * 40_000] + texts[30:40])
    chunks = list(iter_chunks(resolve_inputs([path]), 8192, "text"))
    config = WorkerConfig("text", "uint16", demo_tokenizer.eod, False)
    pool = WorkerPool(config, demo_tokenizer, 2, max_inflight=len(chunks), start_method="fork",
                      chunk_bytes=8192)
    try:
        for chunk in chunks:
            pool.submit(chunk)
        results = sorted((pool.get() for _ in chunks), key=lambda r: r.seq)
    finally:
        pool.close()
    assert [r.seq for r in results] == list(range(len(chunks)))
    for result, chunk in zip(results, chunks, strict=True):
        inline = tokenize_chunk(chunk, demo_tokenizer, config)
        assert result.tokens.dtype == np.uint16 and np.array_equal(result.tokens, inline.tokens)
        assert np.array_equal(result.lengths, inline.lengths)
    through_slots = [r.slot_tokens is not None for r in results]
    assert through_slots.count(False) == 1 and len(through_slots) > 3

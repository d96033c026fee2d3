"""Bad input: every case stops with a message naming file, line and problem (or is
counted with --skip-bad-records), and leaves no output, partial or complete. The CLI cases
at the end (tests/bad_input.py) also check exit status 2, one `error:` line, no traceback,
and that outputs already there are untouched."""

from __future__ import annotations

import gzip
import json

import pytest

from data_pipeline.output_paths import OutputError
from data_pipeline.preprocess import PreprocessError, preprocess
from data_pipeline.sources import InputError
from data_pipeline.tokenizers import TokenizerLoadError
from tests.bad_input import expect_refusal
from tests.data_pipeline.conftest import output_files, read_documents, write_parquet

GOOD = json.dumps({"text": "And God said, Let there be light: and there was light."})

# (line inserted as line 3 of a five-line file, problem category, message fragment)
BAD_LINES = {
    "malformed json": (b'{"text": "unterminated', "malformed JSON", "malformed JSON: Unterminated"),
    "not an object": (b'["text", "in a list"]', "malformed JSON", "expected an object, got list"),
    "blank line": (b"   ", "malformed JSON", "malformed JSON: blank line"),
    "missing field": (b'{"body": "no text field here"}', "missing text field",
                      "missing text field 'text' (fields present: body)"),
    "null field": (b'{"text": null}', "missing text field", "field 'text' is NoneType"),
    "invalid utf-8": (b'{"text": "caf\xe9 au lait"}', "invalid UTF-8", "invalid UTF-8 at byte 14"),
    "lone surrogate": (b'{"text": "broken \\ud800 pair"}', "invalid UTF-8", "lone surrogate"),
    "empty document": (b'{"text": ""}', "empty document", "empty document"),
    "whitespace document": (b'{"text": " \\n\\t "}', "empty document", "whitespace only"),
}


def bad_file(tmp_path, bad_line: bytes, name: str = "input.jsonl") -> str:
    path = tmp_path / name
    lines = [GOOD.encode()] * 2 + [bad_line] + [GOOD.encode()] * 2
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return str(path)


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_record_stops_naming_file_line_and_problem(tmp_path, case):
    bad_line, _, fragment = BAD_LINES[case]
    path = bad_file(tmp_path, bad_line)
    (tmp_path / "out").mkdir()
    with pytest.raises(PreprocessError) as err:
        preprocess([path], tokenizer="byte", output_prefix=str(tmp_path / "out" / "x"), workers=0)
    message = str(err.value)
    assert f"{path} line 3: " in message and fragment in message and "--skip-bad-records" in message
    assert output_files(tmp_path / "out") == []


def test_bad_record_through_worker_processes_and_gzip(tmp_path):
    path = bad_file(tmp_path, BAD_LINES["invalid utf-8"][0], "input.jsonl.gz")
    (tmp_path / "out").mkdir()
    with pytest.raises(PreprocessError, match=r"input.jsonl.gz line 3: invalid UTF-8"):
        preprocess([path], tokenizer="byte", output_prefix=str(tmp_path / "out" / "x"),
                   workers=2, chunk_bytes=64)
    assert output_files(tmp_path / "out") == []


def test_skip_bad_records_counts_and_reports(tmp_path):
    lines = [GOOD.encode()]
    for bad_line, _, _ in BAD_LINES.values():
        lines += [bad_line, GOOD.encode()]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    summary = preprocess([str(path)], tokenizer="byte", output_prefix=str(tmp_path / "x"),
                         workers=2, skip_bad_records=True)  # found by worker processes
    expected = {}
    for _, kind, _ in BAD_LINES.values():
        expected[kind] = expected.get(kind, 0) + 1
    assert dict(summary.skipped) == expected
    assert summary.total("documents") == len(BAD_LINES) + 1
    assert len(read_documents(str(tmp_path / "x"))) == len(BAD_LINES) + 1
    assert summary.outputs[0].examples[0].startswith(f"{path} line 2: malformed JSON")


def test_parquet_null_row_is_named(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", ["first document", "second", None, "fourth"],
                         row_group_size=2)
    with pytest.raises(PreprocessError, match=r"t.parquet row 3: missing text field \(null"):
        preprocess([path], tokenizer="byte", output_prefix=str(tmp_path / "x"), workers=0)
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.idx").exists()


def test_all_records_skipped_is_an_error_not_an_empty_dataset(tmp_path):
    path = bad_file(tmp_path, BAD_LINES["empty document"][0])
    path_all_bad = tmp_path / "all_bad.jsonl"
    path_all_bad.write_bytes(b'{"text": ""}\n{"x": 1}\n')
    with pytest.raises(PreprocessError, match="no documents for"):
        preprocess([str(path_all_bad)], tokenizer="byte", output_prefix=str(tmp_path / "x"),
                   workers=0, skip_bad_records=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["all_bad.jsonl", "input.jsonl"])
    assert path  # the one-bad-line file is untouched


@pytest.mark.parametrize("case,exc,fragment", [
    ("missing input", InputError, "input '{d}/nope.jsonl' not found"),
    ("glob matches nothing", InputError, "no file matches '{d}/*.parquet'"),
    ("unsupported type", InputError, "unsupported file type; supported: .jsonl"),
    ("output dir missing", OutputError, "output directory '{d}/no/such' does not exist"),
    ("tokenizer missing", TokenizerLoadError, "tokenizer '{d}/tok.model' not found"),
    ("tokenizer broken", TokenizerLoadError, "is not a SentencePiece model"),
    ("parquet column missing", InputError, "no column 'text' (columns: body)"),
    ("truncated gzip", InputError, "cannot read"),
])
def test_clear_errors_before_any_work(tmp_path, case, exc, fragment):
    good = tmp_path / "good.jsonl"
    good.write_text(GOOD + "\n")
    args = dict(inputs=[str(good)], tokenizer="byte", output_prefix=str(tmp_path / "out"))
    if case == "missing input":
        args["inputs"] = [str(tmp_path / "nope.jsonl")]
    elif case == "glob matches nothing":
        args["inputs"] = [str(tmp_path / "*.parquet")]
    elif case == "unsupported type":
        (tmp_path / "notes.csv").write_text("a,b\n")
        args["inputs"] = [str(tmp_path / "notes.csv")]
    elif case == "output dir missing":
        args["output_prefix"] = str(tmp_path / "no" / "such" / "out")
    elif case == "tokenizer missing":
        args["tokenizer"] = str(tmp_path / "tok.model")
    elif case == "tokenizer broken":
        (tmp_path / "tok.model").write_bytes(b"\x08\x01garbage")
        args["tokenizer"] = str(tmp_path / "tok.model")
    elif case == "parquet column missing":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
        args["inputs"] = [str(tmp_path / "t.parquet")]
    elif case == "truncated gzip":
        (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(GOOD.encode() * 50)[:20])
        args["inputs"] = [str(tmp_path / "t.jsonl.gz")]
    before = output_files(tmp_path)
    with pytest.raises(exc) as err:
        preprocess(args.pop("inputs"), workers=1, **args)
    assert fragment.format(d=tmp_path) in str(err.value)
    assert output_files(tmp_path) == before  # nothing written, not even a lock file


def test_append_eod_needs_an_eos_token(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json"))
    good = tmp_path / "good.jsonl"
    good.write_text(GOOD + "\n")
    with pytest.raises(TokenizerLoadError, match="no end-of-document token; drop --append-eod"):
        preprocess([str(good)], tokenizer=str(tmp_path), output_prefix=str(tmp_path / "x"),
                   append_eod=True)


def test_parquet_invalid_utf8_row_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = pa.py_buffer(bytes([0, 0, 0, 0, 2, 0, 0, 0, 4, 0, 0, 0, 7, 0, 0, 0]))
    column = pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(b"ok\xff\xfeabc")])
    pq.write_table(pa.table({"text": column}), tmp_path / "bad.parquet")
    with pytest.raises(PreprocessError, match=r"bad.parquet row 2: invalid UTF-8 at byte 1"):
        preprocess([str(tmp_path / "bad.parquet")], tokenizer="byte",
                   output_prefix=str(tmp_path / "x"), workers=0)
    summary = preprocess([str(tmp_path / "bad.parquet")], tokenizer="byte",
                         output_prefix=str(tmp_path / "x"), workers=0, skip_bad_records=True)
    assert summary.total("documents") == 2 and dict(summary.skipped) == {"invalid UTF-8": 1}


def test_gzip_truncated_mid_file_names_the_file(tmp_path):
    data = gzip.compress(("\n".join([GOOD] * 20000) + "\n").encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"cut.jsonl.gz: read failed \(Compressed file ended"):
        preprocess([str(path)], tokenizer="byte", output_prefix=str(tmp_path / "x"), workers=1,
                   chunk_bytes=4096)
    assert output_files(tmp_path) == ["cut.jsonl.gz"]


def test_tokenizer_failure_names_the_record(tmp_path, monkeypatch):
    from data_pipeline.tokenizers import ByteTokenizer

    real = ByteTokenizer.encode_array

    def fragile(self, text):
        if "boom" in text:
            raise ValueError("cannot encode this")
        return real(self, text)

    monkeypatch.setattr(ByteTokenizer, "encode_array", fragile)  # inherited by forked workers
    # Only a forked worker inherits the patch; preprocess would spawn instead when earlier
    # tests left threads in this process (it happened in full-suite runs).
    from data_pipeline import workers

    monkeypatch.setattr(workers, "default_start_method", lambda: "fork")
    path = bad_file(tmp_path, json.dumps({"text": "boom"}).encode())
    with pytest.raises(PreprocessError, match=r"input.jsonl: line 3: the tokenizer failed: "
                                              r"ValueError: cannot encode this"):
        preprocess([path], tokenizer="byte", output_prefix=str(tmp_path / "x"), workers=2)
    assert output_files(tmp_path) == ["input.jsonl"]


def test_lines_are_named_across_byte_range_chunks(tmp_path, monkeypatch):
    """A plain .jsonl's chunks are byte ranges whose lines the workers count, not the main
    process: bad records deep in the file, in chunks of a few lines over two workers, and a
    tokenizer failure are still named by their line in the file."""
    from data_pipeline import workers
    from data_pipeline.tokenizers import ByteTokenizer

    bad_at = [7, 58, 101, 200]
    lines = [BAD_LINES["malformed json"][0] if n in bad_at else GOOD.encode() for n in range(1, 201)]
    path = tmp_path / "long.jsonl"
    path.write_bytes(b"\n".join(lines))  # the last line (bad) unterminated
    run = dict(tokenizer="byte", output_prefix=str(tmp_path / "x"), workers=2, chunk_bytes=300)
    summary = preprocess([str(path)], skip_bad_records=True, **run)
    assert [e.split(": ")[0] for e in summary.outputs[0].examples] == [f"{path} line {n}" for n in bad_at]
    assert summary.total("documents") == 200 - len(bad_at)
    with pytest.raises(PreprocessError, match=f"{path} line 7: malformed JSON"):
        preprocess([str(path)], overwrite=True, **run)

    real = ByteTokenizer.encode_array
    monkeypatch.setattr(ByteTokenizer, "encode_array",  # inherited by forked workers
                        lambda self, text: real(self, text) if "boom" not in text else 1 / 0)
    monkeypatch.setattr(workers, "default_start_method", lambda: "fork")
    lines[150 - 1] = json.dumps({"text": "boom"}).encode()
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(PreprocessError, match=r"long.jsonl: line 150: the tokenizer failed: ZeroDivisionError"):
        preprocess([str(path)], skip_bad_records=True, overwrite=True, **run)


@pytest.mark.parametrize("line", [
    b'{"text": "plain", "meta": {"n": 1.5e300, "tags": [true, null]}}',
    '{"text": "caf\u00e9 \u2603 \U0001F600 tab\\t quote\\" slash\\/ \\u00e9"}'.encode(),
    b'{"text": "first", "text": "duplicate key: the last wins"}',
    b'\xef\xbb\xbf{"text": "after a byte-order mark"}',  # orjson refuses; json takes it
    b'{"text": "NaN elsewhere", "score": NaN}',  # likewise
    b'{"text": "big", "n": 123456789012345678901234567890}',
])
def test_fast_json_path_reads_what_the_json_module_reads(line):
    from data_pipeline.sources import parse_json_record

    assert parse_json_record(line, "text") == json.loads(line)["text"]


# --- the command lines (tests/bad_input.py) ----------------------------------------------------


@pytest.fixture(scope="module")
def made(module_tmp_factory):
    """A finished dataset (byte tokenizer) to damage copies of and to protect."""
    from data_pipeline.datasets import DEMO_CORPUS

    out = module_tmp_factory.mktemp("made")
    preprocess([DEMO_CORPUS], tokenizer="byte", output_prefix=str(out / "kjv"), workers=0)
    return out / "kjv"


def _copy(made, tmp_path, name: str = "d", cut: int = 0, extra: bytes = b"", idx_cut: int = 0) -> str:
    import shutil

    prefix = tmp_path / name
    data = (made.parent / "kjv.bin").read_bytes()
    (tmp_path / f"{name}.bin").write_bytes(data[: len(data) - cut] + extra)
    idx = (made.parent / "kjv.idx").read_bytes()
    (tmp_path / f"{name}.idx").write_bytes(idx[: len(idx) - idx_cut])
    shutil.copyfile(made.parent / "kjv.meta.json", tmp_path / f"{name}.meta.json")
    return str(prefix)


def _input(tmp_path, lines: list[bytes], name: str = "in.jsonl") -> str:
    (tmp_path / name).write_bytes(b"\n".join(lines) + b"\n")
    return str(tmp_path / name)


def _protected_output(tmp_path, made) -> str:
    """An output made by another command, which a refusal must leave byte for byte."""
    return _copy(made, tmp_path, "out")


P = ["--no-progress", "-t", "byte", "-j", "0"]
CLI_CASES = {  # name -> (module, arguments given tmp dir and the made dataset, fragments named)
    "inspect: .bin truncated": ("data_pipeline.inspect", lambda t, m: [_copy(m, t, cut=1000)],
                                ["d.bin", "truncated"]),
    "inspect: .bin with bytes appended": ("data_pipeline.inspect", lambda t, m: [_copy(m, t, extra=b"\0" * 8)],
                                          ["d.bin", "more than its index"]),
    "inspect: .idx truncated": ("data_pipeline.inspect", lambda t, m: [_copy(m, t, idx_cut=100)],
                                ["d.idx", "damaged"]),
    "inspect: no dataset": ("data_pipeline.inspect", lambda t, m: [t / "none"], ["none"]),
    "inspect: tokenizer missing": ("data_pipeline.inspect", lambda t, m: [_copy(m, t), "-t", t / "tok.model"],
                                   ["tok.model"]),
    "merge: an input truncated": ("data_pipeline.merge", lambda t, m: [
        "-i", _copy(m, t, "a"), _copy(m, t, "b", cut=64), "-o", t / "all", "--no-progress"], ["b.bin", "truncated"]),
    "merge: output exists": ("data_pipeline.merge", lambda t, m: [
        "-i", _copy(m, t, "a"), "-o", _protected_output(t, m), "--no-progress"], ["out", "--overwrite"]),
    "merge: output is an input": ("data_pipeline.merge", lambda t, m: [
        "-i", _copy(m, t, "a"), "-o", t / "a", "--no-progress"], ["also an input"]),
    "preprocess: output made by another command": ("data_pipeline.preprocess", lambda t, m: [
        "-i", _input(t, [GOOD.encode()]), "-o", _protected_output(t, m), *P], ["out", "--overwrite"]),
    "preprocess: missing input": ("data_pipeline.preprocess", lambda t, m: [
        "-i", t / "none.jsonl", "-o", t / "x", *P], ["none.jsonl"]),
    "preprocess: bad record": ("data_pipeline.preprocess", lambda t, m: [
        "-i", _input(t, [GOOD.encode(), b'{"body": 1}']), "-o", t / "x", *P], ["in.jsonl line 2", "text"]),
    "preprocess: --workers -1": ("data_pipeline.preprocess", lambda t, m: [
        "-i", _input(t, [GOOD.encode()]), "-o", t / "x", "--no-progress", "-t", "byte", "-j", "-1"], ["--workers"]),
    "preprocess: document over --max-document-bytes": ("data_pipeline.preprocess", lambda t, m: [
        "-i", _input(t, [GOOD.encode(), json.dumps({"text": "word " * 400}).encode()]), "-o", t / "x", *P,
        "--max-document-bytes", "1000"], ["in.jsonl line 2", "--max-document-bytes"]),
    "preprocess: output directory missing": ("data_pipeline.preprocess", lambda t, m: [
        "-i", _input(t, [GOOD.encode()]), "-o", t / "no" / "x", *P], ["does not exist"]),
    "preprocess: output directory not writable (/sys)": ("data_pipeline.preprocess", lambda t, m: [
        "-i", _input(t, [GOOD.encode()]), "-o", "/sys/x", *P], ["/sys", "not writable"]),
    "preprocess: tokenizer missing": ("data_pipeline.preprocess", lambda t, m: [
        "-i", _input(t, [GOOD.encode()]), "-o", t / "x", "--no-progress", "-t", t / "tok.model"], ["tok.model"]),
    "train_tokenizer: --vocab-size 0": ("data_pipeline.train_tokenizer", lambda t, m: [
        "-i", _input(t, [GOOD.encode()]), "-o", t / "sp", "--vocab-size", "0", "--no-progress"], ["--vocab-size"]),
    "train_tokenizer: model exists": ("data_pipeline.train_tokenizer", lambda t, m: [
        "-i", _input(t, [GOOD.encode()]), "-o", _model(t), "--vocab-size", "100", "--no-progress"],
        ["sp.model", "--overwrite"]),
    "train_tokenizer: missing input": ("data_pipeline.train_tokenizer", lambda t, m: [
        "-i", t / "none.jsonl", "-o", t / "sp", "--vocab-size", "100", "--no-progress"], ["none.jsonl"]),
}


def _model(tmp_path) -> str:
    for ext in (".model", ".vocab"):
        (tmp_path / f"sp{ext}").write_text("someone's tokenizer\n")
    return str(tmp_path / "sp")


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_refuses(case, tmp_path, made):
    module, build, names = CLI_CASES[case]
    argv = build(tmp_path, made)
    expect_refusal(module, argv, names=names, cwd=tmp_path)


def _refusals_before_megatron(tmp_path) -> list[tuple[str, list]]:
    good = _input(tmp_path, [GOOD.encode()])
    return [("preprocess", ["-i", tmp_path / "none.jsonl", "-o", tmp_path / "x", *P]),
            ("preprocess", ["-i", good, "-o", tmp_path / "no" / "x", *P]),
            ("preprocess", ["-i", good, "-o", tmp_path / "x", "--no-progress", "-t", tmp_path / "tok.model"]),
            ("preprocess", ["-i", good, "-o", tmp_path / "x", *P, "--encoder", "gigatoken"]),
            ("merge", ["-i", tmp_path / "none", "-o", tmp_path / "x", "--no-progress"]),
            ("merge", ["-i", tmp_path / "none", "-o", tmp_path / "no" / "x"]),
            ("inspect", [tmp_path / "none"])]


def test_data_clis_refuse_before_importing_megatron(tmp_path):
    """A missing input (file or dataset), a missing output directory, a tokenizer that does
    not load or an encoder that cannot encode it is refused before megatron.core's import
    (~9 CPU-s, the dataset reader and writer's), in a fresh process: preprocess, merge and
    inspect."""
    import subprocess
    import sys

    code = ("import importlib, sys; rc = importlib.import_module(sys.argv[1]).main(sys.argv[2:]); "
            "print(rc, 'megatron.core' in sys.modules, 'torch' in sys.modules)")
    for tool, argv in _refusals_before_megatron(tmp_path):
        run = subprocess.run([sys.executable, "-c", code, f"data_pipeline.{tool}", *map(str, argv)],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert run.stdout.split()[-3:] == ["2", "False", "False"], (tool, argv, run.stdout, run.stderr)
        assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, run.stderr
    assert not list(tmp_path.glob("x*"))


def test_preprocess_at_the_file_size_limit_keeps_nothing(tmp_path):
    """A full disk / `ulimit -f` while writing: one line, exit 1, no output, no temporaries."""
    from data_pipeline.datasets import DEMO_CORPUS

    expect_refusal("data_pipeline.preprocess", ["-i", DEMO_CORPUS, "-o", tmp_path / "x", *P], cwd=tmp_path,
                   names=["x.bin", "File too large", "no output was left"], code=1, file_size_limit=256 << 10)


def test_too_long_documents_are_skipped_and_counted_when_asked(tmp_path):
    path = _input(tmp_path, [GOOD.encode(), json.dumps({"text": "word " * 400}).encode(), GOOD.encode()])
    summary = preprocess([path], tokenizer="byte", output_prefix=str(tmp_path / "x"), workers=1,
                         skip_bad_records=True, max_document_bytes=1000)
    assert dict(summary.skipped) == {"document too long": 1} and summary.total("documents") == 2
    assert "line 2: document of 2,000 bytes exceeds --max-document-bytes 1,000" in summary.outputs[0].examples[0]

"""Input files: discovery, streaming into bounded chunks, and record validation.

The main process only cuts files into ~1 MiB chunks at line (or row-batch)
boundaries, so it never holds more than a chunk of any file; parsing, validation
and tokenisation happen in the workers (`data_pipeline.workers`). A plain .jsonl
chunk is a byte range (`FileRange`) that the worker reads itself: the main process
finds its end by seeking and reading to the next newline, and never reads or counts
the rest. Records are numbered from 1, as lines in an editor are; a chunk's records
are numbered from its start (`iter_records`), and whoever consumes the chunks in
order adds the records before it (a FileRange's count is only known once read).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from dataclasses import dataclass
from typing import Iterator

import orjson

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".txt.gz")  # plain text: only train_tokenizer reads these
SUPPORTED = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)


class InputError(ValueError):
    """An input that cannot be read; the message names the file and the problem."""


@dataclass(frozen=True)
class InputFile:
    path: str
    kind: str  # "jsonl", "parquet" or "text"
    size: int  # bytes on disk, what the progress bar counts
    mtime_ns: int


@dataclass
class Chunk:
    """A run of whole records from one input, in order; `seq` orders chunks within an output."""

    seq: int
    source: int  # index into the output's list of inputs
    # 1-based line (jsonl) or row (parquet) number of the first record; None for a
    # FileRange: the line after the previous chunk of the same input (not counted here).
    first_record: int | None
    kind: str
    payload: object  # FileRange or bytes (jsonl lines), or a pyarrow string array (parquet)
    disk_bytes: int  # on-disk bytes this chunk accounts for (progress)


@dataclass(frozen=True)
class FileRange:
    """Bytes [offset, offset + length) of an uncompressed input, whole lines: the payload of
    a plain .jsonl chunk, read by the worker that parses it. The main process reads only
    the few bytes to the next newline after each cut (`_plain_jsonl_chunks`): reading,
    copying or piping whole chunks there cost ~0.1-0.2 CPU-s per 100 MB in the process
    every worker waits on (see data_pipeline.benchmark)."""

    path: str
    offset: int
    length: int
    ends_line: bool  # ends with a newline (every range but a file's unterminated last line)

    def read(self) -> bytes:
        """The bytes, or InputError (its message does not name the file: callers do)."""
        try:
            with open(self.path, "rb") as f:
                data = os.pread(f.fileno(), self.length, self.offset)
        except OSError as err:
            raise InputError(f"read failed ({err})") from None
        if len(data) != self.length or (self.ends_line and not data.endswith(b"\n")):
            raise InputError(f"changed while it was being read (bytes {self.offset:,} to "
                             f"{self.offset + self.length:,} differ); run again once it is complete")
        return data


class BadRecord(ValueError):
    """One record that cannot become a document. `kind` is the category counted in summaries."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def resolve_inputs(patterns: list[str], allow_text: bool = False) -> list[InputFile]:
    """Expand globs (sorted, so the document order is reproducible) and check every file."""
    files: list[InputFile] = []
    seen: set[str] = set()
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise InputError(f"no file matches {pattern!r}; check the path and quote globs")
        else:
            if not os.path.exists(pattern):
                raise InputError(f"input {pattern!r} not found")
            if os.path.isdir(pattern):
                raise InputError(f"input {pattern!r} is a directory; pass files or a glob like "
                                 f"'{pattern.rstrip('/')}/*.jsonl'")
            matches = [pattern]
        for path in matches:
            real = os.path.realpath(path)
            if real in seen:
                continue  # a file named twice (e.g. by two globs) is read once
            seen.add(real)
            files.append(_describe(path, allow_text))
    if not files:
        raise InputError("no input files given")
    return files


def _describe(path: str, allow_text: bool) -> InputFile:
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        kind = "jsonl"
    elif name.endswith(PARQUET_SUFFIXES):
        kind = "parquet"
    elif allow_text and name.endswith(TEXT_SUFFIXES):
        kind = "text"
    else:
        supported = SUPPORTED + (", " + ", ".join(TEXT_SUFFIXES) if allow_text else "")
        raise InputError(f"input {path!r}: unsupported file type; supported: {supported}")
    stat = os.stat(path)
    return InputFile(path=path, kind=kind, size=stat.st_size, mtime_ns=stat.st_mtime_ns)


def check_readable(source: InputFile, text_field: str) -> None:
    """Cheap up-front checks so a bad input fails before any work starts."""
    if source.kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(source.path)
        except (OSError, pa.ArrowException) as err:
            raise InputError(f"{source.path}: not a readable parquet file ({err})") from err
        if text_field not in schema.names:
            raise InputError(f"{source.path}: no column {text_field!r} (columns: "
                             f"{', '.join(schema.names)}); pass --text-field NAME")
        field_type = schema.field(text_field).type
        if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):
            raise InputError(f"{source.path}: column {text_field!r} has type {field_type}, "
                             "expected string")
        return
    try:
        with open_maybe_gzip(source.path) as stream:
            stream.read(1)
    except (OSError, EOFError) as err:
        raise InputError(f"{source.path}: cannot read ({err})") from err


def open_maybe_gzip(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def iter_chunks(sources: list[InputFile], chunk_bytes: int, text_field: str) -> Iterator[Chunk]:
    """Chunks of every source in order; memory is one chunk plus the longest line."""
    seq = 0
    for index, source in enumerate(sources):
        if source.kind == "jsonl" and not source.path.lower().endswith(".gz"):
            pieces = _plain_jsonl_chunks(source.path, chunk_bytes)
        elif source.kind == "jsonl":
            pieces = _jsonl_chunks(source.path, chunk_bytes)
        else:
            pieces = _parquet_chunks(source.path, chunk_bytes, text_field)
        try:
            for first, payload, disk in pieces:
                yield Chunk(seq, index, first, source.kind, payload, disk)
                seq += 1
        except (OSError, EOFError) as err:  # truncated/corrupt gzip, I/O errors
            raise InputError(f"{source.path}: read failed ({err})") from err


def _jsonl_chunks(path: str, chunk_bytes: int, offset: int = 0, line_no: int = 1):
    """(first line number, whole lines, disk bytes) from byte `offset` of a plain file
    (which must start line `line_no`); gzip files are read from the start."""
    with open(path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if path.lower().endswith(".gz") else raw
        if offset:
            raw.seek(offset)
        carry, reported = b"", offset
        while True:
            block = stream.read(chunk_bytes)
            data = carry + block if carry else block
            if not block:
                if data:  # last line without a trailing newline
                    yield line_no, data, raw.tell() - reported
                return
            cut = data.rfind(b"\n")
            if cut < 0:  # one line longer than a chunk: keep reading until it ends
                carry = data
                continue
            payload, carry = data[:cut + 1], data[cut + 1:]
            disk = raw.tell() - reported
            reported += disk
            yield line_no, payload, disk
            line_no += payload.count(b"\n")


def _plain_jsonl_chunks(path: str, chunk_bytes: int):
    """(None, FileRange, disk bytes) of a plain file: each range runs from the previous cut
    to the first newline at or after its `chunk_bytes`-th byte (or to the end of the file),
    found by reading from there only: the main process reads a few KiB per chunk, not the
    chunk, and does not count its lines (the worker does). A chunk is at most
    `chunk_bytes` plus one line, as a _jsonl_chunks chunk."""
    with open(path, "rb", buffering=0) as f:
        fd, start = f.fileno(), 0
        while True:
            end = _next_line_end(fd, start + chunk_bytes - 1)
            if end is None:  # no newline from the cut on: the rest of the file is the last chunk
                size = os.fstat(fd).st_size
                if size > start:
                    ends_line = os.pread(fd, 1, size - 1) == b"\n"
                    yield None, FileRange(path, start, size - start, ends_line), size - start
                return
            yield None, FileRange(path, start, end - start, True), end - start
            start = end


def _next_line_end(fd: int, position: int, block: int = 1 << 14) -> int | None:
    """The offset just past the first newline at or after `position`, or None at the end of
    the file; reads blocks from 16 KiB, doubling, so a line of megabytes costs a few reads."""
    while data := os.pread(fd, block, position):
        at = data.find(b"\n")
        if at >= 0:
            return position + at + 1
        position += len(data)
        block = min(block * 2, 1 << 22)
    return None


def _parquet_chunks(path: str, chunk_bytes: int, text_field: str, row_groups: list[int] | None = None,
                    first: int = 1):
    """(first row number, string array, disk bytes); `row_groups`: only these (the first of
    them starting at row `first`)."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    meta = parquet.metadata
    rows = max(1, meta.num_rows)
    text_bytes = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    # Row batches of ~chunk_bytes of text, sized from the file's own statistics; memory is
    # also bounded by one row group, which pyarrow decodes whole.
    batch_rows = int(min(65536, max(1, chunk_bytes * rows // max(1, text_bytes))))
    disk_per_row = os.path.getsize(path) / rows
    reported = int(disk_per_row * (first - 1))
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=[text_field], row_groups=row_groups):
        array = batch.column(0)
        done = int(disk_per_row * (first - 1 + len(array)))
        yield first, array, done - reported
        reported = done
        first += len(array)


def check_text(text: str) -> int:
    """UTF-8 size of a document's text; raises BadRecord for empty or invalid text."""
    utf8 = text_utf8(text)
    return len(text) if utf8 is None else len(utf8)


def text_utf8(text: str) -> bytes | None:
    """A document's UTF-8, or None where the text is ASCII (then it is its own UTF-8, and
    len(text) its size); raises BadRecord for empty or invalid text. The workers hand the
    bytes to gigatoken, which would otherwise encode a non-ASCII str to UTF-8 once more
    (~0.05 CPU-s per 100 MB of Debian text)."""
    if not text or text.isspace():
        raise BadRecord("empty document", "empty document (no text or whitespace only)")
    if text.isascii():  # O(1) in CPython: the common case costs nothing
        return None
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:  # lone surrogates, e.g. from a "\ud800" JSON escape
        raise BadRecord("invalid UTF-8", f"invalid UTF-8: lone surrogate at character {err.start + 1} "
                                         "of the text") from None


def parse_json_record(line: bytes | memoryview, field: str) -> str:
    """The text of one JSON line, or BadRecord naming what is wrong with it."""
    try:
        # orjson parses a document in ~60% of the json module's time. Whatever it rejects
        # goes through json below, so what is accepted (json also takes NaN, a BOM, lone
        # surrogate escapes that check_text then names) and every message stay json's.
        return _text_field(orjson.loads(line), field)
    except orjson.JSONDecodeError:
        pass
    line = bytes(line)  # json reads no memoryview
    try:
        record = json.loads(line)
    except UnicodeDecodeError as err:
        raise BadRecord("invalid UTF-8", f"invalid UTF-8 at byte {err.start + 1} of the line") from None
    except json.JSONDecodeError as err:
        problem = "blank line" if not line.strip() else f"{err.msg} at column {err.colno}"
        raise BadRecord("malformed JSON", f"malformed JSON: {problem}") from None
    return _text_field(record, field)


def _text_field(record, field: str) -> str:
    if not isinstance(record, dict):
        raise BadRecord("malformed JSON", f"malformed JSON: expected an object, got "
                                          f"{type(record).__name__}")
    if field not in record:
        present = ", ".join(list(record)[:8]) or "none"
        raise BadRecord("missing text field", f"missing text field {field!r} (fields present: "
                                              f"{present}); pass --text-field NAME")
    text = record[field]
    if not isinstance(text, str):
        raise BadRecord("missing text field", f"field {field!r} is {type(text).__name__}, "
                                              "expected a string")
    return text


def iter_records(chunk: Chunk, field: str) -> Iterator[tuple[int, str | BadRecord]]:
    """(index of the record in the chunk, from 0; text or BadRecord) for each record of a
    chunk, in order: its number in the file is the chunk's first record plus the index."""
    if chunk.kind == "jsonl":
        payload = chunk.payload
        if isinstance(payload, FileRange):
            try:
                payload = payload.read()
            except InputError as err:
                raise InputError(f"{payload.path}: {err}") from None
        # Lines as memoryview slices, not split() copies (~0.07 CPU-s per 100 MB); the
        # newline ending the chunk does not start another record.
        view, size, start, index = memoryview(payload), len(payload), 0, 0
        while start < size:
            end = payload.find(b"\n", start)
            if end < 0:
                end = size
            try:
                yield index, parse_json_record(view[start:end], field)
            except BadRecord as bad:
                yield index, bad
            start, index = end + 1, index + 1
        return
    yield from _parquet_records(chunk)


def _parquet_records(chunk: Chunk):
    import pyarrow as pa

    try:
        texts = chunk.payload.to_pylist()
    except (UnicodeDecodeError, pa.ArrowException):
        texts = None
    if texts is None:  # some value is not valid UTF-8: find which, row by row
        raw = chunk.payload.cast(pa.binary()).to_pylist()
        texts = []
        for value in raw:
            try:
                texts.append(None if value is None else value.decode("utf-8"))
            except UnicodeDecodeError as err:
                texts.append(BadRecord("invalid UTF-8", f"invalid UTF-8 at byte {err.start + 1} of the text"))
    for index, text in enumerate(texts):
        if text is None:
            text = BadRecord("missing text field", "missing text field (null value)")
        yield index, text

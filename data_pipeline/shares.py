"""Cut the inputs of a preprocessing run into contiguous shares of whole records.

    shares = plan_shares(resolve_inputs(['corpus/*.jsonl.gz']), 8)   # 8 lists of Segments
    for chunk in iter_share_chunks(sources, shares[3], 1 << 20, "text"): ...

A record is what preprocess reads as one document: a line of a .jsonl(.gz) file (blank
and bad lines included, so the numbering stays the file's) or a row of a parquet file.
Share k holds the records from cut k to cut k+1 of the inputs taken in order, so
tokenising the shares separately and concatenating the outputs in share order gives
the documents, ids and bytes of one run over all inputs. Shares are equal in records
(within one), not in bytes: a corpus mixing very long and very short documents in
different files gives unequal task times.

Counting reads every input once (newlines of .jsonl, decompressing .gz; parquet's
metadata only); for plain .jsonl the planner also records the byte where each share
starts so its task seeks there instead of reading what comes before.
"""

from __future__ import annotations

import gzip
import itertools
from dataclasses import asdict, dataclass
from typing import Iterator

from data_pipeline.sources import Chunk, InputFile, _jsonl_chunks, _parquet_chunks

COUNT_BLOCK = 4 << 20


@dataclass(frozen=True)
class Segment:
    """Records first .. first + count - 1 (1-based, as in error messages) of input `source`;
    `offset`: the byte where record `first` starts in a plain .jsonl (0 elsewhere)."""

    source: int
    first: int
    count: int
    offset: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def count_records(source: InputFile) -> int:
    """Lines of a .jsonl(.gz) (a last line without newline counts) or rows of a parquet."""
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(source.path).metadata.num_rows
    lines, last = 0, b"\n"
    with _open(source.path) as stream:
        while block := stream.read(COUNT_BLOCK):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def _open(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def split_points(total: int, shares: int) -> list[int]:
    """Global record indices (0-based) where shares 1..n-1 start: equal within one record."""
    return [total * k // shares for k in range(1, shares)]


def plan_shares(sources: list[InputFile], counts: list[int], shares: int) -> list[list[Segment]]:
    """`shares` lists of segments covering every record once, in order, none empty."""
    total = sum(counts)
    if not 1 <= shares <= total:
        raise ValueError(f"cannot cut {total:,} records into {shares} non-empty shares")
    bounds = [0, *split_points(total, shares), total]
    starts = [0, *itertools.accumulate(counts)][:-1]  # global index of each input's first record
    plan: list[list[Segment]] = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        segments = []
        for index, (start, count) in enumerate(zip(starts, counts, strict=True)):
            a, b = max(lo, start), min(hi, start + count)
            if a < b:
                segments.append(Segment(index, a - start + 1, b - a))
        plan.append(segments)
    return _with_offsets(sources, plan)


def _with_offsets(sources: list[InputFile], plan: list[list[Segment]]) -> list[list[Segment]]:
    """Segments of plain .jsonl inputs that start past line 1 get their starting byte."""
    wanted: dict[int, set[int]] = {}
    for segments in plan:
        for s in segments:
            if s.first > 1 and sources[s.source].kind == "jsonl" and not sources[s.source].path.lower().endswith(".gz"):
                wanted.setdefault(s.source, set()).add(s.first)
    offsets = {index: line_offsets(sources[index].path, sorted(lines)) for index, lines in wanted.items()}
    return [[Segment(s.source, s.first, s.count, offsets.get(s.source, {}).get(s.first, 0)) for s in segments]
            for segments in plan]


def line_offsets(path: str, lines: list[int]) -> dict[int, int]:
    """Byte offset where each of the (sorted, 1-based) `lines` starts, in one pass."""
    found, seen, position = {}, 0, 0  # seen: newlines before `position`
    todo = iter(lines)
    line = next(todo, None)
    with open(path, "rb") as f:
        while line is not None and (block := f.read(COUNT_BLOCK)):
            in_block = block.count(b"\n")
            while line is not None and seen + in_block >= line - 1:
                # line L starts after the (L-1)-th newline of the file
                at, need = -1, line - 1 - seen
                for _ in range(need):
                    at = block.index(b"\n", at + 1)
                found[line] = position + at + 1
                line = next(todo, None)
            seen += in_block
            position += len(block)
    if line is not None:
        raise ValueError(f"{path} has fewer lines than planned (line {line} missing)")
    return found


def iter_share_chunks(sources: list[InputFile], segments: list[Segment], chunk_bytes: int,
                      text_field: str) -> Iterator[Chunk]:
    """Chunks of exactly the segments' records, in order, numbered as in their files."""
    seq = 0
    for segment in segments:
        source = sources[segment.source]
        try:
            for first, payload, disk in _segment_pieces(source, segment, chunk_bytes, text_field):
                yield Chunk(seq, segment.source, first, source.kind, payload, disk)
                seq += 1
        except (OSError, EOFError) as err:  # truncated/corrupt gzip, I/O errors
            from data_pipeline.sources import InputError

            raise InputError(f"{source.path}: read failed ({err})") from err


def _segment_pieces(source: InputFile, segment: Segment, chunk_bytes: int, text_field: str):
    end = segment.first + segment.count  # first record past the segment
    if source.kind == "jsonl":
        start_line = segment.first if segment.offset else 1
        pieces = _jsonl_chunks(source.path, chunk_bytes, segment.offset, start_line)
    else:
        groups, group_first = _row_groups(source.path, segment.first, end)
        pieces = _parquet_chunks(source.path, chunk_bytes, text_field, groups, group_first)
    for first, payload, disk in pieces:
        n = _records_in(source.kind, payload)
        if first + n <= segment.first:
            continue  # wholly before the segment (a .gz or parquet read from the start)
        lo, hi = max(0, segment.first - first), min(n, end - first)
        if lo or hi < n:
            payload = _slice(source.kind, payload, lo, hi)
        yield first + lo, payload, disk
        if first + n >= end:
            return


def _records_in(kind: str, payload) -> int:
    if kind == "parquet":
        return len(payload)
    return payload.count(b"\n") + (not payload.endswith(b"\n"))


def _slice(kind: str, payload, lo: int, hi: int):
    """Records lo .. hi - 1 of a chunk's payload."""
    if kind == "parquet":
        return payload.slice(lo, hi - lo)
    start = 0
    for _ in range(lo):
        start = payload.index(b"\n", start) + 1
    stop = start
    for _ in range(hi - lo):
        found = payload.find(b"\n", stop)
        stop = len(payload) if found < 0 else found + 1
    return payload[start:stop]


def _row_groups(path: str, first: int, end: int) -> tuple[list[int], int]:
    """Row groups of a parquet holding rows first .. end - 1, and the first row of the first."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    groups, row, group_first = [], 1, None
    for index in range(meta.num_row_groups):
        rows = meta.row_group(index).num_rows
        if row < end and row + rows > first:
            groups.append(index)
            group_first = row if group_first is None else group_first
        row += rows
    return groups, group_first or 1

"""Show what an indexed dataset holds: counts, dtype, length histogram, first documents.

    python -m data_pipeline.inspect data/corpus --docs 3
    python -m data_pipeline.inspect data/corpus --tokenizer tiktoken:llama3.model --scan-ids

The tokenizer used to decode defaults to the one recorded in <prefix>.meta.json
by preprocess. --scan-ids reads every token to report the largest id (and
checks it against the tokenizer's vocabulary), which costs a pass over the .bin.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """(low, high, count) buckets of document lengths by powers of two: [1,2), [2,4), ..."""
    if len(lengths) == 0:
        return []
    exponents = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(exponents)
    return [(1 << e, 1 << (e + 1), int(c)) for e, c in enumerate(counts) if c]


def summarize(prefix: str) -> dict:
    """Counts and statistics of the dataset at `prefix`, read through Megatron's reader."""
    from data_pipeline.output_paths import check_dataset_files

    check_dataset_files(prefix)  # before megatron.core's import (~9 CPU-s): output_paths' docstring
    from data_pipeline.indexed_writer import IndexedDataset, open_index
    from data_pipeline.output_paths import read_manifest

    open_index(prefix)  # DatasetFileError: missing, damaged, or a .bin of the wrong size
    dataset = IndexedDataset(prefix)
    doc_bounds = dataset.document_indices
    seq_lengths = dataset.sequence_lengths.astype(np.int64)
    # A document is the run of sequences between consecutive document indices.
    doc_lengths = np.add.reduceat(seq_lengths, doc_bounds[:-1]) if len(seq_lengths) else seq_lengths
    return {
        "prefix": prefix, "dataset": dataset, "dtype": dataset.index.dtype.__name__,
        "documents": len(doc_bounds) - 1, "sequences": len(seq_lengths),
        "tokens": int(seq_lengths.sum()), "bin_bytes": os.path.getsize(prefix + ".bin"),
        "doc_lengths": doc_lengths, "manifest": read_manifest(prefix) or {},
    }


def _print_report(console, info: dict, tokenizer, docs: int, max_chars: int, scan: bool) -> None:
    from rich.table import Table

    lengths = info["doc_lengths"]
    table = Table(title=info["prefix"], show_header=False)
    table.add_row("token dtype", info["dtype"])
    table.add_row("documents", f"{info['documents']:,}")
    table.add_row("sequences", f"{info['sequences']:,}")
    table.add_row("tokens", f"{info['tokens']:,}")
    table.add_row(".bin size", f"{info['bin_bytes'] / 1e6:,.2f} MB")
    if len(lengths):
        table.add_row("doc length min / median / mean / max",
                      f"{lengths.min():,} / {int(np.median(lengths)):,} / "
                      f"{lengths.mean():,.1f} / {lengths.max():,}")
    request = info["manifest"].get("request", {})
    if request:
        table.add_row("made with", f"{info['manifest'].get('tokenizer_spec')} (eod appended: "
                                   f"{request.get('append_eod')})")
    if tokenizer is not None:
        table.add_row("decoding with", tokenizer.describe())
    if scan:
        largest = max((int(seq.max()) for seq in _sequences(info["dataset"]) if len(seq)), default=-1)
        verdict = "" if tokenizer is None or largest < tokenizer.vocab_size else \
            f"  [red]>= vocab size {tokenizer.vocab_size}: wrong tokenizer?"
        table.add_row("largest token id", f"{largest:,}{verdict}")
    console.print(table)

    hist = Table(title="document length histogram (tokens)")
    for column in ("length", "documents", ""):
        hist.add_column(column, justify="right" if column else "left")
    buckets = length_histogram(lengths)
    peak = max((c for _, _, c in buckets), default=1)
    for low, high, count in buckets:
        hist.add_row(f"{low:,}-{high - 1:,}", f"{count:,}", "█" * max(1, round(40 * count / peak)))
    console.print(hist)

    dataset = info["dataset"]
    for doc in range(min(docs, info["documents"])):
        ids = np.concatenate([dataset[s] for s in range(dataset.document_indices[doc],
                                                         dataset.document_indices[doc + 1])])
        console.rule(f"document {doc}: {len(ids):,} tokens")
        text = tokenizer.decode(ids.tolist()) if tokenizer is not None else str(ids[:64].tolist())
        console.print(text[:max_chars] + (" …" if len(text) > max_chars else ""),
                      markup=False, highlight=False)


def _sequences(dataset, block: int = 4096):
    for start in range(0, len(dataset), block):
        yield from dataset[start:min(start + block, len(dataset))]


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from data_pipeline.checks import nonnegative_int, run_cli
    from data_pipeline.output_paths import DatasetFileError, strip_extension
    from data_pipeline.tokenizers import TokenizerLoadError, load_tokenizer

    parser = argparse.ArgumentParser(prog="python -m data_pipeline.inspect",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("prefix", help="dataset prefix (PREFIX.bin / PREFIX.idx)")
    parser.add_argument("--tokenizer", "-t", default=None,
                        help="decode with this tokenizer (default: the one in the manifest)")
    parser.add_argument("--docs", "-n", type=nonnegative_int, default=3, help="documents to decode")
    parser.add_argument("--max-chars", type=nonnegative_int, default=600, help="characters shown per document")
    parser.add_argument("--scan-ids", action="store_true", help="report the largest token id")
    args = parser.parse_args(argv)

    def body() -> int:
        info = summarize(strip_extension(args.prefix))
        spec = args.tokenizer or info["manifest"].get("tokenizer_spec")
        tokenizer = load_tokenizer(spec) if spec else None
        _print_report(Console(), info, tokenizer, args.docs, args.max_chars, args.scan_ids)
        return 0

    return run_cli(body, bad_input=(DatasetFileError, TokenizerLoadError))


if __name__ == "__main__":
    sys.exit(main())

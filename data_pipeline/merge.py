"""Join existing indexed datasets (.bin/.idx pairs) into one, in the order given.

    python -m data_pipeline.merge --inputs data/shards/a data/shards/b --output-prefix data/all
    python -m data_pipeline.merge --inputs 'data/shards/*' --output-prefix data/all

Inputs are prefixes (a trailing .bin/.idx is ignored) or globs (every .idx they
match). All inputs must share one token dtype and, where they carry a manifest,
one tokenizer. The output is written atomically like preprocess's. Memory does not
grow with the data: tokens and index arrays stream through fixed-size buffers
(indexed_writer.StreamingConcatBuilder; measured by data_pipeline.merge_benchmark).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import numpy as np


class MergeError(ValueError):
    """Inputs that cannot be merged; the message names them."""


def resolve_prefixes(patterns: list[str]) -> list[str]:
    from data_pipeline.output_paths import strip_extension

    prefixes: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            found = sorted({m[: -len(".idx")] for m in glob.glob(pattern) if m.endswith(".idx")}
                           | {m[: -len(".idx")] for m in glob.glob(pattern + ".idx")})
            if not found:
                raise MergeError(f"no .idx file matches {pattern!r}")
            prefixes.extend(found)
        else:
            prefixes.append(strip_extension(pattern))
    return prefixes


def merge(inputs: list[str], output_prefix: str, *, overwrite: bool = False,
          progress: bool = False, console=None, documents_required: bool = False) -> dict:
    """Merge `inputs` (prefixes or globs) into output_prefix; returns the manifest written.
    `documents_required`: refuse inputs that hold no document at all (as preprocess does)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    from data_pipeline.output_paths import DatasetFileError, check_dataset_files, check_output_prefix

    prefixes = resolve_prefixes(inputs)
    check_output_prefix(output_prefix)
    out_real = os.path.realpath(output_prefix)
    for prefix in prefixes:  # before megatron.core's import (~9 CPU-s): output_paths' docstring
        if os.path.realpath(prefix) == out_real:
            raise MergeError(f"output {output_prefix!r} is also an input; choose another prefix")
        try:
            check_dataset_files(prefix)
        except DatasetFileError as exc:
            raise MergeError(str(exc)) from None

    from data_pipeline.index_file import AtomicIndexedDataset
    from data_pipeline.indexed_writer import StreamingConcatBuilder, open_index
    from data_pipeline.output_paths import output_exists, read_manifest

    dtypes, tokenizers, documents, tokens = {}, {}, 0, 0
    for prefix in prefixes:
        try:
            index = open_index(prefix)  # damaged or truncated inputs are refused
        except DatasetFileError as exc:
            raise MergeError(str(exc)) from None
        dtypes[prefix] = index.dtype
        documents += index.document_count - 1
        # open_index checked that the .bin holds exactly the indexed tokens: no pass over lengths
        tokens += os.path.getsize(prefix + ".bin") // np.dtype(index.dtype).itemsize
        del index
        made = read_manifest(prefix) or {}
        if (made.get("request") or {}).get("tokenizer"):
            tokenizers[prefix] = (made["request"]["tokenizer"], made.get("tokenizer_spec"))
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{p} ({d.__name__})" for p, d in dtypes.items())
        raise MergeError(f"inputs store different token dtypes: {listing}; re-tokenise them with "
                         "one tokenizer")
    if len({t["sha256"] for t, _ in tokenizers.values()}) > 1:
        listing = ", ".join(f"{p} ({spec})" for p, (_, spec) in tokenizers.items())
        raise MergeError(f"inputs were made by different tokenizers: {listing}")
    if documents_required and documents == 0:
        raise MergeError(f"no documents in {', '.join(prefixes)}: every record was skipped or empty")
    if output_exists(output_prefix) and not overwrite:
        raise MergeError(f"{output_prefix}.bin/.idx already exist; pass --overwrite to replace them")

    manifest = {"merged_from": [os.path.abspath(p) for p in prefixes], "documents": documents,
                "tokens": tokens, "dtype": next(iter(dtypes.values())).__name__}
    if tokenizers:  # what build_gpt_datasets checks against the training tokenizer
        identity, spec = next(iter(tokenizers.values()))
        manifest.update(request={"tokenizer": identity}, tokenizer_spec=spec)
    console = console or Console(stderr=True)
    sizes = [os.path.getsize(p + ".bin") for p in prefixes]
    with Progress(TextColumn("[bold]merging"), BarColumn(), TaskProgressColumn(),
                  TimeElapsedColumn(), console=console, disable=not progress) as bar:
        task = bar.add_task("merge", total=sum(sizes))
        try:
            dtype = next(iter(dtypes.values()))
            with AtomicIndexedDataset(output_prefix, dtype, StreamingConcatBuilder) as out:
                for prefix, size in zip(prefixes, sizes):
                    out.builder.add_index(prefix)  # Megatron's add_index, streaming the index too
                    bar.advance(task, size)
                out.commit(manifest)
        except OSError as exc:  # a full disk, a file-size limit: the temporaries are gone
            from data_pipeline.checks import WorkFailed, describe_os_error

            raise WorkFailed(f"writing {output_prefix}.bin/.idx failed: {describe_os_error(exc)}; no output "
                             "was left that looks valid (temporary files removed)") from None
    return manifest


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from data_pipeline.checks import run_cli
    from data_pipeline.output_paths import OutputError

    parser = argparse.ArgumentParser(prog="python -m data_pipeline.merge",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", "-i", nargs="+", required=True, help="prefixes or globs")
    parser.add_argument("--output-prefix", "-o", required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    started = time.perf_counter()

    def body() -> int:
        manifest = merge(args.inputs, args.output_prefix, overwrite=args.overwrite,
                         progress=not args.no_progress, console=console)
        console.print(f"merged {len(manifest['merged_from'])} datasets: {manifest['documents']:,} "
                      f"documents, {manifest['tokens']:,} tokens ({manifest['dtype']}) into "
                      f"{args.output_prefix} in {time.perf_counter() - started:.1f} s", highlight=False)
        return 0

    return run_cli(body, bad_input=(MergeError, OutputError), on_interrupt="interrupted: no output was written")


if __name__ == "__main__":
    sys.exit(main())

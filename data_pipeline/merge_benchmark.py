"""Peak memory of merging indexed datasets, at several data sizes: ours (streaming, what
`data_pipeline.merge` and preprocess_slurm's merge job run) against Megatron-Core's
`IndexedDatasetBuilder.add_index`.

    python -m data_pipeline.merge_benchmark --documents 1000000 10000000 --shards 8 --repeats 3

For each size, `--shards` synthetic datasets (random uint16 ids, 1-15 tokens per document:
small documents, so the index, which is what grows, dominates) are written under --dir,
then each merge runs in a fresh process (`python -m data_pipeline.merge`, or Megatron's
builder through this module), and the kernel's peak RSS of that process (wait4's
ru_maxrss) is recorded; the table gives medians over --repeats runs. The two outputs are
compared byte for byte once per size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def write_shards(directory: str, documents: int, shards: int, seed: int = 0) -> list[str]:
    from data_pipeline.index_file import CompactIndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    prefixes = []
    for k in range(shards):
        prefix = os.path.join(directory, f"shard-{k:05d}")
        builder = CompactIndexedDatasetBuilder(prefix + ".bin", np.uint16)
        todo = documents * (k + 1) // shards - documents * k // shards
        while todo:
            n = min(todo, 1 << 20)
            lengths = rng.integers(1, 16, n)
            builder.add_documents(rng.integers(0, 32000, int(lengths.sum())).astype(np.uint16), lengths)
            todo -= n
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    return prefixes


def run_measured(command: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of one process, as the kernel counted it."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)  # its own rusage, not the max over all children
    seconds = time.perf_counter() - start
    stderr = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{stderr[-2000:]}")
    return usage.ru_maxrss * 1024, seconds


def megatron_merge(prefixes: list[str], output: str) -> None:
    """Megatron-Core's own concatenation (the upstream builder, index kept in memory)."""
    from data_pipeline.indexed_writer import quiet_megatron_import

    with quiet_megatron_import():
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(output + ".bin", dtype=np.uint16)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(output + ".idx")


def measure(directory: str, prefixes: list[str], repeats: int) -> dict[str, list[tuple[int, float]]]:
    ours = [sys.executable, "-m", "data_pipeline.merge", "--no-progress", "--overwrite", "-o",
            os.path.join(directory, "ours"), "-i", *prefixes]
    theirs = [sys.executable, "-m", "data_pipeline.merge_benchmark", "--megatron-merge",
              os.path.join(directory, "megatron"), *prefixes]
    runs: dict[str, list[tuple[int, float]]] = {"ours": [], "megatron": []}
    for _ in range(repeats):  # interleaved, so a load change on a shared machine hits both
        runs["ours"].append(run_measured(ours))
        runs["megatron"].append(run_measured(theirs))
    for ext in ("bin", "idx"):
        with open(os.path.join(directory, f"ours.{ext}"), "rb") as a, \
                open(os.path.join(directory, f"megatron.{ext}"), "rb") as b:
            if a.read() != b.read():
                raise RuntimeError(f"ours.{ext} differs from Megatron's")
    return runs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--megatron-merge"]:  # the measured processes this module starts
        megatron_merge(argv[2:], argv[1])
        return 0
    if argv[:1] == ["--write-shards"]:
        write_shards(argv[1], int(argv[2]), int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.merge_benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    print("| documents | tokens | .bin + .idx MB | ours: peak RSS MB | Megatron add_index: peak RSS MB "
          "| ours s | Megatron s |")
    print("|---|---|---|---|---|---|---|")
    for documents in args.documents:
        directory = tempfile.mkdtemp(prefix=f"merge-bench-{documents}-", dir=args.dir)
        try:
            # In a child process: a fork starts with its parent's resident pages counted in its
            # ru_maxrss, so the measuring process must stay small (shard writing is not).
            subprocess.run([sys.executable, "-m", "data_pipeline.merge_benchmark", "--write-shards", directory,
                            str(documents), str(args.shards)], check=True, stderr=subprocess.DEVNULL)
            prefixes = [os.path.join(directory, f"shard-{k:05d}") for k in range(args.shards)]
            size = sum(os.path.getsize(p + ext) for p in prefixes for ext in (".bin", ".idx"))
            tokens = sum(os.path.getsize(p + ".bin") for p in prefixes) // 2
            runs = measure(directory, prefixes, args.repeats)
            med = {k: (statistics.median(r for r, _ in v) / 1e6, statistics.median(s for _, s in v))
                   for k, v in runs.items()}
            print(f"| {documents:,} | {tokens:,} | {size / 1e6:,.0f} | {med['ours'][0]:,.0f} | "
                  f"{med['megatron'][0]:,.0f} | {med['ours'][1]:.1f} | {med['megatron'][1]:.1f} |", flush=True)
            print("  runs (MB): ours " + " ".join(f"{r / 1e6:.0f}" for r, _ in runs["ours"]) + "; Megatron "
                  + " ".join(f"{r / 1e6:.0f}" for r, _ in runs["megatron"]), flush=True)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the data CLIs check about their outputs before any work, without Megatron-Core.

`indexed_writer` reads datasets through megatron.core, whose import takes ~4.5-9 CPU-s
(torch and the package's __init__); the CLIs' refusals of a bad output directory, a
missing input dataset or a tokenizer that does not load come from here and the other light
modules first (preprocess, merge, inspect), so they arrive in about a second, before that
import. preprocess also decides here which outputs are finished and their ids' dtype, and
writes them without the import at all (`index_file`)."""

from __future__ import annotations

import json
import os


class OutputError(ValueError):
    """An output that cannot be written; the message names the path and the fix."""


class DatasetFileError(ValueError):
    """A dataset whose files are missing, damaged or do not belong together."""


def manifest_path(prefix: str) -> str:
    return prefix + ".meta.json"


def strip_extension(path: str) -> str:
    """A dataset prefix from a prefix or a path to its .bin/.idx."""
    return path[: -len(".idx")] if path.endswith((".bin", ".idx")) else path


def dataset_paths(prefix: str) -> tuple[str, str]:
    """The dataset's .idx and .bin (Megatron's get_idx_path/get_bin_path: prefix + ext)."""
    return prefix + ".idx", prefix + ".bin"


def output_exists(prefix: str) -> bool:
    """Either file of a dataset exists (complete or not): replacing it needs --overwrite."""
    return any(os.path.exists(path) for path in dataset_paths(prefix))


def read_manifest(prefix: str) -> dict | None:
    """The manifest of a complete output at `prefix` (both files and the manifest present), or
    None if there is none."""
    if not all(os.path.isfile(path) for path in (*dataset_paths(prefix), manifest_path(prefix))):
        return None
    try:
        with open(manifest_path(prefix), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def token_dtype(vocab_size: int) -> type:
    """Megatron's choice (DType.optimal_dtype): uint16 below 65500 ids, else int32 (a 128k
    vocabulary needs int32)."""
    import numpy as np

    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def check_dataset_files(prefix: str) -> None:
    """Fail if the dataset at `prefix` lacks its .idx or .bin."""
    for path in dataset_paths(prefix):
        if not os.path.isfile(path):
            raise DatasetFileError(f"no dataset at prefix {prefix!r} ({path} not found); create it "
                                   "with python -m data_pipeline.preprocess")


def check_output_prefix(prefix: str) -> None:
    """Fail before any work if the prefix's directory is missing or not writable."""
    from data_pipeline.checks import writable_dir_problem

    directory = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(directory):
        raise OutputError(f"output directory {directory!r} does not exist; create it first "
                          f"(mkdir -p {directory})")
    problem = writable_dir_problem(directory)
    if problem:
        raise OutputError(f"output directory {directory!r} is not writable: {problem}")
    if os.path.basename(prefix) in ("", ".", ".."):
        raise OutputError(f"output prefix {prefix!r} must end in a file name, e.g. {prefix}/corpus")

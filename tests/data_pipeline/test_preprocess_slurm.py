"""preprocess_slurm without Slurm: the shards, each task's output and the streaming merge,
run in this process as the array's tasks and the merge job run them, against one
`preprocess` run (byte for byte); the refusals before anything is written.
The same commands under a real Slurm: tests/data_pipeline/test_slurm_preprocess.py."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from data_pipeline import preprocess_slurm
from data_pipeline.datasets import DEMO_TOKENIZER
from data_pipeline.preprocess import main as preprocess_main
from tests.bad_input import expect_refusal
from tests.data_pipeline.conftest import kjv_texts, write_jsonl, write_parquet


def corpus(tmp_path) -> list[str]:
    """13 records over the three input kinds: plain jsonl (with a blank line, a bad record
    skipped), jsonl.gz and a parquet of row groups of 3 (a shard starts mid-group)."""
    texts = kjv_texts(12)
    plain = write_jsonl(tmp_path / "a.jsonl", texts[:4])
    with open(plain, "a") as f:
        f.write("\n")  # line 5: blank
    return [plain, write_jsonl(tmp_path / "b.jsonl.gz", texts[4:8]),
            write_parquet(tmp_path / "c.parquet", texts[8:12], row_group_size=3)]


def options(inputs: list[str]) -> list[str]:
    return ["--input", *inputs, "--tokenizer", DEMO_TOKENIZER, "--append-eod", "--skip-bad-records",
            "--encoder", "reference"]  # the bytes do not depend on it; saves loading gigatoken per task


def run_like_slurm(plan: str, shards: int) -> None:
    """What the array's tasks and then the merge job run."""
    for k in range(shards):
        assert preprocess_slurm.main(["task", plan, str(k)]) == 0
    assert preprocess_slurm.main(["merge", plan]) == 0


def test_shards_merge_byte_identical_to_one_run(tmp_path, capsys):
    inputs = corpus(tmp_path)
    assert preprocess_main([*options(inputs), "-o", str(tmp_path / "one"), "--workers", "0", "--no-progress"]) == 0
    one = {ext: (tmp_path / f"one.{ext}").read_bytes() for ext in ("bin", "idx")}
    # 4 shards (cuts inside the plain file, at byte offsets, inside the .gz and the parquet);
    # 13 = one record each, so one shard holds only the skipped blank line (an empty dataset).
    for shards in (4, 13):
        prefix = tmp_path / f"multi{shards}"
        assert preprocess_slurm.main([*options(inputs), "-o", str(prefix), "--shards", str(shards),
                                      "--workers", "0"]) == 0
        plan_path = f"{prefix}.shards/plan.json"
        plan = json.loads(open(plan_path).read())
        assert [i["records"] for i in plan["inputs"]] == [5, 4, 4]
        sizes = [sum(s["count"] for s in shard) for shard in plan["shards"]]
        assert sum(sizes) == 13 and max(sizes) - min(sizes) <= 1
        run_like_slurm(plan_path, shards)
        for ext in ("bin", "idx"):
            assert (tmp_path / f"multi{shards}.{ext}").read_bytes() == one[ext], (shards, ext)
    # the shard that starts at line 3 of a.jsonl seeks there (byte offset found by the planner)
    first = json.loads(open(tmp_path / "multi4.shards/plan.json").read())["shards"][1][0]
    assert (first["first"], first["offset"]) == (4, len(b"".join(open(inputs[0], "rb").readlines()[:3])))
    out = capsys.readouterr().out
    assert "ARRAY_JOB=$(sbatch --parsable --array=0-3 " in out
    assert "--dependency=afterok:$ARRAY_JOB --kill-on-invalid-dep=yes" in out


def test_finished_shards_are_not_redone_and_a_changed_input_is_refused(tmp_path, capsys):
    inputs = corpus(tmp_path)
    prefix = tmp_path / "out"
    argv = [*options(inputs), "-o", str(prefix), "--shards", "3", "--workers", "0"]
    assert preprocess_slurm.main(argv) == 0
    plan = f"{prefix}.shards/plan.json"
    assert preprocess_slurm.main(["task", plan, "1"]) == 0
    capsys.readouterr()
    assert preprocess_slurm.main(argv) == 0  # the same command again: only shards 0 and 2 left
    assert "--array=0,2 " in capsys.readouterr().out
    assert preprocess_slurm.main(["task", plan, "1"]) == 0
    assert "already complete for this plan" in capsys.readouterr().out
    os.utime(inputs[1], ns=(1, 1))  # the .gz was replaced after planning: its record numbers may be stale
    expect_refusal("data_pipeline.preprocess_slurm", ["task", plan, "2"], names=["b.jsonl.gz", "changed since planning"],
                   cwd=tmp_path)


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    inputs = corpus(tmp_path)
    module = "data_pipeline.preprocess_slurm"
    out = ["-o", str(tmp_path / "out"), "--partition", "debug"]
    expect_refusal(module, [*options([*inputs, str(tmp_path / "missing.jsonl")]), *out, "--shards", "2"],
                   names=["missing.jsonl", "not found"], cwd=tmp_path)
    expect_refusal(module, [*options(inputs), *out, "--shards", "14"], names=["--shards 14", "13 records"],
                   cwd=tmp_path)
    (tmp_path / "done.bin").write_bytes(b"")
    expect_refusal(module, [*options(inputs), "-o", str(tmp_path / "done"), "--shards", "2"],
                   names=["done.bin", "already exist"], cwd=tmp_path)
    expect_refusal(module, [*options(inputs), *out, "--shards", "0"], names=["--shards"], cwd=tmp_path)


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    inputs = corpus(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert preprocess_slurm.main([*options(inputs), "-o", str(tmp_path / "out"), "--shards", "2", "--dry-run",
                                  "--partition", "debug", "--time", "10"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    out = capsys.readouterr().out
    assert "3 input(s), 13 records -> 2 shards of 6-7 records" in out
    assert "#SBATCH --partition=debug" in out and "#SBATCH --requeue" in out
    assert f"sbatch --parsable --array=0-1 {tmp_path}/out.shards/task.sh" in out


def test_streaming_merge_writes_megatrons_bytes_with_small_blocks(tmp_path, monkeypatch):
    """StreamingConcatBuilder against Megatron-Core's own add_index + finalize, with blocks
    smaller than every input so each array crosses block boundaries."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from data_pipeline import indexed_writer
    from data_pipeline.index_file import CompactIndexedDatasetBuilder
    from data_pipeline.indexed_writer import StreamingConcatBuilder

    monkeypatch.setattr(indexed_writer, "MERGE_BLOCK_ENTRIES", 7)
    rng = np.random.default_rng(0)
    prefixes = []
    for i, documents in enumerate([5, 1, 30, 0]):
        builder = CompactIndexedDatasetBuilder(str(tmp_path / f"s{i}.bin"), np.int32)
        lengths = rng.integers(1, 9, documents)
        builder.add_documents(rng.integers(0, 100_000, lengths.sum()).astype(np.int32), lengths)
        builder.finalize(str(tmp_path / f"s{i}.idx"))
        prefixes.append(str(tmp_path / f"s{i}"))
    for cls, name in ((IndexedDatasetBuilder, "megatron"), (StreamingConcatBuilder, "ours")):
        builder = cls(str(tmp_path / f"{name}.bin"), dtype=np.int32)
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(str(tmp_path / f"{name}.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"megatron.{ext}").read_bytes(), ext
    assert (tmp_path / "ours.idx").stat().st_size == 34 + 12 * 36 + 8 * 37


@pytest.mark.parametrize("indices, text", [([0, 1, 2, 5, 7, 8], "0-2,5,7-8"), ([3], "3"), ([0, 2], "0,2")])
def test_array_ranges(indices, text):
    assert preprocess_slurm._ranges(indices) == text

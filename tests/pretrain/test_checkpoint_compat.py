"""Checkpoints outlive versions: every checkpoint fixture written by an earlier version of the
code (tests/pretrain/fixtures/checkpoint_v<N>, made by tests/pretrain/checkpoint_fixture.py)
resumes bitwise, or is refused with one line naming the conversion (README, "Checkpoint format
versions")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.checkpointing import format as ckpt_format
from tests.bad_input import expect_refusal, snapshot
from tests.distributed import run_ranks
from tests.pretrain.workers import logged_losses

FIXTURES = Path(__file__).parent / "fixtures"
ALL = sorted(FIXTURES.glob("checkpoint_v*"), key=lambda p: int(p.name.rsplit("v", 1)[1]))


def _spec(fixture: Path) -> dict:
    return json.loads((fixture / "continuation.json").read_text())


def _resume_args(fixture: Path, tmp_path: Path) -> list[str]:
    spec = _spec(fixture)
    return spec["overrides"] + [f"checkpoint.resume={fixture / spec['checkpoint']}",
                                f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.run_dir={tmp_path / 'run'}"]


def test_every_format_version_has_a_fixture():
    versions = [_spec(f)["format_version"] for f in ALL]
    assert versions == list(range(1, ckpt_format.FORMAT_VERSION + 1)), (
        f"fixtures for format versions {versions}; a FORMAT_VERSION bump adds "
        "tests/pretrain/fixtures/checkpoint_v<N> (python -m tests.pretrain.checkpoint_fixture)")
    for version in range(1, ckpt_format.OLDEST_READABLE):
        assert version in ckpt_format.CONVERSIONS, f"format version {version} is refused without a conversion"


@pytest.mark.distributed
@pytest.mark.parametrize("fixture", ALL, ids=lambda p: p.name)
def test_fixture_resumes_bitwise_or_is_refused_naming_the_conversion(fixture, tmp_path):
    spec = _spec(fixture)
    before = snapshot(fixture)
    if spec["format_version"] < ckpt_format.OLDEST_READABLE:
        conversion = ckpt_format.CONVERSIONS[spec["format_version"]]
        expect_refusal("pretrain", ["--recipe", spec["recipe"], *_resume_args(fixture, tmp_path)],
                       names=[conversion], watch=fixture, cwd=tmp_path)
        return
    losses = logged_losses(run_ranks(1, "tests.pretrain.workers:train", recipe=spec["recipe"],
                                     overrides=_resume_args(fixture, tmp_path)))
    # Bitwise: the uninterrupted run's steps 3-4 (same layout, same machine type: fp32 CPU).
    assert losses == spec["resumed_losses"], (losses, spec["resumed_losses"])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == spec["resumed_steps"]
    assert snapshot(fixture) == before, "resuming changed the fixture"


def test_a_version_below_the_oldest_readable_is_refused_naming_its_conversion(tmp_path, monkeypatch):
    """The refusal path, as it will run when a later version stops reading version 1."""
    fixture = ALL[0]
    command = "python -m checkpoints_tools.convert_format --from 1 OLD NEW"
    monkeypatch.setattr(ckpt_format, "OLDEST_READABLE", 2)
    monkeypatch.setattr(ckpt_format, "CONVERSIONS", {1: command})
    spec = _spec(fixture)
    expect_refusal("pretrain", ["--recipe", spec["recipe"], *_resume_args(fixture, tmp_path)],
                   names=["format version 1", command], watch=fixture, cwd=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ALL, ids=lambda p: p.name)
def test_fixture_reshards_and_exports_with_the_same_logits(fixture, tmp_path):
    """Every format version (v1: Megatron-Core 0.16.1's, common state in common.pt) is resharded
    (to PP2, optimizer kept) into the current format and exported to Hugging Face; transformers'
    logits of the export equal ours of the resharded checkpoint (checkpoints_tools.verify)."""
    import os
    import subprocess
    import sys

    from checkpoints_tools.dcp_io import read_common
    from checkpoints_tools.export_hf import export_hf
    from checkpoints_tools.reshard import reshard
    from models.layout import ParallelLayout
    from tests.distributed import REPO

    before = snapshot(fixture)
    source = fixture / _spec(fixture)["checkpoint"]
    resharded, exported = tmp_path / "pp2", tmp_path / "hf"
    reshard(source, resharded, layout=ParallelLayout(pipeline_parallel=2))
    export_hf(source, exported, with_tokenizer=False)
    assert not (resharded / "common.pt").exists()  # written in the current format
    common, original = read_common(resharded), read_common(source)
    assert common["scheduler"] == original["scheduler"] and common["scheduler"]["num_steps"] > 0
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "checkpoints_tools.verify", str(resharded), str(exported), "--json",
                           "--seq", "16"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["passed"] and report["max_abs_diff"] <= 1e-4, report
    assert snapshot(fixture) == before, "resharding or exporting changed the fixture"

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

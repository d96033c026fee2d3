"""The training step: fp16 dynamic loss scaling handled by Megatron's optimizer."""

from __future__ import annotations

import json

import pytest

from tests.distributed import run_ranks

pytestmark = [pytest.mark.distributed]


def test_fp16_overflow_lowers_the_loss_scale_skips_then_trains(tmp_path):
    """A huge initial loss scale overflows the fp16 gradients: Megatron's loss scaler must see
    each overflow (the step skips the update and the scale halves, after its hysteresis of 2),
    and once the scale fits, training proceeds and the loss falls. Before the fix the step
    returned before optimizer.step(), so the scale never moved and every step was skipped."""
    run_dir = tmp_path / "fp16"
    overrides = [
        "runtime.dtype=fp16", "runtime.spec=portable", "optimizer.initial_loss_scale=1048576.0",
        "optimizer.lr=3e-3", "schedule.warmup_steps=1", "schedule.train_steps=16", "schedule.seq_length=64",
        "schedule.micro_batch_size=2", "schedule.global_batch_size=2", "data.demo=true",
        "logging.log_interval=1", "logging.tensorboard=false", f"logging.run_dir={run_dir}",
    ]
    run_ranks(1, "tests.pretrain.workers:train", recipe="tiny-llama", overrides=overrides)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first_update = next(i for i, r in enumerate(records) if not r["skipped"])
    leading = records[:first_update]
    assert len(leading) >= 3, [(r["step"], r["loss_scale"]) for r in records]
    scales = [r["loss_scale"] for r in leading]
    # Hysteresis 2: the first overflow keeps the scale, every further one halves it.
    assert scales[0] == 1048576.0 and all(b == a / 2 for a, b in zip(scales[1:], scales[2:])), scales
    assert all(r["lr"] == 0.0 and r["grad_norm"] is None for r in leading)  # no update, no LR step
    # From then on the updates apply with the lowered scale; a later overflow (dynamic loss
    # scaling at work) skips one update and halves the scale again, the LR schedule waiting.
    for before, r in zip(records[first_update - 1:], records[first_update:]):
        assert r["loss_scale"] <= before["loss_scale"]
        if r["skipped"]:
            assert r["lr"] == before["lr"] and r["loss_scale"] == before["loss_scale"] / 2
        else:
            assert r["grad_norm"] is not None and r["lr"] > 0
    applied = records[first_update:]
    assert applied[-1]["loss"] < applied[0]["loss"] - 0.3, [r["loss"] for r in applied]
    assert records[-1]["skipped_steps"] == sum(r["skipped"] for r in records)

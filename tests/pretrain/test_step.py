"""The training step: fp16 dynamic loss scaling handled by Megatron's optimizer."""

from __future__ import annotations

import json
import math

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
    # The first update uses the scheduler's step-0 LR (0: warmup starts from 0), every later one
    # a positive LR (metrics log the LR each step used).
    assert records[first_update]["lr"] == 0.0
    for before, r in zip(records[first_update:], records[first_update + 1:]):
        assert r["loss_scale"] <= before["loss_scale"]
        if before["skipped"]:  # a skipped update does not advance the schedule
            assert r["lr"] == before["lr"]
        if r["skipped"]:
            assert r["loss_scale"] == before["loss_scale"] / 2
        else:
            assert r["grad_norm"] is not None and r["lr"] > 0
    applied = records[first_update:]
    assert applied[-1]["loss"] < applied[0]["loss"] - 0.3, [r["loss"] for r in applied]
    assert records[-1]["skipped_steps"] == sum(r["skipped"] for r in records)


def _scheduled_lr(updates_before: int, *, lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """Linear warmup from 0, then cosine decay to min_lr over `decay` steps (Megatron-Core's
    OptimizerParamScheduler, written out independently): the LR after `updates_before` updates."""
    if updates_before <= warmup:
        return lr * updates_before / warmup
    ratio = min(1.0, (updates_before - warmup) / (decay - warmup))
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


def test_metrics_log_the_lr_each_step_used(tmp_path):
    """metrics.jsonl's lr at step k is the LR of step k's update: the scheduler's value after
    k-1 updates (0 at step 1 when warming up from 0). It used to be read after the scheduler
    stepped, i.e. step k+1's."""
    run_dir = tmp_path / "lr"
    lr, min_lr, warmup, decay, steps = 4e-3, 1e-4, 3, 6, 8
    overrides = [
        "runtime.spec=portable", f"optimizer.lr={lr}", f"optimizer.min_lr={min_lr}",
        f"schedule.warmup_steps={warmup}", f"schedule.decay_steps={decay}", "schedule.decay_style=cosine",
        f"schedule.train_steps={steps}", "schedule.seq_length=32", "schedule.micro_batch_size=1",
        "schedule.global_batch_size=1", "data.demo=true", "logging.log_interval=1",
        "logging.tensorboard=false", f"logging.run_dir={run_dir}",
    ]
    run_ranks(1, "tests.pretrain.workers:train", recipe="tiny-llama", overrides=overrides)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert not any(r["skipped"] for r in records)
    want = [_scheduled_lr(k - 1, lr=lr, min_lr=min_lr, warmup=warmup, decay=decay) for k in range(1, steps + 1)]
    got = [r["lr"] for r in records]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (got, want)

"""schedule.decay_style=wsd: Megatron-Core's scheduler as we build it (pretrain.wrap._scheduler)
against a plain-Python warmup-stable-decay curve, the config's validation, and --dry-run."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.cli import resolve_config
from pretrain.config import ConfigError, dump_yaml
from pretrain.wrap import _scheduler

SHAPES = {"linear": lambda r: 1 - r, "cosine": lambda r: 0.5 * (1 + math.cos(math.pi * r)),
          "exponential": lambda r: 2 * 0.5 ** r - 1, "minus_sqrt": lambda r: 1 - math.sqrt(r)}


def reference_lr(step: int, *, lr, min_lr, warmup, decay_end, cooldown, shape) -> float:
    """Linear warmup from 0, max LR until decay_end - cooldown, then `shape` down to min_lr."""
    if step <= warmup:
        return lr * step / warmup
    if step > decay_end:
        return min_lr
    start = decay_end - cooldown
    coeff = 1.0 if step <= start else SHAPES[shape]((step - start) / cooldown)
    return min_lr + coeff * (lr - min_lr)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("cooldown_key", ["wsd_decay_steps=8", "wsd_decay_fraction=0.2"])
def test_wsd_lr_matches_reference(shape, cooldown_key):
    config = resolve_config("tiny-llama", None, [
        "optimizer.lr=0.004", "optimizer.min_lr=0.0001", "schedule.warmup_steps=5", "schedule.train_steps=40",
        "schedule.decay_style=wsd", f"schedule.{cooldown_key}", f"schedule.lr_wsd_decay_style={shape}"])
    assert config.schedule.wsd_cooldown_steps == 8  # 0.2 x 40
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = _scheduler(optimizer, config)
    got = []
    for _ in range(45):
        got.append(optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    want = [reference_lr(k, lr=0.004, min_lr=0.0001, warmup=5, decay_end=40, cooldown=8, shape=shape)
            for k in range(45)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got[20] == pytest.approx(0.004)  # stable phase at max LR


@pytest.mark.parametrize("overrides, names", [
    (["schedule.decay_style=wsd"], ["exactly one", "wsd_decay_steps"]),
    (["schedule.decay_style=wsd", "schedule.wsd_decay_steps=5", "schedule.wsd_decay_fraction=0.1"], ["exactly one"]),
    (["schedule.decay_style=cosine", "schedule.wsd_decay_steps=5"], ["wsd_decay_steps", "decay_style=wsd"]),
    (["schedule.decay_style=wsd", "schedule.train_steps=20", "schedule.warmup_steps=10",
      "schedule.wsd_decay_steps=11"], ["cooldown", "11"]),
    (["schedule.decay_style=wsd", "schedule.wsd_decay_fraction=1.5"], ["wsd_decay_fraction"]),
    (["schedule.decay_style=wsd", "schedule.wsd_decay_steps=4", "schedule.lr_wsd_decay_style=step"],
     ["lr_wsd_decay_style"]),
])
def test_wsd_config_is_validated(overrides, names):
    with pytest.raises(ConfigError) as info:
        resolve_config("tiny-llama", None, overrides)
    message = str(info.value)
    assert all(n in message for n in names), message


def test_dry_run_config_shows_the_cooldown():
    config = resolve_config("tiny-llama", None, ["schedule.decay_style=wsd", "schedule.wsd_decay_fraction=0.25",
                                                 "schedule.lr_wsd_decay_style=minus_sqrt"])
    text = dump_yaml(config)
    assert "decay_style: wsd" in text and "wsd_decay_fraction: 0.25" in text and "lr_wsd_decay_style: minus_sqrt" in text

"""Step metrics: one readable console line, `metrics.jsonl`, TensorBoard and the trackers.

`MetricsWriter` is the one place records go out: the same record reaches metrics.jsonl,
TensorBoard and every configured tracker (`pretrain.observe.trackers`).

Throughput uses `models.flops` (the same formula as the planner), so TFLOP/s and MFU here
and in `launch.plan` cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import sys
from pathlib import Path
from typing import Optional

import torch

from models.config import ModelConfig
from models.flops import training_flops_per_token

# Dense peak FLOP/s per device (no sparsity), from NVIDIA's H100/H200 datasheets.
DEVICE_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h100-sxm": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "fp32": 66.9},
    "h100-pcie": {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "fp32": 51.0},
    "h200": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "fp32": 66.9},
    # Vendor specs, not measured: NVIDIA's HGX B200 / GB200 NVL72 specification table
    # ("Individual Blackwell GPU Specifications"; its tensor-core figures are with 2:4 sparsity,
    # halved here to dense: B200 FP8 9 -> 4.5 PFLOPS, BF16 4.5 -> 2.25; GB200 FP8 10 -> 5,
    # BF16 5 -> 2.5; FP32 75 / 80 TFLOPS as listed), as reproduced at
    # https://zdszero.github.io/Computer/Artificial_Intelligence/Hardware.html; the dense values
    # agree with https://glennklockwood.com/garden/processors/B200 (HGX B200 at 1,000 W:
    # BF16 2250, FP8 4500; GB200 at 1,200 W: BF16 2500, FP8 5000), whose FP32 says 80 / 90.
    "b200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "fp32": 75.0},
    "gb200": {"bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0, "fp32": 80.0},
}


def detect_device_peak(key: str, dtype: str, fp8: bool) -> Optional[float]:
    """Peak TFLOP/s for MFU; None on CPU or an unknown GPU (MFU is then not reported)."""
    if key == "auto":
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name().lower()
        if "gb200" in name:  # before "b200", which it contains
            key = "gb200"
        elif "b200" in name:
            key = "b200"
        elif "h200" in name:
            key = "h200"
        elif "h100" in name:
            key = "h100-pcie" if "pcie" in name else "h100-sxm"
        else:
            return None
    table = DEVICE_PEAK_TFLOPS.get(key)
    if table is None:
        raise ValueError(f"unknown device {key!r}; known: {', '.join(DEVICE_PEAK_TFLOPS)} or auto")
    return table["fp8" if fp8 else dtype]


def peak_memory_gb() -> float:
    """GPU: max allocated by torch; CPU: the process's peak resident set."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20


@dataclasses.dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float  # the learning rate this step's update used (the scheduler's value before it stepped)
    grad_norm: Optional[float]
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: Optional[float]
    peak_mem_gb: float
    # Time outside forward_backward_func + optimizer step (data, logging), as a fraction.
    overhead_frac: float
    skipped: bool = False  # no update this step (non-finite, or an fp16 overflow)
    skipped_steps: int = 0  # skipped steps so far in this run
    loss_scale: Optional[float] = None  # fp16: the dynamic loss scale after this step
    # MoE: mean load-balancing loss over MoE layers (1.0 = even routing) and router z-loss.
    moe_aux_loss: Optional[float] = None
    moe_z_loss: Optional[float] = None
    # MoE, per MoE layer in layer order (pretrain.moe_load): the load-balancing loss of this
    # step, and on log_interval steps the expert load over the steps since the last one:
    # max and min tokens per expert over the mean (1.0 = even) and their std / mean.
    moe_aux_loss_layers: Optional[list[float]] = None
    moe_load_max: Optional[list[float]] = None
    moe_load_min: Optional[list[float]] = None
    moe_load_cv: Optional[list[float]] = None
    # Multi-token prediction (model.mtp_num_layers): the MTP cross-entropy (predicting token i+k+1,
    # before mtp_loss_scaling_factor), mean over MTP layers, and per layer.
    mtp_loss: Optional[float] = None
    mtp_loss_layers: Optional[list[float]] = None
    # Document masking (data.reset_attention_mask): the share of dense causal attention work
    # that ran (models.flops.document_attention_fraction, mean over the logging rank's
    # samples). tflops_per_device and mfu still count the dense formula (docs/document-masking.md).
    attention_fraction: Optional[float] = None
    # Straggler report steps only (logging.straggler_interval): the rank furthest above its
    # pipeline stage's median forward/backward compute time per step, over the interval.
    straggler_slowest_rank: Optional[int] = None
    straggler_slowest_s: Optional[float] = None
    straggler_median_s: Optional[float] = None
    straggler_ratio: Optional[float] = None


class Throughput:
    """Turns a step time into tokens/s, TFLOP/s per device and MFU."""

    def __init__(self, model: ModelConfig, seq_length: int, global_batch: int, world_size: int,
                 peak_tflops: Optional[float]):
        self.tokens_per_step = seq_length * global_batch
        self.flops_per_step = training_flops_per_token(model, seq_length) * self.tokens_per_step
        self.world_size = world_size
        self.peak = peak_tflops

    def compute(self, step_time: float) -> tuple[float, float, float, Optional[float]]:
        tps = self.tokens_per_step / step_time
        tflops = self.flops_per_step / step_time / self.world_size / 1e12
        mfu = tflops / self.peak if self.peak else None
        return tps, tps / self.world_size, tflops, mfu


class MetricsWriter:
    """Writes on the logging rank only; other ranks hold a disabled writer."""

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool, trackers=None):
        self.enabled = enabled
        self.jsonl = None
        self.tb = None
        self.trackers = trackers  # pretrain.observe.trackers.Trackers, or None
        if not enabled:
            return
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(path / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(path / "tensorboard"))

    def log(self, m: StepMetrics, total_steps: int) -> None:
        if not self.enabled:
            return
        record = dataclasses.asdict(m)
        self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step" and value is not None:
                    self.tb.add_scalar(f"train/{key}", value, m.step)
        if self.trackers:
            self.trackers.log(record)
        print(format_line(m, total_steps), flush=True)

    def log_eval(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        record = {"step": step, "eval_loss": loss}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.trackers:
            self.trackers.log(record)
        if self.tb is not None:
            self.tb.add_scalar("eval/loss", loss, step)
        print(f"eval  step {step:>6} | loss {loss:.4f}", flush=True)

    def log_heldout(self, step: int, losses: list[float]) -> None:
        """The final held-out evaluation: mean loss, its standard error over the batches (the
        spread of per-batch means / sqrt(batches); None from one batch) and every batch's loss."""
        if not self.enabled:
            return
        mean = sum(losses) / len(losses)
        se = (math.sqrt(sum((x - mean) ** 2 for x in losses) / (len(losses) - 1) / len(losses))
              if len(losses) > 1 else None)
        record = {"step": step, "val_loss": mean, "val_loss_se": se, "val_batches": len(losses),
                  "val_batch_losses": losses}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.trackers:
            self.trackers.log({"step": step, "val_loss": mean})
        if self.tb is not None:
            self.tb.add_scalar("eval/heldout_loss", mean, step)
        print(f"held-out step {step:>6} | loss {mean:.4f}" + (f" ± {se:.4f} (s.e., {len(losses)} batches)" if se else ""),
              flush=True)

    def close(self, failed: bool = False) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.trackers:
            self.trackers.close(failed)


def format_line(m: StepMetrics, total_steps: int) -> str:
    width = len(str(total_steps))
    parts = [
        f"step {m.step:>{width}}/{total_steps}",
        f"loss {m.loss:.4f}",
        *([f"mtp {m.mtp_loss:.4f}"] if m.mtp_loss is not None else []),
        f"lr {m.lr:.2e}",
        f"gnorm {m.grad_norm:.3f}" if m.grad_norm is not None else "gnorm   n/a",
        f"{m.step_time_s * 1000:7.1f} ms",
        f"{m.tokens_per_s:9.0f} tok/s",
        f"{m.tflops_per_device:7.3f} TFLOP/s/dev",
    ]
    if m.mfu is not None:
        parts.append(f"MFU {100 * m.mfu:4.1f}%")
    if m.moe_aux_loss is not None:
        parts.append(f"aux {m.moe_aux_loss:.4f}")
    if m.moe_z_loss is not None:
        parts.append(f"z {m.moe_z_loss:.3f}")
    if m.moe_load_max:
        parts.append(f"load max/mean {max(m.moe_load_max):.2f}")
    parts.append(f"mem {m.peak_mem_gb:.2f} GB")
    if m.loss_scale is not None:
        parts.append(f"scale {m.loss_scale:g}")
    if m.skipped:
        parts.append("SKIPPED")
    if m.straggler_ratio is not None:
        parts.append(f"slowest rank {m.straggler_slowest_rank} x{m.straggler_ratio:.2f} of stage median")
    return " | ".join(parts)


def info(message: str, enabled: bool = True) -> None:
    if enabled:
        print(message, file=sys.stdout, flush=True)

"""What fraction of a device's peak each kind of work reaches, per precision.

The time model (launch.planner.throughput) splits a microbatch's work into kinds that run at
different speeds, instead of dividing all FLOPs by one constant:
  gemm_bf16  GEMMs of linear layers in BF16/FP16 (and the output layer, which Megatron runs
             in BF16 even under FP8: it is not a Transformer Engine module)
  gemm_fp8   GEMMs of linear layers under FP8 with current (tensorwise) scaling; blockwise and
             MXFP8 use it too until a run of theirs is in published.yaml
  gemm_fp8_delayed  the same under delayed scaling (the only FP8 run of this stack)
  attention  the fused attention core (scores, softmax, weighted values), always BF16
  memory     element-wise kernels (norms, SwiGLU, RoPE, residual adds, FP8 casts, the loss):
             a fraction of HBM bandwidth, not of FLOP/s
  gemm_fp32  FP32 GEMMs (CPU runs, or dtype=fp32)

Each number below is fitted, not chosen: `fit_efficiencies` (scipy least squares on
log(predicted / measured) tokens/s) over the rows of launch/planner/published.yaml, which
holds Megatron-Bridge's published DGX-H100 table and this stack's own H100 measurements, each
with its source: three free parameters (gemm_bf16, gemm_fp8, gemm_fp8_delayed) for 11 rows.
attention and memory are not fitted: with them free the fit drove both to their bound of 1
(these rows, all seq 4096-8192 Llama-3 shapes, cannot tell those terms apart from the GEMMs),
so they are fixed at values we assume, marked below, until a run with a profiler breakdown
calibrates them. gemm_fp32 has no GPU measurement; `--calibrate` on a CPU run fits it.
tests/launch/test_published.py recomputes the table and fails past +-15%.
"""

from __future__ import annotations

import dataclasses

KINDS = ("gemm_bf16", "gemm_fp8", "gemm_fp8_delayed", "attention", "memory", "gemm_fp32")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiencies:
    # Fitted by fit_efficiencies over launch/planner/published.yaml (H100 SXM): see the
    # table in docs/planner.md, "Checked against measured runs". Sources: Megatron-Bridge docs/performance-summary.md
    # (25.09, 25.11, 26.02 DGX-H100 tables) and docs/benchmarks.md, "GPU: one H100".
    # Fitted: ours-h100 BF16 rows (46.3% / 43.9% MFU, docs/benchmarks.md) with the FP8 rows' BF16 logits.
    gemm_bf16: float = 0.483
    # Fitted: Megatron-Bridge's 8 DGX-H100 FP8-CS rows (8B, 70B, 405B).
    gemm_fp8: float = 0.494
    # Fitted: ours-h100 FP8 hybrid row (delayed scaling, TE 2.11: 1.16x BF16) - one row.
    gemm_fp8_delayed: float = 0.307
    # Assumed, not fitted (see the module docstring): fused attention below large GEMMs.
    attention: float = 0.60
    # Assumed, not fitted: element-wise kernels near streaming bandwidth.
    memory: float = 0.90
    # Not fitted (no FP32 measurement on a GPU); --calibrate on a CPU run fits it.
    gemm_fp32: float = 0.50

    def __post_init__(self) -> None:
        for kind in KINDS:
            value = getattr(self, kind)
            if not 0 < value <= 1:
                raise ValueError(f"efficiency {kind}={value:g} must be a fraction in (0, 1]")

    def gemm(self, dtype: str, fp8: bool, recipe: str | None = None) -> float:
        """The efficiency of a linear layer's GEMM at this precision (and FP8 recipe)."""
        if fp8:
            return self.gemm_fp8_delayed if recipe in (None, "delayed") else self.gemm_fp8
        return self.gemm_fp32 if dtype == "fp32" else self.gemm_bf16

    def scaled(self, factor: float, kinds: tuple[str, ...] = KINDS) -> "Efficiencies":
        """These efficiencies with `kinds` multiplied by `factor` (capped at 1)."""
        return dataclasses.replace(self, **{k: min(1.0, getattr(self, k) * factor) for k in kinds})

    def describe(self) -> str:
        return ", ".join(f"{k} {getattr(self, k):.3f}" for k in KINDS)


DEFAULT_EFFICIENCIES = Efficiencies()

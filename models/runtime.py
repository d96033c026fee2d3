"""How a model runs: seed, layer spec, precision, FP8, recompute, grouped-GEMM MoE, fused kernels.

The `runtime` section of the experiment config (`pretrain.config.RuntimeConfig` adds the
training-only keys). `models.build.build_model_chunks` takes it as one object. What each
FP8 recipe needs from the GPU and Transformer Engine is `models.precision`'s.
"""

from __future__ import annotations

from typing import Literal, Optional, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
SpecName = Literal["auto", "te", "portable"]
DtypeName = Literal["fp32", "bf16", "fp16"]
# Activation recompute: none, the attention core only ("selective"), or whole layers ("full").
Recompute = Literal["none", "selective", "full"]
RECOMPUTE_CHOICES: tuple[Recompute, ...] = get_args(Recompute)
Fp8Recipe = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]
# The FP8 keys besides `fp8` itself; they mean nothing unless `fp8` is set.
FP8_DETAIL_KEYS = ("fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin",
                   "fp8_param_gather", "fp8_bf16_first_layers", "fp8_bf16_last_layers")
FUSION_KEYS = ("fused_rope", "fused_swiglu", "fused_cross_entropy", "gradient_accumulation_fusion")


class RuntimeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    seed: int = 1234
    # Layer spec: "te" (Transformer Engine fused modules, GPU), "portable" (torch-native,
    # CPU or GPU), "auto" (te when Transformer Engine imports and CUDA is present).
    spec: SpecName = "auto"
    dtype: DtypeName = "fp32"
    recompute: Recompute = "none"
    # MoE experts as one grouped GEMM (Transformer Engine's GroupedLinear, te spec only)
    # instead of a loop over experts. None = on with the te spec, off with portable.
    moe_grouped_gemm: Optional[bool] = None

    # --- FP8 through Transformer Engine (te spec, GPU; checked by models.precision) ---
    # The FP8 formats: "hybrid" = E4M3 forward, E5M2 gradients; "e4m3" everywhere. None = off.
    fp8: Optional[Literal["hybrid", "e4m3"]] = None
    # How scales are chosen. None = "delayed" (Megatron-Core's default). "delayed": from the
    # amax history of earlier steps; "tensorwise": per tensor from its current values
    # (current scaling); "blockwise": per 1x128 / 128x128 block (Hopper, CUDA >= 12.9);
    # "mxfp8": per 32 values with E8M0 scales (Blackwell only).
    fp8_recipe: Optional[Fp8Recipe] = None
    # Delayed scaling only. None = Megatron-Core's defaults (1, "most_recent", 0).
    fp8_amax_history_len: Optional[int] = Field(default=None, gt=0)
    fp8_amax_compute_algo: Optional[Literal["most_recent", "max"]] = None
    fp8_margin: Optional[int] = Field(default=None, ge=0)
    # Keep the GEMM weights in FP8 and all-gather them in FP8 (half the bytes of BF16);
    # needs Megatron's distributed optimizer (it re-quantizes its FP32 master shards).
    fp8_param_gather: bool = False
    # Keep the first / last N transformer layers in BF16 (not with the delayed recipe).
    fp8_bf16_first_layers: int = Field(default=0, ge=0)
    fp8_bf16_last_layers: int = Field(default=0, ge=0)

    # --- Fused kernels (te spec, GPU). None = the default: SwiGLU fusion on with te on a
    # GPU, the others off. Speed effect to be measured (launch.benchmark_table --variant).
    fused_rope: Optional[bool] = None  # TE's fused rotary embedding
    fused_swiglu: Optional[bool] = None  # Megatron's fused bias + SwiGLU
    fused_cross_entropy: Optional[bool] = None  # TE's fused vocab-parallel cross-entropy
    # Weight gradients accumulated straight into the fp32 main grads by TE's GEMM.
    gradient_accumulation_fusion: Optional[bool] = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def fp8_recipe_name(self) -> Optional[str]:
        """The FP8 recipe in effect (None without FP8)."""
        return (self.fp8_recipe or "delayed") if self.fp8 else None

    def precision(self) -> dict:
        """What decides the numerics, as recorded in a checkpoint's meta.json: the dtype and,
        with FP8, the format, recipe and its settings (defaults filled in)."""
        record: dict = {"dtype": self.dtype, "fp8": self.fp8}
        if self.fp8:
            record.update(
                fp8_recipe=self.fp8_recipe_name, fp8_param_gather=self.fp8_param_gather,
                fp8_bf16_first_layers=self.fp8_bf16_first_layers,
                fp8_bf16_last_layers=self.fp8_bf16_last_layers,
            )
            if self.fp8_recipe_name == "delayed":
                record.update(fp8_amax_history_len=self.fp8_amax_history_len or 1,
                              fp8_amax_compute_algo=self.fp8_amax_compute_algo or "most_recent",
                              fp8_margin=self.fp8_margin or 0)
        return record

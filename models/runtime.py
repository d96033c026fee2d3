"""How a model runs: seed, layer spec, precision, FP8, recompute, grouped-GEMM MoE.

The `runtime` section of the experiment config (`pretrain.config.RuntimeConfig` adds the
training-only keys). `models.build.build_model_chunks` takes it as one object.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
SpecName = Literal["auto", "te", "portable"]


class RuntimeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    seed: int = 1234
    # Layer spec: "te" (Transformer Engine fused modules, GPU), "portable" (torch-native,
    # CPU or GPU), "auto" (te when Transformer Engine imports and CUDA is present).
    spec: SpecName = "auto"
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # Transformer Engine FP8 recipe on GPU (te spec only): "hybrid" = E4M3 fwd, E5M2 bwd.
    fp8: Optional[Literal["hybrid", "e4m3"]] = None
    recompute: Literal["none", "selective", "full"] = "none"
    # MoE experts as one grouped GEMM (Transformer Engine's GroupedLinear, te spec only)
    # instead of a loop over experts. None = on with the te spec, off with portable.
    moe_grouped_gemm: Optional[bool] = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

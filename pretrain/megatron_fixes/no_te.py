"""Megatron-Core without Transformer Engine.

`te_general_gemm` in the MoE router (megatron-core 0.16.1). `moe/moe_utils.py` imports
`te_general_gemm` inside `try: from megatron.core.extensions.transformer_engine import ...`
(line ~34) and defines nothing when that import fails, yet
`RouterGatingLinearFunction.forward/backward` (lines ~1192, ~1225) test
`te_general_gemm is not None`: a NameError on every MoE forward without TE. Defining it as
None selects the torch matmul branch those lines already have. Known for 0.16.1.
"""

from __future__ import annotations

from pretrain.megatron_fixes._guard import expect_sources

SOURCES = {"megatron.core.transformer.moe.moe_utils:RouterGatingLinearFunction": "a34180b771b42adc"}


def apply() -> None:
    from megatron.core.transformer.moe import moe_utils

    expect_sources("no_te", SOURCES)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

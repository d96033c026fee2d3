"""Torch-native modules for the `portable` layer spec (CPU, or GPU without Transformer Engine).

Megatron-Core's local spec uses `WrappedTorchNorm`, which refuses sequence parallelism.
`PortableNorm` works on sequence-sharded activations: the math is per token, so a
shard normalises exactly like the full sequence; only the parameter gradients differ
per TP rank, and marking the parameters `sequence_parallel` makes Megatron-Core's
`finalize_model_grads` all-reduce them across the TP group.
"""

from __future__ import annotations

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class PortableNorm(torch.nn.Module):
    """RMSNorm or LayerNorm (per `config.normalization`), computed in fp32."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.config = config
        self.eps = eps
        self.rms = config.normalization == "RMSNorm"
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for p in self.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.rms:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * self.weight.float()).to(x.dtype)
        y = torch.nn.functional.layer_norm(
            xf, xf.shape[-1:], self.weight.float(), self.bias.float(), self.eps
        )
        return y.to(x.dtype)

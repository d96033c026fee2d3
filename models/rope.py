"""Llama-3.1 RoPE scaling with all four of its values, not only the factor.

Upstream (Megatron-Core 0.16.1-0.19.2, `models/common/embeddings/rotary_pos_embedding.py`):
`RotaryEmbedding._apply_scaling(freqs, factor, low_freq_factor=1, high_freq_factor=4,
original_max_position_embeddings=8192)` implements HF's "llama3" rope type with all four
values, but `GPTModel` builds its `RotaryEmbedding(rope_scaling=..., rope_scaling_factor=...)`
and the constructor passes only the factor, so any other low/high frequency factor or original
context length is silently replaced by Llama-3.1's 1 / 4 / 8192. An HF model with other values
(e.g. Llama-3.2's original 8192 with factor 32, or a fine-tune's own) would then compute
different logits here than in transformers and vLLM.

What we do instead: after `GPTModel` is built, `apply_llama3_scaling` recomputes the module's
`inv_freq` (a plain attribute: not a parameter, never saved, dropped by
`_load_from_state_dict`) with upstream's own `_apply_scaling` and all four values from our
`ModelConfig`. Done per built module rather than as a patch of the class: the values belong
to one model (a process may build several, e.g. the tests' shared training run), and GPTModel
offers no way to carry them to the constructor. Before overriding, the guard recomputes
upstream's result with the factor alone and requires it to be bit-identical to the
`inv_freq` the constructor made: if upstream changes how it builds the unscaled frequencies
or the scaling, the build fails loudly instead of mixing two formulas.
Known for Megatron-Core 0.19.2 (the signature and the constructor's call are the same in
0.13-0.19).
"""

from __future__ import annotations

import inspect

import torch

from models.config import ModelConfig

_SCALING_ARGS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _unscaled_inv_freq(model: ModelConfig, device: torch.device) -> torch.Tensor:
    # As RotaryEmbedding.__init__ computes it (rotary_percent 1.0; models.build passes
    # rotary_base=int(model.rope_base)).
    dim = model.head_dim
    return 1.0 / (int(model.rope_base) ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def apply_llama3_scaling(rotary: torch.nn.Module, model: ModelConfig) -> None:
    """Set `rotary.inv_freq` to Llama-3.1 scaling with the model's four values (call right
    after GPTModel's construction, before the first forward: `forward` is lru-cached)."""
    if not model.rope_scaling:
        return
    params = inspect.signature(rotary._apply_scaling).parameters
    if not all(name in params for name in _SCALING_ARGS):
        raise RuntimeError(f"Megatron-Core's RotaryEmbedding._apply_scaling no longer takes {_SCALING_ARGS} "
                           f"(it takes {tuple(params)}); models/rope.py must be updated")
    unscaled = _unscaled_inv_freq(model, rotary.inv_freq.device)
    upstream = rotary._apply_scaling(unscaled, factor=model.rope_scaling_factor)
    if not torch.equal(upstream, rotary.inv_freq):
        raise RuntimeError("Megatron-Core's RotaryEmbedding built inv_freq differently from what models/rope.py "
                           "reproduces (unscaled frequencies or scaling changed upstream); update models/rope.py")
    rotary.inv_freq = rotary._apply_scaling(
        unscaled, factor=model.rope_scaling_factor, low_freq_factor=model.rope_scaling_low_freq_factor,
        high_freq_factor=model.rope_scaling_high_freq_factor,
        original_max_position_embeddings=model.rope_scaling_original_max_position_embeddings,
    )

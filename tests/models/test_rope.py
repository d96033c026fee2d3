"""models.rope: Llama-3.1 RoPE scaling with all four values, as transformers computes it."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from models.config import ModelConfig, get_flavor
from models.rope import apply_llama3_scaling

transformers = pytest.importorskip("transformers")
VALUES = dict(rope_scaling_factor=4.0, rope_scaling_low_freq_factor=2.0, rope_scaling_high_freq_factor=8.0,
              rope_scaling_original_max_position_embeddings=128)


def _model(**update) -> ModelConfig:
    return get_flavor("tiny-llama").model_copy(update=dict(num_attention_heads=4, rope_scaling=True, **update))


def _megatron(model: ModelConfig) -> RotaryEmbedding:
    # As GPTModel builds it: only the factor reaches the constructor.
    return RotaryEmbedding(kv_channels=model.head_dim, rotary_percent=1.0, rotary_base=int(model.rope_base),
                           rope_scaling=True, rope_scaling_factor=model.rope_scaling_factor,
                           use_cpu_initialization=True)


def _transformers(model: ModelConfig) -> torch.Tensor:
    config = transformers.LlamaConfig(
        hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads, head_dim=model.head_dim,
        max_position_embeddings=model.max_seq_length, rope_parameters={
            "rope_type": "llama3", "rope_theta": model.rope_base, "factor": model.rope_scaling_factor,
            "low_freq_factor": model.rope_scaling_low_freq_factor,
            "high_freq_factor": model.rope_scaling_high_freq_factor,
            "original_max_position_embeddings": model.rope_scaling_original_max_position_embeddings})
    inv_freq, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    return inv_freq


def test_all_four_values_match_transformers():
    model = _model(**VALUES)
    rotary = _megatron(model)
    before = rotary.inv_freq.clone()
    apply_llama3_scaling(rotary, model)
    expected = _transformers(model)
    torch.testing.assert_close(rotary.inv_freq, expected, rtol=1e-6, atol=0)
    # Upstream alone (factor only, low/high/original 1/4/8192) is far from it at these values,
    # and the three bands all occur: kept, interpolated, divided by the factor.
    assert (before - expected).abs().max() > 1e-2
    ratio = rotary.inv_freq / _megatron(model.model_copy(update=dict(rope_scaling=False))).inv_freq
    assert ratio.max() == 1.0 and ratio.min() == pytest.approx(1 / 4) and ((ratio < 1) & (ratio > 1 / 4)).any()


def test_default_values_leave_upstream_result_unchanged():
    model = _model()
    rotary = _megatron(model)
    before = rotary.inv_freq.clone()
    apply_llama3_scaling(rotary, model)
    assert torch.equal(rotary.inv_freq, before)
    torch.testing.assert_close(rotary.inv_freq, _transformers(model), rtol=1e-6, atol=0)


def test_guard_fails_loudly_when_upstream_built_something_else():
    model = _model(**VALUES)
    rotary = _megatron(model)
    rotary.inv_freq = rotary.inv_freq * 1.001  # as if upstream's formula had changed
    with pytest.raises(RuntimeError, match="models/rope.py"):
        apply_llama3_scaling(rotary, model)


def test_config_fields_default_and_validate():
    old = get_flavor("tiny-llama").model_dump()
    for key in ("rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                "rope_scaling_original_max_position_embeddings"):
        old.pop(key)  # a config.yaml / meta.json written before these fields existed
    loaded = ModelConfig.model_validate(old)
    assert (loaded.rope_scaling_low_freq_factor, loaded.rope_scaling_high_freq_factor,
            loaded.rope_scaling_original_max_position_embeddings) == (1.0, 4.0, 8192)
    with pytest.raises(ValueError, match="rope_scaling_low_freq_factor=4.0 must be below rope_scaling_high_freq_factor=4.0"):
        ModelConfig.model_validate({**old, "rope_scaling": True, "rope_scaling_low_freq_factor": 4.0})

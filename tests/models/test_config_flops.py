"""Flavors, vocab padding, and the parameter/FLOP formulas against a real built model."""

from __future__ import annotations

import pytest

from models.config import FLAVORS, ModelConfig, get_flavor
from models.flops import forward_flops_per_token, total_params, training_flops_per_token
from tests.distributed import run_ranks


def test_unknown_flavor_suggests_closest():
    with pytest.raises(ValueError, match="Did you mean 'llama3-8b'"):
        get_flavor("llama3-8")


def test_vocab_padding_is_layout_independent():
    assert get_flavor("tiny-llama").padded_vocab_size == 4096
    assert get_flavor("llama3-8b").padded_vocab_size == 128256
    assert get_flavor("gpt3-175b").padded_vocab_size == 50304


@pytest.mark.parametrize("name, billions", [
    ("llama2-7b", 6.74), ("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3.1-405b", 405.85),
    ("gpt3-175b", 174.6), ("mixtral-8x7b", 46.7),
])
def test_published_sizes(name, billions):
    assert total_params(FLAVORS[name]) / 1e9 == pytest.approx(billions, rel=0.01)


def test_forward_flops_hand_computed():
    m = ModelConfig(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                    num_query_groups=1, vocab_size=128, max_seq_length=16)
    # per layer: qkv 2*8*(2*4+2*1*4)=256, attention 2*2*16*2*4*0.5=256, proj 2*8*8=128,
    # swiglu mlp 2*8*16*3=768 -> 1408; x2 layers + logits 2*8*128=2048 -> 4864.
    assert forward_flops_per_token(m, 16) == 4864
    assert training_flops_per_token(m, 16) == 3 * 4864


def test_invalid_model_config_messages():
    with pytest.raises(ValueError, match="num_query_groups=3 must divide num_attention_heads=8"):
        get_flavor("tiny-llama").model_copy(update={}).model_validate(
            {**get_flavor("tiny-llama").model_dump(), "num_query_groups": 3})


def count_built_params(flavor: str) -> dict:
    from models.build import build_model_chunks
    from models.runtime import RuntimeOptions
    from models.layout import ParallelLayout
    from pretrain.runtime import init_distributed, shutdown

    layout = ParallelLayout()
    init_distributed(layout, seed=0)
    chunks = build_model_chunks(get_flavor(flavor), layout, RuntimeOptions(seed=0, spec="portable"))
    count = sum(p.numel() for c in chunks for p in c.parameters())
    shutdown()
    return {"params": count}


@pytest.mark.distributed
@pytest.mark.parametrize("flavor", ["tiny-llama", "tiny-gpt", "tiny-llama-tied", "tiny-moe"])
def test_param_formula_matches_built_model(flavor):
    (result,) = run_ranks(1, "tests.models.test_config_flops:count_built_params", flavor=flavor)
    assert result["params"] == total_params(get_flavor(flavor))

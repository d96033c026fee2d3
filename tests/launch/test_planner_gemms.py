"""launch.planner.gemms: the narrow-GEMM factors are the recorded H200 sweep's, wide layers
keep the fitted efficiency, narrow experts lose it, and the expert shapes carry the FLOPs
models.flops counts."""

from __future__ import annotations

import json
import pathlib
import statistics

import pytest

from launch.planner.candidate import Candidate
from launch.planner.gemms import NARROW_FACTORS, WIDTHS, gemm_factor, layer_gemms, linear_gemm_factor, side_factor
from launch.planner.throughput import core_attention_flops, layer_and_logit_flops
from pretrain.config import apply_overrides
from pretrain.recipes import get_recipe

SWEEP = pathlib.Path(__file__).parent / "fixtures" / "h200-runs" / "gemm-h200.jsonl"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_factors_are_the_recorded_sweeps(precision):
    records = [r for r in map(json.loads, SWEEP.read_text().splitlines())
               if r["part"] == "sweep" and r["precision"] == precision]
    wide = statistics.median(r["fraction_of_peak"] for r in records if min(r["m"], r["k"], r["n"]) >= WIDTHS[-1])
    for side, name, key in (("out", "narrow N", "n"), ("k", "narrow K", "k")):
        measured = {r[key]: min(1.0, r["fraction_of_peak"] / wide) for r in records if r["name"] == name}
        for width, factor in zip(WIDTHS[:-1], NARROW_FACTORS[precision][side], strict=False):
            assert factor == pytest.approx(measured[width], abs=0.002), (side, width)


def test_side_factor_shape():
    assert side_factor(4096, "fp8", "k") == 1.0 and side_factor(2048, "bf16", "out") == 1.0
    assert side_factor(64, "fp8", "k") == pytest.approx(NARROW_FACTORS["fp8"]["k"][0] / 2)
    assert NARROW_FACTORS["fp8"]["k"][1] < side_factor(300, "fp8", "k") < NARROW_FACTORS["fp8"]["k"][2]
    assert side_factor(100, "fp32", "k") == 1.0  # not measured: no factor
    assert gemm_factor(8192, 256, 256, "fp8") == pytest.approx(0.357 * 0.947)


def _candidate(recipe, *overrides, world=1):
    config = apply_overrides(get_recipe(recipe), overrides=list(overrides))
    return Candidate.from_config(config, world)


def _linear(c):
    layer, _ = layer_and_logit_flops(c)
    return (layer - core_attention_flops(c)) * c.seq_length * c.micro_batch / (c.tp * c.cp)


def test_wide_layers_keep_the_fitted_efficiency():
    """The published Llama-3 layouts the efficiencies were fitted on get no factor."""
    for recipe, overrides, world in [("llama3-8b", ["parallel.tensor_parallel=1", "parallel.sequence_parallel=false"], 8),
                                     ("llama3-70b", ["parallel.tensor_parallel=4"], 64),
                                     ("llama3-70b", ["model=llama3.1-405b", "parallel.tensor_parallel=8"], 1024)]:
        c = _candidate(recipe, *overrides, "runtime.fp8=hybrid", "runtime.fp8_recipe=tensorwise", world=world)
        assert linear_gemm_factor(c, _linear(c), "fp8") == 1.0, recipe


def test_narrow_experts_lose_efficiency():
    """DeepSeek-V3's 2048-wide experts split 8 ways by expert TP are 256 wide: in FP8 their
    GEMMs run at about half the fitted efficiency; unsplit (EP) they stay wide."""
    split = _candidate("deepseek-v3", "parallel.tensor_parallel=8", "parallel.expert_parallel=1",
                       "parallel.pipeline_parallel=1", "parallel.context_parallel=1", world=8)
    whole = _candidate("deepseek-v3", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false",
                       "parallel.expert_parallel=8", "parallel.expert_tensor_parallel=1",
                       "parallel.pipeline_parallel=1", "parallel.context_parallel=1", world=8)
    assert split.etp == 8 and whole.etp == 1
    assert linear_gemm_factor(split, _linear(split), "fp8") < 0.6
    assert linear_gemm_factor(whole, _linear(whole), "fp8") > 0.95


def test_expert_gemms_carry_the_moe_layers_flops():
    c = _candidate("qwen3-30b-a3b", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false",
                   "parallel.expert_parallel=8", "parallel.pipeline_parallel=1", "parallel.context_parallel=1", world=8)
    listed = sum(g.flops for g in layer_gemms(c))
    assert listed == pytest.approx(_linear(c), rel=0.01)  # the router's GEMM is the rest

"""FP8 recipes vs the machine: the rules of Transformer Engine 2.11 applied to faked GPUs on CPU,
and the mapping of our keys onto Megatron-Core's TransformerConfig."""

from __future__ import annotations

import pytest

from models.build import transformer_config
from models.config import get_flavor
from models.layout import ParallelLayout
from models.precision import MachineFacts, machine_problems, recipe_problem, supported_recipes
from models.runtime import RuntimeOptions

H100 = MachineFacts(capability=(9, 0), gpu_name="NVIDIA H100 80GB HBM3", cuda="13.0", te_version="2.11.0")
B200 = MachineFacts(capability=(10, 0), gpu_name="NVIDIA B200", cuda="13.0", te_version="2.11.0")
RTX_PRO = MachineFacts(capability=(12, 0), gpu_name="NVIDIA RTX PRO 6000", cuda="13.0", te_version="2.11.0")
A100 = MachineFacts(capability=(8, 0), gpu_name="NVIDIA A100-SXM4-80GB", cuda="12.4", te_version="2.11.0")
L40S = MachineFacts(capability=(8, 9), gpu_name="NVIDIA L40S", cuda="12.4", te_version="2.11.0")
CPU = MachineFacts()


@pytest.mark.parametrize("facts, runs", [
    (H100, ["delayed", "tensorwise", "blockwise"]),
    (B200, ["delayed", "tensorwise", "blockwise", "mxfp8"]),
    (RTX_PRO, ["delayed", "tensorwise", "blockwise"]),  # TE 2.11: no MXFP8 on 12.x yet
    (L40S, ["delayed", "tensorwise"]),  # Ada: no block scaling
    (A100, []),
    (CPU, []),
    (MachineFacts(capability=(9, 0), cuda="12.4", te_version="2.11.0"), ["delayed", "tensorwise"]),  # CUDA < 12.9
    (MachineFacts(capability=(8, 9), cuda="12.0", te_version="2.11.0"), []),  # Ada needs CUDA 12.1
    (MachineFacts(capability=(9, 0), cuda="13.0", te_version=None), []),  # no Transformer Engine
    (MachineFacts(capability=(9, 0), cuda="13.0", te_version="2.2.0"), ["delayed", "tensorwise"]),
])
def test_supported_recipes_follow_transformer_engine_rules(facts, runs):
    assert supported_recipes(facts) == runs


@pytest.mark.parametrize("recipe, facts, message", [
    ("mxfp8", H100, "MXFP8 needs compute capability 10.0 (Blackwell); this GPU (NVIDIA H100 80GB HBM3) is 9.0 (Hopper)"),
    ("mxfp8", RTX_PRO, "MXFP8 is not supported on compute capability 12.0 (Blackwell RTX) or newer by Transformer "
                       "Engine 2.11; this GPU (NVIDIA RTX PRO 6000) is 12.0 (Blackwell RTX)"),
    ("delayed", A100, "FP8 delayed scaling needs compute capability 8.9 (Ada); this GPU (NVIDIA A100-SXM4-80GB) is 8.0"),
    ("blockwise", L40S, "FP8 block scaling needs compute capability 9.0 (Hopper); this GPU (NVIDIA L40S) is 8.9 (Ada)"),
    ("blockwise", MachineFacts(capability=(9, 0), cuda="12.8", te_version="2.11.0"),
     "FP8 block scaling needs CUDA 12.9 or newer; torch is built for CUDA 12.8"),
    ("blockwise", MachineFacts(capability=(9, 0), cuda="13.0", te_version="2.2.0"),
     "FP8 block scaling (Float8BlockScaling) needs Transformer Engine >= 2.3.0.dev0 (Megatron-Core 0.19.2); 2.2.0 is installed"),
    ("tensorwise", CPU, "FP8 current (per-tensor) scaling needs an NVIDIA GPU of compute capability 8.9 (Ada) "
                        "or newer; this machine has none"),
])
def test_recipe_problem_names_the_requirement_and_this_machine(recipe, facts, message):
    assert recipe_problem(recipe, facts) == message


def test_machine_problems_suggest_what_this_gpu_runs():
    runtime = RuntimeOptions(dtype="bf16", fp8="e4m3", fp8_recipe="mxfp8")
    (problem,) = machine_problems(runtime, "te", H100)
    assert problem.startswith("MXFP8 needs compute capability 10.0 (Blackwell)")
    assert problem.endswith("(runtime.fp8_recipe=mxfp8); set runtime.fp8_recipe to one this machine runs: "
                            "delayed, tensorwise, blockwise")
    assert machine_problems(runtime, "te", B200) == []
    assert machine_problems(runtime, "portable", B200) == [
        "runtime.fp8 needs the Transformer Engine spec; set runtime.spec=te or auto on a GPU with Transformer Engine"]
    wgrad = RuntimeOptions(gradient_accumulation_fusion=True)
    (problem,) = machine_problems(wgrad, "te", H100)
    assert problem.startswith("runtime.gradient_accumulation_fusion=true needs APEX's fused_weight_gradient_mlp_cuda")
    assert machine_problems(wgrad, "te", MachineFacts(**{**H100.__dict__, "apex_wgrad": True})) == []
    fused = RuntimeOptions(fused_rope=True, fused_swiglu=False)
    assert machine_problems(fused, "portable", CPU) == [
        "runtime.fused_rope=true needs the Transformer Engine spec (runtime.spec=te on a GPU with Transformer "
        "Engine); remove it on this machine"]


def _tconfig(**runtime):
    return transformer_config(get_flavor("tiny-llama"), ParallelLayout(), RuntimeOptions(dtype="bf16", **runtime),
                              spec="te")


def test_fp8_keys_map_onto_megatron_transformer_config():
    delayed = _tconfig(fp8="hybrid", fp8_amax_history_len=16, fp8_amax_compute_algo="max", fp8_margin=1)
    assert (delayed.fp8, delayed.fp8_recipe, delayed.fp8_amax_history_len, delayed.fp8_amax_compute_algo,
            delayed.fp8_margin, delayed.fp8_param, delayed.first_last_layers_bf16) == \
        ("hybrid", "delayed", 16, "max", 1, False, False)
    current = _tconfig(fp8="hybrid", fp8_recipe="tensorwise", fp8_param_gather=True,
                       fp8_bf16_first_layers=1, fp8_bf16_last_layers=2)
    assert (current.fp8_recipe, current.fp8_param, current.first_last_layers_bf16,
            current.num_layers_at_start_in_bf16, current.num_layers_at_end_in_bf16) == \
        ("tensorwise", True, True, 1, 2)
    # Megatron-Core's own defaults stay in force when our keys are unset.
    assert (current.fp8_amax_history_len, current.fp8_amax_compute_algo, current.fp8_margin) == (1, "most_recent", 0)
    off = _tconfig()
    assert off.fp8 is None and off.fp8_param is False


def test_fused_kernel_keys_map_onto_transformer_config():
    default = _tconfig()
    # On CPU the default keeps every fusion off (SwiGLU fusion defaults on only with te on a GPU).
    assert (default.bias_activation_fusion, default.apply_rope_fusion, default.cross_entropy_loss_fusion,
            default.gradient_accumulation_fusion) == (False, False, False, False)
    fused = _tconfig(fused_swiglu=True, fused_cross_entropy=True, gradient_accumulation_fusion=True)
    assert (fused.bias_activation_fusion, fused.cross_entropy_loss_fusion, fused.cross_entropy_fusion_impl,
            fused.gradient_accumulation_fusion) == (True, True, "te", True)


def test_precision_record_fills_in_the_defaults_in_force():
    assert RuntimeOptions(dtype="bf16").precision() == {"dtype": "bf16", "fp8": None}
    assert RuntimeOptions(dtype="bf16", fp8="hybrid").precision() == {
        "dtype": "bf16", "fp8": "hybrid", "fp8_recipe": "delayed", "fp8_param_gather": False,
        "fp8_bf16_first_layers": 0, "fp8_bf16_last_layers": 0,
        "fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent", "fp8_margin": 0}
    assert RuntimeOptions(dtype="bf16", fp8="e4m3", fp8_recipe="blockwise").precision() == {
        "dtype": "bf16", "fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param_gather": False,
        "fp8_bf16_first_layers": 0, "fp8_bf16_last_layers": 0}

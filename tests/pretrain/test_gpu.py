"""GPU-only: Transformer Engine spec vs portable, FP8 recipes vs BF16, exact resume, grouped-GEMM
MoE, sharded data parallelism on one GPU, TP2 / CP2 on two. Run on a GPU machine with
`bash dev.sh gpu-test` (installs the `gpu` extra); without CUDA every test here skips, saying why.

Tolerances (relative, per step, tiny models from identical initial weights):
  te vs portable          fp32: 2e-4 every step; bf16: 5e-3 at step 1, 3e-2 over 8 steps
                          (also with document masking: te's THD packed sequences; and
                          tiny-qwen3's q/k norms, fp32)
  FP8 recipe vs BF16      3e-2 every step of 20 (FP8 GEMMs on a 256-wide model), and the loss falls
  exact resume            BF16 with deterministic kernels: bitwise; FP8: 1e-3
  grouped GEMM vs loop    fp32: 1e-4 every step
  TP2 vs TP1 (te)         fp32: 1e-4; CP2 (TE ring attention, bf16) vs CP1: 2e-2
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from models.precision import FP8_RECIPES, probe_machine, recipe_problem, supported_recipes
from tests.compare import assert_steps_close, assert_steps_equal
from tests.distributed import REPO, run_ranks
from tests.pretrain.workers import logged_losses

FACTS = probe_machine()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run `bash dev.sh gpu-test` on one"),
]
# Without CUDA the module's mark gives the reason; these only speak on a GPU machine.
needs_te = pytest.mark.skipif(FACTS.has_gpu and not FACTS.has_te,
                              reason="needs Transformer Engine: pip install '.[gpu]' (bash dev.sh gpu-test does)")
two_gpus = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                              reason="needs 2 GPUs; this machine has one")

BASE = ["schedule.micro_batch_size=2", "schedule.global_batch_size=8", "schedule.seq_length=64",
        "schedule.eval_interval=0", "schedule.warmup_steps=2", "data.demo=false", "data.mock=true",
        "logging.tensorboard=false", "optimizer.lr=1e-3"]
# FP8 GEMMs want every dimension a multiple of 16 (block scaling: 128): 256-wide, FFN 512.
FP8_MODEL = ["model.hidden_size=256", "model.ffn_hidden_size=512"]
# Deterministic kernels: TE's attention backward without atomics, cuBLAS with a fixed workspace.
DETERMINISTIC = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _losses(tmp_path, tag, overrides, recipe="tiny-llama", nproc=1, env=None, steps=8):
    results = run_ranks(nproc, "tests.pretrain.workers:train", recipe=recipe, env=env,
                        overrides=BASE + [f"schedule.train_steps={steps}", f"logging.run_dir={tmp_path / tag}",
                                          *overrides])
    losses = logged_losses(results)
    assert len(losses) == steps and all(map(torch.isfinite, torch.tensor(losses)))
    return losses


def _close(got, want, rel, what):
    assert_steps_close(got, want, rtol=rel, what=what)


def test_capability_table_agrees_with_transformer_engine():
    """models.precision's rules vs Transformer Engine's own answer on this GPU."""
    if not FACTS.has_te:
        pytest.skip("needs Transformer Engine: pip install '.[gpu]'")
    import transformer_engine.pytorch as te

    theirs = {"delayed": te.is_fp8_available(), "tensorwise": te.is_fp8_available(),
              "blockwise": te.is_fp8_block_scaling_available(), "mxfp8": te.is_mxfp8_available()}
    assert supported_recipes(FACTS) == [r for r in FP8_RECIPES if theirs[r]]


@needs_te
@pytest.mark.parametrize("dtype, first, every", [("fp32", 2e-4, 2e-4), ("bf16", 5e-3, 3e-2)])
def test_te_spec_matches_portable(tmp_path, dtype, first, every):
    te = _losses(tmp_path, "te", [f"runtime.dtype={dtype}", "runtime.spec=te"])
    portable = _losses(tmp_path, "portable", [f"runtime.dtype={dtype}", "runtime.spec=portable"])
    _close(te[:1], portable[:1], first, f"{dtype} te vs portable")
    _close(te, portable, every, f"{dtype} te vs portable")
    assert te[-1] < te[0] - 0.5, "the run must train, or parity proves nothing"


@needs_te
def test_te_spec_with_qk_norms_matches_portable(tmp_path):
    """tiny-qwen3 (issue 45): the te spec's TENorm q/k norms (Megatron-Core's qk_layernorm) vs the
    portable spec's PortableNorm ones, head_dim 32 != hidden / heads, fp32."""
    qwen3 = ["model=tiny-qwen3", "runtime.dtype=fp32"]
    te = _losses(tmp_path, "te", qwen3 + ["runtime.spec=te"])
    portable = _losses(tmp_path, "portable", qwen3 + ["runtime.spec=portable"])
    _close(te, portable, 2e-4, "tiny-qwen3 fp32 te vs portable")
    assert te[-1] < te[0] - 0.5, "the run must train, or parity proves nothing"


@needs_te
@pytest.mark.parametrize("dtype, first, every", [("fp32", 2e-4, 2e-4), ("bf16", 5e-3, 3e-2)])
def test_te_packed_document_masking_matches_portable(tmp_path, dtype, first, every):
    """Document masking: te runs each micro-batch as one THD sequence through TE's fused
    attention (cu_seqlens, no dense mask), portable with a bool mask; same losses. Masking
    must change the te run by far more than the tolerance (else the THD path did nothing)."""
    from tests.pretrain.workers import document_data

    text = document_data(tmp_path) + [f"runtime.dtype={dtype}"]
    docs = text + ["data.reset_attention_mask=true", "data.reset_position_ids=true"]
    te = _losses(tmp_path, "te", docs + ["runtime.spec=te"])
    portable = _losses(tmp_path, "portable", docs + ["runtime.spec=portable"])
    _close(te[:1], portable[:1], first, f"{dtype} masked te vs portable")
    _close(te, portable, every, f"{dtype} masked te vs portable")
    unmasked = _losses(tmp_path, "te-unmasked", text + ["runtime.spec=te"])
    assert max(abs(a - b) / abs(b) for a, b in zip(te, unmasked)) > 3 * first, "masking changed nothing on te"


@pytest.fixture(scope="module")
def bf16_reference(module_tmp_factory):
    if not FACTS.has_te:
        pytest.skip("needs Transformer Engine: pip install '.[gpu]'")
    return _losses(module_tmp_factory.mktemp("bf16"), "bf16", FP8_MODEL + ["runtime.dtype=bf16", "runtime.spec=te"],
                   steps=20)


FP8_CASES = [(recipe, []) for recipe in FP8_RECIPES] + [
    ("delayed", ["runtime.fp8_param_gather=true"]),
    ("tensorwise", ["runtime.fp8_param_gather=true"]),
    ("tensorwise", ["runtime.fp8_bf16_first_layers=1", "runtime.fp8_bf16_last_layers=1"]),
    ("delayed", ["runtime.fp8_amax_history_len=16", "runtime.fp8_amax_compute_algo=max"]),
]


@needs_te
@pytest.mark.parametrize("recipe, extra", FP8_CASES, ids=[f"{r}{'+' + '+'.join(e) if e else ''}" for r, e in FP8_CASES])
def test_fp8_recipe_trains_like_bf16(tmp_path, bf16_reference, recipe, extra):
    why = recipe_problem(recipe, FACTS)
    if why:
        pytest.skip(why)
    fmt = "e4m3" if recipe == "mxfp8" else "hybrid"
    fp8 = _losses(tmp_path, recipe, FP8_MODEL + ["runtime.dtype=bf16", "runtime.spec=te", f"runtime.fp8={fmt}",
                                                 f"runtime.fp8_recipe={recipe}", *extra], steps=20)
    _close(fp8, bf16_reference, 3e-2, f"FP8 {recipe} {extra} vs BF16")
    assert fp8[-1] < fp8[0] - 0.5


@needs_te
def test_bf16_resume_is_bitwise_with_deterministic_kernels(tmp_path):
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.save_interval=3"]
    over = ["runtime.dtype=bf16", "runtime.spec=te"]
    full = _losses(tmp_path, "full", over + ckpt + ["checkpoint.resume=none"], env=DETERMINISTIC, steps=6)
    resumed = logged_losses(run_ranks(
        1, "tests.pretrain.workers:train", recipe="tiny-llama", env=DETERMINISTIC,
        overrides=BASE + over + ckpt + ["schedule.train_steps=6", f"logging.run_dir={tmp_path / 'resumed'}",
                                        "checkpoint.resume=3", "checkpoint.on_newer=move_aside"]))
    # BF16 resume on GPU must be bitwise identical with deterministic kernels.
    assert_steps_equal(resumed, full[3:], what="BF16 resume loss", start=4)


@needs_te
def test_fp8_resume_matches(tmp_path):
    recipes = supported_recipes(FACTS)
    if not recipes:
        pytest.skip("this GPU runs no FP8 recipe")
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.save_interval=3"]
    over = FP8_MODEL + ["runtime.dtype=bf16", "runtime.spec=te", "runtime.fp8=hybrid", f"runtime.fp8_recipe={recipes[0]}"]
    full = _losses(tmp_path, "full", over + ckpt + ["checkpoint.resume=none"], env=DETERMINISTIC, steps=6)
    resumed = logged_losses(run_ranks(
        1, "tests.pretrain.workers:train", recipe="tiny-llama", env=DETERMINISTIC,
        overrides=BASE + over + ckpt + ["schedule.train_steps=6", f"logging.run_dir={tmp_path / 'resumed'}",
                                        "checkpoint.resume=3", "checkpoint.on_newer=move_aside"]))
    _close(resumed, full[3:], 1e-3, f"FP8 {recipes[0]} resume")


@needs_te
@pytest.mark.parametrize("before, after", [("delayed", "tensorwise"), (None, "delayed")])
def test_resume_with_another_recipe_warns_and_trains(tmp_path, before, after):
    for recipe in (before, after):
        if recipe and recipe_problem(recipe, FACTS):
            pytest.skip(recipe_problem(recipe, FACTS))

    def run(recipe, steps):
        fp8 = ["runtime.fp8=hybrid", f"runtime.fp8_recipe={recipe}"] if recipe else []
        cmd = [sys.executable, "-m", "pretrain", "--recipe", "tiny-llama", *BASE, *FP8_MODEL, "runtime.dtype=bf16",
               "runtime.spec=te", *fp8, f"schedule.train_steps={steps}", f"checkpoint.dir={tmp_path / 'ckpt'}",
               f"logging.run_dir={tmp_path / 'run'}"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    run(before, 3)
    out = run(after, 6)
    assert "was trained with other precision settings than this run" in out
    assert f"fp8_recipe {before!r} -> {after!r}" in out or f"fp8 None -> 'hybrid'" in out
    assert "step 6/6" in out


@needs_te
def test_moe_grouped_gemm_matches_the_expert_loop(tmp_path):
    over = ["runtime.dtype=fp32", "runtime.spec=te"]
    grouped = _losses(tmp_path, "grouped", over + ["runtime.moe_grouped_gemm=true"], recipe="tiny-moe")
    loop = _losses(tmp_path, "loop", over + ["runtime.moe_grouped_gemm=false"], recipe="tiny-moe")
    _close(grouped, loop, 1e-4, "grouped GEMM vs expert loop")
    assert grouped[-1] < grouped[0]


@two_gpus
def test_sharded_data_parallel_matches_ddp(tmp_path):
    """ZeRO-2 and ZeRO-3 (Megatron-FSDP) over 2 GPUs against plain DDP over the same 2."""
    over = ["runtime.dtype=fp32", "runtime.spec=auto"]
    plain = _losses(tmp_path, "ddp", over + ["parallel.sharding=none"], nproc=2)
    for level in ("zero2", "zero3"):
        _close(_losses(tmp_path, level, over + [f"parallel.sharding={level}"], nproc=2), plain, 1e-5,
               f"{level} vs DDP")


def test_optimizer_cpu_offload_matches_on_gpu(tmp_path):
    """Megatron's optimizer CPU offload (fp32 main weights and Adam moments in host memory,
    Adam stepped on the CPU) against the same run with the optimizer on the GPU."""
    over = ["runtime.dtype=fp32", "runtime.spec=auto", "parallel.sharding=zero1"]
    _close(_losses(tmp_path, "offload", over + ["optimizer.cpu_offload=true"]),
           _losses(tmp_path, "on-gpu", over), 1e-5, "optimizer CPU offload vs on GPU")


@needs_te
@two_gpus
def test_tp2_matches_tp1(tmp_path):
    over = ["runtime.dtype=fp32", "runtime.spec=te"]
    _close(_losses(tmp_path, "tp2", over + ["parallel.tensor_parallel=2"], nproc=2),
           _losses(tmp_path, "tp1", over), 1e-4, "TP2 vs TP1")


@needs_te
@two_gpus
def test_cp2_ring_attention_matches_cp1(tmp_path):
    # TE's context parallelism runs in flash/fused attention, which has no fp32: bf16 both.
    over = ["runtime.dtype=bf16", "runtime.spec=te", "schedule.seq_length=128"]
    cp2 = _losses(tmp_path, "cp2", over + ["parallel.context_parallel=2", "parallel.cp_comm_type=p2p"], nproc=2)
    _close(cp2, _losses(tmp_path, "cp1", over), 2e-2, "CP2 ring attention vs CP1")

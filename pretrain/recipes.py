"""Recipes: functions returning a validated ExperimentConfig. Variants derive from a base.

Production recipes are sized for H100 nodes (8 GPUs each) with the layouts commonly used
for these models; `launch.plan` can rank alternatives for a different cluster.
"""

from __future__ import annotations

from typing import Callable

from models.config import get_flavor
from models.layout import ParallelLayout
from models.suggest import did_you_mean
from pretrain.config import (
    CheckpointConfig,
    DataConfig,
    ExperimentConfig,
    LoggingConfig,
    OptimizerConfig,
    RuntimeConfig,
    ScheduleConfig,
)


def tiny_llama() -> ExperimentConfig:
    """A 4-layer GQA Llama that trains on the shipped demo corpus on CPU in minutes."""
    return ExperimentConfig(
        name="tiny-llama",
        model=get_flavor("tiny-llama"),
        runtime=RuntimeConfig(spec="auto", dtype="fp32"),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, weight_decay=0.01, clip_grad=1.0),
        schedule=ScheduleConfig(
            train_steps=300, warmup_steps=20, micro_batch_size=4, global_batch_size=16,
            seq_length=128, eval_interval=100, eval_steps=2,
        ),
        data=DataConfig(demo=True),
        logging=LoggingConfig(run_dir="runs/tiny-llama", log_interval=10),
    )


def tiny_moe() -> ExperimentConfig:
    """tiny-llama with 4 experts (top-2) per layer: the MoE/EP path on CPU."""
    base = tiny_llama()
    return base.model_copy(update=dict(
        name="tiny-moe", model=get_flavor("tiny-moe"),
        logging=base.logging.model_copy(update=dict(run_dir="runs/tiny-moe")),
    ))


def tiny_qwen3() -> ExperimentConfig:
    """tiny-llama's run with the tiny-qwen3 flavor: q/k RMSNorm, head_dim 32 != hidden / heads."""
    base = tiny_llama()
    return base.model_copy(update=dict(
        name="tiny-qwen3", model=get_flavor("tiny-qwen3"),
        logging=base.logging.model_copy(update=dict(run_dir="runs/tiny-qwen3")),
    ))


def tiny_qwen3_moe() -> ExperimentConfig:
    """tiny-llama's run with the tiny-qwen3-moe flavor: tiny-qwen3's attention, 8 fine-grained
    experts (64 wide) per layer, top-4 renormalised: the Qwen3-MoE path on CPU."""
    base = tiny_llama()
    return base.model_copy(update=dict(
        name="tiny-qwen3-moe", model=get_flavor("tiny-qwen3-moe"),
        logging=base.logging.model_copy(update=dict(run_dir="runs/tiny-qwen3-moe")),
    ))


def tiny_deepseek() -> ExperimentConfig:
    """tiny-llama's run with the tiny-deepseek flavor: multi-latent attention, layer 1 dense, then
    8 routed experts (top-2 of 2 groups out of 4, sigmoid with the aux-loss-free bias) and a
    shared expert: the DeepSeek-V3 path on CPU."""
    base = tiny_llama()
    return base.model_copy(update=dict(
        name="tiny-deepseek", model=get_flavor("tiny-deepseek"),
        logging=base.logging.model_copy(update=dict(run_dir="runs/tiny-deepseek")),
    ))


def _h100_base(name: str, flavor: str, layout: ParallelLayout, *, seq: int, gbs: int,
               lr: float, steps: int) -> ExperimentConfig:
    return ExperimentConfig(
        name=name,
        model=get_flavor(flavor),
        parallel=layout,
        runtime=RuntimeConfig(spec="auto", dtype="bf16", recompute="selective"),
        optimizer=OptimizerConfig(lr=lr, min_lr=lr / 10, weight_decay=0.1, clip_grad=1.0),
        schedule=ScheduleConfig(
            train_steps=steps, warmup_steps=2000, micro_batch_size=1, global_batch_size=gbs,
            seq_length=seq, eval_interval=1000, eval_steps=10,
        ),
        data=DataConfig(mock=True),
        checkpoint=CheckpointConfig(dir=f"runs/{name}/checkpoints", save_interval=1000, async_save=True),
        logging=LoggingConfig(run_dir=f"runs/{name}", log_interval=10),
    )


def llama3_8b() -> ExperimentConfig:
    """Llama-3 8B, 8k context; TP2 keeps activations per GPU modest at seq 8192."""
    return _h100_base("llama3-8b", "llama3-8b", ParallelLayout(tensor_parallel=2, sequence_parallel=True),
                      seq=8192, gbs=512, lr=3e-4, steps=250_000)


def qwen3_8b() -> ExperimentConfig:
    """Qwen3-8B (the published shape; models.config) at 4k context, 512 x 4096 = 2M tokens a
    step; TP2 + SP as llama3-8b (the same hidden size, heads and KV heads)."""
    return _h100_base("qwen3-8b", "qwen3-8b", ParallelLayout(tensor_parallel=2, sequence_parallel=True),
                      seq=4096, gbs=512, lr=3e-4, steps=250_000)


def qwen3_30b_a3b() -> ExperimentConfig:
    """Qwen3-30B-A3B (the published shape; models.config): 128 experts of 768, top-8, at 4k
    context, 512 x 4096 = 2M tokens a step. EP8 inside a node (16 whole experts per GPU), TP1
    (4 KV heads, 2048 hidden: attention is small), PP2 (24 layers a stage) for the 61 GB of bf16
    weights; 16 GPUs give DP8, each DP rank one EP rank, as mixtral-8x7b. Not a measured optimum:
    `launch.plan --recipe qwen3-30b-a3b --gpus 16` estimates this layout at 66.5 GiB and 9.9 s a
    step on H100s, and ranks TP2 x PP2 x CP2 x DP2 + SP without EP first (8.1 s, 73 GiB)."""
    layout = ParallelLayout(pipeline_parallel=2, expert_parallel=8)
    return _h100_base("qwen3-30b-a3b", "qwen3-30b-a3b", layout, seq=4096, gbs=512, lr=3e-4, steps=250_000)


def deepseek_v3() -> ExperimentConfig:
    """DeepSeek-V3 671B (the published shape; models.config) at 4k context, 1920 x 4096 = 7.9M
    tokens a step (the paper's final batch size), 125k steps = 1T tokens (DeepSeek trained
    14.8T; more steps than this need a larger data index than the dry run's memory check allows). DeepSeek trained with PP16 x EP64, no TP, as
    here: 61 layers as 3 (the dense ones, beside the embedding) + 14 x 4 + 2 (beside the output
    layer); 1024 GPUs give DP64, each DP rank one EP rank (4 experts per GPU). Not a measured
    layout, and too large for 80 GB in the planner's model: `python -m launch.planner.deepseek_layouts`
    estimates 134.9 GiB on stage 1, 104.3 GiB of it activations (15 microbatches in flight x 4
    MoE layers: each token's 8 routed copies and MLA's per-head q/k/v; DeepSeek recomputes MLA's
    up projections and keeps FP8 activations, which our training does not)."""
    layout = ParallelLayout(pipeline_parallel=16, expert_parallel=64, num_layers_in_first_pipeline_stage=3,
                            num_layers_in_last_pipeline_stage=2)
    return _h100_base("deepseek-v3", "deepseek-v3", layout, seq=4096, gbs=1920, lr=2.2e-4, steps=125_000)


def llama3_70b() -> ExperimentConfig:
    """Llama-3 70B: TP8 inside a node, PP4 with 5 virtual stages (80 layers = 4 x 5 x 4)."""
    layout = ParallelLayout(tensor_parallel=8, pipeline_parallel=4, virtual_pipeline=5, sequence_parallel=True)
    return _h100_base("llama3-70b", "llama3-70b", layout, seq=8192, gbs=512, lr=1.5e-4, steps=500_000)


def gpt3_175b() -> ExperimentConfig:
    """GPT-3 175B (2k context): TP8 x PP16 as in the Megatron-LM scaling paper, VPP 3
    (96 layers = 16 x 3 x 2)."""
    layout = ParallelLayout(tensor_parallel=8, pipeline_parallel=16, virtual_pipeline=3, sequence_parallel=True)
    return _h100_base("gpt3-175b", "gpt3-175b", layout, seq=2048, gbs=1536, lr=6e-5, steps=300_000)


def mixtral_8x7b() -> ExperimentConfig:
    """Mixtral 8x7B (47B params, 13B active): EP8 within DP, PP4 (8 layers per stage), TP1,
    as Megatron-LM's Mixtral example; 32 GPUs give DP8 with each DP rank one EP rank."""
    layout = ParallelLayout(pipeline_parallel=4, expert_parallel=8)
    return _h100_base("mixtral-8x7b", "mixtral-8x7b", layout, seq=4096, gbs=256, lr=1e-4, steps=250_000)


# GPU speed options for the production recipes, prepared but NOT chosen: none has been
# measured yet (issue 18 needs a GPU). Each is a list of overrides; a variant becomes a recipe
# default only after it wins in `python -m launch.benchmark_table --variant NAME` on the target
# GPU, with the measured reason written beside it. All need a GPU (validation refuses them on CPU).
SPEED_VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    # Gradient reduce-scatter during backward, parameter all-gather during the next forward
    # (distributed optimizer). Only helps at DP > 1; on one GPU it measures the hooks' cost.
    "overlap": ["optimizer.overlap_grad_reduce=true", "optimizer.overlap_param_gather=true"],
    # Larger buckets: fewer, bigger collectives (Megatron's default is max(40M, 1M x DP) params).
    "bucket-100m": ["optimizer.overlap_grad_reduce=true", "optimizer.bucket_size=100000000"],
    # Transformer Engine / Megatron fused kernels.
    "fused": ["runtime.fused_rope=true", "runtime.fused_swiglu=true", "runtime.fused_cross_entropy=true"],
    "fused+overlap": ["runtime.fused_rope=true", "runtime.fused_swiglu=true", "runtime.fused_cross_entropy=true",
                      "optimizer.overlap_grad_reduce=true", "optimizer.overlap_param_gather=true"],
    # Weight gradients accumulated into the fp32 main grads inside the GEMM (needs APEX's
    # fused_weight_gradient_mlp_cuda for Megatron-Core's output layer; validation says so).
    "wgrad-fusion": ["runtime.gradient_accumulation_fusion=true"],
    # FP8 runs only: weights kept and all-gathered in FP8.
    "fp8-param-gather": ["runtime.fp8_param_gather=true"],
}


RECIPES: dict[str, Callable[[], ExperimentConfig]] = {
    "tiny-llama": tiny_llama,
    "tiny-moe": tiny_moe,
    "tiny-qwen3": tiny_qwen3,
    "tiny-qwen3-moe": tiny_qwen3_moe,
    "tiny-deepseek": tiny_deepseek,
    "llama3-8b": llama3_8b,
    "qwen3-8b": qwen3_8b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "deepseek-v3": deepseek_v3,
    "llama3-70b": llama3_70b,
    "gpt3-175b": gpt3_175b,
    "mixtral-8x7b": mixtral_8x7b,
}


def get_recipe(name: str) -> ExperimentConfig:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}.{did_you_mean(name, RECIPES, sentence=True)} Valid recipes: {', '.join(RECIPES)}")
    return RECIPES[name]()

"""DeepSeek-V3's published layouts through the planner's memory and time model.

    python -m launch.planner.deepseek_layouts          # markdown table (peak memory, step, rank)

Rows, each estimated at its exact layout on H100 80 GB (H800s have the same 80 GB):
  deepseek-paper  DeepSeek-V3 technical report (arXiv 2412.19437, section 3.2): 2048 GPUs,
                  PP16 x EP64, no TP, ZeRO-1 data parallelism. The report does not give the
                  per-stage split of the 61 layers: our recipe's 3 | 14 x 4 | 2 is used.
  our-recipe      pretrain.recipes.deepseek_v3 on 1024 GPUs (the same split, DP64).
  megatron-bridge NVIDIA-NeMo/Megatron-Bridge recipes/deepseek/deepseek_v3.py,
                  deepseek_v3_pretrain_config: TP2 x PP16 x EP64 (expert TP 1) + SP, layers 4 | 14 x 4 | 1
                  (its pipeline layout; the last stage also holds the MTP layer), selective recompute, mbs 1, global batch 4096, gradients reduced in
                  bf16 (grad_reduce_in_fp32=False), on 1024 GPUs (its minimum at EP64: DP32).
The global batch is the recipe's (1920) except for Megatron-Bridge's row. The planner's own
choices differ from these where our training differs (fp32 Adam moments, where Bridge's
precision-aware optimizer keeps bf16 ones and DeepSeek FP8 / BF16 ones; no FP8).

Rank: where the row's estimated step time falls among the layouts the planner's search finds
fitting at the same GPU count and batch ("-" when the row does not fit: its largest terms are
shown). 61 layers (prime; 63 with the embedding and loss counted) split evenly over no PP that
divides 1024 or 2048 GPUs; the search's uneven first / last stages (launch.planner.search.
uneven_splits) give it PP2 to PP16, both published splits among them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from launch.planner.candidate import Candidate
from launch.planner.devices import get_device
from launch.planner.memory import GIB, MemoryOptions
from launch.planner.search import Evaluation, PlanError, SearchSpace, _rank_key, evaluate, rank_layouts
from launch.planner.throughput import ThroughputOptions
from models.layout import ParallelLayout
from pretrain.config import ExperimentConfig, validate_for_world
from pretrain.recipes import get_recipe

DEVICE = "h100-80gb"


def rows() -> list[tuple[str, ExperimentConfig, int, dict]]:
    """(name, config, GPUs, Candidate fields beyond the config) of each published layout."""
    recipe = get_recipe("deepseek-v3")
    bridge_layout = ParallelLayout(tensor_parallel=2, pipeline_parallel=16, expert_parallel=64,
                                   expert_tensor_parallel=1, sequence_parallel=True,
                                   num_layers_in_first_pipeline_stage=4, num_layers_in_last_pipeline_stage=1)
    bridge = recipe.model_copy(update=dict(
        parallel=bridge_layout,
        schedule=recipe.schedule.model_copy(update=dict(global_batch_size=4096)),
        runtime=recipe.runtime.model_copy(update=dict(recompute="selective"))))
    return [
        ("deepseek-paper", recipe, 2048, {}),
        ("our-recipe", recipe, 1024, {}),
        ("megatron-bridge", bridge, 1024, {"grad_reduce_in_fp32": False}),
    ]


def evaluate_row(config: ExperimentConfig, gpus: int, fields: dict) -> tuple[Evaluation, int, int]:
    """(the row's evaluation, its rank by step time among the search's fitting layouts or 0,
    how many fit)."""
    validate_for_world(config, gpus)  # the layout is one our training accepts
    device = get_device(DEVICE)
    cand = dataclasses.replace(Candidate.from_config(config, gpus), **fields)
    row = evaluate(cand, device, MemoryOptions(), ThroughputOptions())
    try:
        ranked = rank_layouts(config, world_size=gpus, device=device, space=SearchSpace(),
                              memory_options=MemoryOptions(), throughput_options=ThroughputOptions()).ranked
    except PlanError:  # no layout the search tries is valid there (e.g. CP, refused with MTP, was needed)
        ranked = []
    if not row.fits:
        return row, 0, len(ranked)
    faster = sum(1 for e in ranked if _rank_key(e) < _rank_key(row))
    return row, faster + 1, len(ranked)


def largest_terms(e: Evaluation, count: int = 3) -> str:
    terms = sorted(e.memory.terms().items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{k} {v / GIB:.1f}" for k, v in terms)


def table() -> str:
    lines = ["| layout | GPUs | peak GiB (stage) | largest terms (GiB) | s/step | MFU | rank |",
             "|---|---|---|---|---|---|---|"]
    for name, config, gpus, fields in rows():
        e, rank, fitting = evaluate_row(config, gpus, fields)
        step = f"{e.estimate.step_s:.2f}" if e.fits else "-"
        mfu = f"{100 * e.estimate.mfu:.1f}%" if e.fits else "-"
        where = f"{rank} of {fitting}" if rank else f"does not fit ({fitting} other layouts do)"
        lines.append(f"| {name}: {e.candidate.describe()} | {gpus} | {e.memory.total / GIB:.1f} ({e.memory.stage}) | "
                     f"{largest_terms(e)} | {step} | {mfu} | {where} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m launch.planner.deepseek_layouts",
                            description=__doc__.split("\n\n")[0]).parse_args(argv)
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pretrain a GPT/Llama model with Megatron-Core.

    # tiny Llama on CPU, 4 gloo ranks as TP2 x PP2:
    torchrun --nproc-per-node 4 -m pretrain --recipe tiny-llama \
        parallel.tensor_parallel=2 parallel.pipeline_parallel=2
    # show the resolved config and check it against a world size, without training:
    python -m pretrain --recipe llama3-70b --dry-run --world-size 64
    python -m pretrain --version

Config layering: recipe, then --config FILE.yaml, then key=value overrides
(e.g. schedule.train_steps=50 optimizer.lr=1e-3 data.blend='[[1.0, data/web]]'), before, between
or after the options (parse_intermixed_args, as in every CLI that takes overrides).
Ranks come from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or Slurm (SLURM_PROCID/...).
"""

from __future__ import annotations

import argparse
import sys

from data_pipeline.checks import positive_int, run_cli
from pretrain.config import (
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    dump_yaml,
    validate_for_world,
    validate_inputs,
)
from pretrain.recipes import RECIPES, get_recipe
from pretrain.version import describe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", required=True, help=f"one of: {', '.join(RECIPES)}")
    parser.add_argument("--config", help="YAML file of overrides, layered over the recipe")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config, validate it (layout, paths, data), exit")
    parser.add_argument("--world-size", type=positive_int, help="world size to validate against in --dry-run")
    parser.add_argument("--version", action="version", version=describe(),
                        help="print this stack's version (and Megatron-Core's, torch's, Python's) and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def resolve_config(recipe: str, config_file: str | None, overrides: list[str]) -> ExperimentConfig:
    return apply_overrides(get_recipe(recipe), yaml_file=config_file, overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)

    def check() -> ExperimentConfig | int:
        config = resolve_config(args.recipe, args.config, args.overrides)
        if not args.dry_run:
            return config
        from pretrain.runtime import world_size_from_env

        world = args.world_size if args.world_size is not None else world_size_from_env()
        validate_for_world(config, world)
        validate_inputs(config)
        print(dump_yaml(config), end="")
        print(f"# valid for world size {world}: {config.parallel.describe(world)}")
        if config.model.use_mup:
            embedding, output, scale = config.model.mup_forward
            print(f"# muP: width_mult {config.model.mup_width_mult:g}, embeddings x {embedding:g}, logits x "
                  f"{output:g}, softmax scale {scale:g}; hidden matrices' AdamW LR and eps x {1 / config.model.mup_width_mult:g}")
        if config.parallel.uneven_pipeline:
            from models.layout import pipeline_split

            split = pipeline_split(config.model.num_layers, config.parallel)
            shown = [stage[0] if len(stage) == 1 else stage for stage in split]
            print(f"# transformer layers per pipeline stage{' (per virtual stage)' if config.parallel.virtual_pipeline else ''}: {shown}")
        return 0

    config = run_cli(check, bad_input=(ConfigError, ValueError))
    if isinstance(config, int):
        return config
    from pretrain.loop import main_train

    # Training errors keep their tracebacks: bad input was refused above or in setup's checks.
    return main_train(config)

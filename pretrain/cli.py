"""Pretrain a GPT/Llama model with Megatron-Core.

    # tiny Llama on CPU, 4 gloo ranks as TP2 x PP2:
    torchrun --nproc-per-node 4 -m pretrain --recipe tiny-llama \
        parallel.tensor_parallel=2 parallel.pipeline_parallel=2
    # show the resolved config and check it against a world size, without training:
    python -m pretrain --recipe llama3-70b --dry-run --world-size 64

Config layering: recipe, then --config FILE.yaml, then key=value overrides
(e.g. schedule.train_steps=50 optimizer.lr=1e-3 data.blend='[[1.0, data/web]]').
Ranks come from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or Slurm (SLURM_PROCID/...).
"""

from __future__ import annotations

import argparse
import sys

from pretrain.config import ConfigError, ExperimentConfig, apply_overrides, dump_yaml, validate_for_world
from pretrain.recipes import RECIPES, get_recipe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", required=True, help=f"one of: {', '.join(RECIPES)}")
    parser.add_argument("--config", help="YAML file of overrides, layered over the recipe")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config, validate, exit")
    parser.add_argument("--world-size", type=int, help="world size to validate against in --dry-run")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def resolve_config(recipe: str, config_file: str | None, overrides: list[str]) -> ExperimentConfig:
    return apply_overrides(get_recipe(recipe), yaml_file=config_file, overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = resolve_config(args.recipe, args.config, args.overrides)
        if args.dry_run:
            from pretrain.runtime import world_size_from_env

            world = args.world_size or world_size_from_env()
            validate_for_world(config, world)
            print(dump_yaml(config), end="")
            print(f"# valid for world size {world}: {config.parallel.describe(world)}")
            return 0
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from pretrain.loop import main_train

    return main_train(config)


if __name__ == "__main__":
    sys.exit(main())

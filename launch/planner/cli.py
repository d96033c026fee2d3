"""Plan before you launch: which parallel layouts of a recipe fit a cluster, and which is fastest.

    python -m launch.plan --recipe llama3-70b --gpus 64 --gpu h100-80gb
    python -m launch.plan --recipe llama3-8b --gpus 8 --seq 4096 --global-batch 256 \
        --write-override best.yaml          # then: python -m launch.slurm ... --config best.yaml
    python -m launch.plan --recipe gpt3-175b --gpus 1024 --recompute selective full --top 5

The command line of `launch.planner`: the search is `launch.planner.search`, the memory and
time models `launch.planner.memory` / `launch.planner.throughput`, the tables
`launch.planner.report`. Recipe overrides (`key=value`, `--config FILE`) work as in
`python -m pretrain`, so the plan is about the run you would start.
"""

from __future__ import annotations

import argparse
import os
import sys

from data_pipeline.checks import finite_float, fraction, nonnegative_int, positive_int, print_error, writable_dir_problem
from launch.planner.devices import UnknownDeviceError, get_device
from launch.planner.memory import MemoryOptions
from launch.planner.search import PlanError, SearchSpace, plan
from launch.planner.throughput import ThroughputOptions
from pretrain.config import ConfigError


def _overlap_options(items: list[str], efficiency: float) -> ThroughputOptions:
    kinds = ("tp", "cp", "ep", "pp", "dp")
    values = {}
    for item in items:
        kind, _, frac = item.partition("=")
        try:
            value = float(frac)
        except ValueError:
            value = None
        if kind not in kinds and kind != "all" or value is None or not 0 <= value <= 1:
            raise PlanError(f"--overlap {item!r}: expected KIND=FRACTION with KIND one of {', '.join(kinds)} or all "
                            "and FRACTION in [0, 1], e.g. --overlap tp=0.5")
        for k in kinds if kind == "all" else (kind,):
            values[f"{k}_overlap"] = value
    return ThroughputOptions(efficiency=efficiency, **values)


def _nonnegative(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value:g}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, help="recipe name (pretrain.recipes)")
    p.add_argument("--config", help="YAML overrides layered over the recipe, as for python -m pretrain")
    p.add_argument("--gpus", type=positive_int, required=True, help="total GPUs")
    p.add_argument("--gpu", default="h100-80gb", help="GPU type (launch.planner.devices): h100-80gb, h100-pcie, h200-141gb")
    p.add_argument("--seq", type=positive_int, help="sequence length (schedule.seq_length)")
    p.add_argument("--global-batch", type=positive_int, help="global batch in sequences (schedule.global_batch_size)")
    p.add_argument("--micro-batch", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                   help="micro batch sizes to try")
    p.add_argument("--recompute", nargs="+", choices=["none", "selective", "full"],
                   default=["none", "selective", "full"])
    p.add_argument("--distributed-optimizer", choices=["on", "off", "both"], default="both")
    for axis in ("tp", "pp", "vpp", "cp", "ep"):
        p.add_argument(f"--{axis}", type=positive_int, nargs="+", help=f"{axis.upper()} sizes to try (default: all valid)")
    p.add_argument("--efficiency", type=fraction, default=ThroughputOptions.efficiency,
                   help="achievable fraction of peak FLOP/s for the math")
    p.add_argument("--overlap", action="append", default=[], metavar="KIND=FRACTION",
                   help="fraction of a communication hidden by compute (tp, cp, ep, pp, dp or all)")
    p.add_argument("--framework-gib", type=_nonnegative, default=MemoryOptions.framework_gib,
                   help="fixed per-GPU allowance for CUDA context, NCCL, workspaces")
    p.add_argument("--fragmentation", type=_nonnegative, default=MemoryOptions.fragmentation,
                   help="allocator slack as a fraction of activation memory")
    p.add_argument("--top", type=positive_int, default=10, help="rows of the ranking to print")
    p.add_argument("--show-dropped", type=nonnegative_int, default=3, help="closest non-fitting layouts to print")
    p.add_argument("--write-override", metavar="FILE.yaml", help="write the best layout as recipe overrides")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, as for python -m pretrain")
    return p


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from launch.planner.report import print_plan, write_override
    from pretrain.cli import resolve_config

    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.seq is not None:
        overrides.append(f"schedule.seq_length={args.seq}")
    if args.global_batch is not None:
        overrides.append(f"schedule.global_batch_size={args.global_batch}")
    dist_opt = {"on": (True,), "off": (False,), "both": (True, False)}[args.distributed_optimizer]
    space = SearchSpace(tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep,
                        micro_batch=tuple(args.micro_batch), recompute=tuple(args.recompute),
                        distributed_optimizer=dist_opt)
    memory_options = MemoryOptions(framework_gib=args.framework_gib, fragmentation=args.fragmentation)
    try:
        if args.write_override:  # before the search, not after it
            problem = writable_dir_problem(os.path.dirname(os.path.abspath(args.write_override)))
            if problem:
                raise PlanError(f"--write-override {args.write_override}: {problem}")
        config = resolve_config(args.recipe, args.config, overrides)
        device = get_device(args.gpu)
        result = plan(config, world_size=args.gpus, device=device, space=space, memory_options=memory_options,
                      throughput_options=_overlap_options(args.overlap, args.efficiency))
    except (PlanError, ConfigError, UnknownDeviceError, ValueError) as exc:
        print_error(exc)
        return 2
    console = Console(width=max(Console().width, 180))  # wide tables; piped output defaults to 80
    print_plan(result, console=console, top=args.top, show_dropped=args.show_dropped, options=memory_options)
    if args.write_override:
        path = write_override(result, args.recipe, args.write_override)
        console.print(f"wrote {path}: python -m pretrain --recipe {args.recipe} --config {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

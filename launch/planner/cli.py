"""Plan before you launch: which parallel layouts of a recipe fit a cluster, and which is fastest.

    python -m launch.plan --recipe llama3-70b --gpus 64 --gpu h100-80gb
    python -m launch.plan --recipe llama3-8b --gpus 8 --seq 4096 --global-batch 256 \
        --write-override best.yaml          # then: python -m launch.slurm ... --config best.yaml
    python -m launch.plan --recipe gpt3-175b --gpus 1024 --recompute selective full --top 5
    python -m launch.plan --recipe llama3-70b --gpus 16 --zero 2 3 --json > plan.json
    python -m launch.plan --recipe llama3-8b --gpus 64 --calibrate runs/llama3-8b   # fit to your run
    python -m launch.plan --recipe llama3-8b --gpus 64 --calibrate runs/a --calibrate runs/b --calibrate runs/c

The command line of `launch.planner`: the search is `launch.planner.search`, the memory and
time models `launch.planner.memory` / `launch.planner.throughput`, the tables
`launch.planner.report`. Recipe overrides (`key=value`, `--config FILE`) work as in
`python -m pretrain`, so the plan is about the run you would start.
"""

from __future__ import annotations

import argparse
import os
import sys

import json
from typing import Optional

from data_pipeline.checks import BAD_INPUT, finite_float, fraction, positive_int, print_error, writable_dir_problem
from launch.planner.devices import UnknownDeviceError, get_device
from launch.planner.memory import MemoryOptions
from launch.planner.search import PlanError, SearchSpace, no_fit_message, rank_layouts
from launch.planner.throughput import ThroughputOptions
from models.layout import ZERO_STAGES
from models.runtime import RECOMPUTE_CHOICES
from pretrain.config import ConfigError


def _count(text: str) -> Optional[int]:
    """A row count: a non-negative integer, or 'all' (None)."""
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'all', got {text!r}")
    return value


def _overlap_options(items: list[str], efficiency: Optional[float]) -> ThroughputOptions:
    kinds = ("tp", "cp", "ep", "pp", "dp", "zero", "offload")
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


def _calibrated(run_dirs: list[str], device, tput: ThroughputOptions, to_stderr: bool,
                portable: bool = False) -> ThroughputOptions:
    """`tput` with the efficiencies fitted to the runs in `run_dirs` (launch.planner.calibrate:
    one run scales the kinds by one factor, several fit each kind); what was fitted goes to
    stdout, or stderr under --json."""
    import dataclasses

    from launch.planner.calibrate import calibrate, calibrate_runs, read_run

    if tput.efficiency is not None:
        raise PlanError("--calibrate fits the per-kind efficiencies; drop --efficiency")
    runs = [read_run(d) for d in run_dirs]
    fit = calibrate(runs[0], device, tput) if len(runs) == 1 else calibrate_runs(runs, device, tput)
    out = sys.stderr if to_stderr else sys.stdout
    print(fit.describe(tput.efficiencies), file=out)
    if any((r.config.runtime.spec == "portable") != portable for r in runs):
        # The portable spec's attention is unfused (scores in HBM), the te spec's fused: an
        # attention efficiency fitted on one does not describe the other.
        print("note: the calibration runs and this plan use different layer specs (runtime.spec portable vs te): "
              "the fitted attention efficiency is that of the runs' attention kernel", file=out)
    return dataclasses.replace(tput, efficiencies=fit.efficiencies)


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
    p.add_argument("--gpu", default="h100-80gb",
                   help="GPU type (launch.planner.devices): h100-80gb, h100-pcie, h200-141gb, b200-180gb, gb200-186gb; cpu (nominal "
                        "numbers, for --calibrate)")
    p.add_argument("--seq", type=positive_int, help="sequence length (schedule.seq_length)")
    p.add_argument("--global-batch", type=positive_int, help="global batch in sequences (schedule.global_batch_size)")
    p.add_argument("--micro-batch", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                   help="micro batch sizes to try")
    p.add_argument("--recompute", nargs="+", choices=RECOMPUTE_CHOICES, default=list(RECOMPUTE_CHOICES))
    p.add_argument("--zero", type=int, nargs="+", choices=ZERO_STAGES, default=list(ZERO_STAGES),
                   help="ZeRO stages to try: 0 none, 1 optimizer state sharded (Megatron's distributed "
                        "optimizer), 2 + gradients, 3 + parameters (Megatron-FSDP); default all")
    p.add_argument("--hsdp", type=int, nargs="+", metavar="REPLICAS",
                   help="HSDP replica counts to try with ZeRO-2/3 (1 = plain sharding; default 1 and every "
                        "divisor of DP)")
    p.add_argument("--offload", choices=["on", "off", "both"], default="both",
                   help="optimizer CPU offload (fp32 main weights and Adam moments in host memory)")
    for axis in ("tp", "pp", "vpp", "cp", "ep"):
        p.add_argument(f"--{axis}", type=positive_int, nargs="+", help=f"{axis.upper()} sizes to try (default: all valid)")
    p.add_argument("--uneven-stages", choices=["on", "off"], default="on",
                   help="also try first/last pipeline stages lighter than the evenly split middle stages "
                        "(parallel.num_layers_in_first/last_pipeline_stage; launch.planner.search.uneven_splits)")
    p.add_argument("--efficiency", type=fraction, default=None,
                   help="one achievable fraction of peak FLOP/s for all the math (default: per kind of work "
                        "and precision, fitted to measured runs: launch/planner/efficiency.py)")
    p.add_argument("--calibrate", metavar="RUN_DIR", action="append",
                   help="a short run's directory (config.yaml + metrics.jsonl): fit this cluster's efficiencies "
                        "to its step time after warm-up, print them, and plan with them; repeat it with runs of "
                        "other shapes (seq, micro batch, layers) to fit each kind of work on its own")
    p.add_argument("--overlap", action="append", default=[], metavar="KIND=FRACTION",
                   help="fraction of a communication hidden by compute (tp, cp, ep, pp, dp, zero, offload or all); "
                        "pp applies to interleaved layouts (VPP > 1) only: Megatron-Core overlaps PP send/recv "
                        "only in that schedule")
    p.add_argument("--framework-gib", type=_nonnegative, default=MemoryOptions.framework_gib,
                   help="fixed per-GPU allowance for CUDA context, NCCL, workspaces")
    p.add_argument("--fragmentation", type=_nonnegative, default=MemoryOptions.fragmentation,
                   help="allocator slack as a fraction of activation memory")
    p.add_argument("--top", type=_count, default=10, help="rows of the ranking to print (a number or all)")
    p.add_argument("--show-dropped", type=_count, default=3,
                   help="closest non-fitting layouts to print (a number or all)")
    p.add_argument("--json", action="store_true",
                   help='print one JSON document {"candidates": [...]} instead of the tables: the --top '
                        "fastest layouts that fit, then the --show-dropped closest that do not, with the reason")
    p.add_argument("--document-length", type=positive_int, metavar="TOKENS",
                   help="mean tokens per document, with data.reset_attention_mask=true: attention inside each "
                        "document does less work (te spec; the estimate's FLOP/s and MFU stay on the dense formula)")
    p.add_argument("--write-override", metavar="FILE.yaml", help="write the best layout as recipe overrides")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, as for python -m pretrain")
    return p


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from launch.planner.report import plan_json, print_plan, write_override
    from pretrain.cli import resolve_config

    args = build_parser().parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.seq is not None:
        overrides.append(f"schedule.seq_length={args.seq}")
    if args.global_batch is not None:
        overrides.append(f"schedule.global_batch_size={args.global_batch}")
    offload = {"on": (True,), "off": (False,), "both": (False, True)}[args.offload]
    space = SearchSpace(tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep,
                        micro_batch=tuple(args.micro_batch), recompute=tuple(args.recompute),
                        zero=tuple(args.zero), hsdp=args.hsdp, offload=offload, document_length=args.document_length,
                        uneven_stages=args.uneven_stages == "on")
    memory_options = MemoryOptions(framework_gib=args.framework_gib, fragmentation=args.fragmentation)
    tput = None
    try:
        if args.write_override:  # before the search, not after it
            problem = writable_dir_problem(os.path.dirname(os.path.abspath(args.write_override)))
            if problem:
                raise PlanError(f"--write-override {args.write_override}: {problem}")
        tput = _overlap_options(args.overlap, args.efficiency)
        config = resolve_config(args.recipe, args.config, overrides)
        if args.document_length and not config.data.reset_attention_mask:
            raise PlanError(f"--document-length {args.document_length} estimates document masking, which this config "
                            "does not train with: add data.reset_attention_mask=true (and reset_position_ids)")
        device = get_device(args.gpu)
        problem = device.fp8_problem(config.runtime.fp8_recipe_name)
        if problem:
            raise PlanError(problem)
        if args.calibrate:
            tput = _calibrated(args.calibrate, device, tput, args.json, config.runtime.spec == "portable")
        result = rank_layouts(config, world_size=args.gpus, device=device, space=space,
                              memory_options=memory_options, throughput_options=tput)
        if not result.ranked and not args.json:
            raise PlanError(no_fit_message(result, space, memory_options, tput))
    except (PlanError, ConfigError, UnknownDeviceError, ValueError, OSError) as exc:
        print_error(exc)
        return BAD_INPUT
    if args.json:
        # stdout holds the one JSON document; anything else goes to stderr.
        print(json.dumps(plan_json(result, top=args.top, show_dropped=args.show_dropped), indent=1))
        if not result.ranked:
            print(f"note: {no_fit_message(result, space, memory_options, tput)}", file=sys.stderr)
            return 0
        log = lambda text: print(text, file=sys.stderr)  # noqa: E731
    else:
        console = Console(width=max(Console().width, 180))  # wide tables; piped output defaults to 80
        print_plan(result, console=console, top=args.top, show_dropped=args.show_dropped)
        log = console.print
    if args.write_override:
        path = write_override(result, args.recipe, args.write_override)
        log(f"wrote {path}: python -m pretrain --recipe {args.recipe} --config {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

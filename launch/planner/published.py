"""The planner against measured runs: launch/planner/published.yaml's rows (Megatron-Bridge's
published DGX-H100 table and this stack's own H100 measurements), each estimated at its exact
layout, and the fit of the per-kind efficiencies (launch.planner.efficiency) to them (MoE rows
are reported, not fitted: `calibration_rows`).

    python -m launch.planner.published            # the table (markdown), as in docs/planner.md
    python -m launch.planner.published --fit      # refit the efficiencies and print them
    python -m launch.planner.published --rank     # where the planner ranks each `fastest` layout
    python -m launch.planner.published --rank --top 10   # + the 10 fastest, each with its breakdown

Rows are built as `Candidate`s directly at the published layouts (the 405B's with
Megatron-Core's embedding/loss pipeline split, which the training offers too:
parallel.account_for_embedding/loss_in_pipeline_split).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys

import yaml

from launch.planner.candidate import Candidate
from launch.planner.devices import get_device
from launch.planner.efficiency import DEFAULT_EFFICIENCIES, Efficiencies
from launch.planner.memory import GIB, peak_memory
from launch.planner.throughput import ThroughputOptions, estimate_step
from models.config import get_flavor
from models.layout import ParallelLayout

PUBLISHED = pathlib.Path(__file__).with_name("published.yaml")
# Where a recipe overlaps TP communication (userbuffers) and the DP gradient reduce / parameter
# gather with compute: the share hidden, the planner's existing constant for overlapped kinds
# (cp_overlap, zero_overlap), not fitted.
OVERLAPPED = 0.8
# The efficiencies these rows determine (launch.planner.efficiency says why not attention, memory).
FITTED_KINDS = ("gemm_bf16", "gemm_fp8", "gemm_fp8_delayed")


def load_rows(path: pathlib.Path = PUBLISHED) -> list[dict]:
    return yaml.safe_load(path.read_text())["rows"]


def calibration_rows(rows: list[dict]) -> list[dict]:
    """The rows the efficiencies are fitted to and held to +-15% (not those marked fit: false:
    MoE, which the planner does not model well yet; published.yaml says why)."""
    return [r for r in rows if r.get("fit", True)]


def row_candidate(r: dict) -> Candidate:
    """The Candidate a published row describes."""
    model = get_flavor(r["model"])
    if "num_layers" in r:
        model = model.model_copy(update={"num_layers": r["num_layers"]})
    layout = ParallelLayout(tensor_parallel=r["tp"], pipeline_parallel=r["pp"],
                            virtual_pipeline=r["vpp"] if r["vpp"] > 1 else None, context_parallel=r["cp"],
                            expert_parallel=r.get("ep", 1),
                            sequence_parallel=r["tp"] > 1, account_for_embedding_in_pipeline_split=r.get("split", False),
                            account_for_loss_in_pipeline_split=r.get("split", False))
    return Candidate(model=model, layout=layout, world_size=r["gpus"], micro_batch=r["mbs"], global_batch=r["gbs"],
                     seq_length=r["seq"], dtype=r["dtype"], fp8=r["fp8"] is not None, fp8_recipe=r["fp8"],
                     recompute=r["recompute"], zero=r["zero"], grad_reduce_in_fp32=r["grad_fp32"])


def row_options(r: dict, eff: Efficiencies) -> ThroughputOptions:
    """The recipe's overlaps: TP (userbuffers) and DP (overlap_grad_reduce / param_gather), and
    PP send/recv, which NeMo / Megatron-Bridge overlap whenever VPP > 1 (overlap_p2p_comm=True,
    batch_p2p_comm=False: NeMo's MegatronCommOverlapCallback._get_model_comm_overlap_cfgs, ported
    to Megatron-Bridge's CommOverlapConfig; the planner applies it to interleaved layouts only)."""
    overlap = OVERLAPPED if r["overlap"] else 0.0
    return ThroughputOptions(efficiencies=eff, tp_overlap=overlap, dp_overlap=overlap, pp_overlap=overlap)


def predict(r: dict, eff: Efficiencies = DEFAULT_EFFICIENCIES) -> tuple[float, float]:
    """(predicted tokens/s/GPU, peak memory GiB) of row `r`."""
    c = row_candidate(r)
    device = get_device(r.get("device", "h100-80gb"))
    est = estimate_step(c, device, row_options(r, eff))
    return est.tokens_per_s / c.world_size, peak_memory(c).total / GIB


def fit_efficiencies(rows: list[dict], start: Efficiencies = DEFAULT_EFFICIENCIES) -> Efficiencies:
    """Least squares on log(predicted / measured) over `rows`, for the FITTED_KINDS (each kept
    in [0.05, 1]); the other kinds stay at `start`."""
    from scipy.optimize import least_squares

    def residuals(x):
        eff = dataclasses.replace(start, **dict(zip(FITTED_KINDS, x, strict=True)))
        return [math.log(predict(r, eff)[0] / r["tokens_per_s_per_gpu"]) for r in rows]

    x0 = [getattr(start, k) for k in FITTED_KINDS]
    result = least_squares(residuals, x0, bounds=([0.05] * len(x0), [1.0] * len(x0)))
    return dataclasses.replace(start, **dict(zip(FITTED_KINDS, (round(v, 3) for v in result.x), strict=True)))


def ranked_for_row(r: dict, eff: Efficiencies = DEFAULT_EFFICIENCIES, *, recipe_settings: bool = True) -> list:
    """The planner's search for row `r`'s model, GPU count, precision, sequence, global batch
    and micro batch: every layout that fits, fastest first (search._rank_key); each estimated
    with the recipe's settings (its overlaps, `row_options`, and its gradient-reduction
    precision), or with `recipe_settings=False` with our training's (the planner's defaults:
    no TP, DP or PP overlap, fp32 gradient reduction)."""
    from launch.planner.memory import MemoryOptions
    from launch.planner.search import SearchSpace, _rank_key, enumerate_candidates, evaluate
    from pretrain.config import apply_overrides
    from pretrain.recipes import get_recipe

    fp8 = ["runtime.fp8=hybrid", f"runtime.fp8_recipe={r['fp8']}"] if r["fp8"] else []
    config = apply_overrides(get_recipe("llama3-8b"), overrides=[
        f"model={r['model']}", f"runtime.dtype={r['dtype']}", f"schedule.seq_length={r['seq']}",
        f"schedule.global_batch_size={r['gbs']}", *fp8])
    device = get_device(r.get("device", "h100-80gb"))
    candidates, _ = enumerate_candidates(config, r["gpus"], device, SearchSpace(micro_batch=(r["mbs"],)))
    opts = row_options(r, eff) if recipe_settings else ThroughputOptions(efficiencies=eff)
    grad_fp32 = r["grad_fp32"] if recipe_settings else True
    evaluated = [evaluate(dataclasses.replace(c, grad_reduce_in_fp32=grad_fp32), device, MemoryOptions(), opts)
                 for c in candidates]
    return sorted((e for e in evaluated if e.fits), key=_rank_key)


def is_published_layout(e, r: dict) -> bool:
    """Whether evaluation `e` is row `r`'s layout (with its ZeRO stage and recompute, no HSDP
    nor offload)."""
    want, c = row_candidate(r), e.candidate
    return (c.layout == want.layout and (c.zero, c.recompute, c.hsdp_replicas, c.offload)
            == (want.zero, want.recompute, 1, False))


def rank_of_published_layout(r: dict, eff: Efficiencies = DEFAULT_EFFICIENCIES, *, recipe_settings: bool = True
                              ) -> tuple[int, int]:
    """(rank, layouts that fit) of row `r`'s layout in `ranked_for_row`; rank 0 when the layout
    is not among those that fit."""
    ranked = ranked_for_row(r, eff, recipe_settings=recipe_settings)
    rank = next((i + 1 for i, e in enumerate(ranked) if is_published_layout(e, r)), 0)
    return rank, len(ranked)


def breakdown(e) -> str:
    """One line per evaluated layout: the layout, step time and its parts (seconds per step:
    compute incl. recompute, the bubble, exposed communication by kind) and memory."""
    c, s = e.candidate, e.estimate
    name = (f"TP{c.tp} PP{c.pp} VPP{c.vpp} CP{c.cp} DP{c.dp}"
            + (" +emb/loss-split" if c.layout.account_for_embedding_in_pipeline_split else "")
            + "".join(f" {edge}{n}" for edge, n in (("first", c.layout.num_layers_in_first_pipeline_stage),
                                                   ("last", c.layout.num_layers_in_last_pipeline_stage)) if n)
            + f" zero{c.zero} recompute={c.recompute}" + (" offload" if c.offload else "")
            + (f" hsdp{c.hsdp_replicas}" if c.hsdp_replicas > 1 else ""))
    comm = " ".join(f"{k} {v:.2f}" for k, v in s.comm_s.items() if v >= 0.005)
    return (f"{name:52s} step {s.step_s:7.3f} s = compute {s.compute_s:.2f} + bubble {s.bubble_s:.2f} + "
            f"exposed [{comm or '-'}]; {e.memory.total / GIB:.1f} GiB")


def print_top(r: dict, top: int, *, recipe_settings: bool) -> None:
    """The `top` fastest layouts for row `r` with their breakdown, then the published layout's."""
    ranked = ranked_for_row(r, recipe_settings=recipe_settings)
    print(f"{r['source']} {r['model']} {r['gpus']} GPUs gbs {r['gbs']}, "
          f"{'recipe' if recipe_settings else 'our training'}'s settings ({len(ranked)} fit):")
    for i, e in enumerate(ranked):
        mark = "*" if is_published_layout(e, r) else " "
        if i < top or mark == "*":
            print(f"{mark}{i + 1:4d} {breakdown(e)}")


def table_rows(rows: list[dict], eff: Efficiencies = DEFAULT_EFFICIENCIES) -> list[dict]:
    """One dict per row: the row, predicted tokens/s/GPU, error, memory and whether it fits."""
    out = []
    for r in rows:
        tokens, mem = predict(r, eff)
        device = get_device(r.get("device", "h100-80gb"))
        out.append({**r, "predicted": tokens, "error": tokens / r["tokens_per_s_per_gpu"] - 1,
                    "memory_gib": mem, "fits": mem <= device.memory_gib})
    return out


def markdown(rows: list[dict]) -> str:
    head = ("| source | model | GPUs | precision | TP/PP/VPP/CP | ZeRO | MBS/GBS | seq | recompute | measured "
            "tok/s/GPU | predicted | error | memory GiB (fits) |\n|" + "---|" * 13)
    lines = [head]
    for r in rows:
        model = r["model"] + (f" ({r['num_layers']} layers)" if "num_layers" in r else "")
        if r.get("ep", 1) > 1:
            model += f" (EP{r['ep']})"
        if not r.get("fit", True):
            model += " [not fitted]"
        precision = f"FP8 {r['fp8']}" if r["fp8"] else r["dtype"].upper()
        lines.append(
            f"| {r['source']} | {model} | {r['gpus']} | {precision} | {r['tp']}/{r['pp']}/{r['vpp']}/{r['cp']} | "
            f"{r['zero']} | {r['mbs']}/{r['gbs']} | {r['seq']} | {r['recompute']} | {r['tokens_per_s_per_gpu']:,} | "
            f"{r['predicted']:,.0f} | {r['error']:+.1%} | {r['memory_gib']:.1f} ({'yes' if r['fits'] else 'NO'}) |")
    return "\n".join(lines)


def _rank_text(r: dict, recipe_settings: bool) -> str:
    """'RANK of N (X% behind the best)': how far behind, since hundreds of layouts can sit
    within the model's +-15% accuracy of the best."""
    ranked = ranked_for_row(r, recipe_settings=recipe_settings)
    rank = next((i + 1 for i, e in enumerate(ranked) if is_published_layout(e, r)), 0)
    if not rank:
        return f"not fitting of {len(ranked)}"
    behind = ranked[rank - 1].estimate.step_s / ranked[0].estimate.step_s - 1
    return f"{rank} of {len(ranked)} ({behind:+.1%} step time vs the best)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.planner.published", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", action="store_true", help="refit the efficiencies to the rows and print them")
    p.add_argument("--rank", action="store_true",
                   help="print the planner's rank of each layout marked fastest (recipe's settings, then ours)")
    p.add_argument("--top", type=int, default=0, metavar="N",
                   help="with --rank: print each model's N fastest layouts and the published one (marked *) "
                        "with compute, bubble, exposed communication and memory")
    args = p.parse_args(argv)
    rows = load_rows()
    if args.rank and args.top:
        seen = set()
        for r in (r for r in rows if r.get("fastest")):
            if (r["model"], r["gbs"]) in seen:  # rows of one model and batch rank alike
                continue
            seen.add((r["model"], r["gbs"]))
            for settings in (True, False):
                print_top(r, args.top, recipe_settings=settings)
        return 0
    if args.rank:
        for r in (r for r in rows if r.get("fastest")):
            print(f"{r['source']} {r['model']} {r['gpus']} GPUs gbs {r['gbs']}: recipe's settings "
                  f"{_rank_text(r, True)}, ours {_rank_text(r, False)}")
        return 0
    fitted = calibration_rows(rows)
    eff = fit_efficiencies(fitted) if args.fit else DEFAULT_EFFICIENCIES
    if args.fit:
        print(f"fitted ({len(FITTED_KINDS)} free parameters, {len(fitted)} rows): {eff.describe()}")
    print(markdown(table_rows(rows, eff)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

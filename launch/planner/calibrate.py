"""Self-calibration: fit the efficiencies of *your* cluster from a short run of this stack.

    python -m pretrain --recipe llama3-8b schedule.train_steps=20 logging.log_interval=1 ...
    python -m launch.plan --recipe llama3-8b --gpus 64 --calibrate runs/llama3-8b

A run directory holds config.yaml (the resolved config: model, layout, precision, batch)
and metrics.jsonl (one record per logged step: step_time_s, tokens/s globally and per device,
from which the world size follows). The step times after warm-up (the first quarter of the
logged steps, at least one) give a median; the planner estimates that same run, and the
efficiencies of the run's precision are scaled by the one factor that makes the estimate equal
the median (bisection; the estimate falls monotonically as efficiencies rise). One run pins
one number: the kinds are scaled together, keeping the ratios fitted to published runs
(launch.planner.efficiency). A profiler breakdown per kind is not read yet.

Several runs of other shapes (`--calibrate A --calibrate B ...`: another sequence length, micro
batch or depth moves the share of attention in the step) fit each kind on its own: least
squares on log(predicted / measured) over the runs for the runs' GEMM kind and attention
(`memory` stays: with it free as well, the fit drives a GEMM kind to 1 on runs that cannot
tell them apart). With more runs than kinds, each run is also predicted by a fit that leaves
it out, the honest test of the fit. On one H200 (tests/launch/data/h200, three portable-spec
BF16 runs) one factor fitted on seq 4096 missed the other two runs by +22% and -27%; the
per-kind fit left each one out within 6%.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics

import yaml

from launch.planner.candidate import Candidate
from launch.planner.devices import Device
from launch.planner.efficiency import Efficiencies
from launch.planner.throughput import ThroughputOptions, estimate_step
from pretrain.config import ExperimentConfig


class CalibrationError(ValueError):
    """The run directory cannot be calibrated from; the message says why."""


@dataclasses.dataclass(frozen=True)
class RunMeasurement:
    config: ExperimentConfig
    world_size: int
    step_times: list[float]  # after warm-up
    warmup: int  # logged steps left out

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times)


@dataclasses.dataclass(frozen=True)
class Calibration:
    run: RunMeasurement
    candidate: Candidate
    before_s: float  # predicted step time with the efficiencies we started from
    after_s: float  # with the fitted ones
    factor: float
    kinds: tuple[str, ...]
    efficiencies: Efficiencies

    def describe(self, start: Efficiencies) -> str:
        fitted = ", ".join(f"{k} {getattr(start, k):.3f} -> {getattr(self.efficiencies, k):.3f}" for k in self.kinds)
        return (f"calibrated on {len(self.run.step_times)} steps after {self.run.warmup} of warm-up "
                f"({self.candidate.describe()}, {self.run.world_size} ranks): measured {self.run.median_step_s:.4g} "
                f"s/step, predicted {self.before_s:.4g} before, {self.after_s:.4g} after; fitted {fitted}")


def read_run(run_dir: str | pathlib.Path, warmup: int | None = None) -> RunMeasurement:
    """config.yaml + metrics.jsonl of a run; training-step records only (not eval lines)."""
    run = pathlib.Path(run_dir)
    for name in ("config.yaml", "metrics.jsonl"):
        if not (run / name).is_file():
            raise CalibrationError(f"--calibrate {run_dir}: no {name} there (a run directory of python -m pretrain "
                                   "holds config.yaml and metrics.jsonl)")
    config = ExperimentConfig.model_validate(yaml.safe_load((run / "config.yaml").read_text()))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("step_time_s") and not r.get("skipped")]
    if warmup is None:
        warmup = max(1, len(steps) // 4)
    if len(steps) <= warmup:
        raise CalibrationError(f"--calibrate {run_dir}: {len(steps)} logged training steps, need more than the "
                               f"{warmup} of warm-up (set logging.log_interval=1 and train a few more steps)")
    first = steps[0]
    world = round(first["tokens_per_s"] / first["tokens_per_s_per_device"])
    return RunMeasurement(config=config, world_size=world, step_times=[r["step_time_s"] for r in steps[warmup:]],
                          warmup=warmup)


def run_kinds(c: Candidate) -> tuple[str, ...]:
    """The efficiencies a run of this precision exercises."""
    if c.dtype == "fp32":
        return ("gemm_fp32", "memory")
    gemm = ("gemm_fp8_delayed" if c.fp8_recipe in (None, "delayed") else "gemm_fp8") if c.fp8 else "gemm_bf16"
    return (gemm, "attention", "memory") + (("gemm_bf16",) if c.fp8 else ())


def _step_s(c: Candidate, device: Device, opts: ThroughputOptions, eff: Efficiencies) -> float:
    """The planner's step time of `c` with efficiencies `eff` (per kind, no single --efficiency)."""
    return estimate_step(c, device, dataclasses.replace(opts, efficiencies=eff, efficiency=None)).step_s


def calibrate(run: RunMeasurement, device: Device, opts: ThroughputOptions = ThroughputOptions()) -> Calibration:
    """The factor on the run's efficiencies at which the planner's step time equals the
    measured median (bisection in log space; refused when no efficiency <= 1 gets there)."""
    c = Candidate.from_config(run.config, run.world_size)
    kinds = run_kinds(c)
    start = opts.efficiencies
    target = run.median_step_s

    def step(factor: float) -> float:
        return _step_s(c, device, opts, start.scaled(factor, kinds))

    before = step(1.0)
    top = min(1.0 / getattr(start, k) for k in kinds)  # every scaled kind at most 1
    if step(top) > target:
        raise CalibrationError(f"the run took {target:.4g} s/step; at 100% of {device.name}'s peak the planner "
                               f"predicts {step(top):.4g}: the device's peak or bandwidths are too low for this run")
    lo, hi = 1e-6, top
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if step(mid) > target else (lo, mid)
    factor = math.sqrt(lo * hi)
    return Calibration(run=run, candidate=c, before_s=before, after_s=step(factor), factor=factor, kinds=kinds,
                       efficiencies=start.scaled(factor, kinds))


@dataclasses.dataclass(frozen=True)
class MultiCalibration:
    runs: list[RunMeasurement]
    candidates: list[Candidate]
    kinds: tuple[str, ...]
    efficiencies: Efficiencies
    predicted_s: list[float]  # each run with the fitted efficiencies
    left_out_s: list[float] | None  # each run predicted by a fit without it (None: too few runs)

    def describe(self, start: Efficiencies) -> str:
        fitted = ", ".join(f"{k} {getattr(start, k):.3f} -> {getattr(self.efficiencies, k):.3f}" for k in self.kinds)
        lines = [f"calibrated on {len(self.runs)} runs, each kind fitted on its own: {fitted}"]
        for i, (run, c) in enumerate(zip(self.runs, self.candidates, strict=True)):
            line = (f"  {c.describe()} seq {c.seq_length} layers {c.model.num_layers}: measured "
                    f"{run.median_step_s:.4g} s/step, fitted {self.predicted_s[i]:.4g} "
                    f"({self.predicted_s[i] / run.median_step_s - 1:+.1%})")
            if self.left_out_s:
                line += (f", left out of the fit {self.left_out_s[i]:.4g} "
                         f"({self.left_out_s[i] / run.median_step_s - 1:+.1%})")
            lines.append(line)
        return "\n".join(lines)


def fit_kinds(c: Candidate) -> tuple[str, ...]:
    """The kinds a multi-run fit frees for a run of this precision (not `memory`)."""
    if c.dtype == "fp32":
        return ("gemm_fp32",)
    return (run_kinds(c)[0], "attention")


def _least_squares(runs, candidates, kinds, device, opts) -> Efficiencies:
    from scipy.optimize import least_squares

    def efficiencies(x) -> Efficiencies:
        return dataclasses.replace(opts.efficiencies, **dict(zip(kinds, x, strict=True)))

    def residuals(x):
        eff = efficiencies(x)
        return [math.log(_step_s(c, device, opts, eff) / r.median_step_s) for r, c in zip(runs, candidates)]

    x0 = [getattr(opts.efficiencies, k) for k in kinds]
    return efficiencies(least_squares(residuals, x0, bounds=([0.001] * len(kinds), [1.0] * len(kinds))).x)


def calibrate_runs(runs: list[RunMeasurement], device: Device,
                   opts: ThroughputOptions = ThroughputOptions()) -> MultiCalibration:
    """Each kind's efficiency fitted to several runs (module docstring)."""
    candidates = [Candidate.from_config(r.config, r.world_size) for r in runs]
    kinds = tuple(dict.fromkeys(k for c in candidates for k in fit_kinds(c)))
    if len(runs) < len(kinds):
        raise CalibrationError(f"{len(runs)} runs cannot fit {len(kinds)} efficiencies ({', '.join(kinds)}): give "
                               f"one run (one factor for all kinds) or at least {len(kinds)} of other shapes (another "
                               "seq_length or micro_batch_size moves the share of attention)")
    if len({(c.seq_length, c.micro_batch, c.model.num_layers, c.layout) for c in candidates}) < len(kinds):
        raise CalibrationError("the runs have the same shape: a per-kind fit needs runs that differ in seq_length, "
                               "micro_batch_size or num_layers")
    eff = _least_squares(runs, candidates, kinds, device, opts)
    left_out = None
    if len(runs) > len(kinds):
        left_out = []
        for i, c in enumerate(candidates):
            rest = [j for j in range(len(runs)) if j != i]
            e = _least_squares([runs[j] for j in rest], [candidates[j] for j in rest], kinds, device, opts)
            left_out.append(_step_s(c, device, opts, e))
    return MultiCalibration(runs=runs, candidates=candidates, kinds=kinds, efficiencies=eff,
                            predicted_s=[_step_s(c, device, opts, eff) for c in candidates], left_out_s=left_out)

"""Does the aux-loss-free expert bias even out the expert load? Two runs of a tiny MoE on the demo
corpus (real text), identical but for model.moe_router_enable_expert_bias, read back from their
metrics.jsonl (pretrain.moe_load's per-layer load).

    python -m pretrain.expert_bias_demo                       # tiny-qwen3-moe, 200 steps, rate 1e-3
    python -m pretrain.expert_bias_demo --steps 400 --rate 1e-2 --recipe tiny-moe --out runs/bias-demo

Both runs: sigmoid router scores (the bias needs them), aux loss off (so nothing else
balances), one rank, log_interval --window (each logged load counts the tokens of the window's
steps). Prints, per window, the max/mean and min/mean tokens per expert and the coefficient of
variation (std/mean), each the mean over the MoE layers (worst layer in brackets), off vs on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]


def _train(recipe: str, out: Path, steps: int, window: int, bias: bool, rate: float) -> list[dict]:
    overrides = [
        f"schedule.train_steps={steps}", f"logging.log_interval={window}", "schedule.eval_interval=0",
        "data.demo=true", "data.mock=false", "runtime.spec=portable", "logging.tensorboard=false",
        "checkpoint.save_interval=0", "checkpoint.resume=none", f"checkpoint.dir={out / 'ckpt'}",
        f"logging.run_dir={out}", "model.moe_aux_loss_coeff=0", "model.moe_router_score_function=sigmoid",
    ] + ([f"model.moe_router_enable_expert_bias=true", f"model.moe_router_bias_update_rate={rate}"] if bias else [])
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "pretrain", "--recipe", recipe, *overrides], cwd=REPO, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("moe_load_max")]


def _cell(values: list[float], worst) -> str:
    return f"{sum(values) / len(values):.3f} ({worst(values):.2f})"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.expert_bias_demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny-qwen3-moe", help="a MoE recipe (default tiny-qwen3-moe)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=25, help="steps per logged load (log_interval)")
    parser.add_argument("--rate", type=float, default=1e-3, help="moe_router_bias_update_rate (default 1e-3)")
    parser.add_argument("--out", type=Path, default=Path("runs/expert-bias-demo"))
    args = parser.parse_args(argv)
    runs = {name: _train(args.recipe, args.out / name, args.steps, args.window, name == "bias-on", args.rate)
            for name in ("bias-off", "bias-on")}
    print(f"{args.recipe}, {args.steps} steps on the demo corpus, sigmoid scores, aux loss off, bias rate "
          f"{args.rate:g}; per window: mean over layers (worst layer)")
    print(f"{'steps':>9} | {'max/mean off':>15} {'max/mean on':>15} | {'min/mean off':>15} {'min/mean on':>15} | "
          f"{'CV off':>15} {'CV on':>15}")
    previous = 0
    for off, on in zip(runs["bias-off"], runs["bias-on"]):
        cells = [_cell(r[key], worst) for key, worst in (("moe_load_max", max), ("moe_load_min", min),
                                                         ("moe_load_cv", max)) for r in (off, on)]
        print(f"{previous + 1:>4}-{off['step']:<4} | {cells[0]:>15} {cells[1]:>15} | {cells[2]:>15} {cells[3]:>15} | "
              f"{cells[4]:>15} {cells[5]:>15}")
        previous = off["step"]
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a layout's run leaves the one-rank run: per-step, per-tensor gradient differences.

    python -m tests.pretrain.grad_drift TP2-SP-docs                     # test_sharded_dp's settings
    python -m tests.pretrain.grad_drift TP2-SP-docs optimizer.lr=3e-3   # extra overrides, both runs
    python -m tests.pretrain.grad_drift --noise 1e-7 --seed 2 TP2-SP-docs optimizer.lr=3e-3

Trains the layout of tests/pretrain/test_sharded_dp.py and its one-rank reference for 5 steps,
keeping every rank's gradients (what the optimizer is handed: DDP's main_grad after the
all-reduces) and weights before each optimizer step, puts TP shards back together, and prints per
step: the logged loss and grad norm differences and the tensors whose gradients differ most. A
parity failure then reads as either a wrong gradient from step 1 (a bug: a mask or position on the
wrong shard gives differences of 1e-3 or more at once) or gradients that agree at fp32 level for
the first steps and weights that part later (summation order grown by the training).

`--noise R` runs one rank instead of the layout, with every gradient element multiplied by
(1 + R N(0, 1)) before each step: how far plain fp32-size differences carry in this trajectory.
Issue 24 used it to explain TP2+SP's drift with document masking at lr 3e-3 (test_sharded_dp,
the comment above DOC_TEXT). Layouts whose ranks hold whole tensors or TP shards only (TP, SP,
CP, DP): PP, ZeRO-3 and EP place parameters differently and are refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

UNSUPPORTED_AXES = ("parallel.pipeline_parallel", "parallel.sharding=zero3", "parallel.expert_parallel")


def train_and_dump(recipe: str, overrides: list[str], out: str, noise: float = 0.0, seed: int = 0) -> dict:
    """A rank of run_ranks: train; save {step: {name: (grad, weight)}} and this rank's TP place."""
    import os

    import torch
    from megatron.core import parallel_state

    from pretrain.cli import resolve_config
    from pretrain.loop import setup, train as train_loop
    from pretrain.runtime import shutdown
    from tests.pretrain.workers import _gpt

    run = setup(resolve_config(recipe, None, overrides))
    models = [_gpt(chunk) for chunk in run.state.model]
    steps, optimizer_step = [], run.state.optimizer.step
    generator = torch.Generator().manual_seed(seed)

    def step():
        kept = {}
        for model in models:
            for name, p in model.named_parameters():
                grad = p.main_grad
                if noise:
                    grad.mul_(1 + noise * torch.randn(grad.shape, generator=generator))
                kept[name] = (grad.detach().clone(), p.detach().clone(),
                              bool(getattr(p, "tensor_model_parallel", False)), getattr(p, "partition_dim", -1))
        steps.append(kept)
        return optimizer_step()

    run.state.optimizer.step = step
    try:
        train_loop(run, run.start_step)
        torch.save({"steps": steps, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                    "tp": parallel_state.get_tensor_model_parallel_world_size(),
                    "gated": models[0].config.gated_linear_unit},
                   os.path.join(out, f"rank{os.environ['RANK']}.pt"))
        return {}
    finally:
        run.writer.close()
        shutdown()


def _whole(parts: list, gated: bool, name: str):
    """TP shards (in TP rank order) -> the one-rank tensor. A gated fc1 shard is [gate_r; up_r]."""
    import torch

    tensor, _, split, dim = parts[0]
    if len(parts) == 1 or not split:
        return tensor
    shards = [p[0] for p in parts]
    if gated and "linear_fc1" in name:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def load_steps(folder: Path) -> list[dict]:
    """Every step's {name: (gradient, weight)} as one rank would hold them."""
    import torch

    ranks = [torch.load(f, weights_only=False) for f in sorted(folder.glob("rank*.pt"))]
    by_tp = {}
    for rank in ranks:
        by_tp.setdefault(rank["tp_rank"], rank)  # DP/CP replicas hold the same reduced gradients
    shards = [by_tp[r] for r in range(ranks[0]["tp"])]
    whole = []
    for i, names in enumerate(shards[0]["steps"]):
        step = {}
        for name in names:
            parts = [s["steps"][i][name] for s in shards]
            grads = [(p[0], None, p[2], p[3]) for p in parts]
            weights = [(p[1], None, p[2], p[3]) for p in parts]
            step[name] = (_whole(grads, ranks[0]["gated"], name), _whole(weights, ranks[0]["gated"], name))
        whole.append(step)
    return whole


def report(got: list[dict], want: list[dict], top: int) -> None:
    """Per step: the gradient norm over all tensors and the `top` tensors that differ most."""
    for i, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert mine.keys() == theirs.keys(), sorted(mine.keys() ^ theirs.keys())
        norm_a = sum(float(g.double().pow(2).sum()) for g, _ in theirs.values()) ** 0.5
        norm_b = sum(float(g.double().pow(2).sum()) for g, _ in mine.values()) ** 0.5
        print(f"step {i + 1}: gradient norm {norm_b:.9g} vs {norm_a:.9g} ({(norm_b - norm_a) / norm_a:+.2e})")
        rows = []
        for name, (grad, weight) in theirs.items():
            diff = float((mine[name][0] - grad).double().norm())
            rel = diff / max(float(grad.double().norm()), 1e-30)
            rows.append((diff, rel, float((mine[name][1] - weight).abs().max()), name))
        for diff, rel, weights, name in sorted(rows, reverse=True)[:top]:
            print(f"    {name:55s} gradient {rel:.1e} relative ({diff:.1e} abs), weights before it {weights:.1e} max abs")


def main(argv: list[str] | None = None) -> int:
    from tests.compare import relative_differences
    from tests.distributed import run_ranks
    from tests.pretrain.test_sharded_dp import BASE, LAYOUTS, REFERENCE, REPEAT_ONLY, _reference_of
    from tests.pretrain.workers import document_data

    layouts = {**LAYOUTS, **REPEAT_ONLY}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layout", choices=sorted(layouts), metavar="LAYOUT")
    parser.add_argument("overrides", nargs="*", help="key=value for both runs (after the layout's own)")
    parser.add_argument("--noise", type=float, default=0.0, help="one rank with perturbed gradients instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=4, help="tensors shown per step")
    args = parser.parse_args(argv)
    recipe, nproc, extra = layouts[args.layout]
    if any(axis in item for item in extra for axis in UNSUPPORTED_AXES):
        parser.error(f"{args.layout}: PP, ZeRO-3 and EP layouts are not supported (ranks hold whole tensors "
                     "or TP shards only); choose a TP, SP, CP or DP layout")
    ref_recipe, ref_extra = REFERENCE[_reference_of(args.layout)]
    runs = {"one rank": (ref_recipe, 1, ref_extra, 0.0),
            args.layout if not args.noise else f"one rank, noise {args.noise:g}":
                (ref_recipe, 1, ref_extra, args.noise) if args.noise else (recipe, nproc, extra, 0.0)}
    with tempfile.TemporaryDirectory(prefix="grad-drift-") as tmp:
        root, loaded, logged = Path(tmp), {}, {}
        for i, (tag, (rec, ranks, over, noise)) in enumerate(runs.items()):
            folder = root / f"run{i}"
            folder.mkdir()
            data = document_data(root) if "data.mock=false" in over else []
            run_ranks(ranks, "tests.pretrain.grad_drift:train_and_dump", recipe=rec, out=str(folder),
                      noise=noise, seed=args.seed,
                      overrides=BASE + over + data + args.overrides + [
                          "checkpoint.save_interval=0", f"logging.run_dir={folder}"])
            loaded[tag] = load_steps(folder)
            logged[tag] = (folder / "metrics.jsonl").read_text().splitlines()
        (want_tag, want), (got_tag, got) = loaded.items()
        print(f"{got_tag} vs {want_tag}")
        for key in ("loss", "grad_norm"):
            values = {tag: [json.loads(line)[key] for line in lines] for tag, lines in logged.items()}
            rel = relative_differences(values[got_tag], values[want_tag], what=key)
            print(f"logged {key}: " + ", ".join(f"{r:.1e}" for r in rel))
        report(got, want, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())

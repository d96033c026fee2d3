"""muP coordinate check (Yang et al. 2022, "Tensor Programs V", section 7): train the same tiny
Llama at several widths for a few steps at a large learning rate and record the size of every
layer's output. Under muP (model.use_mup, base width = the smallest) the sizes stay flat with
width; under the standard parametrization they grow with it once the optimizer has taken a step.

    PYTHONPATH=. python -m pretrain.mup_coord_check --widths 64 128 256 512 1024 --steps 4 --lr 1e-2

One rank, the real training path (pretrain.loop: Megatron-Core GPTModel, its muP fields, our
layout-invariant init, Megatron-Core's optimizer with its muP param groups), with forward hooks
on the embedding, each layer's QKV, attention output, MLP fc1 and fc2, and the output layer.
Size = RMS of the output (finite entries: padded-vocab logits are -inf); the logits are taken
after Megatron-Core's muP output multiplier, which GPTModel applies after the output layer.
Widths keep head_dim 16 (heads = width / 16), ffn = 2 x width, 2 layers, mock data (Megatron-Core's
MockGPTDataset): what is compared is only how sizes move with width.
Prints, per layer, the slope of log(size) vs log(width) at the last step (the forward after
steps - 1 updates) for both parametrizations; --json prints the whole record.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

import torch

# The hooked modules (Megatron-Core names under GPTModel) -> a short layer label.
_HOOKED = {"self_attention.linear_qkv": "qkv", "self_attention.linear_proj": "attn_out",
           "mlp.linear_fc1": "fc1", "mlp.linear_fc2": "fc2"}
HEAD_DIM = 16


def width_overrides(width: int, *, mup: bool, base_width: int, steps: int, lr: float, layers: int,
                    run_dir: str, data: Optional[list[str]] = None) -> list[str]:
    """tiny-llama at `width` (head_dim 16, ffn 2 x width), constant LR, no clipping; muP or not."""
    if width % HEAD_DIM:
        raise ValueError(f"width {width} must be a multiple of the head dim {HEAD_DIM}")
    overrides = [
        f"model.hidden_size={width}", f"model.num_attention_heads={width // HEAD_DIM}", "model.num_query_groups=null",
        f"model.ffn_hidden_size={2 * width}", f"model.num_layers={layers}",
        f"schedule.train_steps={steps}", "schedule.warmup_steps=0", "schedule.decay_style=constant",
        "schedule.micro_batch_size=4", "schedule.global_batch_size=4", "schedule.seq_length=64",
        "schedule.eval_interval=0", f"optimizer.lr={lr}", f"optimizer.min_lr={lr}", "optimizer.clip_grad=0",
        "optimizer.weight_decay=0", "optimizer.distributed=false", "runtime.spec=portable", "runtime.dtype=fp32",
        "logging.tensorboard=false", f"logging.log_interval={steps}", "logging.straggler_interval=0",
        f"logging.run_dir={run_dir}", "checkpoint.resume=none",
    ]
    overrides += data if data is not None else ["data.demo=false", "data.mock=true"]
    if mup:
        # Base = the smallest width; head_dim is fixed, so base_head_dim = 16 keeps 1/sqrt(16).
        overrides += ["model.use_mup=true", f"model.mup_base_hidden_size={base_width}",
                      f"model.mup_base_head_dim={HEAD_DIM}"]
    return overrides


def _rms(x: torch.Tensor) -> float:
    x = x.detach().float()
    x = x[torch.isfinite(x)]
    return x.pow(2).mean().sqrt().item()


def _hook_sizes(gpt, sizes: dict[str, list[float]]) -> list:
    """Forward hooks appending each hooked module's output RMS (one entry per forward)."""
    def record(label: str, scale: float = 1.0):
        def hook(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            sizes.setdefault(label, []).append(_rms(out) * scale)
        return hook

    handles = [gpt.embedding.register_forward_hook(record("embedding"))]
    for layer in gpt.decoder.layers:
        for name, label in _HOOKED.items():
            module = layer.get_submodule(name)
            handles.append(module.register_forward_hook(record(f"layer{layer.layer_number}.{label}")))
    cfg = gpt.config
    handles.append(gpt.output_layer.register_forward_hook(
        record("logits", cfg.mup_output_mult if cfg.use_mup else 1.0)))
    return handles


def train_width(overrides: list[str], *, hooks: bool = True) -> dict:
    """One single-process run (pretrain.loop) of tiny-llama with these overrides: per-step losses
    and, with hooks, each hooked layer's output RMS per step (one micro-batch per step)."""
    from pretrain.cli import resolve_config
    from pretrain.loop import setup, train
    from pretrain.runtime import shutdown

    config = resolve_config("tiny-llama", None, overrides)
    run = setup(config)
    sizes: dict[str, list[float]] = {}
    failed = True
    try:
        if hooks:
            for chunk in run.state.model:
                _hook_sizes(chunk.module, sizes)
        history = train(run, run.start_step)
        failed = False
        return {"losses": [m.loss for m in history], "sizes": sizes}
    finally:
        run.writer.close()
        shutdown(barrier=not failed)


def slope(widths: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(width)."""
    xs, ys = [math.log(w) for w in widths], [math.log(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def coord_check(widths: list[int], *, steps: int, lr: float, layers: int, run_root: str) -> dict:
    """Both parametrizations at every width: {"sp"|"mup": {"sizes": {width: {layer: [rms per step]}},
    "losses": {width: [...]}, "slopes": {layer: slope at the last step}}}."""
    out = {}
    for kind in ("sp", "mup"):
        sizes, losses = {}, {}
        for width in widths:
            result = train_width(width_overrides(width, mup=kind == "mup", base_width=min(widths), steps=steps,
                                                 lr=lr, layers=layers, run_dir=f"{run_root}/{kind}-{width}"))
            sizes[width], losses[width] = result["sizes"], result["losses"]
        layers_seen = list(sizes[widths[0]])
        slopes = {name: slope(widths, [sizes[w][name][-1] for w in widths]) for name in layers_seen}
        out[kind] = {"sizes": sizes, "losses": losses, "slopes": slopes}
    return out


def format_table(result: dict) -> str:
    lines = [f"{'layer':<18} {'slope SP':>9} {'slope muP':>9}"]
    for name in result["sp"]["slopes"]:
        lines.append(f"{name:<18} {result['sp']['slopes'][name]:>9.3f} {result['mup']['slopes'][name]:>9.3f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.mup_coord_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--steps", type=int, default=4, help="training steps; sizes are read at the last one")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--run-dir", default="runs/mup_coord_check")
    parser.add_argument("--json", action="store_true", help="print the whole record as one JSON document")
    args = parser.parse_args(argv)
    bad = [w for w in args.widths if w <= 0 or w % HEAD_DIM]
    if bad or len(args.widths) < 2 or args.steps < 2:
        print(f"error: need >= 2 widths, each a positive multiple of {HEAD_DIM} (got {args.widths}), "
              f"and --steps >= 2 (got {args.steps})", file=sys.stderr)
        return 2
    widths = sorted(set(args.widths))
    result = coord_check(widths, steps=args.steps, lr=args.lr, layers=args.layers, run_root=args.run_dir)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

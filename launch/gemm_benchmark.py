"""What one transformer layer and the last pipeline stage's extras cost on this GPU, part by
part, beside what the planner charges for them.

    python -m launch.gemm_benchmark --recipe llama3-70b --tp 4 --seq 8192 --precision bf16 fp8
    python -m launch.gemm_benchmark --sweep --precision bf16 fp8     # narrow GEMMs

For one rank of a model at a tensor-parallel size (sequence parallel: the GEMMs see the whole
sequence), it times each linear layer's three GEMMs (forward, input gradient, weight gradient; replayed
from a CUDA graph, so no host launch cost shows) with cuBLAS through torch (`torch.matmul` in BF16; `torch._scaled_mm` with per-tensor scales
for FP8, what Transformer Engine's tensorwise recipe calls), the attention core with
`scaled_dot_product_attention` (causal, flash kernel, forward + backward), and the last stage's
extras: the output layer's three BF16 GEMMs and the fp32 cross entropy over the rank's vocabulary
slice. It prints each part's time and fraction of the device's peak, then the planner's time
for the same parts (launch.planner.throughput.time_parts_per_token) and "the last stage's
extras in layers", the number that decides whether an uneven pipeline split pays.

Not measured: the element-wise kernels (norms, SwiGLU, RoPE), FP8 casts and amax
reductions, communication: a real step is slower than the sum of these parts.
`--sweep` times forward GEMMs with one narrow side (128 to 16384: the output's N, the reduction
K, or the tokens M) and the others 8192, the shapes of MoE experts (expert tensor parallelism
narrows N and K, few tokens per expert narrow M). CPU (`--device cpu`, fp32) runs
the same code on small shapes (the tests); the numbers that matter come from a GPU.
Results: a table on stdout, one JSON line per measurement appended to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

from data_pipeline.checks import positive_int, run_cli
from launch.planner.gemms import Gemm, layer_gemms


def output_gemm(model, tp: int, tokens: int) -> Gemm:
    """The output layer's GEMM on one rank (vocabulary split over TP)."""
    return Gemm("output-layer", tokens, model.hidden_size, model.padded_vocab_size // tp)


class Timer:
    """Median seconds per call over `windows` windows of `iters` calls, after warm-up."""

    def __init__(self, device: torch.device, iters: int = 10, windows: int = 5):
        self.device, self.iters, self.windows = device, iters, windows

    def __call__(self, fn, graph: bool = False) -> float:
        """`graph`: on a GPU, capture the `iters` calls in one CUDA graph and time its replays,
        so the host's launch cost (10-30 us a call from Python) cannot idle the GPU between
        small kernels: what a grouped GEMM or a captured step would see."""
        for _ in range(3):
            fn()
        if graph and self.device.type == "cuda":
            return self._graphed(fn)
        samples = []
        for _ in range(self.windows):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.iters):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / self.iters)
            else:
                t0 = time.perf_counter()
                for _ in range(self.iters):
                    fn()
                samples.append((time.perf_counter() - t0) / self.iters)
        return statistics.median(samples)


    def _graphed(self, fn) -> float:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(self.iters):
                fn()
        g.replay()
        samples = []
        for _ in range(self.windows):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / self.iters)
        return statistics.median(samples)


def _operands(m: int, k: int, n: int, precision: str, device: torch.device):
    """A[M, K] row-major and B[K, N] column-major (what cuBLAS' FP8 GEMM takes) in `precision`."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(precision, torch.bfloat16)
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype).t()
    if precision == "fp8":
        return a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    return a, b


def gemm_fn(m: int, k: int, n: int, precision: str, device: torch.device):
    a, b = _operands(m, k, n, precision, device)
    if precision == "fp8":
        one = torch.ones((), device=device, dtype=torch.float32)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return lambda: torch.matmul(a, b)


def time_gemm(g: Gemm, precision: str, timer: Timer) -> dict[str, float]:
    """Seconds of the forward, input-gradient and weight-gradient GEMMs of `g` (x its count:
    local experts run one after another, not as one grouped GEMM)."""
    out = {}
    for name, (m, k, n) in zip(("fwd", "dgrad", "wgrad"), g.passes(), strict=True):
        out[name] = g.count * timer(gemm_fn(round(m), round(k), round(n), precision, timer.device), graph=True)
        torch.cuda.empty_cache() if timer.device.type == "cuda" else None
    return out


def time_attention(model, tp: int, seq: int, micro_batch: int, timer: Timer, dtype: torch.dtype) -> float:
    """Forward + backward of the causal attention core of one rank's heads."""
    heads, groups, d = model.num_attention_heads // tp, max(1, model.query_groups // tp), model.head_dim
    q = torch.randn(micro_batch, heads, seq, d, device=timer.device, dtype=dtype, requires_grad=True)
    k = torch.randn(micro_batch, groups, seq, d, device=timer.device, dtype=dtype, requires_grad=True)
    v = torch.randn(micro_batch, groups, seq, d, device=timer.device, dtype=dtype, requires_grad=True)
    grad = torch.randn(micro_batch, heads, seq, d, device=timer.device, dtype=dtype)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups != heads)
        out.backward(grad)
    return timer(step)


def time_loss(tokens: int, vocab: int, timer: Timer) -> float:
    """Forward + backward of cross entropy over fp32 logits of the rank's vocabulary slice."""
    logits = torch.randn(tokens, vocab, device=timer.device, dtype=torch.float32, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,), device=timer.device)

    def step():
        torch.nn.functional.cross_entropy(logits, target).backward()
    return timer(step)


def _candidate(args, precision: str):
    from launch.planner.candidate import Candidate
    from pretrain.config import apply_overrides
    from pretrain.recipes import get_recipe
    fp8 = ["runtime.fp8=hybrid", "runtime.fp8_recipe=tensorwise"] if precision == "fp8" else []
    config = apply_overrides(get_recipe(args.recipe), overrides=[
        *args.overrides, f"parallel.tensor_parallel={args.tp}", "parallel.pipeline_parallel=1",
        "parallel.context_parallel=1", f"parallel.sequence_parallel={str(args.tp > 1).lower()}",
        f"schedule.seq_length={args.seq}", f"schedule.micro_batch_size={args.micro_batch}",
        "runtime.recompute=none", f"runtime.dtype={'fp32' if precision == 'fp32' else 'bf16'}", *fp8])
    return Candidate.from_config(config, world_size=args.tp)


def planner_parts(c, device_name: str) -> tuple[dict[str, float], dict[str, float]]:
    """The planner's seconds for one layer and for the last stage's extras, one rank, one
    microbatch (launch.planner.throughput.time_parts_per_token)."""
    from launch.planner.devices import get_device
    from launch.planner.throughput import ThroughputOptions, time_parts_per_token
    device, opts = get_device(device_name), ThroughputOptions()
    tokens = c.seq_length * c.micro_batch / (c.tp * c.cp)
    layer = {k: v * tokens for k, v in time_parts_per_token(c, 1, False, device, opts).items() if v}
    extras = {k: v * tokens for k, v in time_parts_per_token(c, 0, True, device, opts).items() if v}
    return layer, extras


def measure_model(args, precision: str, timer: Timer, peak: dict[str, float]) -> list[dict]:
    c = _candidate(args, precision)
    tokens = args.seq * args.micro_batch
    records = []
    for g in layer_gemms(c):
        for pass_, s in time_gemm(g, precision, timer).items():
            records.append({"part": "layer-gemm", "name": f"{g.name}.{pass_}", "m": round(g.m), "k": round(g.k),
                            "n": round(g.n), "count": g.count,
                            "precision": precision, "s": s, "tflops": g.flops / s / 1e12})
    act = torch.float32 if precision == "fp32" else torch.bfloat16
    attn = time_attention(c.model, args.tp, args.seq, args.micro_batch, timer, act)
    records.append({"part": "layer-attention", "name": "attention fwd+bwd", "precision": "fp32" if precision == "fp32"
                    else "bf16", "s": attn})
    out = output_gemm(c.model, args.tp, tokens)
    for pass_, s in time_gemm(out, "fp32" if precision == "fp32" else "bf16", timer).items():
        records.append({"part": "extras-gemm", "name": f"{out.name}.{pass_}", "m": out.m, "k": out.k, "n": out.n,
                        "precision": "fp32" if precision == "fp32" else "bf16", "s": s,
                        "tflops": out.flops / s / 1e12})
    records.append({"part": "extras-loss", "name": "cross entropy fwd+bwd", "precision": "fp32",
                    "s": time_loss(tokens, c.model.padded_vocab_size // args.tp, timer)})
    for r in records:
        if "tflops" in r:
            r["fraction_of_peak"] = r["tflops"] / peak[r["precision"]]
    return records


def summarize(args, precision: str, records: list[dict]) -> dict:
    """Measured vs the planner: one layer, the extras, extras in layers."""
    layer_gemm = sum(r["s"] for r in records if r["part"] == "layer-gemm")
    attention = sum(r["s"] for r in records if r["part"] == "layer-attention")
    extras = sum(r["s"] for r in records if r["part"].startswith("extras"))
    planned_layer, planned_extras = planner_parts(_candidate(args, precision), args.planner_device)
    return {"part": "summary", "recipe": args.recipe, "tp": args.tp, "seq": args.seq, "micro_batch": args.micro_batch,
            "precision": precision, "measured_layer_s": layer_gemm + attention, "measured_layer_gemm_s": layer_gemm,
            "measured_attention_s": attention, "measured_extras_s": extras,
            "measured_extras_in_layers": extras / (layer_gemm + attention),
            "planner_device": args.planner_device, "planner_layer": planned_layer, "planner_extras": planned_extras,
            "planner_extras_in_layers": sum(planned_extras.values()) / sum(planned_layer.values()),
            "planner_extras_in_layers_without_elementwise": sum(planned_extras.values())
            / (planned_layer["gemm"] + planned_layer["attention"])}


def sweep(args, precision: str, timer: Timer, peak: dict[str, float]) -> list[dict]:
    records = []
    for narrow in args.sweep_sizes:
        for side, (m, k, n) in (("narrow N", (args.sweep_tokens, args.sweep_wide, narrow)),
                                ("narrow K", (args.sweep_tokens, narrow, args.sweep_wide)),
                                ("narrow M", (narrow, args.sweep_wide, args.sweep_tokens))):
            s = timer(gemm_fn(m, k, n, precision, timer.device), graph=True)
            tflops = 2.0 * m * k * n / s / 1e12
            records.append({"part": "sweep", "name": side, "m": m, "k": k, "n": n, "precision": precision, "s": s,
                            "tflops": tflops, "fraction_of_peak": tflops / peak[precision]})
    return records


def print_records(records: list[dict]) -> None:
    for r in records:
        if r["part"] == "summary":
            print(f"[{r['recipe']} TP{r['tp']} seq {r['seq']} mbs {r['micro_batch']} {r['precision']}] one layer "
                  f"{r['measured_layer_s'] * 1e3:.2f} ms measured (GEMMs {r['measured_layer_gemm_s'] * 1e3:.2f}, "
                  f"attention {r['measured_attention_s'] * 1e3:.2f}), planner ({r['planner_device']}) "
                  f"{sum(r['planner_layer'].values()) * 1e3:.2f} ms ("
                  + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r["planner_layer"].items()) + ")")
            print(f"    last stage's extras {r['measured_extras_s'] * 1e3:.2f} ms measured = "
                  f"{r['measured_extras_in_layers']:.2f} layers (GEMMs + attention); planner "
                  f"{sum(r['planner_extras'].values()) * 1e3:.2f} ms = {r['planner_extras_in_layers']:.2f} layers "
                  f"({r['planner_extras_in_layers_without_elementwise']:.2f} of its GEMMs + attention)")
            continue
        shape = f"{r['m']}x{r['k']}x{r['n']}" if "m" in r else ""
        rate = f"{r['tflops']:8.1f} TFLOP/s {r['fraction_of_peak']:6.1%}" if "tflops" in r else ""
        print(f"  {r['part']:16s} {r['name']:24s} {r['precision']:5s} {shape:20s} {r['s'] * 1e3:9.3f} ms {rate}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.gemm_benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="llama3-8b")
    p.add_argument("--tp", type=positive_int, default=1)
    p.add_argument("--seq", type=positive_int, default=8192)
    p.add_argument("--micro-batch", type=positive_int, default=1)
    p.add_argument("--precision", nargs="+", choices=("bf16", "fp8", "fp32"), default=["bf16"])
    p.add_argument("--sweep", action="store_true", help="narrow-GEMM sweep instead of a model's layer")
    p.add_argument("--sweep-sizes", nargs="+", type=positive_int,
                   default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--sweep-tokens", type=positive_int, default=8192)
    p.add_argument("--sweep-wide", type=positive_int, default=8192)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--planner-device", default="h100-80gb", help="the planner's device to compare with")
    p.add_argument("--iters", type=positive_int, default=10)
    p.add_argument("--windows", type=positive_int, default=5)
    p.add_argument("--out", type=pathlib.Path, help="append one JSON line per measurement")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (e.g. model=llama3.1-405b)")
    return p


def run(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device here; this benchmark measures a GPU (--device cpu runs it on "
                         "the CPU in fp32, for testing the harness)")
    if args.device == "cpu" and set(args.precision) - {"fp32"}:
        raise SystemExit("error: --device cpu measures fp32 only (--precision fp32)")
    device = torch.device(args.device)
    if device.type == "cuda":
        from pretrain.metrics import detect_device_peak
        peak = {"bf16": detect_device_peak("auto", "bf16", False), "fp8": detect_device_peak("auto", "bf16", True),
                "fp32": detect_device_peak("auto", "fp32", False)}
        if None in peak.values():
            raise SystemExit(f"error: no peak FLOP/s known for {torch.cuda.get_device_name()} "
                             "(pretrain.metrics.DEVICE_PEAK_TFLOPS)")
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, peaks (TFLOP/s) {peak}")
    else:
        peak = {"fp32": 1.0}
    timer = Timer(device, args.iters, args.windows)
    records = []
    for precision in args.precision:
        if args.sweep:
            found = sweep(args, precision, timer, peak)
        else:
            found = measure_model(args, precision, timer, peak)
            found.append(summarize(args, precision, found))
        print_records(found)
        records += found
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            for r in records:
                f.write(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                    **r}) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(build_parser().parse_intermixed_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

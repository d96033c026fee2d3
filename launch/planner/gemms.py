"""Narrow GEMMs: a linear layer's GEMM with a side of a few hundred runs far below the
efficiency of a wide one, and more so in FP8. The planner's GEMM efficiencies
(launch.planner.efficiency) are fitted on Llama-3 layers whose every side is >= 2048 wide;
this module scales them down for the GEMMs of a layer that are narrower: experts split by
expert tensor parallelism (DeepSeek-V3's 2048-wide experts at ETP 8 are 256 wide), small
experts (Qwen3-30B-A3B's 768), a few tokens per expert, or a small model at high TP.

Measured on one H200 (2026-11-30, torch 2.11 + cuBLAS through `torch.matmul` and
`torch._scaled_mm`, tests/launch/fixtures/h200-runs/gemm-h200.jsonl):
`python -m launch.gemm_benchmark --sweep --precision bf16 fp8` times Y[M, N] = X[M, K] W[K, N]
with one side narrow and the others 8192, each GEMM replayed from a CUDA graph (no host launch
cost). Each factor below is that GEMM's fraction of peak over the median of the sweep's wide
GEMMs (no side under 2048: BF16 69.0%, FP8 64.0% of peak), capped at 1; from 2048 on it is 1
(the wide GEMMs scatter by +-7% there, and the fitted efficiencies already describe layers that
wide). An output side (M or N: the two measured within 2 points of each other) and the
reduction side (K) are measured apart: K hurts more (FP8 at K=256 reaches 23% of peak, at
N=256 61%). GEMMs small in every side run slower than these factors say: Qwen3-30B-A3B's
experts at EP8 (2048 x 2048 x 1536 and 2048 x 768 x 2048) reached 51% and 35-43% of the FP8 peak,
where the factors give 64% and 47%. A GEMM with a narrow output side and a
narrow K gets both factors (not measured together). Between measured widths the factor is
interpolated in log(width); below the narrowest it falls in proportion to the width.
tests/launch/test_planner_gemms.py recomputes the tables from the recorded sweep.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

WIDTHS = (128, 256, 512, 1024, 2048)
# precision -> side -> factor at each of WIDTHS (1 from the last width on).
NARROW_FACTORS: dict[str, dict[str, tuple[float, ...]]] = {
    "bf16": {"out": (0.682, 1.0, 1.0, 1.0, 1.0), "k": (0.508, 0.778, 0.94, 1.0, 1.0)},
    "fp8": {"out": (0.592, 0.947, 1.0, 1.0, 1.0), "k": (0.203, 0.357, 0.619, 0.831, 1.0)},
}


def side_factor(width: float, precision: str, side: str) -> float:
    """The factor of one side `width` wide (module docstring); 1 for fp32 (not measured)."""
    table = NARROW_FACTORS.get(precision)
    if table is None:
        return 1.0
    values = table[side]
    if width >= WIDTHS[-1]:
        return 1.0
    if width <= WIDTHS[0]:
        return values[0] * width / WIDTHS[0]
    i = bisect.bisect_right(WIDTHS, width) - 1
    t = math.log(width / WIDTHS[i]) / math.log(WIDTHS[i + 1] / WIDTHS[i])
    return values[i] + t * (values[i + 1] - values[i])


def gemm_factor(m: float, k: float, n: float, precision: str) -> float:
    """Y[m, n] = X[m, k] W[k, n]: the narrow-output factor times the narrow-K factor."""
    return side_factor(min(m, n), precision, "out") * side_factor(k, precision, "k")


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One forward GEMM of a layer on one rank, `count` times (local experts); backward runs
    dX = dY W^T (m, n, k) and dW = X^T dY (k, m, n)."""
    name: str
    m: float
    k: float
    n: float
    count: float = 1

    def passes(self) -> tuple[tuple[float, float, float], ...]:
        return (self.m, self.k, self.n), (self.m, self.n, self.k), (self.k, self.m, self.n)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count


def layer_gemms(c) -> list[Gemm]:
    """The linear GEMMs of one layer of candidate `c` on one rank for one microbatch (the
    kind of layer `c.model` describes: MoE if it has experts). Sequence parallel gathers the
    sequence, so dense GEMMs see s b / cp tokens; each expert sees its balanced share of the
    EP group's tokens, ep s b k / (E cp). Multi-latent attention's projections are not
    listed (launch.planner.throughput prices what is not listed as wide)."""
    m, tokens = c.model, c.seq_length * c.micro_batch / c.cp
    h, gated = m.hidden_size, 2 if m.gated else 1
    out: list[Gemm] = []
    if not m.multi_latent_attention:
        qkv = (m.num_attention_heads + 2 * m.query_groups) * m.head_dim
        out += [Gemm("qkv", tokens, h, qkv / c.tp), Gemm("attn-out", tokens, m.num_attention_heads * m.head_dim / c.tp, h)]
    if m.is_moe:
        local = m.num_experts / c.ep
        per_expert = c.ep * tokens * m.moe_router_topk / m.num_experts
        f = m.expert_ffn_hidden_size / c.etp
        out += [Gemm("expert-fc1", per_expert, h, gated * f, local), Gemm("expert-fc2", per_expert, f, h, local)]
        if m.moe_shared_expert_hidden_size:
            fs = m.moe_shared_expert_hidden_size / c.tp
            out += [Gemm("shared-fc1", tokens, h, gated * fs), Gemm("shared-fc2", tokens, fs, h)]
    else:
        f = m.ffn_hidden_size / c.tp
        out += [Gemm("fc1", tokens, h, gated * f), Gemm("fc2", tokens, f, h)]
    return out


def linear_gemm_factor(c, linear_flops: float, precision: str) -> float:
    """The factor on the GEMM efficiency for one layer of `c`: its listed GEMMs' FLOPs over
    the time they take at their factors (a FLOP-weighted harmonic mean over all three
    passes), with `linear_flops` (the layer's linear FLOPs on this rank and microbatch, from
    models.flops) minus the listed ones priced as wide."""
    listed = layer_gemms(c)
    flops = sum(g.flops for g in listed)
    time = sum(2.0 * a * b * d * g.count / gemm_factor(a, b, d, precision) for g in listed for a, b, d in g.passes())
    rest = max(0.0, linear_flops - flops)
    return (3 * flops + 3 * rest) / (time + 3 * rest) if flops else 1.0

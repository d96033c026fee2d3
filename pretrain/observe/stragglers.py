"""The straggler report: every `logging.straggler_interval` steps, which rank is slow.

Each rank sums its own forward/backward compute time (`pretrain.observe.timers`: Megatron-
Core's 'forward-compute' / 'backward-compute', which exclude pipeline waits, the gradient
all-reduce and the optimizer) over the interval; one all-gather per report brings every
rank's mean per step to every rank. A rank is compared with the median of the ranks of its
own pipeline stage (data- and tensor-parallel peers do the same work; stages differ by
design: the first holds the embedding, the last the output layer and loss).

Limits: tensor-parallel peers wait for each other inside the compute (TP all-reduces in
every layer), so a slow rank's TP peers look slow too; the data-parallel comparison across
TP groups is what singles it out. MoE expert imbalance shows up as compute differences.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Optional

import torch
import torch.distributed as dist

from pretrain.observe.timers import StepTimers
from pretrain.runtime import collective_device


@dataclasses.dataclass
class StragglerStats:
    first_step: int
    last_step: int
    slowest_rank: int
    slowest_s: float  # its compute time per step
    median_s: float  # the median of its pipeline stage
    ratio: float  # slowest_s / median_s
    per_rank_s: list[float]

    def metrics(self) -> dict:
        """The keys StepMetrics carries (metrics.jsonl, TensorBoard, trackers)."""
        return dict(straggler_slowest_rank=self.slowest_rank, straggler_slowest_s=self.slowest_s,
                    straggler_median_s=self.median_s, straggler_ratio=self.ratio)

    def warning(self, warn_ratio: float) -> Optional[str]:
        if self.ratio <= warn_ratio:
            return None
        return (f"warning: straggler: rank {self.slowest_rank} computes {1000 * self.slowest_s:.1f} ms/step, "
                f"x{self.ratio:.2f} its pipeline stage's median {1000 * self.median_s:.1f} ms (steps "
                f"{self.first_step}-{self.last_step}; over logging.straggler_warn_ratio={warn_ratio:g}): "
                "check that rank's node (clocks, thermals, neighbours)")


def slowest(per_rank: list[float], stage: list[int]) -> tuple[int, float, float]:
    """(rank, its time, its stage's median) for the rank furthest above its stage's median."""
    best = (0, per_rank[0], per_rank[0], 0.0)
    for rank, t in enumerate(per_rank):
        median = statistics.median(x for x, s in zip(per_rank, stage) if s == stage[rank])
        ratio = t / median if median > 0 else 1.0
        if ratio > best[3]:
            best = (rank, t, median, ratio)
    return best[:3]


class StragglerReport:
    def __init__(self, interval: int, timers: StepTimers, pipeline_rank: int, start_step: int):
        self.interval, self.timers, self.pipeline_rank = interval, timers, pipeline_rank
        self._compute_s = 0.0
        self._steps = 0
        self._first = start_step + 1

    def after_step(self, step: int) -> Optional[StragglerStats]:
        """Every rank calls this after every step; on report steps it gathers (a collective)."""
        self._compute_s += self.timers.take_compute_s()
        self._steps += 1
        if step % self.interval:
            return None
        mine = torch.tensor([self._compute_s / self._steps, float(self.pipeline_rank)],
                            dtype=torch.float64, device=collective_device())
        gathered = torch.empty(dist.get_world_size() * 2, dtype=torch.float64, device=mine.device)
        dist.all_gather_into_tensor(gathered, mine)
        table = gathered.view(-1, 2).tolist()
        per_rank, stage = [row[0] for row in table], [int(row[1]) for row in table]
        rank, t, median = slowest(per_rank, stage)
        stats = StragglerStats(self._first, step, rank, t, median, t / median if median > 0 else 1.0, per_rank)
        self._compute_s, self._steps, self._first = 0.0, 0, step + 1
        return stats

"""`Candidate`: one point the planner can estimate — a model, a layout, a world size and
the batch/precision/recompute choices that change memory or time.

It is read from (and written back to) the same `ExperimentConfig` the training uses, so
a plan is about exactly the run that `python -m pretrain` would start.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from models.config import ModelConfig
from models.layout import ParallelLayout
from pretrain.config import ExperimentConfig

Recompute = Literal["none", "selective", "full"]
# Bytes per element of parameters and of stored activations, by training dtype.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    model: ModelConfig
    layout: ParallelLayout
    world_size: int
    micro_batch: int
    global_batch: int
    seq_length: int
    dtype: str = "bf16"
    fp8: bool = False
    recompute: Recompute = "none"
    distributed_optimizer: bool = True
    # Flash/fused attention (Transformer Engine spec) stores no s x s score matrix.
    flash_attention: bool = True
    # Our TransformerConfig sets hidden/attention dropout to 0 (no masks are stored); True
    # reproduces the published analysis, which assumes dropout.
    dropout: bool = False

    @classmethod
    def from_config(cls, config: ExperimentConfig, world_size: int, *, flash_attention: bool | None = None
                    ) -> "Candidate":
        """The candidate a config describes; flash attention unless the spec is `portable`."""
        sched = config.schedule
        return cls(
            model=config.model, layout=config.parallel, world_size=world_size,
            micro_batch=sched.micro_batch_size, global_batch=sched.global_batch_size,
            seq_length=sched.seq_length, dtype=config.runtime.dtype, fp8=bool(config.runtime.fp8),
            recompute=config.runtime.recompute, distributed_optimizer=config.optimizer.distributed,
            flash_attention=(config.runtime.spec != "portable") if flash_attention is None else flash_attention,
        )

    def apply_to(self, config: ExperimentConfig) -> ExperimentConfig:
        """`config` with this candidate's layout, batch, recompute and optimizer choices."""
        return config.model_copy(update=dict(
            model=self.model,
            parallel=self.layout,
            schedule=config.schedule.model_copy(update=dict(
                micro_batch_size=self.micro_batch, global_batch_size=self.global_batch,
                seq_length=self.seq_length)),
            runtime=config.runtime.model_copy(update=dict(recompute=self.recompute)),
            optimizer=config.optimizer.model_copy(update=dict(distributed=self.distributed_optimizer)),
        ))

    def overrides(self) -> dict:
        """The nested YAML overrides (`pretrain --config FILE`) that select this candidate."""
        return {
            "parallel": self.layout.model_dump(),
            "schedule": {"micro_batch_size": self.micro_batch, "global_batch_size": self.global_batch,
                         "seq_length": self.seq_length},
            "runtime": {"recompute": self.recompute},
            "optimizer": {"distributed": self.distributed_optimizer},
        }

    # Sizes of the process groups, as Megatron-Core builds them.
    @property
    def tp(self) -> int:
        return self.layout.tensor_parallel

    @property
    def pp(self) -> int:
        return self.layout.pipeline_parallel

    @property
    def vpp(self) -> int:
        return self.layout.vpp

    @property
    def cp(self) -> int:
        return self.layout.context_parallel

    @property
    def ep(self) -> int:
        return self.layout.expert_parallel

    @property
    def etp(self) -> int:
        return self.layout.expert_tp

    @property
    def dp(self) -> int:
        return self.layout.data_parallel(self.world_size)

    @property
    def dense_shard(self) -> int:
        """Ranks that share one copy of a dense parameter: DP x CP (Megatron's intra_dp_cp group,
        over which the distributed optimizer shards dense state)."""
        return self.world_size // (self.tp * self.pp)

    @property
    def expert_shard(self) -> int:
        """Ranks that share one copy of an expert parameter: expert-DP = world / (ETP x EP x PP)."""
        return self.layout.expert_data_parallel(self.world_size)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def describe(self) -> str:
        parts = [self.layout.describe(self.world_size), f"mbs{self.micro_batch}"]
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        parts.append("distopt" if self.distributed_optimizer else "no-distopt")
        return " ".join(parts)

"""`Candidate`: one point the planner can estimate — a model, a layout, a world size and
the batch/precision/recompute choices that change memory or time.

It is read from (and written back to) the same `ExperimentConfig` the training uses, so
a plan is about exactly the run that `python -m pretrain` would start.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from models.config import ModelConfig
from models.flops import packed_attention_fraction
from models.layout import SHARDING_LEVELS, ParallelLayout, pipeline_split
from models.runtime import DTYPES, DtypeName, Recompute
from pretrain.config import ExperimentConfig, data_parallel_sharding, microbatches
from pretrain.config.schema import MuonConfig


def zero_stage(config: ExperimentConfig) -> int:
    """The ZeRO stage a config trains with, as the training reads it (`parallel.sharding`, or
    when unset `optimizer.distributed`): ZeRO-1 is Megatron's distributed optimizer, ZeRO-2/3
    Megatron-FSDP's `optim_grads` / `optim_grads_params`."""
    return SHARDING_LEVELS.index(data_parallel_sharding(config))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    model: ModelConfig
    layout: ParallelLayout
    world_size: int
    micro_batch: int
    global_batch: int
    seq_length: int
    dtype: DtypeName = "bf16"
    fp8: bool = False
    # runtime.fp8_recipe as the training reads it (delayed, tensorwise, blockwise, mxfp8);
    # only the GEMMs of linear layers run in FP8 (launch.planner.throughput).
    fp8_recipe: Optional[str] = None
    # Megatron DDP's grad_reduce_in_fp32: ours always True (pretrain/wrap.py); published
    # recipes (Megatron-Bridge's llama performance configs) reduce in bf16.
    grad_reduce_in_fp32: bool = True
    recompute: Recompute = "none"
    # Data-parallel sharding: 0 = none, 1 = optimizer state (Megatron's distributed
    # optimizer), 2 = + gradients, 3 = + parameters (Megatron-FSDP).
    zero: int = 1
    # HSDP (ZeRO-2/3 only): shards live in groups of DP / hsdp_replicas ranks and are
    # replicated across hsdp_replicas such groups.
    hsdp_replicas: int = 1
    # Optimizer CPU offload (GPU only): fp32 main weights and Adam moments live in host memory.
    offload: bool = False
    # optimizer.bucket_size (parameters per bucket; None = Megatron's default): sets the size
    # of Megatron-FSDP's gradient reduce-scatter buckets.
    bucket_size: Optional[int] = None
    # Flash/fused attention (Transformer Engine spec) stores no s x s score matrix.
    flash_attention: bool = True
    # Our TransformerConfig sets hidden/attention dropout to 0 (no masks are stored); True
    # reproduces the published analysis, which assumes dropout.
    dropout: bool = False
    # Document masking (data.reset_attention_mask): the share of the causal attention work that
    # runs (models.flops.packed_attention_fraction); 1.0 = every token sees its whole prefix.
    # It shortens the estimated time on the te spec (TE's fused attention skips the masked
    # blocks); the portable spec computes the full masked score matrix. FLOP/s and MFU stay on
    # the dense formula, as in metrics.jsonl.
    attention_fraction: float = 1.0
    # optimizer.name=muon: its section (launch.planner.muon models its state and
    # Newton-Schulz); None = AdamW for every parameter (or Lion, below).
    muon: Optional[MuonConfig] = None
    # optimizer.name=lion: one fp32 momentum for every parameter, stepped (and sharded at ZeRO-1)
    # the way Muon is (launch.planner.muon.lion_state_bytes).
    lion: bool = False

    @classmethod
    def from_config(cls, config: ExperimentConfig, world_size: int, *, flash_attention: bool | None = None,
                    document_length: Optional[int] = None) -> "Candidate":
        """The candidate a config describes; flash attention unless the spec is `portable`;
        with data.reset_attention_mask, documents of `document_length` tokens on average.
        The sharding keys live in `zero` / `hsdp_replicas` / `offload`; `layout` keeps only
        the model-parallel ones (its sharding keys at their defaults), so one fact has one home."""
        sched = config.schedule
        return cls(
            model=config.model, layout=_model_parallel_only(config.parallel), world_size=world_size,
            micro_batch=sched.micro_batch_size, global_batch=sched.global_batch_size,
            seq_length=sched.seq_length, dtype=config.runtime.dtype, fp8=bool(config.runtime.fp8),
            fp8_recipe=config.runtime.fp8_recipe_name,
            recompute=config.runtime.recompute, zero=zero_stage(config),
            hsdp_replicas=config.parallel.hsdp_replicas, offload=config.optimizer.cpu_offload,
            bucket_size=config.optimizer.bucket_size,
            flash_attention=(config.runtime.spec != "portable") if flash_attention is None else flash_attention,
            attention_fraction=(packed_attention_fraction(document_length, sched.seq_length)
                                if config.data.reset_attention_mask and document_length else 1.0),
            muon=config.optimizer.muon if config.optimizer.name == "muon" else None,
            lion=config.optimizer.name == "lion",
        )

    def apply_to(self, config: ExperimentConfig) -> ExperimentConfig:
        """`config` with this candidate's layout, sharding, batch, recompute and optimizer choices."""
        return config.model_copy(update=dict(
            model=self.model,
            parallel=self.sharded_layout,
            schedule=config.schedule.model_copy(update=dict(
                micro_batch_size=self.micro_batch, global_batch_size=self.global_batch,
                seq_length=self.seq_length)),
            runtime=config.runtime.model_copy(update=dict(recompute=self.recompute)),
            optimizer=config.optimizer.model_copy(update=self._optimizer_keys()),
        ))

    def _sharding_keys(self) -> dict:
        return {"sharding": SHARDING_LEVELS[self.zero], "hsdp_replicas": self.hsdp_replicas}

    # Cached (the candidate is frozen): the memory and time models ask every stage of every
    # candidate, and rebuilding it each time was most of a 1024-GPU search.
    @functools.cached_property
    def sharded_layout(self) -> ParallelLayout:
        """The training's layout with this candidate's sharding: it answers the sharding
        questions (FSDP or not, shard group sizes) as the training does."""
        return self.layout.model_copy(update=self._sharding_keys())

    def _optimizer_keys(self) -> dict:
        # ZeRO-0 is the one stage without Megatron's distributed optimizer; set it explicitly
        # so `optimizer.distributed` never contradicts `parallel.sharding`.
        return {"distributed": self.zero >= 1, "cpu_offload": self.offload}

    def overrides(self) -> dict:
        """The nested YAML overrides (`pretrain --config FILE`) that select this candidate."""
        return {
            "parallel": self.sharded_layout.model_dump(),
            "schedule": {"micro_batch_size": self.micro_batch, "global_batch_size": self.global_batch,
                         "seq_length": self.seq_length},
            "runtime": {"recompute": self.recompute},
            "optimizer": self._optimizer_keys(),
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
    def distributed_optimizer(self) -> bool:
        """Megatron's distributed optimizer (ZeRO-1) or Megatron-FSDP's (ZeRO-2/3)."""
        return self.zero >= 1

    @property
    def fsdp(self) -> bool:
        """ZeRO-2/3 run on Megatron-FSDP (its own buffers, bucketing and collectives)."""
        return self.sharded_layout.fsdp

    @property
    def dense_zero_shard(self) -> int:
        """Ranks over which sharded dense state is split: DP x CP, divided by the HSDP
        replicas (each replica group holds a whole copy)."""
        return self.sharded_layout.shard_group_size(self.world_size)

    @property
    def expert_zero_shard(self) -> int:
        """Ranks over which sharded expert state is split: expert-DP (MoE has no HSDP)."""
        return self.sharded_layout.expert_shard_group_size(self.world_size)

    @property
    def num_microbatches(self) -> int:
        return microbatches(self.global_batch, self.micro_batch, self.dp)

    @property
    def act_bytes(self) -> int:
        """Bytes per stored activation element: the training dtype's."""
        return DTYPES[self.dtype].itemsize

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the DDP gradient buffer: fp32 with grad_reduce_in_fp32."""
        return 4 if self.grad_reduce_in_fp32 else DTYPES[self.dtype].itemsize

    @property
    def embedding_loss_in_split(self) -> bool:
        """Megatron-Core's account_for_embedding_in_pipeline_split + account_for_loss_in_pipeline_split
        (the layout's keys, as the training reads them): the embedding and the loss each take a
        layer's slot, so L + 2 layers split evenly (Llama-3.1 405B: 126 + 2 = 128 = PP8 x VPP8 x 2)."""
        return self.layout.account_for_embedding_in_pipeline_split and self.layout.account_for_loss_in_pipeline_split

    @functools.cached_property
    def stage_split(self) -> list[list[int]]:
        """Transformer layers of each model chunk, [pp_rank][vp_stage], as the training splits
        them (models.layout.pipeline_split: even, or uneven by the layout's keys); cached, as
        `sharded_layout`."""
        return pipeline_split(self.model.num_layers, self.layout)

    def layers_on_stage(self, stage: int) -> int:
        """Transformer layers on pipeline rank `stage`, all its virtual chunks together."""
        return sum(self.stage_split[stage])

    @property
    def max_stage_layers(self) -> int:
        return max(self.layers_on_stage(s) for s in range(self.pp))

    @property
    def optimizer_name(self) -> str:
        return "muon" if self.muon else "lion" if self.lion else "adamw"

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter element: the training dtype's."""
        return DTYPES[self.dtype].itemsize

    def describe(self) -> str:
        parts = [self.layout.describe(self.world_size), f"mbs{self.micro_batch}"]
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        parts.append(self.sharding_label())
        return " ".join(parts)

    def sharding_label(self) -> str:
        """'zero1', 'zero3 hsdp4', 'zero1 offload'."""
        label = f"zero{self.zero}"
        if self.hsdp_replicas > 1:
            label += f" hsdp{self.hsdp_replicas}"
        if self.offload:
            label += " offload"
        return label


def _model_parallel_only(layout: ParallelLayout) -> ParallelLayout:
    return layout.model_copy(update={"sharding": None, "hsdp_replicas": 1})

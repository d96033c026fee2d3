"""The parallel layout as pure data, validated against a model before any communicator exists.

Rank order follows Megatron-Core's default "tp-cp-ep-dp-pp": TP innermost (consecutive
ranks share a node's fast links), PP outermost.
"""

from __future__ import annotations

import math
from typing import Literal, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field

from models.config import ModelConfig, divisors


# Data-parallel sharding, the ZeRO ladder; a level's index is its ZeRO stage.
Sharding = Literal["none", "zero1", "zero2", "zero3"]
SHARDING_LEVELS: tuple[Sharding, ...] = get_args(Sharding)
ZERO_STAGES = tuple(range(len(SHARDING_LEVELS)))


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the value and the valid choices."""


class ParallelLayout(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    tensor_parallel: int = Field(default=1, gt=0)
    pipeline_parallel: int = Field(default=1, gt=0)
    # Model chunks per pipeline rank (interleaved 1F1B); None = plain 1F1B.
    virtual_pipeline: Optional[int] = Field(default=None, gt=0)
    context_parallel: int = Field(default=1, gt=0)
    expert_parallel: int = Field(default=1, gt=0)
    # None = same as tensor_parallel (Megatron-Core's default).
    expert_tensor_parallel: Optional[int] = Field(default=None, gt=0)
    sequence_parallel: bool = False
    # How CP ranks exchange keys/values. `te` spec: Transformer Engine's ring ("p2p",
    # overlaps with compute), head all-to-all ("a2a", Ulysses) or "allgather". `portable`
    # spec: "allgather" only. None = "p2p" with te, "allgather" with portable.
    cp_comm_type: Optional[Literal["p2p", "a2a", "allgather"]] = None
    # MoE token dispatcher over the EP group: "alltoall" sends each token only to the ranks
    # of its experts; "allgather" gathers all tokens everywhere (simpler, more traffic).
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    # Data-parallel sharding, the ZeRO ladder: "none" = plain DDP (every rank holds all
    # parameters, gradients and optimizer state); "zero1" shards the optimizer state
    # (Megatron's distributed optimizer); "zero2" also the gradients and "zero3" also the
    # parameters (Megatron-FSDP). None = follow optimizer.distributed (zero1 / none).
    sharding: Optional[Sharding] = None
    # HSDP (zero2/zero3): shard over DP / hsdp_replicas ranks (inside a node) and replicate
    # the shards across hsdp_replicas groups (across nodes). 1 = shard over all of DP.
    hsdp_replicas: int = Field(default=1, gt=0)
    # Uneven pipeline stages, Megatron-Core's four options (TransformerConfig): the first / last
    # stage's transformer layer count, the other layers split evenly over the middle stages; or
    # the embedding / the loss counted as one layer each in an even split (its stage then builds
    # one transformer layer fewer: Llama-3.1 405B's 126 + 2 = 128 = PP8 x VPP8 x 2). The two
    # kinds do not mix (Megatron-Core refuses it). `pipeline_split` computes the split.
    num_layers_in_first_pipeline_stage: Optional[int] = Field(default=None, gt=0)
    num_layers_in_last_pipeline_stage: Optional[int] = Field(default=None, gt=0)
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    @property
    def uneven_pipeline(self) -> bool:
        return (self.num_layers_in_first_pipeline_stage is not None or self.num_layers_in_last_pipeline_stage
                is not None or self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split)

    def megatron_pipeline_split(self) -> dict:
        """The uneven-stage fields of Megatron-Core's TransformerConfig."""
        return dict(num_layers_in_first_pipeline_stage=self.num_layers_in_first_pipeline_stage,
                    num_layers_in_last_pipeline_stage=self.num_layers_in_last_pipeline_stage,
                    account_for_embedding_in_pipeline_split=self.account_for_embedding_in_pipeline_split,
                    account_for_loss_in_pipeline_split=self.account_for_loss_in_pipeline_split)

    @property
    def fsdp(self) -> bool:
        """Whether Megatron-FSDP wraps the model (ZeRO-2/3)."""
        return self.sharding in ("zero2", "zero3")

    def shard_group_size(self, world_size: int) -> int:
        """Ranks one copy of the sharded dense state is spread over: DP (x CP) / hsdp_replicas."""
        return self.data_parallel(world_size) * self.context_parallel // self.hsdp_replicas

    def expert_shard_group_size(self, world_size: int) -> int:
        """Ranks one copy of the sharded expert state is spread over: expert DP / hsdp_replicas."""
        return self.expert_data_parallel(world_size) // self.hsdp_replicas

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one dense model replica: TP x PP x CP."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def expert_tp(self) -> int:
        """Expert tensor parallelism; unset means the same as TP (Megatron-Core's default)."""
        return self.expert_tensor_parallel or self.tensor_parallel

    @property
    def expert_model_parallel_size(self) -> int:
        """Ranks of one expert replica: expert TP x EP x PP."""
        return self.expert_tp * self.expert_parallel * self.pipeline_parallel

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline or 1

    def data_parallel(self, world_size: int) -> int:
        """Dense data-parallel size: world / (TP x PP x CP)."""
        return world_size // self.model_parallel_size

    def expert_data_parallel(self, world_size: int) -> int:
        """Expert data-parallel size: world / (expert TP x EP x PP). Megatron-Core lays the
        expert grid over the same ranks as the dense grid, so EP reuses ranks of TP x CP x DP."""
        return world_size // self.expert_model_parallel_size

    def min_world_size(self) -> int:
        """The smallest world that tiles both the dense grid and the expert grid."""
        return math.lcm(self.model_parallel_size, self.expert_model_parallel_size)

    def megatron_parallel_sizes(self) -> dict:
        """Keyword arguments of Megatron-Core's `parallel_state.initialize_model_parallel`
        (and the matching `TransformerConfig` fields)."""
        return dict(
            tensor_model_parallel_size=self.tensor_parallel,
            pipeline_model_parallel_size=self.pipeline_parallel,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline,
            context_parallel_size=self.context_parallel,
            expert_model_parallel_size=self.expert_parallel,
            expert_tensor_parallel_size=self.expert_tp,
        )

    def describe(self, world_size: Optional[int] = None) -> str:
        parts = [f"TP{self.tensor_parallel}", f"PP{self.pipeline_parallel}"]
        if self.virtual_pipeline:
            parts.append(f"VPP{self.virtual_pipeline}")
        counted = [k for k, on in (("emb", self.account_for_embedding_in_pipeline_split),
                                   ("loss", self.account_for_loss_in_pipeline_split)) if on]
        if counted:
            parts.append("+".join(counted) + "-in-PP")  # the embedding / loss take a layer's slot
        if self.num_layers_in_first_pipeline_stage is not None:
            parts.append(f"first{self.num_layers_in_first_pipeline_stage}")
        if self.num_layers_in_last_pipeline_stage is not None:
            parts.append(f"last{self.num_layers_in_last_pipeline_stage}")
        if self.context_parallel > 1:
            parts.append(f"CP{self.context_parallel}")
        if self.expert_parallel > 1:
            parts.append(f"EP{self.expert_parallel}")
        if world_size is not None:
            parts.append(f"DP{self.data_parallel(world_size)}")
        if self.sequence_parallel:
            parts.append("SP")
        if self.fsdp:
            parts.append(self.sharding.replace("zero", "ZeRO"))
        if self.hsdp_replicas > 1:
            parts.append(f"HSDP{self.hsdp_replicas}")
        return "x".join(parts)


def validate_layout(model: ModelConfig, layout: ParallelLayout, world_size: int) -> None:
    """Raise LayoutError naming the first impossible value and listing the valid choices."""
    tp, pp, cp = layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel
    if not isinstance(world_size, int) or world_size < 1:
        raise LayoutError(f"world size must be at least 1, got {world_size}")
    if world_size % layout.model_parallel_size:
        valid = [f"{d}" for d in divisors(world_size)]
        raise LayoutError(
            f"world size {world_size} is not divisible by TP({tp}) x PP({pp}) x CP({cp}) = "
            f"{layout.model_parallel_size}; the product must be one of: {', '.join(valid)}"
        )
    _check_divides("TP", tp, "num_attention_heads", model.num_attention_heads)
    _check_divides("TP", tp, "num_query_groups", model.query_groups)
    _check_divides("TP", tp, "ffn_hidden_size", model.ffn_hidden_size)
    _check_divides("TP", tp, "padded vocab size", model.padded_vocab_size)
    if model.multi_latent_attention:
        # The portable spec's MLA down projections are column-parallel (split over TP).
        if model.q_lora_rank is not None:
            _check_divides("TP", tp, "q_lora_rank", model.q_lora_rank)
        _check_divides("TP", tp, "kv_lora_rank + qk_pos_emb_head_dim", model.kv_lora_rank + model.qk_pos_emb_head_dim)
    pipeline_split(model.num_layers, layout)
    if layout.virtual_pipeline and pp == 1:
        raise LayoutError(
            f"virtual_pipeline={layout.virtual_pipeline} needs pipeline_parallel > 1 "
            "(interleaving has nothing to interleave at PP=1); unset virtual_pipeline"
        )
    if layout.sequence_parallel and tp == 1:
        raise LayoutError("sequence_parallel=true needs tensor_parallel > 1; set TP>=2 or turn it off")
    if cp > 1 and layout.cp_comm_type == "a2a":
        # Ulysses-style CP scatters each TP rank's heads (and KV groups) over the CP ranks.
        _check_divides("CP (cp_comm_type=a2a)", cp, "attention heads per TP rank", model.num_attention_heads // tp)
        _check_divides("CP (cp_comm_type=a2a)", cp, "query groups per TP rank", model.query_groups // tp)
    _validate_moe(model, layout, world_size)
    _validate_sharding(model, layout, world_size)


def pipeline_split(num_layers: int, layout: ParallelLayout) -> list[list[int]]:
    """Transformer layers of each model chunk: [pp_rank][vp_stage], in the order Megatron-Core's
    get_num_layers_to_build (0.16.1-0.19.2) builds them; raise LayoutError naming the fix when
    a split is impossible (tests/models/test_pipeline_split.py checks it against Megatron-Core's)."""
    pp, vpp = layout.pipeline_parallel, layout.vpp
    first, last = layout.num_layers_in_first_pipeline_stage, layout.num_layers_in_last_pipeline_stage
    extra = int(layout.account_for_embedding_in_pipeline_split) + int(layout.account_for_loss_in_pipeline_split)
    if not layout.uneven_pipeline:
        stages = pp * vpp
        if num_layers % stages:
            raise LayoutError(
                f"num_layers={num_layers} cannot be split evenly over PP({pp}) x VPP({vpp}) = {stages} model "
                f"chunks; PP x VPP must be one of {divisors(num_layers)}, or split unevenly "
                "(parallel.num_layers_in_first/last_pipeline_stage, parallel.account_for_embedding/loss_in_pipeline_split)")
        return [[num_layers // stages] * vpp for _ in range(pp)]
    if pp == 1:
        raise LayoutError("uneven pipeline stages (parallel.num_layers_in_first/last_pipeline_stage, "
                          "account_for_embedding/loss_in_pipeline_split) need pipeline_parallel > 1; remove them")
    if (first or last) and extra:
        raise LayoutError("parallel.num_layers_in_first/last_pipeline_stage and parallel.account_for_embedding/"
                          "loss_in_pipeline_split do not mix (Megatron-Core refuses it); use one kind")
    if extra:
        per_rank = _even_share(num_layers + extra, pp, f"num_layers + {extra} (embedding/loss counted) = "
                               f"{num_layers + extra}", "PP")
        counts = [per_rank] * pp
    else:
        middle_layers = num_layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
            raise LayoutError(f"num_layers_in_first/last_pipeline_stage ({first} / {last}) leave {middle_layers} "
                              f"of num_layers={num_layers} for the {middle_stages} other stage(s) of PP{pp}; every "
                              "stage needs layers and every layer a stage")
        middle = _even_share(middle_layers, middle_stages, f"the {middle_layers} middle layers", "middle stages") \
            if middle_stages else 0
        counts = [middle] * pp
        counts[0] = first if first is not None else counts[0]
        counts[-1] = last if last is not None else counts[-1]
    split = []
    for rank, count in enumerate(counts):
        per_chunk = _even_share(count, vpp, f"pipeline stage {rank}'s {count} layers", "VPP") if vpp > 1 else count
        split.append([per_chunk] * vpp)
    if layout.account_for_embedding_in_pipeline_split:
        split[0][0] -= 1  # the embedding takes a layer's slot in the first chunk
    if layout.account_for_loss_in_pipeline_split:
        split[-1][-1] -= 1  # the loss in the last
    if any(chunk < 1 for stage in split for chunk in stage):
        raise LayoutError(f"this pipeline split leaves a model chunk without a transformer layer ({split}: layers per "
                          "[stage][virtual stage]); use fewer stages or virtual stages, or an even split")
    return split


def _even_share(total: int, parts: int, what: str, over: str) -> int:
    if total % parts:
        raise LayoutError(f"{what} cannot be split evenly over {over} ({parts}); valid sizes: {divisors(total)}")
    return total // parts


def _validate_sharding(model: ModelConfig, layout: ParallelLayout, world_size: int) -> None:
    """What Megatron-FSDP (ZeRO-2/3) runs correctly on megatron-core 0.19.2 (re-measured; the
    0.16.1 history is in pretrain/megatron_fixes/fsdp.py)."""
    if layout.hsdp_replicas > 1 and not layout.fsdp:
        raise LayoutError(f"hsdp_replicas={layout.hsdp_replicas} needs sharding=zero2 or zero3 (HSDP shards "
                          "inside a replica and replicates across replicas)")
    if not layout.fsdp:
        return
    name = layout.sharding
    if layout.pipeline_parallel > 1:
        raise LayoutError(
            f"sharding={name} (Megatron-FSDP) does not support pipeline_parallel={layout.pipeline_parallel} in "
            "megatron-core 0.19.2 (its device mesh has no pipeline dimension); use sharding=zero1 with "
            f"PP{layout.pipeline_parallel}, or fold PP into data parallelism (pipeline_parallel=1) with {name}")
    dp_cp = layout.data_parallel(world_size) * layout.context_parallel
    if dp_cp % layout.hsdp_replicas:
        raise LayoutError(f"hsdp_replicas={layout.hsdp_replicas} does not divide DP x CP = {dp_cp}; valid "
                          f"hsdp_replicas: {', '.join(map(str, divisors(dp_cp)))}")
    expert_dp = layout.expert_data_parallel(world_size)
    if model.is_moe and expert_dp % layout.hsdp_replicas:
        raise LayoutError(f"hsdp_replicas={layout.hsdp_replicas} does not divide the expert data-parallel size "
                          f"{expert_dp} (world {world_size} / expert TP x EP x PP); valid hsdp_replicas: "
                          f"{', '.join(str(d) for d in divisors(expert_dp) if dp_cp % d == 0)}")
    # 0.16.1's refusals of a shard group of one rank (ZeRO-2/3 at DP 1, HSDP with one rank per
    # replica), of MoE with expert DP 1 and of MoE with HSDP are lifted on 0.19.2: re-measured
    # equal to one rank (tests/pretrain/test_sharded_dp.py: losses, grad norms, final weights).


def _validate_moe(model: ModelConfig, layout: ParallelLayout, world_size: int) -> None:
    ep, etp = layout.expert_parallel, layout.expert_tp
    if not model.is_moe:
        if ep > 1:
            raise LayoutError(f"expert_parallel={ep} needs a MoE model (num_experts is unset)")
        if layout.expert_tensor_parallel is not None:
            raise LayoutError(f"expert_tensor_parallel={layout.expert_tensor_parallel} needs a MoE model "
                              "(num_experts is unset); remove it")
        return
    if model.add_bias_linear and etp > 1:
        # transformer_config.py: "Bias in Moe is only supported when ETP==1" (megatron-core 0.16.1-0.19.2).
        raise LayoutError(f"a MoE model with add_bias_linear=true needs expert TP 1 (got {etp}: expert TP "
                          "follows tensor_parallel unless set); set expert_tensor_parallel=1, or add_bias_linear=false")
    _check_divides("EP", ep, "num_experts", model.num_experts)
    # Megatron-Core lays the expert grid (expert TP x EP x expert DP x PP) over the same
    # ranks as the dense grid (TP x CP x DP x PP): EP reuses ranks of TP x CP x DP, so
    # EP x TP x CP x PP may exceed the world size; ETP x EP x PP must divide it.
    if world_size % layout.expert_model_parallel_size:
        per_stage = world_size // layout.pipeline_parallel
        fits = divisors(per_stage // etp) if per_stage % etp == 0 else []
        valid = [d for d in fits if model.num_experts % d == 0]
        raise LayoutError(
            f"world size {world_size} is not divisible by expert TP({etp}) x EP({ep}) x "
            f"PP({layout.pipeline_parallel}) = {layout.expert_model_parallel_size}; "
            f"with expert TP {etp} choose EP from {valid}"
        )
    _check_divides("expert TP", etp, "moe ffn hidden size", model.expert_ffn_hidden_size)
    if model.moe_shared_expert_hidden_size:
        _check_divides("TP", layout.tensor_parallel, "moe_shared_expert_hidden_size",
                       model.moe_shared_expert_hidden_size)
    if layout.tensor_parallel > 1 and not layout.sequence_parallel:
        # Megatron-Core's MoELayer raises in training when TP > 1 without SP.
        raise LayoutError(
            f"a MoE model at tensor_parallel={layout.tensor_parallel} needs sequence_parallel=true "
            "(Megatron-Core's MoE layer trains with TP only under sequence parallelism)"
        )


def _check_divides(axis: str, size: int, what: str, value: int) -> None:
    if value % size:
        valid = ", ".join(str(d) for d in divisors(value))
        raise LayoutError(
            f"{axis}={size} does not divide {what}={value}; valid {axis}: {valid}"
        )

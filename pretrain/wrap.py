"""`wrap_for_training`: model chunks -> Megatron DDP or Megatron-FSDP -> optimizer -> LR/WD schedule.

Order (each step needs the previous one):
  1. Data parallelism by `parallel.sharding`: "none"/"zero1": Megatron
     `DistributedDataParallel` per chunk (contiguous grad buffers; only chunk 0 uses
     bucketing: Megatron-LM does the same, as later chunks' grads finish first under
     interleaving). "zero2"/"zero3": Megatron-FSDP (`FullyShardedDataParallel`, strategy
     `optim_grads` / `optim_grads_params`; HSDP shards inside a replica and replicates
     across `hsdp_replicas`).
  2. `get_megatron_optimizer`: AdamW (Transformer Engine's FusedAdam on GPU, torch's
     AdamW on CPU), mixed-precision wrapper, distributed optimizer (ZeRO-1) if asked; or
     Muon for the hidden matrices + AdamW for the rest (pretrain/muon.py). With model.use_mup,
     Megatron-Core's muP param-group overrides (hidden matrices' LR and eps / width_mult).
  3. Hooks on the TransformerConfig that the schedules call: no_sync for gradient
     accumulation across microbatches, finalize_model_grads (DP reduce, tied-embedding
     and sequence-parallel norm reduces, per-token loss scaling), grad_scale_func (fp16).
  4. `OptimizerParamScheduler`: linear warmup then cosine/linear/WSD decay to min_lr.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer, get_mup_config_overrides, get_standard_config_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config

from pretrain.config import ExperimentConfig, data_parallel_sharding
from pretrain.muon import EMERGING_OPTIMIZERS, megatron_muon_fields, muon_param_overrides


@dataclasses.dataclass
class TrainingState:
    model: list[DistributedDataParallel]
    optimizer: object  # MegatronOptimizer
    scheduler: OptimizerParamScheduler


def wrap_for_training(chunks: list[torch.nn.Module], config: ExperimentConfig) -> TrainingState:
    sharding = data_parallel_sharding(config)
    tconfig = get_model_config(chunks[0])
    ddp_config = _ddp_config(config, sharding)
    if ddp_config.use_megatron_fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        model = [FullyShardedDataParallel(config=tconfig, ddp_config=ddp_config, module=chunk,
                                          disable_bucketing=index > 0, device=device)
                 for index, chunk in enumerate(chunks)]
    else:
        model = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=chunk,
                                         disable_bucketing=index > 0)
                 for index, chunk in enumerate(chunks)]
        for m in model:
            m.broadcast_params()  # DP replicas start identical (they already do; cheap insurance)
    mcfg = _optimizer_config(config, sharding)
    overrides = None  # Megatron-Core's standard ones (no weight decay on biases and 1-D params)
    if config.optimizer.name == "muon":
        overrides = muon_param_overrides(mcfg, config)
    elif config.model.use_mup:
        # What Megatron-LM's training.py does for --use-mup: the standard overrides plus muP's
        # (hidden matrices' max/min LR and Adam eps / width_mult; embedding, output, norms at base).
        overrides = {**get_standard_config_overrides(mcfg),
                     **get_mup_config_overrides(mcfg, tconfig.mup_width_mult, mcfg.optimizer)}
    optimizer = get_megatron_optimizer(mcfg, model, config_overrides=overrides)

    tconfig.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    tconfig.finalize_model_grads_func = finalize_model_grads
    if config.runtime.torch_dtype == torch.float16:
        tconfig.grad_scale_func = optimizer.scale_loss
    return TrainingState(model=model, optimizer=optimizer, scheduler=_scheduler(optimizer, config))


_FSDP_STRATEGY = {"zero2": "optim_grads", "zero3": "optim_grads_params"}


def _ddp_config(config: ExperimentConfig, sharding: str) -> DistributedDataParallelConfig:
    opt, runtime, layout = config.optimizer, config.runtime, config.parallel
    # MXFP8 weights all-gathered in FP8 reuse the gradient buffer for the gather (what
    # Megatron-Bridge's MXFP8 recipe sets; without it each bucket needs a second buffer).
    reuse_grad_buf = runtime.fp8_recipe_name == "mxfp8" and runtime.fp8_param_gather
    common = dict(grad_reduce_in_fp32=True, check_for_nan_in_grad=False, bucket_size=opt.bucket_size,
                  fp8_param_gather=runtime.fp8_param_gather, reuse_grad_buf_for_mxfp8_param_ag=reuse_grad_buf)
    if sharding not in _FSDP_STRATEGY:
        return DistributedDataParallelConfig(
            **common, overlap_grad_reduce=opt.overlap_grad_reduce, overlap_param_gather=opt.overlap_param_gather,
            # Muon's updates need whole matrices: DDP all-reduces its gradients (the
            # distributed optimizer's reduce-scatter would leave each rank a flat slice).
            use_distributed_optimizer=sharding == "zero1" and opt.name not in EMERGING_OPTIMIZERS)
    return DistributedDataParallelConfig(
        **common,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=_FSDP_STRATEGY[sharding],
        use_distributed_optimizer=True,  # Megatron-FSDP's optimizer path (main weights, all-gather)
        # Megatron-FSDP reduces from its backward hooks; without overlap its strategy `optim`
        # reduces twice (0.16.1), so overlap is on for every strategy.
        overlap_grad_reduce=True,
        overlap_param_gather=sharding == "zero3",
        # HSDP: shard inside a replica, replicate across replicas (outer `no_shard`; the
        # outer-sharded variants get the grad norm wrong in 0.16.1: megatron_fixes/fsdp.py).
        num_distributed_optimizer_instances=layout.hsdp_replicas,
        outer_dp_sharding_strategy="no_shard",
        # fp32 weights ARE the main weights (None): no second fp32 copy (exact; saves 4 bytes
        # per parameter / shard group). Mixed precision keeps fp32 main weights. Gradients are
        # kept and reduced in fp32 whatever the weights' dtype: Megatron-FSDP no longer reads
        # grad_reduce_in_fp32 (0.19), its main-grad dtype defaults to the weights'.
        megatron_fsdp_main_params_dtype=None if runtime.torch_dtype == torch.float32 else torch.float32,
        megatron_fsdp_main_grads_dtype=torch.float32,
        megatron_fsdp_grad_comm_dtype=torch.float32,
    )


def _optimizer_config(config: ExperimentConfig, sharding: str) -> MegatronOptimizerConfig:
    opt, runtime = config.optimizer, config.runtime
    dtype = runtime.torch_dtype
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                   use_precision_aware_optimizer=True) if opt.cpu_offload else {}
    fields = {"muon": megatron_muon_fields(config) if opt.name == "muon" else {},
              "lion": dict(optimizer="lion", lion_beta1=opt.lion_beta1, lion_beta2=opt.lion_beta2),
              "adamw": dict(optimizer="adam")}[opt.name]
    # Muon and Lion are Megatron-Core's emerging optimizers: whole-tensor updates over
    # all-reduced gradients, sharded (ZeRO-1) by the layer-wise distributed optimizer.
    emerging = opt.name in EMERGING_OPTIMIZERS
    return MegatronOptimizerConfig(
        **fields,
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        initial_loss_scale=opt.initial_loss_scale,
        use_distributed_optimizer=sharding != "none" and not emerging,
        # Muon's (and Lion's) ZeRO-1: Megatron-Core's LayerWiseDistributedOptimizer (each DP rank
        # steps whole matrices, then the updated weights are all-gathered), over all-reduced grads.
        # At DP 1 there is nothing to shard: plain Muon.
        use_layer_wise_distributed_optimizer=sharding == "zero1" and emerging
        and parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1,
        # The distributed optimizer shards FP8 weights differently per recipe (MXFP8 and
        # block-scaled tensors cannot be viewed flat) and must know the recipe.
        fp8_recipe=runtime.fp8_recipe_name,
        reuse_grad_buf_for_mxfp8_param_ag=runtime.fp8_recipe_name == "mxfp8" and runtime.fp8_param_gather,
        overlap_param_gather=opt.overlap_param_gather,
        **offload,
    )


def _scheduler(optimizer, config: ExperimentConfig) -> OptimizerParamScheduler:
    opt, sched = config.optimizer, config.schedule
    # An explicit decay_steps <= warmup_steps is refused by the config. Unset, decay spans
    # train_steps; a run shorter than its warmup (short tests) ends still warming up, and
    # Megatron's scheduler needs decay > warmup: the max() below is that unreached step.
    decay_steps = sched.decay_steps or sched.train_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=sched.warmup_steps,
        lr_decay_steps=max(decay_steps, sched.warmup_steps + 1),
        # Megatron-Core spells it "WSD"; the cooldown ends at lr_decay_steps.
        lr_decay_style="WSD" if sched.decay_style == "wsd" else sched.decay_style,
        wsd_decay_steps=sched.wsd_cooldown_steps,
        lr_wsd_decay_style=sched.lr_wsd_decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )

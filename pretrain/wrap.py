"""`wrap_for_training`: model chunks -> Megatron DDP -> optimizer -> LR/WD schedule.

Order (each step needs the previous one):
  1. Megatron `DistributedDataParallel` per chunk: contiguous grad buffers; only chunk 0
     uses bucketing (Megatron-LM does the same: later chunks' grads finish first under
     interleaving, so bucket overlap helps only the first).
  2. `get_megatron_optimizer`: AdamW (Transformer Engine's FusedAdam on GPU, torch's
     AdamW on CPU), mixed-precision wrapper, distributed optimizer (ZeRO-1) if asked.
  3. Hooks on the TransformerConfig that the schedules call: no_sync for gradient
     accumulation across microbatches, finalize_model_grads (DP reduce, tied-embedding
     and sequence-parallel norm reduces, per-token loss scaling), grad_scale_func (fp16).
  4. `OptimizerParamScheduler`: linear warmup then cosine/linear decay to min_lr.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config

from pretrain.config import ExperimentConfig

@dataclasses.dataclass
class TrainingState:
    model: list[DistributedDataParallel]
    optimizer: object  # MegatronOptimizer
    scheduler: OptimizerParamScheduler


def wrap_for_training(chunks: list[torch.nn.Module], config: ExperimentConfig) -> TrainingState:
    opt = config.optimizer
    dtype = config.runtime.torch_dtype
    tconfig = get_model_config(chunks[0])
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=opt.distributed,
        check_for_nan_in_grad=False,
    )
    model = [
        DistributedDataParallel(
            config=tconfig, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0
        )
        for index, chunk in enumerate(chunks)
    ]
    for m in model:
        m.broadcast_params()  # DP replicas start identical (they already do; cheap insurance)

    optimizer = get_megatron_optimizer(
        MegatronOptimizerConfig(
            optimizer="adam",
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
            use_distributed_optimizer=opt.distributed,
        ),
        model,
    )

    tconfig.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    tconfig.finalize_model_grads_func = finalize_model_grads
    if dtype == torch.float16:
        tconfig.grad_scale_func = optimizer.scale_loss

    sched = config.schedule
    # An explicit decay_steps <= warmup_steps is refused by the config. Unset, decay spans
    # train_steps; a run shorter than its warmup (short tests) ends still warming up, and
    # Megatron's scheduler needs decay > warmup: the max() below is that unreached step.
    decay_steps = sched.decay_steps or sched.train_steps
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=sched.warmup_steps,
        lr_decay_steps=max(decay_steps, sched.warmup_steps + 1),
        lr_decay_style=sched.decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return TrainingState(model=model, optimizer=optimizer, scheduler=scheduler)

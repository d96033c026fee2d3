"""The training loop. Reads top to bottom: step, log, evaluate, checkpoint.

`train_step` runs one global batch through Megatron-Core's schedule
(`get_forward_backward_func`: no pipelining, 1F1B, or interleaved 1F1B by layout),
then the optimizer step and the LR schedule, and returns what the loop logs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_batch_on_this_cp_rank, get_model_config

from pretrain.config import ExperimentConfig
from pretrain.runtime import collective_device
from pretrain.moe_load import router_losses
from pretrain.wrap import TrainingState


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of per-token losses and the token count; Megatron divides by the global count.

    Returning (sum, count, report) with `calculate_per_token_loss=True` makes the gradient
    exactly the mean over every token of the global batch, whatever the DP/microbatch split.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def _forward_step(data_iterator, model):
    batch = next(data_iterator) if data_iterator is not None else None
    tokens = position_ids = labels = loss_mask = None
    extra = {}
    if batch is not None:
        # Context parallelism: every CP rank reads the same micro-batch and keeps sequence
        # chunks r and 2CP-1-r of 2 x CP (Megatron-Core's load-balanced causal split, which
        # RoPE and the portable CP attention assume). A no-op at CP 1. Document ids (with
        # data.reset_attention_mask) are split the same way.
        # 0.19 takes the group explicitly (None would mean the world group, not CP's).
        batch = get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False,
                                          cp_group=parallel_state.get_context_parallel_group())
        device = next(model.parameters()).device
        batch = {k: t.to(device, non_blocking=True) for k, t in batch.items()}
        tokens, position_ids = batch["tokens"], batch["position_ids"]
        labels, loss_mask = batch["labels"], batch["loss_mask"]
        if "document_ids" in batch:  # models.documents.DocumentGPTModel builds the mask
            extra["document_ids"] = batch["document_ids"]
            extra["label_document_ids"] = batch["label_document_ids"]
    output = model(tokens, position_ids, None, labels=labels, **extra)
    return output, partial(_loss_func, loss_mask)


def _slow_forward_step(seconds: float, data_iterator, model):
    """Test-only (runtime.inject_slow_rank): a straggler, slow in every micro-batch's forward."""
    time.sleep(seconds)
    return _forward_step(data_iterator, model)


def injected_hang(step: int, seconds: float) -> None:
    """Test-only (runtime.inject_hang_step): this rank stops making progress mid-step; the
    hang watchdog's stack dump names this function."""
    print(f"[fault injection] rank {dist.get_rank()} hangs in step {step} for {seconds:g} s "
          f"(from unix time {time.time():.3f})", flush=True)
    time.sleep(seconds)


def _loss_sums(losses: list[dict]) -> Optional[torch.Tensor]:
    """[loss sum, token count] over the global batch, on the last pipeline stage (None elsewhere)."""
    if not losses:
        return None
    total = torch.stack([d["lm loss"] for d in losses]).sum(0)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dist.all_reduce(total, group=group)
    return total


def _reduce_loss(losses: list[dict]) -> Optional[float]:
    """Global mean loss per token, on the last pipeline stage (None elsewhere)."""
    total = _loss_sums(losses)
    return None if total is None else (total[0] / total[1].clamp(min=1)).item()


def _agree(losses: list[dict], grads_bad: bool, mtp: Optional[list[float]] = None,
           mtp_layers: int = 0) -> tuple[float, bool, Optional[list[float]]]:
    """One collective per step: every rank learns the step's loss (from the last stage; NaN if
    it is not finite), whether any rank's gradients are non-finite, and the MTP losses (from
    the last stage: `mtp_layers` values, None without MTP)."""
    total = _loss_sums(losses)
    loss = (total[0] / total[1].clamp(min=1)).item() if total is not None else float("-inf")
    bad_loss = not math.isfinite(loss) and total is not None
    carried = mtp if mtp is not None else [float("-inf")] * mtp_layers  # MAX keeps the last stage's
    flags = torch.tensor([loss if not bad_loss else float("-inf"), float(grads_bad), float(bad_loss), *carried],
                         dtype=torch.float64, device=collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    agreed = flags[3:].tolist() if mtp_layers else None
    return (float("nan") if flags[2].item() else flags[0].item()), bool(flags[1].item()), agreed


def mtp_losses(config: ExperimentConfig, num_microbatches: int) -> Optional[list[float]]:
    """The step's MTP losses, one per MTP layer (the cross-entropy of predicting token i+k+1,
    without mtp_loss_scaling_factor), from Megatron-Core's own tracker, then reset.

    `process_mtp_loss` adds each micro-batch's mean loss to `MTPLossLoggingHelper.tracker` on
    the last pipeline stage; its `track_mtp_metrics` (Megatron-LM's logging call) averages them
    over DP x CP and scales by 1 / micro-batches: the mean of the micro-batch means, the same
    for every split of a global batch into micro-batches of one size. None on other stages.
    """
    if not config.model.mtp_num_layers:
        return None
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    totals: dict = {}
    MTPLossLoggingHelper.track_mtp_metrics(1.0 / num_microbatches, 0, None, total_loss_dict=totals)
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    if not totals:
        return None
    return [float(totals[f"mtp_{k} loss"]) for k in range(1, config.model.mtp_num_layers + 1)]


@dataclasses.dataclass
class StepResult:
    loss: float  # global mean per token, on every rank (NaN if it was not finite)
    grad_norm: Optional[float]
    lr: float
    skipped: bool  # no update was applied
    compute_time_s: float  # forward/backward + optimizer, excluding data fetch
    # Loss or gradients were NaN/Inf (checkpoint.on_nan decides); an fp16 overflow that the
    # dynamic loss scaler handled is `skipped` without being `non_finite`.
    non_finite: bool = False
    loss_scale: Optional[float] = None  # fp16: the dynamic loss scale after this step
    # MoE router losses of the step (without their coefficients), mean over MoE layers
    # and micro-batches: load balancing (1.0 = perfectly even) and z-loss; None if off.
    moe_aux_loss: Optional[float] = None
    moe_z_loss: Optional[float] = None
    moe_aux_loss_layers: Optional[list[float]] = None  # the load-balancing loss per MoE layer
    # Multi-token prediction (model.mtp_num_layers): each MTP layer's loss (see mtp_losses).
    mtp_loss_layers: Optional[list[float]] = None
    # Document masking: mean share of the dense causal attention work that ran, over this
    # rank's samples of the step (None when attention is not reset at documents).
    attention_fraction: Optional[float] = None


def _attention_fraction(iterators: list) -> Optional[float]:
    """From the first stream (every chunk's stream reads the same samples)."""
    stream = next((it for it in iterators if it is not None), None)
    fractions = stream.take_attention_fractions() if stream is not None else []
    for other in iterators:
        if other is not None and other is not stream:
            other.take_attention_fractions()
    return sum(fractions) / len(fractions) if fractions else None


def run_schedule(state: TrainingState, iterators: list, config: ExperimentConfig,
                 num_microbatches: int, forward_only: bool) -> list[dict]:
    sched = config.schedule
    its = iterators if len(iterators) > 1 else iterators[0]
    forward_step = _forward_step
    if config.runtime.inject_slow_rank is not None and config.runtime.inject_slow_rank == dist.get_rank():
        forward_step = partial(_slow_forward_step, config.runtime.inject_slow_ms / 1000)
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=its,
        model=state.model if len(state.model) > 1 else state.model[0],
        num_microbatches=num_microbatches,
        # The full length: the schedules derive the pipeline message shape themselves
        # (seq / CP, and / TP under sequence parallelism).
        seq_length=sched.seq_length,
        micro_batch_size=sched.micro_batch_size,
        decoder_seq_length=sched.seq_length,
        forward_only=forward_only,
    )


def moe_router_losses(config: ExperimentConfig, num_microbatches: int) -> tuple[dict[str, float], dict]:
    """Megatron-Core's per-layer MoE loss tracker, reduced and reset (pretrain.moe_load)."""
    if not config.model.is_moe:
        return {}, {}
    # MTP layers' routers record after the decoder's layers (Megatron-Core's router.py).
    return router_losses(config.model.num_layers + config.model.mtp_num_layers, num_microbatches)


def _local_grads_bad(state: TrainingState) -> bool:
    """Whether this rank holds a NaN/Inf gradient (one sum per grad buffer, no collective)."""
    for chunk in state.model:
        if hasattr(chunk, "param_and_grad_buffer"):  # Megatron-FSDP
            # Only the optimizer's gradient shards: the buffers' alignment gaps receive
            # whatever the temporary reduce-scatter bucket held (NaN now and then, never read).
            for _, param in chunk.param_and_grad_buffer.optimizer_named_parameters:
                grad = param.grad
                if grad is not None and not torch.isfinite(grad._local_tensor.float().sum()):
                    return True
            continue
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            if not torch.isfinite(buffer.grad_data.float().sum()):
                return True
    return False


def _inject_nan(state: TrainingState) -> None:
    if dist.get_rank() != 0:
        return
    chunk = state.model[0]
    if hasattr(chunk, "param_and_grad_buffer"):  # Megatron-FSDP: this rank's gradient shards
        for _, param in chunk.param_and_grad_buffer.optimizer_named_parameters:
            if param.grad is not None:
                param.grad._local_tensor.fill_(float("nan"))
        return
    chunk.buffers[0].grad_data.fill_(float("nan"))


def train_step(state: TrainingState, iterators: list, config: ExperimentConfig,
               num_microbatches: int, step: int) -> StepResult:
    """Forward/backward over the global batch, then the update unless gradients are not finite.

    Non-finite gradients are found once per step: in fp16 by Megatron's dynamic loss scaler
    (the optimizer's `found_inf`: it skips the update, reports it and lowers the scale);
    otherwise by a local check folded into the step's one loss all-reduce, before the
    optimizer (a NaN grad norm would poison every weight through clipping). A non-finite loss
    also skips the update (in fp16 that is a forward overflow, which no loss scale fixes).
    """
    start = time.perf_counter()
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    losses = run_schedule(state, iterators, config, num_microbatches, forward_only=False)
    router, per_layer = moe_router_losses(config, num_microbatches)
    moe = dict(moe_aux_loss=router.get("load_balancing_loss"), moe_z_loss=router.get("z_loss"),
               moe_aux_loss_layers=per_layer.get("load_balancing_loss"),
               attention_fraction=_attention_fraction(iterators))
    if config.runtime.inject_nan_step == step:
        _inject_nan(state)
    runtime = config.runtime
    if runtime.inject_hang_step == step and runtime.inject_hang_rank == dist.get_rank():
        injected_hang(step, runtime.inject_hang_seconds)
    fp16 = config.runtime.dtype == "fp16"
    loss, grads_bad, moe["mtp_loss_layers"] = _agree(
        losses, not fp16 and _local_grads_bad(state), mtp_losses(config, num_microbatches),
        config.model.mtp_num_layers)
    # The LR this step's update uses (or would have used): read before the scheduler steps
    # to the next step's value, so metrics.jsonl's lr at step k is step k's.
    lr = state.optimizer.param_groups[0]["lr"]
    if grads_bad or not math.isfinite(loss):
        fetch = sum(it.take_fetch_time() for it in iterators if it is not None)
        return StepResult(loss, float("nan"), lr, True, time.perf_counter() - start - fetch, non_finite=True, **moe)
    # Megatron-LM's name for the step's optimizer timer; a range while profiling
    # (pretrain.observe.timers; None, and free, otherwise).
    timers = get_model_config(state.model[0]).timers
    if timers is not None:
        timers("optimizer", log_level=1).start()
    update_ok, grad_norm, _ = state.optimizer.step()
    if timers is not None:
        timers("optimizer").stop()
    if update_ok:
        state.scheduler.step(increment=1)
    grad_norm = float(grad_norm) if grad_norm is not None else None
    fetch = sum(it.take_fetch_time() for it in iterators if it is not None)
    return StepResult(loss, grad_norm, lr, not update_ok, time.perf_counter() - start - fetch,
                      loss_scale=_loss_scale(state) if fp16 else None, **moe)


def _loss_scale(state: TrainingState) -> Optional[float]:
    scale = state.optimizer.get_loss_scale()
    return float(scale) if scale is not None else None


@torch.no_grad()
def evaluate(state: TrainingState, iterators: list, config: ExperimentConfig,
             num_microbatches: int, begin_batch=None) -> Optional[float]:
    """The mean loss over schedule.eval_steps forward-only batches; `begin_batch(i)` (the hang
    watchdog's) is called before batch i (1-based)."""
    losses = evaluate_batches(state, iterators, config, num_microbatches, config.schedule.eval_steps, begin_batch)
    return sum(losses) / len(losses) if losses else None


def evaluate_batches(state: TrainingState, iterators: list, config: ExperimentConfig, num_microbatches: int,
                     batches: int, begin_batch=None) -> list[float]:
    """Each forward-only batch's loss, `batches` of them (empty on ranks without the loss)."""
    for chunk in state.model:
        chunk.eval()
    losses = []
    for index in range(1, batches + 1):
        if begin_batch is not None:
            begin_batch(index)
        loss = _reduce_loss(run_schedule(state, iterators, config, num_microbatches, forward_only=True))
        if loss is not None:
            losses.append(loss)
    for chunk in state.model:
        chunk.train()
    return losses

"""Set up a run and train: the top-level flow of `python -m pretrain`.

setup: validate (no process group yet) -> runtime start-up -> build model chunks ->
wrap for training -> datasets. Then the loop: step, log, evaluate, checkpoint, in that
order, until train_steps (or a stop request: signal, time limit).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist

from models.build import build_model_chunks
from pretrain.config import (
    ExperimentConfig,
    dump_yaml,
    num_microbatches,
    validate_for_machine,
    validate_for_world,
    validate_inputs,
)
from pretrain.data import build_datasets, chunk_iterators
from pretrain.metrics import (
    MetricsWriter,
    StepMetrics,
    Throughput,
    detect_device_peak,
    info,
    peak_memory_gb,
)
from pretrain.runtime import init_distributed, is_logging_rank, world_size_from_env
from pretrain.checkpointing import checkpointer as checkpoint
from pretrain.checkpointing.resume import plan_resume, settle
from pretrain.signals import StopDuringSetup, StopRequest
from pretrain.step import evaluate, train_step
from pretrain.wrap import TrainingState, wrap_for_training


@dataclasses.dataclass
class Run:
    config: ExperimentConfig
    world_size: int
    state: TrainingState
    datasets: object
    num_microbatches: int
    writer: MetricsWriter
    throughput: Throughput
    log_rank: bool
    stop: StopRequest
    start_step: int = 0


def setup(config: ExperimentConfig) -> Run:
    # Handlers first: a SIGTERM/USR1 during setup ends it (StopDuringSetup: nothing trained,
    # nothing to save; checked between phases once the process group exists), not the rank.
    stop = StopRequest(config.checkpoint.exit_after_minutes)
    world_size = world_size_from_env()
    validate_for_world(config, world_size)  # before any process group exists
    spec = validate_for_machine(config)  # the spec `auto` resolves to here can run this config
    validate_inputs(config, prepare_demo=True)  # paths it writes, data it reads
    resume = plan_resume(config, print)  # bad or clashing checkpoints fail here
    if resume.first is not None:
        checkpoint.check_compatible(resume.first, config)
    env = init_distributed(config.parallel, seed=config.runtime.seed)
    stop.check_setup()
    resume_from = settle(resume, config, lambda m: info(m, env.rank == 0))  # checksums; fallback
    if resume_from is not None and resume_from != resume.first:
        checkpoint.check_compatible(resume_from, config)
    log_rank = is_logging_rank()
    run_dir = Path(config.logging.run_dir)
    if env.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(config))
    info(f"[{config.name}] world {world_size} = {config.parallel.describe(world_size)} "
         f"({env.source}, {'cuda/nccl' if torch.cuda.is_available() else 'cpu/gloo'}), run dir {run_dir}",
         env.rank == 0)
    chunks = build_model_chunks(config.model, config.parallel, config.runtime.model_copy(update={"spec": spec}))
    state = wrap_for_training(chunks, config)
    stop.check_setup()
    start_step = 0
    if resume_from is not None:
        start_step = checkpoint.load(resume_from, state, config, world_size, lambda m: info(m, env.rank == 0))
        stop.check_setup()
    datasets = build_datasets(config, world_size)
    stop.check_setup()
    stop.training_started()
    peak = detect_device_peak(config.logging.device_peak, config.runtime.dtype, bool(config.runtime.fp8))
    sched = config.schedule
    return Run(
        config=config, world_size=world_size, state=state, datasets=datasets,
        num_microbatches=num_microbatches(config, world_size),
        writer=MetricsWriter(config.logging.run_dir, log_rank, config.logging.tensorboard),
        throughput=Throughput(config.model, sched.seq_length, sched.global_batch_size, world_size, peak),
        log_rank=log_rank,
        stop=stop,
        start_step=start_step,
    )


def train(run: Run, start_step: int = 0) -> list[StepMetrics]:
    """Train from `start_step` to `schedule.train_steps` (or a stop request).

    Each iteration: step -> NaN policy -> log -> evaluate -> checkpoint -> stop check.
    """
    config, sched = run.config, run.config.schedule
    gbs = sched.global_batch_size
    train_iters = chunk_iterators(run.datasets.train, config, start_step * gbs, sched.train_steps * gbs)
    stop = run.stop
    saver = checkpoint.Checkpointer(config, run.world_size, lambda m: info(m, dist.get_rank() == 0))
    history: list[StepMetrics] = []
    skipped = 0
    last = time.perf_counter()
    for step in range(start_step + 1, sched.train_steps + 1):
        result = train_step(run.state, train_iters, config, run.num_microbatches, step)
        if result.skipped:
            skipped += 1
            _report_skip(run, step, result, skipped)
        now = time.perf_counter()
        step_time, last = now - last, now
        metrics = _step_metrics(run, step, result, step_time, skipped)
        history.append(metrics)
        if step % config.logging.log_interval == 0 or step == sched.train_steps or metrics.skipped:
            run.writer.log(metrics, sched.train_steps)
        if sched.eval_interval and step % sched.eval_interval == 0 and run.datasets.valid is not None:
            _run_eval(run, step)
        reason = stop.reason()
        saver.save(step, run.state, last_step=step == sched.train_steps, stop=reason is not None)
        if reason is not None:
            info(f"stopping after step {step}: {reason}", dist.get_rank() == 0)
            break
        last = time.perf_counter()  # evaluation and checkpoint time are not step time
    saver.close()  # exit waits for an async save to be complete
    return history


def _report_skip(run: Run, step: int, result, skipped: int) -> None:
    """A step without an update. Non-finite loss or gradients: `checkpoint.on_nan=stop` raises
    (saving nothing), `skip` warns. An fp16 overflow that the dynamic loss scaler caught is
    routine: it lowered the scale; say so."""
    where = f"step {step} (loss {result.loss}, grad norm {result.grad_norm})"
    if result.non_finite:
        if run.config.checkpoint.on_nan == "stop":
            raise FloatingPointError(
                f"non-finite loss or gradients at {where} seen on rank {dist.get_rank()}; no checkpoint "
                "was written for this step. Lower optimizer.lr, check the data, or set checkpoint.on_nan=skip"
            )
        info(f"warning: skipped the update of {where}; {skipped} step(s) skipped so far", run.log_rank)
    else:
        info(f"fp16 gradient overflow at {where}: update skipped, loss scale lowered to "
             f"{result.loss_scale:g}; {skipped} step(s) skipped so far", run.log_rank)


def _step_metrics(run: Run, step: int, result, step_time: float, skipped_total: int) -> StepMetrics:
    tps, tps_dev, tflops, mfu = run.throughput.compute(step_time)
    return StepMetrics(
        step=step, loss=result.loss, lr=result.lr, grad_norm=result.grad_norm, step_time_s=step_time,
        tokens_per_s=tps, tokens_per_s_per_device=tps_dev, tflops_per_device=tflops, mfu=mfu,
        peak_mem_gb=peak_memory_gb(), overhead_frac=max(0.0, 1.0 - result.compute_time_s / step_time),
        skipped=result.skipped, skipped_steps=skipped_total, loss_scale=result.loss_scale,
        moe_aux_loss=result.moe_aux_loss, moe_z_loss=result.moe_z_loss,
    )


def _run_eval(run: Run, step: int) -> None:
    sched = run.config.schedule
    per_eval = sched.eval_steps * sched.global_batch_size
    index = step // sched.eval_interval - 1
    iters = chunk_iterators(run.datasets.valid, run.config, index * per_eval, (index + 1) * per_eval)
    loss = evaluate(run.state, iters, run.config, run.num_microbatches)
    if loss is not None:
        run.writer.log_eval(step, loss)


def main_train(config: ExperimentConfig) -> int:
    """Set up, train, shut down; returns the process exit code."""
    from data_pipeline.checks import print_error
    from pretrain.config import ConfigError
    from pretrain.runtime import shutdown

    try:
        run = setup(config)
    except (ConfigError, checkpoint.CheckpointError) as exc:
        print_error(exc)
        shutdown()  # the process group, if the error came after it (a damaged checkpoint)
        return 2
    except StopDuringSetup as exc:
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        info(f"[{config.name}] stopped during setup ({exc}), before step 1: nothing was trained or saved", rank0)
        shutdown()
        return 0
    try:
        history = train(run, run.start_step)
        if run.log_rank and history:
            info(f"[{config.name}] done: {len(history)} steps, final loss {history[-1].loss:.4f}")
    finally:
        run.writer.close()
        shutdown()
    return 0

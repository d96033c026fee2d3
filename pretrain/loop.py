"""Set up a run and train: the top-level flow of `python -m pretrain`.

setup: validate (no process group yet) -> runtime start-up -> build model chunks ->
wrap for training -> datasets -> trackers, profiler, watchdog. Then the loop: step, log,
evaluate, checkpoint, in that order, until train_steps (or a stop request: signal, time
limit). The hang watchdog times each step and each evaluation batch by the step timeout,
a checkpoint save by its own.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from data_pipeline.checks import BAD_INPUT, print_error
from models.build import build_model_chunks
from pretrain.config import ExperimentConfig, dump_yaml, num_microbatches, validate_before_start
from pretrain.data import build_datasets, chunk_iterators
from pretrain.metrics import (
    MetricsWriter,
    StepMetrics,
    Throughput,
    detect_device_peak,
    info,
    peak_memory_gb,
)
from pretrain.moe_load import ExpertLoad
from pretrain.netcheck import check_network, log_placement
from pretrain.runtime import collective_device, init_distributed, is_logging_rank, read_dist_env, world_size_from_env
from pretrain.checkpointing import checkpointer as checkpoint
from pretrain.checkpointing.format import CheckpointMeta
from pretrain.checkpointing.resume import plan_resume, settle
from pretrain.observe import profiler as step_profiler
from pretrain.observe.stragglers import StragglerReport, StragglerStats
from pretrain.observe.timers import StepTimers, install as install_timers
from pretrain.observe.trackers import open_trackers
from pretrain.observe.watchdog import Watchdog, enable_flight_recorder
from pretrain.signals import StopDuringSetup, StopRequest
from pretrain.step import evaluate, evaluate_batches, train_step
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
    watchdog: Watchdog
    start_step: int = 0
    profiler: Optional[step_profiler.StepProfiler] = None
    stragglers: Optional[StragglerReport] = None
    tracker_runs: Optional[dict] = None  # stored in every checkpoint, so a resume continues them
    expert_load: Optional[ExpertLoad] = None  # MoE: tokens per expert per layer (metrics.jsonl)


def setup(config: ExperimentConfig) -> Run:
    # Handlers first: a SIGTERM/USR1 during setup ends it (StopDuringSetup: nothing trained,
    # nothing to save; checked between phases once the process group exists, and at once in
    # the long steps, `stop.interruptible`), not the rank.
    stop = StopRequest(config.checkpoint.exit_after_minutes)
    world_size = world_size_from_env()
    # Before any process group: layout and batch, what the spec `auto` resolves to here can
    # run, the paths the run writes and the data it reads.
    spec = validate_before_start(config, world_size, prepare_demo=True)
    check_network()  # loopback hostname or a missing interface: refused before the rendezvous
    rank = read_dist_env().rank
    step_profiler.check_writable(config, rank)  # before training starts
    resume = plan_resume(config, print)  # bad or clashing checkpoints fail here
    if resume.first is not None:
        checkpoint.check_compatible(resume.first, config)
    # The hang watchdog covers set-up too (a rendezvous or a dataset build that never ends).
    watchdog = Watchdog(config.watchdog, config.logging.run_dir, rank)
    watchdog.begin_setup()
    try:
        return _setup_distributed(config, world_size, spec, resume, stop, watchdog)
    except BaseException:
        watchdog.stop()
        raise


def _setup_distributed(config: ExperimentConfig, world_size: int, spec: str, resume, stop: StopRequest,
                       watchdog: Watchdog) -> Run:
    """Set-up from the process group on: model, wrapping, resume, datasets, observers."""
    watchdog.setup_phase("process group (rendezvous)")
    enable_flight_recorder(config.watchdog)  # read when the process groups are created
    env = init_distributed(config.parallel, seed=config.runtime.seed)
    if world_size > 1:
        layout = config.parallel
        log_placement({"CP": layout.context_parallel, "EP": layout.expert_parallel}, info)
    stop.check_setup()
    watchdog.setup_phase("checkpoint checksums")
    with stop.interruptible():
        resume_from = settle(resume, config, lambda m: info(m, env.rank == 0))  # checksums; fallback
    if resume_from is not None and resume_from != resume.first:
        checkpoint.check_compatible(resume_from, config)
    resume_meta = CheckpointMeta.read(resume_from) if resume_from is not None else None
    log_rank = is_logging_rank()
    run_dir = Path(config.logging.run_dir)
    if env.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(config))
    info(f"[{config.name}] world {world_size} = {config.parallel.describe(world_size)} "
         f"({env.source}, {'cuda/nccl' if torch.cuda.is_available() else 'cpu/gloo'}), run dir {run_dir}",
         env.rank == 0)
    watchdog.setup_phase("building the model")
    chunks = build_model_chunks(config.model, config.parallel, config.runtime.model_copy(update={"spec": spec}),
                                reset_position_ids=config.data.reset_position_ids)
    state = wrap_for_training(chunks, config)
    stop.check_setup()
    start_step = 0
    if resume_from is not None:
        watchdog.setup_phase(f"loading {resume_from}")
        with stop.interruptible():
            start_step = checkpoint.load(resume_from, state, config, world_size, lambda m: info(m, env.rank == 0),
                                         branch=resume.branch)
        if config.runtime.inject_hang_step is not None:  # test-only: a requeued job gets past it
            config = config.model_copy(update={"runtime": config.runtime.model_copy(update={"inject_hang_step": None})})
        stop.check_setup()
    watchdog.setup_phase("datasets (Megatron's index caches)")
    with stop.interruptible():
        datasets = build_datasets(config, world_size)
    stop.check_setup()
    watchdog.setup_phase("trackers, profiler, first batch")
    stop.training_started()
    peak = detect_device_peak(config.logging.device_peak, config.runtime.dtype, bool(config.runtime.fp8))
    sched = config.schedule
    tracking = config.tracking.mlflow or config.tracking.wandb
    # A branch is a run of its own: new tracker runs, not the stable run's continued.
    continued = None if resume.branch else resume_meta and resume_meta.tracker_runs
    trackers = open_trackers(config, log_rank and tracking, continued, info)
    timers = _timers(config, env.rank)
    return Run(
        config=config, world_size=world_size, state=state, datasets=datasets,
        num_microbatches=num_microbatches(config, world_size),
        writer=MetricsWriter(config.logging.run_dir, log_rank, config.logging.tensorboard, trackers),
        throughput=Throughput(config.model, sched.seq_length, sched.global_batch_size, world_size, peak),
        log_rank=log_rank,
        stop=stop,
        watchdog=watchdog,
        start_step=start_step,
        profiler=step_profiler.build(config, env.rank, timers, start_step, info),
        stragglers=(StragglerReport(config.logging.straggler_interval, timers, _pipeline_rank(), start_step)
                    if config.logging.straggler_interval else None),
        tracker_runs=_share_tracker_runs(trackers.run_ids(), log_rank) if tracking else None,
        # (MTP layers' routers count in the rows after the decoder's: pretrain.moe_load.)
        expert_load=(ExpertLoad(state.model, config.model.num_layers + config.model.mtp_num_layers,
                                config.model.num_experts, collective_device())
                     if config.model.is_moe else None),
    )


def _timers(config: ExperimentConfig, rank: int) -> Optional[StepTimers]:
    """Megatron-Core's timer hook, only where the straggler report or a profiler needs it."""
    stragglers = config.logging.straggler_interval > 0
    if not (stragglers or step_profiler.profiles_rank(config.profile, rank)):
        return None
    return StepTimers(measure_compute=stragglers)


def _pipeline_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank()


def _share_tracker_runs(ids: dict, log_rank: bool) -> dict:
    """Every rank learns the logging rank's tracker run ids (rank 0 writes checkpoint metadata)."""
    src = torch.tensor([dist.get_rank() if log_rank else -1], device=collective_device())
    dist.all_reduce(src, op=dist.ReduceOp.MAX)
    box = [ids]
    dist.broadcast_object_list(box, src=int(src.item()))
    return box[0]


def train(run: Run, start_step: int = 0) -> list[StepMetrics]:
    """Train from `start_step` to `schedule.train_steps` (or a stop request).

    Each iteration: step -> NaN policy -> log -> evaluate -> checkpoint -> stop check.
    """
    config, sched = run.config, run.config.schedule
    gbs = sched.global_batch_size
    train_iters = chunk_iterators(run.datasets.train, config, start_step * gbs, sched.train_steps * gbs)
    stop, watchdog, profiler = run.stop, run.watchdog, run.profiler
    saver = checkpoint.Checkpointer(config, run.world_size, lambda m: info(m, dist.get_rank() == 0),
                                    tracker_runs=run.tracker_runs)
    install_timers(run.state, profiler.timers if profiler else run.stragglers and run.stragglers.timers)
    history: list[StepMetrics] = []
    skipped = 0
    watchdog.start()
    last = time.perf_counter()
    try:
        for step in range(start_step + 1, sched.train_steps + 1):
            watchdog.begin_step(step)
            if profiler:
                profiler.before_step(step)
            result = train_step(run.state, train_iters, config, run.num_microbatches, step)
            if result.skipped:
                skipped += 1
                _report_skip(run, step, result, skipped)
            now = time.perf_counter()
            step_time, last = now - last, now
            watchdog.end_step(step_time)
            excluded = time.perf_counter()  # profiler trace writing, evaluation and checkpoints
            if profiler:
                with watchdog.paused("profiler (writing the trace)"):
                    profiler.after_step(step)
            excluded = time.perf_counter() - excluded
            stragglers = run.stragglers.after_step(step) if run.stragglers else None
            interval = step % config.logging.log_interval == 0 or step == sched.train_steps
            # Every rank takes part in the load's all-reduce, so only at steps all ranks agree on.
            load = run.expert_load.take() if run.expert_load and interval else {}
            metrics = _step_metrics(run, step, result, step_time, skipped, stragglers, load)
            history.append(metrics)
            if interval or metrics.skipped or stragglers:
                run.writer.log(metrics, sched.train_steps)
            if stragglers and stragglers.warning(config.logging.straggler_warn_ratio):
                info(stragglers.warning(config.logging.straggler_warn_ratio), run.log_rank)
            paused = time.perf_counter()
            if sched.eval_interval and step % sched.eval_interval == 0 and run.datasets.valid is not None:
                with watchdog.batches("evaluation", sched.eval_steps) as begin_batch:
                    _run_eval(run, step, begin_batch)
            if step == sched.train_steps and run.datasets.heldout is not None:
                with watchdog.batches("held-out evaluation", sched.final_eval_steps) as begin_batch:
                    _run_heldout_eval(run, step, begin_batch)
            excluded += time.perf_counter() - paused
            reason = stop.reason()
            paused = time.perf_counter()
            save_limit = config.watchdog.save_timeout_s
            with watchdog.paused("checkpoint save", save_limit, "watchdog.save_timeout_s"):
                saver.save(step, run.state, last_step=step == sched.train_steps, stop=reason is not None)
            if reason is not None:
                info(f"stopping after step {step}: {reason}", dist.get_rank() == 0)
                break
            # Step time runs from one step's end to the next's: it includes logging, trackers,
            # the straggler report and the stop check, not evaluation, checkpoints or traces.
            last += excluded + time.perf_counter() - paused
    finally:
        watchdog.stop()
        if profiler:
            profiler.close()
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


def _step_metrics(run: Run, step: int, result, step_time: float, skipped_total: int,
                  stragglers: Optional[StragglerStats], expert_load: dict) -> StepMetrics:
    tps, tps_dev, tflops, mfu = run.throughput.compute(step_time)
    return StepMetrics(
        step=step, loss=result.loss, lr=result.lr, grad_norm=result.grad_norm, step_time_s=step_time,
        tokens_per_s=tps, tokens_per_s_per_device=tps_dev, tflops_per_device=tflops, mfu=mfu,
        peak_mem_gb=peak_memory_gb(), overhead_frac=max(0.0, 1.0 - result.compute_time_s / step_time),
        skipped=result.skipped, skipped_steps=skipped_total, loss_scale=result.loss_scale,
        moe_aux_loss=result.moe_aux_loss, moe_z_loss=result.moe_z_loss, attention_fraction=result.attention_fraction,
        moe_aux_loss_layers=result.moe_aux_loss_layers, **expert_load, **_mtp_metrics(result.mtp_loss_layers),
        **(stragglers.metrics() if stragglers else {}),
    )


def _mtp_metrics(layers: Optional[list[float]]) -> dict:
    if not layers:
        return {}
    return {"mtp_loss": sum(layers) / len(layers), "mtp_loss_layers": layers}


def _run_eval(run: Run, step: int, begin_batch) -> None:
    sched = run.config.schedule
    per_eval = sched.eval_steps * sched.global_batch_size
    index = step // sched.eval_interval - 1
    iters = chunk_iterators(run.datasets.valid, run.config, index * per_eval, (index + 1) * per_eval)
    loss = evaluate(run.state, iters, run.config, run.num_microbatches, begin_batch)
    if loss is not None:
        run.writer.log_eval(step, loss)


def _run_heldout_eval(run: Run, step: int, begin_batch) -> None:
    """The final held-out loss (schedule.final_eval_steps): its mean and the standard error of
    that mean over the batches, each batch's loss kept so the noise can be studied later."""
    from pretrain.data import heldout_samples

    n = heldout_samples(run.config)
    iters = chunk_iterators(run.datasets.heldout, run.config, 0, n)
    losses = evaluate_batches(run.state, iters, run.config, run.num_microbatches, run.config.schedule.final_eval_steps,
                              begin_batch)
    if losses:
        run.writer.log_heldout(step, losses)


def main_train(config: ExperimentConfig) -> int:
    """Set up, train, shut down; returns the process exit code."""
    from pretrain.config import ConfigError
    from pretrain.runtime import shutdown

    try:
        run = setup(config)
    except (ConfigError, checkpoint.CheckpointError) as exc:
        print_error(exc)
        shutdown()  # the process group, if the error came after it (a damaged checkpoint)
        return BAD_INPUT
    except StopDuringSetup as exc:
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        info(f"[{config.name}] stopped during setup ({exc}), before step 1: nothing was trained or saved", rank0)
        shutdown()
        return 0
    failed = True
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    try:
        history = train(run, run.start_step)
        failed = False
    finally:
        run.writer.close(failed)  # marks the tracker runs finished (or failed)
        shutdown(barrier=not failed)  # after an error: no barrier the peers never reach
    # After shutdown's barrier every rank has saved and logged: this is the run's last line. Rank
    # 0 prints it (every rank knows the loss: train_step agrees on it across ranks).
    info(closing_line(config, run.start_step, history), rank0)
    return 0


def closing_line(config: ExperimentConfig, start_step: int, history: list[StepMetrics]) -> str:
    """Where the run, its metrics and its checkpoint are, and what to run next, in one line:
    `[NAME] done: 300 steps, final loss 4.1; run RUN_DIR (metrics.jsonl), checkpoint DIR/step_...;
    next: python -m checkpoints_tools.export_hf ...`."""
    import shlex

    from pretrain.checkpointing.format import read_latest

    sched, run_dir = config.schedule, config.logging.run_dir
    last = history[-1].step if history else start_step
    if not history:
        what = f"nothing to train (resumed at step {start_step} of {sched.train_steps})"
    elif last == sched.train_steps:
        what = f"done: {len(history)} steps, final loss {history[-1].loss:.4f}"
    else:
        what = f"stopped after step {last} of {sched.train_steps}, loss {history[-1].loss:.4f}"
    root = Path(config.checkpoint.dir) if config.checkpoint.dir else None
    latest = read_latest(root) if root is not None and root.is_dir() else None
    if latest is None:
        saved = "no checkpoint (checkpoint.dir unset)" if root is None else f"no checkpoint in {root}"
        then = "add checkpoint.dir=DIR to keep the weights"
    elif last < sched.train_steps:
        saved = f"checkpoint {root / latest}"
        then = "resume: the same command with checkpoint.resume=auto"
    else:
        saved = f"checkpoint {root / latest}"
        then = f"python -m checkpoints_tools.export_hf {shlex.quote(str(root))} {shlex.quote(str(Path(run_dir) / 'hf'))}"
    return f"[{config.name}] {what}; run {run_dir} (metrics.jsonl), {saved}; next: {then}"

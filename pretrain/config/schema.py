"""The experiment config's schema: typed, strict sub-configs (pydantic), the facts derived
from them (ZeRO level, micro-batches, sample counts) and the YAML form saved with every run.

Checks that need one section only live beside it (pydantic validators); checks across
sections and against the world size, the machine, paths and data are in
`pretrain.config.validation`; `key=value` and YAML layering in `pretrain.config.overrides`.
"""

from __future__ import annotations

import json
from typing import Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from models.config import ModelConfig
from models.layout import ParallelLayout, Sharding
from models.runtime import RuntimeOptions


class _Strict(BaseModel):
    # allow_inf_nan=False: `optimizer.lr=inf` is a typo'd value, not a learning rate.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)


class RuntimeConfig(RuntimeOptions):
    """models.runtime.RuntimeOptions (seed, spec, dtype, recompute, moe_grouped_gemm, FP8,
    fused kernels) plus training-only keys."""

    # Fault injection for testing checkpoint.on_nan: rank 0 poisons its gradients at this step.
    inject_nan_step: Optional[int] = Field(default=None, gt=0)
    # Fault injection for testing the hang watchdog: rank `inject_hang_rank` sleeps
    # `inject_hang_seconds` in the middle of this step (after forward/backward, before the
    # step's loss all-reduce). Only in a run that did not resume, so a requeued job gets past it.
    inject_hang_step: Optional[int] = Field(default=None, gt=0)
    inject_hang_rank: int = Field(default=0, ge=0)
    inject_hang_seconds: float = Field(default=3600.0, gt=0)
    # Fault injection for testing the straggler report: this rank sleeps inject_slow_ms in
    # every micro-batch's forward.
    inject_slow_rank: Optional[int] = Field(default=None, ge=0)
    inject_slow_ms: float = Field(default=50.0, ge=0)


class MuonConfig(_Strict):
    """Muon (optimizer.name=muon): Megatron-Core 0.19's TensorParallelMuon from NVIDIA's
    emerging_optimizers. Defaults are Megatron-Core's OptimizerConfig `muon_*` defaults
    (megatron/core/optimizer/optimizer_config.py), except tp_mode (see below).

    Muon updates the 2-D hidden matrices (QKV, attention output, MLP fc1/fc2, expert
    matrices); the embedding, the output layer, norms, biases and the MoE router go to
    AdamW with the optimizer section's betas, eps and weight decay, at adamw_lr.
    Fused matrices: QKV is split per projection (split_qkv, Megatron-Core's default: Q,
    K and V are different maps whose singular values need not match); the fused SwiGLU
    gate/up matrix (linear_fc1) is orthogonalized whole (Megatron-Core has no split for
    it; torch.optim.Muon on the fused parameter does the same).
    """

    momentum: float = Field(default=0.95, ge=0, lt=1)
    nesterov: bool = False
    # Newton-Schulz: iteration count and coefficient set (emerging_optimizers' names;
    # "simple" is torch.optim.Muon's (3.4445, -4.775, 2.0315) at every step).
    num_ns_steps: int = Field(default=5, ge=1, le=100)
    coefficient_type: Literal["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4"] = "quintic"
    # The update's scale: spectral = sqrt(max(out, in)) (Kimi; x 0.2 via extra_scale_factor is
    # torch's adjust_lr_fn="match_rms_adamw"), shape_scaling = sqrt(max(1, out/in)) (Keller
    # Jordan's, torch's default "original"), unit_rms_norm = sqrt(out/in).
    scale_mode: Literal["spectral", "shape_scaling", "unit_rms_norm"] = "spectral"
    extra_scale_factor: float = Field(default=1.0, gt=0)
    # torch.set_float32_matmul_precision during Newton-Schulz: "medium" runs it in bf16.
    fp32_matmul_prec: Literal["highest", "high", "medium"] = "medium"
    split_qkv: bool = True
    # Tensor-parallel shards: "duplicated" gathers the whole matrix on each TP rank and
    # "distributed" runs Newton-Schulz on the shards with all-reduces: both are one-rank Muon.
    # "blockwise" (Megatron-Core's default) orthogonalizes each shard alone: a different
    # optimizer whose update depends on TP, hence not our default.
    tp_mode: Literal["duplicated", "distributed", "blockwise"] = "duplicated"
    # LR of the AdamW parameters (peak, and the floor of the decay); None = optimizer.lr / min_lr.
    adamw_lr: Optional[float] = Field(default=None, gt=0)
    adamw_min_lr: Optional[float] = Field(default=None, ge=0)


class OptimizerConfig(_Strict):
    # adamw: every parameter on AdamW. muon: hidden matrices on Muon, the rest on AdamW (`muon`).
    # lion: every parameter on Lion (emerging_optimizers' Lion through Megatron-Core; set a
    # smaller lr than AdamW's, its update is sign(.) x lr per element).
    name: Literal["adamw", "muon", "lion"] = "adamw"
    muon: MuonConfig = MuonConfig()
    # Lion's betas, Megatron-Core's OptimizerConfig names and defaults: the update is
    # sign(lion_beta1*m + (1-lion_beta1)*g), the momentum m = lion_beta2*m + (1-lion_beta2)*g.
    lion_beta1: float = Field(default=0.95, ge=0, lt=1)
    lion_beta2: float = Field(default=0.98, ge=0, lt=1)
    lr: float = Field(default=3e-4, gt=0)
    min_lr: float = Field(default=3e-5, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = Field(default=1.0, ge=0)
    # Megatron's distributed optimizer (ZeRO-1: optimizer state sharded over DP). Same as
    # parallel.sharding=zero1 (true) / none (false); parallel.sharding, when set, decides.
    distributed: bool = True
    # Optimizer state and fp32 main weights in host memory, the Adam step on the CPU
    # (Megatron's HybridDeviceOptimizer): GPU only, with a sharded optimizer (zero1-3).
    cpu_offload: bool = False
    # fp16 only: initial dynamic loss scale.
    initial_loss_scale: float = 2.0**16
    # GPU speed options (NCCL only; their effect is to be measured, launch.benchmark_table):
    # reduce gradient buckets while backward still runs; all-gather parameter buckets (distributed
    # optimizer) during the next forward instead of at the end of the optimizer step.
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # Parameters per gradient bucket; None = Megatron's max(40M, 1M x DP).
    bucket_size: Optional[int] = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _optimizer_keys_need_their_optimizer(self) -> "OptimizerConfig":
        # Muon keys under optimizer.name=adamw would silently do nothing. Compared with the
        # defaults, not model_fields_set: a saved config lists every key.
        changed = [k for k in MuonConfig.model_fields if getattr(self.muon, k) != getattr(MuonConfig(), k)]
        if self.name != "muon" and changed:
            key = changed[0]
            raise ValueError(f"optimizer.muon.{key} is set but optimizer.name={self.name}; "
                             "set optimizer.name=muon or remove it")
        for key in ("lion_beta1", "lion_beta2"):
            if self.name != "lion" and getattr(self, key) != OptimizerConfig.model_fields[key].default:
                raise ValueError(f"optimizer.{key} is set but optimizer.name={self.name}; "
                                 "set optimizer.name=lion or remove it")
        return self


class ScheduleConfig(_Strict):
    train_steps: int = Field(default=100, gt=0)
    warmup_steps: int = Field(default=10, ge=0)
    decay_style: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    # None = decay over all train_steps.
    decay_steps: Optional[int] = Field(default=None, gt=0)
    # wsd (warmup-stable-decay): max LR until the cooldown, which ends at the decay span's end.
    # Its length as steps or as a fraction of the decay span (one of the two), its shape with
    # Megatron-Core's names (OptimizerParamScheduler's wsd_decay_steps / lr_wsd_decay_style).
    wsd_decay_steps: Optional[int] = Field(default=None, gt=0)
    wsd_decay_fraction: Optional[float] = Field(default=None, gt=0, le=1)
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "linear"
    micro_batch_size: int = Field(default=1, gt=0)
    global_batch_size: int = Field(default=8, gt=0)
    seq_length: int = Field(default=256, gt=0)
    eval_interval: int = Field(default=0, ge=0)  # 0 = never
    eval_steps: int = Field(default=2, gt=0)
    # Held-out evaluation after the last step: this many batches of global_batch_size from
    # the start of the validation split, in a dataset built for exactly that many samples, so
    # that it is the same documents for every run with the same data, seed, seq_length and
    # batch, whatever its train_steps or eval_interval (scaling sweeps fit this loss). 0 = none.
    final_eval_steps: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _decay_after_warmup(self) -> "ScheduleConfig":
        # Megatron's scheduler needs decay_steps > warmup_steps; an explicit smaller value
        # was clamped silently (the LR then decayed over steps nobody asked for).
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"schedule.decay_steps={self.decay_steps} must exceed schedule.warmup_steps="
                             f"{self.warmup_steps} (decay starts after warmup); raise decay_steps or unset it "
                             "to decay over train_steps")
        self._check_wsd()
        return self

    @property
    def wsd_cooldown_steps(self) -> Optional[int]:
        """Cooldown length in steps (wsd only): wsd_decay_steps, or the fraction of the decay span."""
        if self.decay_style != "wsd":
            return None
        if self.wsd_decay_steps is not None:
            return self.wsd_decay_steps
        return max(1, round(self.wsd_decay_fraction * (self.decay_steps or self.train_steps)))

    def _check_wsd(self) -> None:
        given = [k for k in ("wsd_decay_steps", "wsd_decay_fraction") if getattr(self, k) is not None]
        if self.decay_style != "wsd":
            if given:  # a cooldown that would silently do nothing
                raise ValueError(f"schedule.{given[0]} is set but schedule.decay_style={self.decay_style}; "
                                 "set schedule.decay_style=wsd or remove it")
            return
        if len(given) != 1:
            raise ValueError("schedule.decay_style=wsd needs exactly one of schedule.wsd_decay_steps or "
                             f"schedule.wsd_decay_fraction (got {', '.join(given) or 'neither'})")
        span = (self.decay_steps or self.train_steps) - self.warmup_steps
        if self.wsd_cooldown_steps > span:
            raise ValueError(f"schedule wsd cooldown of {self.wsd_cooldown_steps} steps is longer than the "
                             f"{span} steps between warmup ({self.warmup_steps}) and the decay end "
                             f"({self.decay_steps or self.train_steps}); shorten it or lengthen the run")


class DataConfig(_Strict):
    # Weighted blend of indexed-dataset prefixes: [[weight, prefix], ...].
    blend: Optional[list[tuple[float, str]]] = None
    # The demo corpus shipped with data_pipeline (real English text).
    demo: bool = False
    # Megatron-Core's MockGPTDataset (random tokens), for benchmarks and smoke tests.
    mock: bool = False
    tokenizer: Optional[str] = None
    split: str = "969,30,1"
    cache_dir: Optional[str] = None
    # Document masking of packed samples (Megatron-LM's names and semantics; a document ends
    # with, and includes, the tokenizer's EOD token). reset_attention_mask: a token attends
    # only to earlier tokens of its own document. reset_position_ids: positions (RoPE or
    # learned) restart at 0 after each EOD. eod_mask_loss: no loss on positions whose input
    # is EOD (the prediction of the next document's first token). All off by default: see
    # docs/document-masking.md for why.
    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False

    @field_validator("split")
    @classmethod
    def _split_parses(cls, value: str) -> str:
        from data_pipeline.datasets import DatasetConfigError, parse_split

        try:
            parse_split(value)
        except DatasetConfigError as exc:
            raise ValueError(f"data.{exc}") from None
        return value


class CheckpointConfig(_Strict):
    dir: Optional[str] = None
    save_interval: int = Field(default=0, ge=0)  # 0 = only at the end (if dir is set)
    # "auto": newest complete checkpoint if any; "none"; or a path / step number.
    resume: Union[str, int] = "auto"
    # A cooldown branch (pretrain.checkpointing.branch): start from this stable-phase checkpoint
    # of another run (model, optimizer, RNG, data position, step) with this config's schedule,
    # saving into this run's own checkpoint.dir. Used while checkpoint.dir holds no checkpoint
    # of its own; after that the branch resumes itself (resume=auto), as a requeued job must.
    branch_from: Optional[str] = None
    keep_last: int = Field(default=3, gt=0)
    # Steps saved besides the interval's and kept whatever keep_last says: the branch points of
    # cooldown branches (launch.sweep sets them on a stable run).
    save_steps: list[PositiveInt] = []
    async_save: bool = False
    exit_after_minutes: Optional[float] = Field(default=None, gt=0)
    on_nan: Literal["skip", "stop"] = "stop"
    # Checkpoints in `dir` newer than the resume point (or any, starting fresh) would be
    # overwritten or interleaved: "refuse" to start, or "move_aside" into superseded-<time>/.
    on_newer: Literal["refuse", "move_aside"] = "refuse"
    # Check every file's xxh3-64 checksum on load (sizes are always checked).
    verify_checksums: bool = True


class LoggingConfig(_Strict):
    run_dir: str = "runs/default"
    log_interval: int = Field(default=1, gt=0)
    tensorboard: bool = True
    # Peak FLOP/s table key for MFU; "auto" picks from the GPU name (none on CPU).
    device_peak: str = "auto"
    # Straggler report every N steps (0 = off): each rank's forward/backward compute time per
    # step, gathered once per report; the slowest rank vs the median of its pipeline stage.
    straggler_interval: int = Field(default=100, ge=0)
    # A rank this many times slower than its stage's median is named in a warning.
    straggler_warn_ratio: float = Field(default=1.2, gt=1)


class ProfileConfig(_Strict):
    """torch.profiler (or nsys) over a window of steps on chosen ranks; off unless start_step is set."""

    start_step: Optional[int] = Field(default=None, gt=0)  # first profiled step; None = off
    num_steps: int = Field(default=2, gt=0)
    ranks: Union[Literal["all"], list[int]] = [0]
    dir: Optional[str] = None  # default <logging.run_dir>/profile; one rank_<r>/ per rank
    # "torch": torch.profiler traces (trace.json.gz) + top-ops table. "nsys" (CUDA): only
    # cudaProfilerStart/Stop around the window and NVTX ranges, for `nsys --capture-range=cudaProfilerApi`.
    mode: Literal["torch", "nsys"] = "torch"
    record_shapes: bool = True
    profile_memory: bool = True
    with_stack: bool = False
    top_ops: int = Field(default=15, gt=0)  # rows of the top-operators table
    # CUDA: record the allocator's history during this step and dump memory_snapshot.pickle
    # (open it at pytorch.org/memory_viz).
    memory_snapshot_step: Optional[int] = Field(default=None, gt=0)


class TrackingConfig(_Strict):
    """Experiment trackers, logged from the logging rank only (optional extras: mcore-stack[mlflow], [wandb])."""

    mlflow: bool = False
    wandb: bool = False
    # MLflow experiment / W&B project; default: the config's name.
    project: Optional[str] = None
    run_name: Optional[str] = None
    # Default: MLflow's own (the MLFLOW_TRACKING_URI environment variable, else ./mlruns).
    mlflow_tracking_uri: Optional[str] = None
    wandb_entity: Optional[str] = None
    # "offline" writes the run under <wandb_dir>/wandb/ for a later `wandb sync`.
    wandb_mode: Literal["online", "offline"] = "online"
    wandb_dir: Optional[str] = None  # default: logging.run_dir


class WatchdogConfig(_Strict):
    """Per-rank hang watchdog: a step or an evaluation batch that makes no progress within
    the timeout, or a checkpoint save within save_timeout_s, dumps every thread's stack to
    <run_dir>/hang/ and exits 75."""

    enabled: bool = True
    # Fixed timeout in seconds after the first step; None derives it: max(min_timeout_s,
    # step_time_factor x the median of the recent step times), startup_timeout_s until 5 steps
    # are timed. The run's first step always has startup_timeout_s (one-time start-up costs).
    timeout_s: Optional[float] = Field(default=None, gt=0)
    min_timeout_s: float = Field(default=300.0, gt=0)
    step_time_factor: float = Field(default=10.0, gt=1)
    startup_timeout_s: float = Field(default=1800.0, gt=0)
    # A checkpoint save (the part the loop waits for: all of a synchronous one, the staging of
    # an async one) may take this long; None: saves are not timed. Without it, a save whose
    # collective never returns (a network cut that leaves both nodes pingable) was ended only
    # by the process group's own timeout.
    save_timeout_s: Optional[float] = Field(default=3600.0, gt=0)
    # Collectives torch's flight recorder keeps per rank (TORCH_FR_BUFFER_SIZE, unless set in
    # the environment); the report lists the last ones. 0 = off.
    flight_recorder_entries: int = Field(default=256, ge=0)


class ExperimentConfig(_Strict):
    name: str = "experiment"
    model: ModelConfig
    parallel: ParallelLayout = ParallelLayout()
    runtime: RuntimeConfig = RuntimeConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    profile: ProfileConfig = ProfileConfig()
    tracking: TrackingConfig = TrackingConfig()
    watchdog: WatchdogConfig = WatchdogConfig()

    @model_validator(mode="after")
    def _evaluation_has_data(self) -> "ExperimentConfig":
        from data_pipeline.datasets import parse_split

        sched = self.schedule
        for key, value in (("eval_interval", sched.eval_interval), ("final_eval_steps", sched.final_eval_steps)):
            if value and parse_split(self.data.split)[1] == 0:
                raise ValueError(f"schedule.{key}={value} needs validation data, but "
                                 f"data.split={self.data.split} gives the validation part 0; set "
                                 f"schedule.{key}=0 or a non-zero middle part (e.g. 969,30,1)")
        return self


class ConfigError(ValueError):
    """A config value or key that cannot work; the message says which and what would."""


def data_parallel_sharding(config: ExperimentConfig) -> Sharding:
    """The ZeRO level that runs: parallel.sharding, else zero1/none by optimizer.distributed."""
    sharding = config.parallel.sharding
    if sharding is None:
        return "zero1" if config.optimizer.distributed else "none"
    return sharding


def microbatches(global_batch: int, micro_batch: int, data_parallel: int) -> int:
    """Micro-batches each data-parallel rank runs per step: the global batch over micro batch x DP
    (a whole number once `validate_for_world` has passed)."""
    return global_batch // (micro_batch * data_parallel)


def num_microbatches(config: ExperimentConfig, world_size: int) -> int:
    sched = config.schedule
    return microbatches(sched.global_batch_size, sched.micro_batch_size, config.parallel.data_parallel(world_size))


def sample_counts(config: ExperimentConfig) -> tuple[int, int, int]:
    """Samples the run reads from the (train, validation, test) splits."""
    sched = config.schedule
    gbs = sched.global_batch_size
    n_valid = (sched.train_steps // sched.eval_interval + 1) * sched.eval_steps * gbs if sched.eval_interval else 0
    return sched.train_steps * gbs, n_valid, 0


def demo_prefix(config: ExperimentConfig) -> str:
    """Where `data.demo=true` tokenises the shipped corpus (a cache: made once, reused)."""
    from data_pipeline.datasets import DEMO_PREFIX_NAME

    return f"{config.data.cache_dir or config.logging.run_dir + '/data_cache'}/demo/{DEMO_PREFIX_NAME}"


def dump_yaml(config: ExperimentConfig) -> str:
    return yaml.safe_dump(json.loads(config.model_dump_json()), sort_keys=False)

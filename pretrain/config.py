"""The experiment config: typed, strict sub-configs, YAML + `key=value` overrides.

Unknown keys are errors naming the closest valid key; values are type-checked by pydantic.
`validate_for_world` checks everything that depends on the world size (layout, batch
arithmetic) before any process group exists.
"""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from models import precision
from models.config import ModelConfig, get_flavor
from models.layout import LayoutError, ParallelLayout, validate_layout
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


class OptimizerConfig(_Strict):
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


class ScheduleConfig(_Strict):
    train_steps: int = Field(default=100, gt=0)
    warmup_steps: int = Field(default=10, ge=0)
    decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    # None = decay over all train_steps.
    decay_steps: Optional[int] = Field(default=None, gt=0)
    micro_batch_size: int = Field(default=1, gt=0)
    global_batch_size: int = Field(default=8, gt=0)
    seq_length: int = Field(default=256, gt=0)
    eval_interval: int = Field(default=0, ge=0)  # 0 = never
    eval_steps: int = Field(default=2, gt=0)

    @model_validator(mode="after")
    def _decay_after_warmup(self) -> "ScheduleConfig":
        # Megatron's scheduler needs decay_steps > warmup_steps; an explicit smaller value
        # was clamped silently (the LR then decayed over steps nobody asked for).
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"schedule.decay_steps={self.decay_steps} must exceed schedule.warmup_steps="
                             f"{self.warmup_steps} (decay starts after warmup); raise decay_steps or unset it "
                             "to decay over train_steps")
        return self


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
    # the README's "Document masking" for why.
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
    keep_last: int = Field(default=3, gt=0)
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
    """Per-rank hang watchdog: a step (not evaluation or a checkpoint save) that makes no
    progress within the timeout dumps every thread's stack to <run_dir>/hang/ and exits 75."""

    enabled: bool = True
    # Fixed timeout in seconds after the first step; None derives it: max(min_timeout_s,
    # step_time_factor x the median of the recent step times), startup_timeout_s until 5 steps
    # are timed. The run's first step always has startup_timeout_s (one-time start-up costs).
    timeout_s: Optional[float] = Field(default=None, gt=0)
    min_timeout_s: float = Field(default=300.0, gt=0)
    step_time_factor: float = Field(default=10.0, gt=1)
    startup_timeout_s: float = Field(default=1800.0, gt=0)
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

        if self.schedule.eval_interval and parse_split(self.data.split)[1] == 0:
            raise ValueError(f"schedule.eval_interval={self.schedule.eval_interval} needs validation data, but "
                             f"data.split={self.data.split} gives the validation part 0; set "
                             "schedule.eval_interval=0 or a non-zero middle part (e.g. 969,30,1)")
        return self


class ConfigError(ValueError):
    """A config value or key that cannot work; the message says which and what would."""


def _parse_value(key: str, text: str) -> Any:
    # YAML 1.1 reads "3e-4" as a string; numbers first, then YAML for lists/bools/null.
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}={text!r} is not valid YAML ({_yaml_problem(exc)}); quote the "
                          "value for the shell, e.g. data.blend='[[1.0, data/web]]'") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line from a YAML error: the problem and where it is."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid keys: {', '.join(valid)}"


def _set_path(tree: dict, path: str, value: Any, schema: type[BaseModel]) -> None:
    """Set tree[a][b]... = value, checking every key of the path against the schema."""
    parts = path.split(".")
    node, model = tree, schema
    for i, part in enumerate(parts):
        fields = list(model.model_fields)
        if part not in fields:
            where = ".".join(parts[:i]) or "top level"
            raise ConfigError(f"unknown config key {path!r} ({part!r} at {where}){_closest(part, fields)}")
        if i == len(parts) - 1:
            node[part] = value
            return
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            raise ConfigError(f"config key {'.'.join(parts[:i + 1])!r} is a value, not a section")
        node = node.setdefault(part, {})
        model = annotation


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            items.extend(_flatten(value, path + "."))
        else:
            items.append((path, value))
    return items


def _read_yaml_file(yaml_file: str) -> dict:
    path = Path(yaml_file)
    if not path.is_file():
        raise ConfigError(f"config file {yaml_file!r} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {yaml_file!r} is not valid YAML: {_yaml_problem(exc)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {yaml_file!r} cannot be read: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {yaml_file!r} must hold a mapping of sections")
    return loaded


def _model_flavor(value: Any) -> dict:
    """`model=<flavor>`: the whole model section from a named flavor (models.config.FLAVORS)."""
    if not isinstance(value, str):
        raise ConfigError(f"model={value!r}: give a flavor name (e.g. model=tiny-gpt) or set single fields "
                          "(model.num_layers=2)")
    try:
        return get_flavor(value).model_dump(mode="python")
    except ValueError as exc:
        raise ConfigError(f"model={value}: {exc}") from None


def apply_overrides(
    config: ExperimentConfig, *, yaml_file: Optional[str] = None, overrides: list[str] = ()
) -> ExperimentConfig:
    """Layer a YAML file, then `key=value` strings, over a recipe's config.

    `model=<flavor>` (in either) replaces the whole model section with a named flavor;
    `model.<field>=...` after it changes single fields of that flavor.
    """
    tree = config.model_dump(mode="python")
    pairs: list[tuple[str, Any]] = []
    if yaml_file:
        pairs.extend(_flatten(_read_yaml_file(yaml_file)))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. schedule.train_steps=50)")
        key, text = item.split("=", 1)
        pairs.append((key.strip(), _parse_value(key.strip(), text)))
    for key, value in pairs:
        if key == "model" and not isinstance(value, dict):
            tree["model"] = _model_flavor(value)
        else:
            _set_path(tree, key, value, ExperimentConfig)
    try:
        # JSON validation: strict types, yet lists are accepted for tuples (blend entries).
        return ExperimentConfig.model_validate_json(json.dumps(tree))
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc)) from None


def _format_validation(exc: ValidationError) -> str:
    """One line per problem, the first one first: `invalid config: KEY: what (got VALUE)`."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if not loc or (err["type"] == "value_error" and loc in message):  # our checks name their keys
            lines.append(message)
        else:
            lines.append(f"{loc}: {message} (got {err.get('input')!r})")
    return "invalid config: " + "\n".join(lines)


def validate_for_world(config: ExperimentConfig, world_size: int) -> None:
    """Every world-size dependent check, before any process group exists."""
    try:
        validate_layout(config.model, config.parallel, world_size)
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None
    layout, sched = config.parallel, config.schedule
    dp = layout.data_parallel(world_size)
    per_step = sched.micro_batch_size * dp
    if sched.global_batch_size % per_step:
        valid = [sched.micro_batch_size * dp * k for k in range(1, 5)]
        raise ConfigError(
            f"schedule.global_batch_size={sched.global_batch_size} is not divisible by "
            f"micro_batch_size({sched.micro_batch_size}) x DP({dp}) = {per_step}; "
            f"valid global batch sizes include {valid}"
        )
    microbatches = sched.global_batch_size // per_step
    if layout.virtual_pipeline and microbatches % layout.pipeline_parallel:
        raise ConfigError(
            f"interleaved 1F1B needs the number of microbatches ({microbatches} = global batch "
            f"{sched.global_batch_size} / (micro batch {sched.micro_batch_size} x DP {dp})) to be "
            f"a multiple of PP={layout.pipeline_parallel}; e.g. global_batch_size="
            f"{per_step * layout.pipeline_parallel * max(1, microbatches // layout.pipeline_parallel)}"
        )
    if sched.seq_length > config.model.max_seq_length:
        raise ConfigError(
            f"schedule.seq_length={sched.seq_length} exceeds model.max_seq_length="
            f"{config.model.max_seq_length}"
        )
    if layout.context_parallel > 1 and sched.seq_length % (2 * layout.context_parallel):
        raise ConfigError(
            f"schedule.seq_length={sched.seq_length} must be divisible by 2 x CP = "
            f"{2 * layout.context_parallel} (load-balanced context parallel split)"
        )
    _check_precision(config)
    if config.runtime.spec == "portable":
        check_spec_support(config, "portable")
    _check_sharding(config)
    if config.optimizer.min_lr > config.optimizer.lr:
        raise ConfigError(f"optimizer.min_lr={config.optimizer.min_lr} exceeds optimizer.lr={config.optimizer.lr}")
    data = config.data
    if sum([bool(data.blend), data.demo, data.mock]) != 1:
        raise ConfigError("set exactly one data source: data.blend=[[w, prefix], ...], data.demo=true or data.mock=true")
    if data.blend and not data.tokenizer:
        raise ConfigError("data.blend needs data.tokenizer (the tokenizer the data was preprocessed with)")
    ranks = config.profile.ranks
    if ranks != "all" and any(r >= world_size for r in ranks):
        raise ConfigError(f"profile.ranks={ranks} names ranks outside the world of {world_size} "
                          f"(ranks 0..{world_size - 1}); or use profile.ranks=all")


def data_parallel_sharding(config: ExperimentConfig) -> str:
    """The ZeRO stage that runs: parallel.sharding, else zero1/none by optimizer.distributed."""
    sharding = config.parallel.sharding
    if sharding is None:
        return "zero1" if config.optimizer.distributed else "none"
    return sharding


def _check_sharding(config: ExperimentConfig) -> None:
    sharding, opt = data_parallel_sharding(config), config.optimizer
    if config.parallel.sharding not in (None, "none") and not opt.distributed:
        raise ConfigError(f"parallel.sharding={sharding} shards the optimizer state, but optimizer.distributed=false "
                          "asks for an unsharded optimizer; drop optimizer.distributed=false")
    if opt.cpu_offload and sharding == "none":
        raise ConfigError("optimizer.cpu_offload needs a sharded optimizer (parallel.sharding=zero1, zero2 or zero3)")
    if config.parallel.fsdp and config.runtime.dtype == "fp16":
        raise ConfigError(f"parallel.sharding={sharding} (Megatron-FSDP) is not supported here with fp16 loss "
                          "scaling; use runtime.dtype=bf16 (or fp32), or parallel.sharding=zero1")


def _check_precision(config: ExperimentConfig) -> None:
    """FP8 and speed options that cannot work on any machine."""
    problems = precision.config_problems(
        config.runtime, num_layers=config.model.num_layers, pipeline_parallel=config.parallel.pipeline_parallel,
        distributed_optimizer=config.optimizer.distributed)
    opt = config.optimizer
    if opt.overlap_param_gather and not opt.distributed:
        problems.append("optimizer.overlap_param_gather=true needs optimizer.distributed=true (it overlaps the "
                        "distributed optimizer's parameter all-gather)")
    if config.runtime.fp8_recipe_name == "mxfp8" and config.runtime.fp8_param_gather and opt.overlap_param_gather:
        problems.append("runtime.fp8_param_gather with fp8_recipe=mxfp8 and optimizer.overlap_param_gather: "
                        "Megatron-Core 0.16.1 then leaves the parameter copy to the training loop "
                        "(optimizer.py, reuse_grad_buf_for_mxfp8_param_ag), which this loop does not do; "
                        "set optimizer.overlap_param_gather=false")
    if problems:
        raise ConfigError("; ".join(problems))


def check_document_masking(config: ExperimentConfig, spec: str) -> None:
    """Document masking (data.reset_attention_mask / reset_position_ids) the resolved spec can
    run. `portable`: every layout. `te`: THD packed sequences (models.documents), which reset
    attention and positions together, at CP 1 (TE's THD context parallelism needs every
    document padded to a multiple of 2 x CP: not implemented), and one sample per
    micro-batch under PP (pipeline messages keep the [s, b, h] shape)."""
    data, layout = config.data, config.parallel
    if spec != "te" or not (data.reset_attention_mask or data.reset_position_ids):
        return
    if data.reset_attention_mask != data.reset_position_ids:
        raise ConfigError(
            f"data.reset_attention_mask={str(data.reset_attention_mask).lower()} with data.reset_position_ids="
            f"{str(data.reset_position_ids).lower()}: the te spec masks documents as packed (THD) sequences, "
            "which reset both; set both true, or runtime.spec=portable")
    if layout.context_parallel > 1:
        raise ConfigError(
            f"document masking with the te spec at CP={layout.context_parallel} is not supported (TE's THD "
            "context parallelism needs documents padded to a multiple of 2 x CP); use CP=1 with the te "
            "spec, or runtime.spec=portable, whose context parallelism masks documents")
    if layout.pipeline_parallel > 1 and config.schedule.micro_batch_size > 1:
        raise ConfigError(
            f"document masking with the te spec at PP={layout.pipeline_parallel} needs "
            f"schedule.micro_batch_size=1 (got {config.schedule.micro_batch_size}): a packed micro-batch is "
            "one THD sequence; raise the global batch instead")


def check_spec_support(config: ExperimentConfig, spec: str) -> None:
    """Refuse features the (resolved) layer spec cannot run; the message names the fix."""
    check_document_masking(config, spec)
    if spec != "portable":
        return
    runtime, layout = config.runtime, config.parallel
    problems = precision.machine_problems(runtime, spec, precision.MachineFacts())
    if problems:
        raise ConfigError("; ".join(problems))
    if layout.context_parallel > 1 and layout.cp_comm_type not in (None, "allgather"):
        raise ConfigError(
            f"parallel.cp_comm_type={layout.cp_comm_type} needs the Transformer Engine spec (runtime.spec=te "
            "on a GPU with Transformer Engine); the portable spec's context parallelism all-gathers "
            "keys/values: set parallel.cp_comm_type=allgather or leave it unset"
        )
    if runtime.moe_grouped_gemm and config.model.is_moe:
        raise ConfigError("runtime.moe_grouped_gemm=true needs the Transformer Engine spec (TE's grouped "
                          "GEMM); set runtime.spec=te on GPU, or runtime.moe_grouped_gemm=false")


def validate_for_machine(config: ExperimentConfig, facts: Optional[precision.MachineFacts] = None) -> str:
    """Resolve runtime.spec on this machine and check the config against it; returns the spec.

    Separate from `validate_for_world` because `auto` depends on the machine (a dry run on a
    laptop validates a GPU recipe without Transformer Engine). Call before any process group.
    `facts` (the GPU's compute capability, CUDA, Transformer Engine) default to
    `models.precision.probe_machine()`; FP8 recipes are checked against them, so "MXFP8 on
    an H100" fails here, before any model is built.
    """
    from models.build import resolve_spec

    facts = facts or precision.probe_machine()
    try:
        spec = resolve_spec(config.runtime.spec, facts)
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from None
    check_spec_support(config, spec)
    problems = precision.machine_problems(config.runtime, spec, facts)
    opt = config.optimizer
    if not facts.has_gpu:
        # Megatron's overlapped paths issue asynchronous coalesced collectives; on gloo those
        # corrupted the heap now and then (notes/megatron-fsdp-on-cpu.md). GPU (NCCL) only.
        problems += [f"optimizer.{key}=true needs a GPU (NCCL); remove it on this machine"
                     for key in ("overlap_grad_reduce", "overlap_param_gather") if getattr(opt, key)]
        if opt.cpu_offload:
            problems.append("optimizer.cpu_offload=true moves optimizer state from GPU to host memory "
                            "(Megatron's HybridDeviceOptimizer: pinned memory, CUDA streams); this machine "
                            "has no GPU and the state is in host memory already: remove it")
    if problems:
        raise ConfigError("; ".join(problems))
    _check_observability(config, facts.has_gpu)
    return spec


def _check_observability(config: ExperimentConfig, has_gpu: bool) -> None:
    """Tracker extras installed and CUDA-only profiling on CUDA, at start-up (not at the
    first log call, hours later)."""
    import importlib.util

    for key, module in (("mlflow", "mlflow"), ("wandb", "wandb")):
        if getattr(config.tracking, key) and importlib.util.find_spec(module) is None:
            raise ConfigError(f"tracking.{key}=true needs the {module} package, which is not installed: "
                              f"pip install 'mcore-stack[{key}]' (or set tracking.{key}=false)")
    profile = config.profile
    if not has_gpu:
        if profile.start_step is not None and profile.mode == "nsys":
            raise ConfigError("profile.mode=nsys needs CUDA (it brackets the window with cudaProfilerStart/"
                              "Stop for nsys); on CPU use profile.mode=torch")
        if profile.memory_snapshot_step is not None:
            raise ConfigError("profile.memory_snapshot_step needs CUDA (it records the CUDA caching "
                              "allocator's history); unset it on CPU")


def validate_paths(config: ExperimentConfig) -> None:
    """Every directory the run creates or writes into, checked before any process group:
    a checkpoint.dir that cannot be written was found at the first save, after training."""
    from data_pipeline.checks import writable_dir_problem

    run_dir = config.logging.run_dir
    for key, path in (("logging.run_dir", run_dir), ("checkpoint.dir", config.checkpoint.dir),
                      ("data.cache_dir", config.data.cache_dir)):
        problem = writable_dir_problem(path) if path else None
        if problem:
            raise ConfigError(f"{key}={path}: {problem}; choose a directory this process can write")


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


def validate_data(config: ExperimentConfig, *, prepare_demo: bool = False):
    """The data the run reads, before any process group: the tokenizer loads and fits
    model.vocab_size; blend prefixes exist, are intact and were made with that tokenizer;
    the schedule does not ask for absurdly more samples than the data holds. With
    `prepare_demo`, the demo dataset is made first (a dry run checks it only if it exists).
    Returns the tokenizer."""
    from data_pipeline.datasets import (
        DEMO_TOKENIZER,
        DatasetConfigError,
        check_blend,
        check_sample_budget,
        ensure_demo_dataset,
    )
    from data_pipeline.indexed_writer import IndexedDataset
    from data_pipeline.tokenizers import TokenizerLoadError, load_tokenizer

    data, sched = config.data, config.schedule
    spec = DEMO_TOKENIZER if data.demo else (data.tokenizer or "byte")
    try:
        tokenizer = load_tokenizer(spec)
    except TokenizerLoadError as exc:
        raise ConfigError(f"data.tokenizer={spec}: {exc}") from None
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(f"tokenizer {spec!r} has {tokenizer.vocab_size} tokens but model.vocab_size="
                          f"{config.model.vocab_size}; set model.vocab_size={tokenizer.vocab_size}")
    masking = [k for k in ("reset_attention_mask", "reset_position_ids", "eod_mask_loss") if getattr(data, k)]
    if masking and tokenizer.eod is None:
        raise ConfigError(f"data.{masking[0]}=true needs documents ending in an EOD token, but tokenizer "
                          f"{spec!r} has none; use a tokenizer with an EOS/EOD token or turn it off")
    blend = [tuple(item) for item in data.blend] if data.blend else None
    try:
        if blend:
            check_blend(blend, tokenizer)
            if masking:
                _warn_without_eod(blend, tokenizer.eod, masking[0])
    except DatasetConfigError as exc:
        raise ConfigError(f"data.blend: {exc}") from None
    if data.demo:
        prefix = demo_prefix(config)
        if prepare_demo:
            ensure_demo_dataset(str(Path(prefix).parent))
        blend = [(1.0, prefix)] if IndexedDataset.exists(prefix) else None
        if blend is None:
            return tokenizer  # a dry run before the first training run: nothing to measure yet
    try:
        check_sample_budget(blend=blend, mock=data.mock, split=data.split, seq_length=sched.seq_length,
                            num_samples=sample_counts(config), vocab_size=tokenizer.vocab_size)
    except DatasetConfigError as exc:
        raise ConfigError(f"schedule.train_steps={sched.train_steps} x global_batch_size="
                          f"{sched.global_batch_size} asks too much of the data: {exc}; lower "
                          "schedule.train_steps or add data") from None
    return tokenizer


def _warn_without_eod(blend: list, eod: int, key: str) -> None:
    """A dataset with no EOD in its first 16M tokens has nothing to mask: say so, with the
    counts, and go on (masking then changes nothing; it is not an error)."""
    from data_pipeline.datasets import count_eod

    for _, prefix in blend:
        found, scanned = count_eod(prefix, eod)
        if not found:
            print(f"warning: data.{key}=true but {prefix} has no EOD token (id {eod}) in its first "
                  f"{scanned:,} tokens: 0 document boundaries to mask (preprocess with --append-eod)",
                  file=sys.stderr, flush=True)


def validate_inputs(config: ExperimentConfig, *, prepare_demo: bool = False) -> None:
    """Paths and data (`validate_paths`, `validate_data`): what `--dry-run`, launch.local and
    every rank's setup check before any process group."""
    validate_paths(config)
    validate_data(config, prepare_demo=prepare_demo)


def num_microbatches(config: ExperimentConfig, world_size: int) -> int:
    dp = config.parallel.data_parallel(world_size)
    return config.schedule.global_batch_size // (config.schedule.micro_batch_size * dp)


def dump_yaml(config: ExperimentConfig) -> str:
    return yaml.safe_dump(json.loads(config.model_dump_json()), sort_keys=False)

"""Every check of a config across sections and against the world, the machine, the paths and
the data, each before any process group exists. Set-up calls one function:

    spec = validate_before_start(config, world_size, prepare_demo=True)

which runs, in order: `validate_for_world` (layout, batch arithmetic, sharding, precision
keys), `validate_for_machine` (resolves `runtime.spec` here and checks what it can run) and
`validate_inputs` (`validate_paths`: what the run writes; `validate_data`: the tokenizer and
the data it reads). `--dry-run` and the launchers call the world and input checks alone (a
dry run on a laptop validates a GPU recipe). Each raises ConfigError with one line naming
the problem and the fix.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional

from models import precision
from models.layout import LayoutError, validate_layout
from pretrain.config.schema import (
    ConfigError,
    ExperimentConfig,
    data_parallel_sharding,
    demo_prefix,
    microbatches,
    sample_counts,
)


def validate_before_start(config: ExperimentConfig, world_size: int, *, prepare_demo: bool = False) -> str:
    """Everything a training run checks before its process group: world, machine, inputs.
    Returns the layer spec `runtime.spec` resolves to on this machine."""
    validate_for_world(config, world_size)
    spec = validate_for_machine(config)
    validate_inputs(config, prepare_demo=prepare_demo)
    return spec


def validate_for_world(config: ExperimentConfig, world_size: int) -> None:
    """Every world-size dependent check, before any process group exists."""
    try:
        validate_layout(config.model, config.parallel, world_size)
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None
    validate_beyond_layout(config, world_size)


def validate_beyond_layout(config: ExperimentConfig, world_size: int) -> None:
    """`validate_for_world`'s checks after the layout's own (`validate_layout`), for a caller
    that has already validated the layout: the planner, which asks once per layout and not for
    each of the batch, recompute and offload choices built on it."""
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
    count = microbatches(sched.global_batch_size, sched.micro_batch_size, dp)
    if layout.virtual_pipeline and count % layout.pipeline_parallel:
        raise ConfigError(
            f"interleaved 1F1B needs the number of microbatches ({count} = global batch "
            f"{sched.global_batch_size} / (micro batch {sched.micro_batch_size} x DP {dp})) to be "
            f"a multiple of PP={layout.pipeline_parallel}; e.g. global_batch_size="
            f"{per_step * layout.pipeline_parallel * max(1, count // layout.pipeline_parallel)}"
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
    if layout.sequence_parallel and (sched.seq_length // layout.context_parallel) % layout.tensor_parallel:
        # Megatron-Core scatters each CP rank's sequence over the TP ranks ("First dimension of
        # the tensor should be divisible by tensor parallel size" at the first forward).
        cp, tp = layout.context_parallel, layout.tensor_parallel
        step = cp * (math.lcm(2, tp) if cp > 1 else tp)  # CP's load-balanced split halves a CP chunk
        below = sched.seq_length // step * step
        valid = ", ".join(str(s) for s in (below, below + step) if s > 0)
        raise ConfigError(
            f"schedule.seq_length={sched.seq_length} with parallel.sequence_parallel=true must split over CP "
            f"({layout.context_parallel}) and then TP ({layout.tensor_parallel}) evenly: use a multiple of {step} "
            f"(e.g. {valid}), or parallel.sequence_parallel=false")
    _check_precision(config)
    _check_mtp(config)
    if config.runtime.spec == "portable":
        check_spec_support(config, "portable")
    _check_sharding(config)
    _check_muon(config, dp * layout.context_parallel)  # the layer-wise optimizer shards over DP x CP
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


def _check_emerging_layout(config: ExperimentConfig, dp_cp: int) -> None:
    """Muon and Lion are Megatron-Core 0.19.2's emerging optimizers (`_get_megatron_emerging_optimizer`):
    what that path cannot run, refused in one line before any process group."""
    opt = config.optimizer
    name, sharding = opt.name, data_parallel_sharding(config)
    if sharding in ("zero2", "zero3"):
        # Tried with Lion (elementwise, so it could run on FSDP shards): bf16 fails at the first
        # step ("'DTensor' object has no attribute 'main_grad'"); fp32 runs, but zero2's third loss
        # was 8.3308 where one rank's is 8.3190 (scratch run, tiny-llama, 3 steps).
        raise ConfigError(f"optimizer.name={name} with parallel.sharding={sharding} (Megatron-FSDP): Megatron-Core "
                          f"0.19 runs {name.title()} with DDP only; use parallel.sharding=zero1 or none")
    if sharding == "zero1" and dp_cp > 1 and config.runtime.dtype == "fp32":
        # LayerWiseDistributedOptimizer.__init__ wraps its torch optimizers for bf16 only (fp32:
        # "'TensorParallelMuon' object has no attribute 'prepare_grads'" at the first step), and
        # neither fp32 wrapper's state dict is one its sharded_state_dict can save.
        raise ConfigError(f"optimizer.name={name} with the distributed optimizer at DP x CP={dp_cp} needs "
                          "runtime.dtype=bf16 (Megatron-Core 0.19.2's layer-wise distributed optimizer cannot step "
                          "or save fp32 parameters); or set optimizer.distributed=false")
    if opt.cpu_offload:
        raise ConfigError(f"optimizer.name={name} with optimizer.cpu_offload=true: Megatron-Core's offloaded "
                          "optimizer is Adam only; remove optimizer.cpu_offload")
    if config.runtime.dtype == "fp16":
        raise ConfigError(f"optimizer.name={name} with runtime.dtype=fp16: Megatron-Core refuses emerging "
                          "optimizers with fp16 loss scaling; use runtime.dtype=bf16 or fp32")


def _check_muon(config: ExperimentConfig, dp_cp: int) -> None:
    """What Megatron-Core 0.19.2's Muon (optimizer/emerging_optimizers.py) cannot run, refused
    in one line before any process group."""
    opt = config.optimizer
    if opt.name == "lion":
        _check_emerging_layout(config, dp_cp)
    if opt.name != "muon":
        return
    if config.model.use_mup:
        # get_mup_config_overrides leaves Muon's matrices to Muon's own scale_mode: only the
        # init and multipliers would be muP, the update size of the hidden matrices would not.
        raise ConfigError("model.use_mup=true with optimizer.name=muon: Megatron-Core 0.19's muP LR rule skips "
                          "Muon-managed matrices (Muon's scale_mode sizes their updates), so muP would be half "
                          "applied; use optimizer.name=adamw with muP, or model.use_mup=false with Muon")
    _check_emerging_layout(config, dp_cp)
    muon = opt.muon
    lr = muon.adamw_lr if muon.adamw_lr is not None else opt.lr
    min_lr = muon.adamw_min_lr if muon.adamw_min_lr is not None else opt.min_lr
    if min_lr > lr:
        raise ConfigError(f"the AdamW parameters' min LR {min_lr} exceeds their LR {lr} "
                          "(optimizer.muon.adamw_min_lr / adamw_lr, else optimizer.min_lr / lr)")


def muon_available() -> bool:
    """Megatron-Core's Muon needs NVIDIA's emerging_optimizers (>= 0.2), an optional package."""
    import importlib.util

    return importlib.util.find_spec("emerging_optimizers") is not None


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


def _check_mtp(config: ExperimentConfig) -> None:
    """Multi-token prediction (model.mtp_num_layers) where this stack runs it: Megatron-Core 0.19
    puts every MTP layer on the last pipeline stage (its last virtual stage under VPP; no custom
    pipeline layout here), so TP/SP, PP, VPP, EP and DP all work; what is refused is what its
    token shift (roll_tensor) or our tests do not cover."""
    model, layout, data = config.model, config.parallel, config.data
    if not model.mtp_num_layers:
        return
    if data.reset_attention_mask or data.reset_position_ids:
        # MTP shifts the sequence by one token per layer across document boundaries; the portable
        # spec drops the predictions that cross one, per depth (models.documents.mtp_depth_loss_masks,
        # through pretrain/megatron_fixes/mtp.py), from the document ids, which reset_attention_mask
        # brings. The te spec: check_document_masking.
        if not data.reset_attention_mask:
            raise ConfigError(
                f"model.mtp_num_layers={model.mtp_num_layers} with document masking needs "
                "data.reset_attention_mask=true (got reset_attention_mask=false); or set model.mtp_num_layers=0")
    if layout.context_parallel > 1:
        raise ConfigError(f"model.mtp_num_layers at context_parallel={layout.context_parallel} is not supported here "
                          "(untested); MTP runs with TP/SP, PP/VPP, EP and DP: set parallel.context_parallel=1")


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
    if config.model.mtp_num_layers:
        raise ConfigError("model.mtp_num_layers with document masking on the te spec is untested here (its THD "
                          "path shifts MTP per document); use runtime.spec=portable, or model.mtp_num_layers=0")
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
    if config.model.multi_latent_attention:
        _check_portable_mla(config)
    if runtime.moe_grouped_gemm and config.model.is_moe:
        raise ConfigError("runtime.moe_grouped_gemm=true needs the Transformer Engine spec (TE's grouped "
                          "GEMM); set runtime.spec=te on GPU, or runtime.moe_grouped_gemm=false")


def _check_portable_mla(config: ExperimentConfig) -> None:
    """What models.mla's portable MLA does not run (Transformer Engine's MLA does)."""
    if config.parallel.context_parallel > 1:
        raise ConfigError(f"multi_latent_attention at context_parallel={config.parallel.context_parallel} needs the "
                          "Transformer Engine spec (runtime.spec=te on a GPU); the portable spec's MLA runs at CP 1")


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
        # corrupted the heap now and then (an asynchronous coalesced all-gather crashed with
        # heap corruption in 2 of 53 runs on CPU, 0 of 25 with coalescing off). GPU (NCCL) only.
        problems += [f"optimizer.{key}=true needs a GPU (NCCL); remove it on this machine"
                     for key in ("overlap_grad_reduce", "overlap_param_gather") if getattr(opt, key)]
        if opt.cpu_offload:
            problems.append("optimizer.cpu_offload=true moves optimizer state from GPU to host memory "
                            "(Megatron's HybridDeviceOptimizer: pinned memory, CUDA streams); this machine "
                            "has no GPU and the state is in host memory already: remove it")
    if opt.name in ("muon", "lion") and not muon_available():
        problems.append(f"optimizer.name={opt.name} needs NVIDIA's emerging-optimizers package (Megatron-Core 0.19 "
                        "imports Muon and Lion from it), not installed here: pip install emerging-optimizers==0.3.0")
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
        check_split_documents,
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
        check_split_documents(blend=blend, mock=data.mock, split=data.split, vocab_size=tokenizer.vocab_size)
    except DatasetConfigError as exc:
        raise ConfigError(f"data.{exc}") from None
    try:
        check_sample_budget(blend=blend, mock=data.mock, split=data.split, seq_length=sched.seq_length,
                            num_samples=sample_counts(config), vocab_size=tokenizer.vocab_size)
    except DatasetConfigError as exc:
        raise ConfigError(f"schedule.train_steps={sched.train_steps} x global_batch_size="
                          f"{sched.global_batch_size} asks too much of the data: {exc}; lower "
                          "schedule.train_steps or add data") from None
    if not data.mock:
        _check_heldout_fits(config, blend)
    return tokenizer


def _check_heldout_fits(config: ExperimentConfig, blend) -> None:
    """schedule.final_eval_steps reads each held-out sample once: a request the validation
    split cannot give without Megatron repeating its documents would count some twice, and the
    standard error, which assumes independent batches, would be understated."""
    from data_pipeline.datasets import one_epoch_samples

    sched = config.schedule
    asked = sched.final_eval_steps * sched.global_batch_size
    if not asked:
        return
    fits, prefix, tokens = one_epoch_samples(blend=blend, split=config.data.split, seq_length=sched.seq_length,
                                             part=1)
    if asked > fits:
        raise ConfigError(
            f"schedule.final_eval_steps={sched.final_eval_steps} x global_batch_size={sched.global_batch_size} "
            f"asks {asked:,} held-out samples of {sched.seq_length} tokens, but the validation split of {prefix} "
            f"holds {tokens:,} tokens ({fits:,} samples before its documents repeat); set "
            f"schedule.final_eval_steps<={fits // sched.global_batch_size} or give the validation split more "
            "documents (data.split's middle part, or more data)")


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

"""The planner's search: which parallel layouts of a config fit a cluster, fastest first.

Enumerates TP (inside a node), PP (even stages, the embedding and loss counted in the split, or
lighter first / last stages: `uneven_splits`), VPP, CP, EP, DP, micro batch, recompute, the ZeRO stage
(0 none, 1 Megatron's distributed optimizer, 2 / 3 Megatron-FSDP), HSDP replicas and
optimizer CPU offload; keeps the combinations the training would accept
(`pretrain.config.validate_for_world`); drops those whose memory (launch.planner.memory) exceeds
the GPU, saying by how much and which terms; ranks the rest by estimated time per step
(launch.planner.throughput). The command line is `launch.planner.cli` (`python -m launch.plan`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from typing import Iterator, Optional, Sequence

from launch.planner.candidate import Candidate
from launch.planner.devices import Device
from launch.planner.memory import GIB, MemoryBreakdown, MemoryOptions, peak_memory
from launch.planner.throughput import StepEstimate, ThroughputOptions, estimate_step
from models.config import divisors
from models.layout import ZERO_STAGES, LayoutError, ParallelLayout, pipeline_split, validate_layout
from models.runtime import RECOMPUTE_CHOICES
from pretrain.config import ConfigError, ExperimentConfig, check_document_masking, validate_beyond_layout


class PlanError(ValueError):
    """No plan is possible; the message says what would make one possible."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Values to try; None = every value the model and world size allow."""

    tp: Optional[Sequence[int]] = None
    pp: Optional[Sequence[int]] = None
    vpp: Optional[Sequence[int]] = None  # 1 = no interleaving
    cp: Optional[Sequence[int]] = None
    ep: Optional[Sequence[int]] = None
    micro_batch: Sequence[int] = (1, 2, 4, 8)
    recompute: Sequence[str] = RECOMPUTE_CHOICES
    zero: Sequence[int] = ZERO_STAGES
    # HSDP replica counts to try with ZeRO-2/3 (1 = plain sharding); None = 1 and every
    # divisor of DP above 1.
    hsdp: Optional[Sequence[int]] = None
    offload: Sequence[bool] = (False, True)
    max_cp: int = 8
    # Also try first / last pipeline stages lighter than the middle ones (`uneven_splits`).
    uneven_stages: bool = True
    # Mean tokens per document, with data.reset_attention_mask (None: no masking estimate).
    document_length: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    memory: MemoryBreakdown
    estimate: Optional[StepEstimate]  # None when it does not fit

    @property
    def fits(self) -> bool:
        return self.estimate is not None

    def reason(self, device: Device) -> str:
        """Why it was dropped ('' when it fits)."""
        if self.fits:
            return ""
        m = self.memory
        if m.total > device.memory_bytes:
            return (f"needs {m.total / GIB:.1f} GiB per GPU, {(m.total - device.memory_bytes) / GIB:.1f} GiB "
                    f"more than the {device.memory_gib:.1f} GiB of {device.name}: {m.describe()}")
        return (f"offloaded optimizer needs {m.host / GIB:.1f} GiB of host memory per GPU, more than the "
                f"{device.host_memory_gib:.0f} GiB of a {device.name} node's share")


@dataclasses.dataclass(frozen=True)
class Plan:
    config: ExperimentConfig
    world_size: int
    device: Device
    ranked: list[Evaluation]  # fitting, fastest first
    dropped: list[Evaluation]  # valid but too large, closest to fitting first
    invalid: int  # combinations the training would reject (divisibility, batch arithmetic)

    @property
    def best(self) -> Evaluation:
        return self.ranked[0]


def check_world(world_size: int, device: Device) -> None:
    """TP groups must stay inside a node (NVLink), so a multi-node job needs whole nodes."""
    node = device.gpus_per_node
    if world_size < 1:
        raise PlanError(f"--gpus must be positive, got {world_size}")
    if world_size > node and world_size % node:
        lower, upper = world_size // node * node, (world_size // node + 1) * node
        raise PlanError(
            f"{world_size} GPUs is not a whole number of {device.name} nodes ({node} GPUs each): "
            f"tensor-parallel groups must stay inside a node; use {lower} or {upper} GPUs"
        )


def _pick(values: Optional[Sequence[int]], allowed: list[int]) -> list[int]:
    return allowed if values is None else [v for v in allowed if v in values]


def _layouts(config: ExperimentConfig, world: int, device: Device, space: SearchSpace) -> Iterator[dict]:
    """Raw (tp, pp, vpp, cp, ep, pipeline split keys) combinations whose product divides the world size."""
    m, seq = config.model, config.schedule.seq_length
    # TP inside one NVLink domain (a node; a GB200 NVL72 rack, whose groups must not straddle racks).
    nvl = device.nvlink_gpus
    tps = [d for d in divisors(world) if d <= nvl and (world <= nvl or nvl % d == 0)]
    for tp in _pick(space.tp, tps):
        for pp, vpp, pipeline in _pipeline_options(m.num_layers, divisors(world // tp), space):
            cps = [c for c in divisors(world // (tp * pp))
                   if c <= space.max_cp and c & (c - 1) == 0 and seq % (2 * c) == 0]
            for cp in _pick(space.cp, cps):
                eps = [1]
                if m.is_moe:
                    eps = [e for e in divisors(m.num_experts) if (world // pp // tp) % e == 0]
                for ep in _pick(space.ep, eps):
                    yield dict(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, pipeline=pipeline)


def _pipeline_options(num_layers: int, pps: list[int], space: SearchSpace) -> Iterator[tuple[int, int, dict]]:
    """(PP, VPP, the layout's pipeline-split keys) the training accepts: an even split of L
    layers; of L + 2 with the embedding and the loss each in a layer's slot (how Megatron-
    Bridge runs Llama-3.1 405B's 126 layers at PP8 x VPP8); or first / last stages lighter than
    evenly split middle stages (`uneven_splits`: DeepSeek-V3's 61 = 3 + 14 x 4 + 2 at PP16)."""
    for pp in _pick(space.pp, pps):
        for split in ((False, True) if pp > 1 else (False,)):
            slots = num_layers + 2 * split
            if slots % pp:
                continue
            vpps = [1] + ([v for v in divisors(slots // pp) if v > 1] if pp > 1 else [])
            for vpp in _pick(space.vpp, vpps):
                if not split or (slots // (pp * vpp)) > 1:  # no model chunk without a layer
                    yield pp, vpp, dict(account_for_embedding_in_pipeline_split=split,
                                        account_for_loss_in_pipeline_split=split)
        for first, last, vpps in uneven_splits(num_layers, pp) if space.uneven_stages else ():
            for vpp in _pick(space.vpp, vpps):
                yield pp, vpp, dict(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)


# First / last pipeline stages at most this many layers lighter than the middle ones: the
# embedding (first stage, which also keeps the most microbatches in flight) and the output
# layer + loss (last stage: 1.2 layers of llama3-70b's time in BF16, ~2 when its layers run in FP8)
# are worth about a layer or two.
LIGHTER_EDGES = 2


def uneven_splits(num_layers: int, pp: int) -> list[tuple[Optional[int], Optional[int], list[int]]]:
    """(num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage, the VPP sizes
    it allows) the search tries at PP `pp`, each stage edge None when it holds the middle
    stages' share. Two families, both with the middle stages split evenly and neither edge
    heavier than them: (a) each edge 0 to LIGHTER_EDGES layers lighter (not both 0: that is the
    even split); (b) when L does not divide by PP, every split at the fewest layers per middle
    stage, ceil(L / PP) (61 at PP16: 4 | 14 x 4 | 1, 3 | .. | 2, 2 | .. | 3, 1 | .. | 4). PP2 has
    no middle: one edge is lighter than the other. Whether a split is valid is
    models.layout.pipeline_split's call; VPP must divide every stage's count."""
    if pp < 2:
        return []
    fewest = -(-num_layers // pp)
    found = []
    for middle in range(fewest, (num_layers + 2 * LIGHTER_EDGES) // pp + 1):
        lighter = pp * middle - num_layers  # the two edges' layers below the middle share, together
        for a in range(max(0, lighter - middle + 1), min(lighter, middle - 1) + 1):
            b = lighter - a
            balance = max(a, b) <= LIGHTER_EDGES
            indivisible = num_layers % pp and middle == fewest
            if not lighter or not (balance or indivisible) or (pp == 2 and min(a, b)):
                continue
            first, last = (middle - a if a else None), (middle - b if b else None)
            counts = _stage_counts(num_layers, pp, first, last, 1)
            if counts is None:
                continue
            vpps = [1] + [v for v in divisors(math.gcd(*counts)) if v > 1
                          and _stage_counts(num_layers, pp, first, last, v) is not None]
            found.append((first, last, vpps))
    return found


def _stage_counts(num_layers: int, pp: int, first: Optional[int], last: Optional[int], vpp: int
                  ) -> Optional[list[int]]:
    """Layers per pipeline stage as the training splits them, or None when it refuses the split."""
    layout = ParallelLayout(pipeline_parallel=pp, virtual_pipeline=vpp if vpp > 1 else None,
                            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    try:
        return [sum(chunks) for chunks in pipeline_split(num_layers, layout)]
    except LayoutError:
        return None


def _sharding_options(space: SearchSpace, dp: int, shards: int) -> list[tuple[int, int, bool]]:
    """(ZeRO stage, HSDP replicas, offload) triples to try at data-parallel size `dp`, when
    sharded state is split over `shards` ranks at most. With nothing to shard over (one rank)
    the stages differ only in overheads, so only the one nearest ZeRO-1 is tried."""
    replicas = [1] + [r for r in divisors(dp) if r > 1]
    zeros = space.zero if shards > 1 else [min(space.zero, key=lambda z: abs(z - 1))]
    options = []
    for zero in zeros:
        for r in _pick(space.hsdp, replicas if zero >= 2 else [1]):
            options += [(zero, r, offload) for offload in space.offload]
    return options


def enumerate_candidates(config: ExperimentConfig, world: int, device: Device, space: SearchSpace,
                         refusals: Optional[Counter] = None) -> tuple[list[Candidate], int]:
    """Every combination the training accepts, and how many it would reject (with `refusals`,
    each of the training's refusal messages counted there)."""
    base = Candidate.from_config(config, world, document_length=space.document_length)
    valid, invalid = [], 0
    for lay in _layouts(config, world, device, space):
        layout = ParallelLayout(
            tensor_parallel=lay["tp"], pipeline_parallel=lay["pp"],
            virtual_pipeline=lay["vpp"] if lay["vpp"] > 1 else None, context_parallel=lay["cp"],
            expert_parallel=lay["ep"], sequence_parallel=lay["tp"] > 1,
            **lay["pipeline"],
        )
        shards = max(world // (lay["tp"] * lay["pp"]), layout.expert_data_parallel(world))
        sharding = _sharding_options(space, layout.data_parallel(world), shards)
        layout_errors: dict[tuple[int, int], Optional[str]] = {}
        for mbs in space.micro_batch:
            for recompute in space.recompute:
                for zero, replicas, offload in sharding:
                    cand = dataclasses.replace(base, layout=layout, micro_batch=mbs, recompute=recompute,
                                               zero=zero, hsdp_replicas=replicas, offload=offload)
                    # validate_for_world checks the layout first, and the layout's verdict does not
                    # depend on the batch, recompute or offload: asked once per sharding, it skips
                    # building and validating the configs it refuses anyway (ZeRO-2/3 at PP > 1
                    # were 408k of deepseek-v3's 540k combinations on 1024 GPUs), same messages;
                    # the layouts it passes get only the checks after the layout's.
                    if (zero, replicas) not in layout_errors:
                        layout_errors[zero, replicas] = _layout_error(cand)
                    if layout_errors[zero, replicas] is not None:
                        invalid += 1
                        if refusals is not None:
                            refusals[layout_errors[zero, replicas]] += 1
                        continue
                    try:
                        chosen = cand.apply_to(config)
                        validate_beyond_layout(chosen, world)
                        # What the spec the plan assumes (te with flash attention) can mask.
                        check_document_masking(chosen, "te" if cand.flash_attention else "portable")
                    except ConfigError as exc:
                        invalid += 1
                        if refusals is not None:
                            refusals[str(exc)] += 1
                        continue
                    valid.append(cand)
    return valid, invalid


def _layout_error(c: Candidate) -> Optional[str]:
    """The message validate_for_world would refuse `c`'s layout with (its first check), or None."""
    try:
        validate_layout(c.model, c.sharded_layout, c.world_size)
    except LayoutError as exc:
        return str(exc)
    return None


def evaluate(c: Candidate, device: Device, mem: MemoryOptions, tput: ThroughputOptions) -> Evaluation:
    memory = peak_memory(c, mem)
    fits = memory.total <= device.memory_bytes and memory.host <= device.host_memory_bytes
    return Evaluation(candidate=c, memory=memory, estimate=estimate_step(c, device, tput) if fits else None)


def _rank_key(e: Evaluation) -> tuple[float, float]:
    """Estimated step time to 3 significant digits, then memory: the model cannot tell
    layouts apart by 0.1%, so among those the one with more headroom ranks first."""
    return float(f"{e.estimate.step_s:.3g}"), e.memory.total


def rank_layouts(config: ExperimentConfig, *, world_size: int, device: Device, space: SearchSpace,
                 memory_options: MemoryOptions, throughput_options: ThroughputOptions) -> Plan:
    """Every valid layout evaluated and sorted; `ranked` may be empty (see `plan`)."""
    check_world(world_size, device)
    refusals = Counter()
    candidates, invalid = enumerate_candidates(config, world_size, device, space, refusals)
    if not candidates:
        raise PlanError(no_valid_layout_message(config, world_size, space, refusals))
    evaluated = [evaluate(c, device, memory_options, throughput_options) for c in candidates]
    ranked = sorted((e for e in evaluated if e.fits), key=_rank_key)
    dropped = sorted((e for e in evaluated if not e.fits), key=lambda e: e.memory.total)
    return Plan(config=config, world_size=world_size, device=device, ranked=ranked, dropped=dropped,
                invalid=invalid)


def plan(config: ExperimentConfig, *, world_size: int, device: Device, space: SearchSpace = SearchSpace(),
         memory_options: MemoryOptions = MemoryOptions(),
         throughput_options: ThroughputOptions = ThroughputOptions()) -> Plan:
    """Rank every valid layout of `config` on `world_size` x `device`; PlanError if none
    fits, saying what would."""
    result = rank_layouts(config, world_size=world_size, device=device, space=space,
                          memory_options=memory_options, throughput_options=throughput_options)
    if not result.ranked:
        raise PlanError(no_fit_message(result, space, memory_options, throughput_options))
    return result


def no_valid_layout_message(config: ExperimentConfig, world: int, space: SearchSpace, refusals: Counter) -> str:
    """Why the training refuses every combination tried: the pipeline split when no PP asked for
    splits the layers, else the training's most frequent refusal (numbers aside), verbatim."""
    head = f"no parallel layout of {config.name} is valid on {world} GPUs"
    if not refusals:  # nothing reached the training's validation
        layers = config.model.num_layers
        asked = _pick(space.pp, divisors(world))
        if any(_pipeline_options(layers, asked, space)):
            return f"{head}: no combination of the --tp, --pp, --cp and --ep sizes asked for divides {world}"
        # What would work: the PP sizes that split it at the VPP asked for, else without --vpp.
        for hint, anywhere in (("", dataclasses.replace(space, pp=None)),
                               (" without --vpp", dataclasses.replace(space, pp=None, vpp=None))):
            working = [pp for pp in divisors(world) if any(_pipeline_options(layers, [pp], anywhere))]
            if working:
                break
        vpp = f" x VPP {list(space.vpp)}" if space.vpp else ""
        return (f"{head}: num_layers={layers} splits over none of PP {asked}{vpp}: not evenly, not with the embedding "
                f"and loss counted ({layers} + 2), and no first/last stage split (each at most {LIGHTER_EDGES} layers "
                f"lighter than the evenly split middle stages, or any at ceil(L / PP) per middle stage) is valid; "
                f"PP that split it on {world} GPUs{hint}: {working}")
    kinds, examples = Counter(), {}
    for message, count in refusals.items():
        kind = re.sub(r"\d+", "N", message)
        kinds[kind] += count
        examples.setdefault(kind, message)
    kind, count = kinds.most_common(1)[0]
    text = (f"{head}: the training refuses all {sum(kinds.values())} combinations tried, most often ({count}) with: "
            f"{examples[kind]}")
    if any(m.startswith("schedule.global_batch_size=") for m in refusals):
        text += (f"; the global batch must be a multiple of micro batch x DP: try --global-batch "
                 f"{_round_up(config.schedule.global_batch_size, world)} or a GPU count that divides it")
    return text


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def no_fit_message(result: Plan, space: SearchSpace, mem: MemoryOptions, tput: ThroughputOptions) -> str:
    """Why nothing fits (the closest miss, per term) and which changes would make it fit."""
    closest = result.dropped[0]
    limit = result.device.memory_bytes
    lines = [
        f"no layout of {result.config.name} fits {result.world_size} x {result.device.name} "
        f"({limit / GIB:.1f} GiB each); {len(result.dropped)} valid layouts tried.",
        f"closest: {closest.candidate.describe()} needs {closest.memory.describe()}, "
        f"{(closest.memory.total - limit) / GIB:.1f} GiB too much.",
        "would fit:",
    ]
    lines += [f"  - {fix}" for fix in suggest_fixes(result, space, mem, tput)] or [
        "  - nothing tried (more GPUs up to 64x, full recompute, micro batch 1, half the sequence); "
        "use a larger GPU (--gpu h200) or a smaller model"
    ]
    return "\n".join(lines)


def suggest_fixes(result: Plan, space: SearchSpace, mem: MemoryOptions, tput: ThroughputOptions) -> list[str]:
    """Re-plan with one change at a time and report those that produce a fitting layout."""
    config, world, device = result.config, result.world_size, result.device
    fixes = []

    def fits(cfg: ExperimentConfig, gpus: int, sp: SearchSpace) -> Optional[Evaluation]:
        try:
            ranked = rank_layouts(cfg, world_size=gpus, device=device, space=sp, memory_options=mem,
                                  throughput_options=tput).ranked
        except PlanError:  # no valid layout at all there (batch arithmetic)
            return None
        return ranked[0] if ranked else None

    node = device.gpus_per_node
    for factor in (2, 4, 8, 16, 32, 64):
        gpus = _round_up(world * factor, node) if world * factor > node else world * factor
        best = fits(config, gpus, space)
        if best:
            fixes.append(f"more GPUs: {gpus} (best there: {best.candidate.describe()}, "
                         f"{best.memory.total / GIB:.1f} GiB)")
            break
    if "full" not in space.recompute:
        best = fits(config, world, dataclasses.replace(space, recompute=(*space.recompute, "full")))
        if best:
            fixes.append(f"recompute: allow full recompute (--recompute ... full): {best.candidate.describe()}")
    if 1 not in space.micro_batch:
        best = fits(config, world, dataclasses.replace(space, micro_batch=(1, *space.micro_batch)))
        if best:
            fixes.append(f"smaller micro batch: --micro-batch 1: {best.candidate.describe()}")
    seq = config.schedule.seq_length
    if seq >= 256:
        shorter = config.model_copy(update=dict(schedule=config.schedule.model_copy(update=dict(seq_length=seq // 2))))
        best = fits(shorter, world, space)
        if best:
            fixes.append(f"shorter sequence: --seq {seq // 2}: {best.candidate.describe()}")
    return fixes

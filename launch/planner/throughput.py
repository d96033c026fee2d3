"""Time per training step for a candidate on a device: compute, pipeline bubble, and the
communication of every parallel dimension.

FLOPs come from `models.flops` (the formula the training metrics use for TFLOP/s and
MFU). Compute time = FLOPs / (peak x achievable fraction). Collectives use ring formulas
over the link the group spans (NVLink inside a node, InfiniBand across nodes):
  all-reduce     2 (n-1)/n x B / bw
  reduce-scatter (n-1)/n x B / bw   (B = the full, unsharded tensor)
  all-gather     (n-1)/n x B / bw
Each communication time is multiplied by (1 - overlap) for its kind: the part not hidden
behind compute. Latency terms are ignored (messages here are MBs to GBs).

Step = t_mb x (M + (p-1)/v) + PP send/recv + DP gradient sync + offload, where t_mb is the
slowest pipeline stage's time for one microbatch (compute + TP + CP + EP + ZeRO-2/3
gathers and reduce-scatters), M microbatches, and (p-1)/v the interleaved-1F1B bubble in
units of t_mb. Sharded data parallelism (ZeRO-2/3, Megatron-FSDP) communicates inside every
microbatch (zero_comm_s); HSDP keeps that inside a shard group and adds one all-reduce
across the replicas per step (dp_comm_s); optimizer CPU offload adds PCIe copies and the CPU
optimizer step (offload_s). Muon (optimizer.name=muon) adds its Newton-Schulz GEMMs once per
step (optimizer_s) and, in its TP modes that communicate, their all-gathers / all-reduces
over TP (comm "muon"; launch.planner.muon has the formulas).
"""

from __future__ import annotations

import dataclasses

from launch.planner.candidate import Candidate
from launch.planner.devices import Device
from launch.planner import muon as _muon
from launch.planner.efficiency import DEFAULT_EFFICIENCIES, Efficiencies
from launch.planner.gemms import linear_gemm_factor
from launch.planner.layers import mixed_layers, moe_layers_on_stage, stage_layer_kinds
from launch.planner.memory import edge_stages, host_bytes, params_on_rank
from models.flops import forward_flops_per_token, mtp_layer_is_moe, training_flops_per_step


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThroughputOptions:
    # Per kind of work and precision (launch.planner.efficiency): fitted to measured runs.
    efficiencies: Efficiencies = DEFAULT_EFFICIENCIES
    # One fraction of peak for all FLOPs (no element-wise term): the old model, kept for
    # --efficiency and the unit tests' round numbers; None = use `efficiencies`.
    efficiency: float | None = None
    # Fraction of the link bandwidth NCCL reaches (bus bandwidth / link bandwidth).
    bus_efficiency: float = 0.8
    # Fraction of each communication hidden behind compute. Defaults follow what our
    # wrap/build configure: no TP-comm overlap, no overlap_grad_reduce, blocking EP
    # all-to-all and PP send/recv; Transformer Engine's ring attention prefetches the next
    # KV block while computing on the current one, so CP is mostly hidden.
    tp_overlap: float = 0.0
    cp_overlap: float = 0.8
    ep_overlap: float = 0.0
    pp_overlap: float = 0.0
    dp_overlap: float = 0.0
    # Megatron-FSDP turns on overlap_param_gather / overlap_grad_reduce itself for ZeRO-2/3
    # (megatron_fsdp.py, MegatronFSDP.__init__) and prefetches the next unit's parameters
    # while the current one computes; the first gather and the last reduce-scatter of a
    # pass stay exposed. Never more is hidden than the microbatch's compute.
    zero_overlap: float = 0.8
    # Megatron's HybridDeviceOptimizer copies gradients down, steps on the CPU and copies
    # parameters up between backward and the next forward: nothing to hide behind.
    offload_overlap: float = 0.0
    # Fraction of host DRAM bandwidth the CPU Adam step reaches (memory bound; multi-threaded
    # CPU Adam implementations reach about half the socket's bandwidth).
    host_efficiency: float = 0.5

    def __post_init__(self) -> None:
        # An efficiency of 0 divided by zero; 5 reported 461% MFU; an overlap above 1 hid
        # more communication than there is.
        for name in ("efficiency", "bus_efficiency"):
            if getattr(self, name) is not None and not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name):g} must be a fraction in (0, 1]")
        for kind in ("tp", "cp", "ep", "pp", "dp"):
            if not 0 <= getattr(self, f"{kind}_overlap") <= 1:
                raise ValueError(f"--overlap {kind}={getattr(self, f'{kind}_overlap'):g} must be a fraction "
                                 "in [0, 1]")


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    step_s: float
    compute_s: float  # M x slowest stage's compute per microbatch
    bubble_s: float
    comm_s: dict[str, float]  # exposed seconds per step, by kind (tp, cp, ep, zero, pp, dp, offload, muon)
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (as in metrics.jsonl), not counting recompute
    mfu: float
    optimizer_s: float = 0.0  # Muon's Newton-Schulz GEMMs per step (0 for AdamW)

    @property
    def exposed_comm_s(self) -> float:
        return sum(self.comm_s.values())


def layer_and_logit_flops(c: Candidate) -> tuple[float, float]:
    """Forward FLOPs per token of one layer (X) and of the logits (Y), read off
    models.flops.forward_flops_per_token F(L) = L X + Y: X = F(2) - F(1), Y = F(1) - X."""
    fraction = _attention_fraction(c)
    one = forward_flops_per_token(c.model.model_copy(update={"num_layers": 1}), c.seq_length, attention_fraction=fraction)
    two = forward_flops_per_token(c.model.model_copy(update={"num_layers": 2}), c.seq_length, attention_fraction=fraction)
    return two - one, 2 * one - two


def _attention_fraction(c: Candidate) -> float:
    """The attention work that runs: document masking saves it only where the kernel skips
    masked blocks (flash/fused attention, te spec); the portable spec computes every score."""
    return c.attention_fraction if c.flash_attention else 1.0


def recompute_flops_per_layer(c: Candidate) -> float:
    """Extra forward FLOPs per token per layer spent recomputing: full -> the whole layer
    (X); selective -> core attention, the part of F that grows with s:
    (F(s) - F(0)) / L; none -> 0."""
    if c.recompute == "full":
        return layer_and_logit_flops(c)[0]
    if c.recompute == "selective":
        m = c.model
        fraction = _attention_fraction(c)
        return (forward_flops_per_token(m, c.seq_length, attention_fraction=fraction)
                - forward_flops_per_token(m, 0)) / m.num_layers
    return 0.0


def core_attention_flops(c: Candidate) -> float:
    """Forward FLOPs per token per layer of the attention core (Q K^T and A V), the part of X
    that grows with s: (F(s) - F(0)) / L."""
    m = c.model
    return (forward_flops_per_token(m, c.seq_length, attention_fraction=_attention_fraction(c))
            - forward_flops_per_token(m, 0)) / m.num_layers


def elementwise_bytes_per_token(c: Candidate) -> float:
    """HBM bytes per token per layer that the forward's element-wise kernels move (e bytes per
    element): 2 norms read + write h (4 e h), 2 residual adds read 2 write 1 (6 e h), the
    activation function reads 2f writes f if gated (else reads and writes f), RoPE reads and
    writes Q and K (2 e (n + g) d); with FP8 each linear input is read in e and written in one
    byte: (e + 1) (2h + n d + f). MoE (moe_dispatch_bytes_per_token): f is what a token's
    experts run, k f_e (+ the shared expert's f_s), plus the dispatch's own passes. Launch
    overheads are not modelled."""
    m, e = c.model, c.act_bytes
    h, nd = m.hidden_size, m.num_attention_heads * m.head_dim
    f = m.ffn_hidden_size
    if m.is_moe:
        f = m.moe_router_topk * m.expert_ffn_hidden_size + (m.moe_shared_expert_hidden_size or 0)
    total = 10 * e * h + (3 if m.gated else 2) * e * f
    if m.position_embedding == "rope":
        total += 2 * e * (nd + m.query_groups * m.head_dim)
    if c.fp8:
        total += (e + 1) * (2 * h + nd + f)
    return total + moe_dispatch_bytes_per_token(c)


def moe_dispatch_bytes_per_token(c: Candidate) -> float:
    """MoE's memory-bound dispatch per token per layer, forward (Megatron-Core's all-to-all
    dispatcher with fused permutation, moe_utils.permute / unpermute): the router's fp32
    logits, softmax and top-k read and write 4 E bytes three times (12 E); permute gathers the
    token's k copies (reads and writes k e h); unpermute reads them back and scatter-adds them
    into one row (k e h read, e h written): 12 E + (3k + 1) e h. 0 for dense models."""
    m = c.model
    if not m.is_moe:
        return 0.0
    return 12 * m.num_experts + (3 * m.moe_router_topk + 1) * c.act_bytes * m.hidden_size


def time_parts_per_token(c: Candidate, layers: float, last: bool, device: Device,
                         opts: ThroughputOptions) -> dict[str, float]:
    """Seconds per token (before dividing by TP x CP) for `layers` layers forward + backward
    (+ recompute), and on the last stage the logits and loss, by kind of work, each at its
    efficiency:
      gemm        linear GEMMs 3 (X - A) [+ recompute] at gemm(dtype, fp8) of the precision's peak,
                  times the narrow-GEMM factor of the layer's shapes (launch.planner.gemms),
      attention   the core 3 A [+ recompute] at `attention` of the BF16 peak (never FP8),
      elementwise 3 bytes [+1 forward under full recompute] at `memory` of HBM bandwidth,
      logits      3 Y at gemm_bf16 (Megatron's output layer is not a TE module: no FP8),
      loss        3 x 4 V bytes (fp32 logits written, read, gradient written).
    launch.gemm_benchmark measures the same parts on a GPU."""
    eff = opts.efficiencies
    layer, logits = layer_and_logit_flops(c)
    attention = core_attention_flops(c)
    passes = {"full": 4, "selective": 3, "none": 3}[c.recompute]
    attn_passes = 3 if c.recompute == "none" else 4
    bf16 = device.peak("bf16" if c.dtype != "fp32" else "fp32")
    hbm = device.hbm_gbps * 1e9 * eff.memory
    # Narrow GEMMs (small experts, expert TP, few tokens per expert) run below the fitted
    # efficiency, which describes layers >= 2048 wide (launch.planner.gemms).
    precision = "fp8" if c.fp8 else ("fp32" if c.dtype == "fp32" else "bf16")
    narrow = linear_gemm_factor(c, (layer - attention) * c.seq_length * c.micro_batch / (c.tp * c.cp), precision)
    return {
        "gemm": layers * passes * (layer - attention) / (device.peak(c.dtype, c.fp8)
                                                         * eff.gemm(c.dtype, c.fp8, c.fp8_recipe) * narrow),
        "attention": layers * attn_passes * attention / (bf16 * (eff.attention if c.dtype != "fp32" else eff.gemm_fp32)),
        "elementwise": layers * passes * elementwise_bytes_per_token(c) / hbm,
        "logits": 3 * logits / (bf16 * eff.gemm(c.dtype, False)) if last else 0.0,
        "loss": 12 * c.model.padded_vocab_size / hbm if last else 0.0,
    }


def _time_per_token(c: Candidate, layers: float, last: bool, device: Device, opts: ThroughputOptions) -> float:
    """The sum of time_parts_per_token."""
    return sum(time_parts_per_token(c, layers, last, device, opts).values())


def stage_compute_s(c: Candidate, stage: int, device: Device, opts: ThroughputOptions) -> float:
    """One microbatch through pipeline rank `stage`, forward + backward, s b / (t c) tokens:
    by kind of work (_time_per_token); with a single --efficiency, the old one-constant model
    s b [(L/p)(3 X + recompute) + (last stage) 3 Y] / (t c) / (peak x efficiency)."""
    if mixed_layers(c.model):
        return mixed_stage_compute_s(c, stage, device, opts)
    layers = c.layers_on_stage(stage)
    last = stage == c.pp - 1
    tokens = c.seq_length * c.micro_batch / (c.tp * c.cp)
    if opts.efficiency is None:
        return tokens * _time_per_token(c, layers, last, device, opts)
    layer, logits = layer_and_logit_flops(c)
    per_token = layers * (3 * layer + recompute_flops_per_layer(c))
    if last:
        per_token += 3 * logits
    return per_token * tokens / (device.peak(c.dtype, c.fp8) * opts.efficiency)


def layer_kind_candidate(c: Candidate, moe: bool) -> Candidate:
    """`c` with every layer of one kind: MoE (moe_layer_freq=1) or dense (no experts, the
    dense layers' ffn_hidden_size), so the one-kind formulas (layer_and_logit_flops,
    elementwise_bytes_per_token, which read models.flops) price that kind's layer."""
    update = {"moe_layer_freq": 1} if moe else {"num_experts": None, "moe_layer_freq": 1}
    return dataclasses.replace(c, model=c.model.model_copy(update=update))


def mixed_stage_compute_s(c: Candidate, stage: int, device: Device, opts: ThroughputOptions) -> float:
    """stage_compute_s of a model with dense layers among MoE ones (moe_layer_freq): each kind's
    layers on the stage at that kind's per-layer cost (layer_kind_candidate), the logits once
    on the last stage, priced with the kind of the multi-token prediction layers (they copy the
    decoder's last layer; models.flops counts them with the logits)."""
    last = stage == c.pp - 1
    tokens = c.seq_length * c.micro_batch / (c.tp * c.cp)
    logits_kind = mtp_layer_is_moe(c.model) if c.model.mtp_num_layers else False
    total = 0.0
    for layers, moe in stage_layer_kinds(c, stage):
        kind = layer_kind_candidate(c, moe)
        with_logits = last and moe == logits_kind
        if opts.efficiency is None:
            total += tokens * _time_per_token(kind, layers, with_logits, device, opts)
            continue
        layer, logits = layer_and_logit_flops(kind)
        per_token = layers * (3 * layer + recompute_flops_per_layer(kind)) + (3 * logits if with_logits else 0)
        total += per_token * tokens / (device.peak(c.dtype, c.fp8) * opts.efficiency)
    return total


def _max_moe_layers(c: Candidate) -> int:
    """MoE layers on the pipeline stage that holds the most (every stage's layers for a MoE
    model without dense layers)."""
    if not mixed_layers(c.model):
        return c.max_stage_layers
    return max(moe_layers_on_stage(c, s) for s in range(c.pp))


def _bandwidth(span: int, device: Device, opts: ThroughputOptions) -> float:
    """Bytes/s for a group whose ranks cover `span` consecutive ranks: NVLink if that fits
    in the NVLink domain (a node; a GB200 NVL72 rack), else InfiniBand."""
    gbps = device.intra_node_gbps if span <= device.nvlink_gpus else device.inter_node_gbps
    return gbps * 1e9 * opts.bus_efficiency


def _passes(c: Candidate) -> int:
    """Forward + backward (+ one more forward with full recompute)."""
    return 3 if c.recompute == "full" else 2


def tp_comm_s(c: Candidate, device: Device, opts: ThroughputOptions) -> float:
    """TP per microbatch on one stage: each layer does 2 all-reduces in forward and 2 in
    backward (with SP: all-gather + reduce-scatter pairs of the same volume), 2 more under
    full recompute; B = e (s/c) b h:  (L/p) x 2 x passes x 2 (t-1)/t x B / bw(TP)."""
    if c.tp == 1:
        return 0.0
    size = c.act_bytes * c.seq_length / c.cp * c.micro_batch * c.model.hidden_size
    per_allreduce = 2 * (c.tp - 1) / c.tp * size / _bandwidth(c.tp, device, opts)
    return c.max_stage_layers * 2 * _passes(c) * per_allreduce


def linear_gemm_s(c: Candidate, device: Device, opts: ThroughputOptions) -> tuple[float, ...]:
    """Forward GEMM seconds of a layer's four linear layers (QKV, attention projection, fc1,
    fc2) for one microbatch on one GPU: 2 (s/c) b K N / t FLOPs each (with sequence parallel
    the GEMM sees the all-gathered s/c tokens), at the linear GEMMs' efficiency."""
    m = c.model
    h, nd, kv = m.hidden_size, m.num_attention_heads * m.head_dim, 2 * m.query_groups * m.head_dim
    shapes = ((h, nd + kv), (nd, h), (h, (2 if m.gated else 1) * m.ffn_hidden_size), (m.ffn_hidden_size, h))
    eff = opts.efficiency if opts.efficiency is not None else opts.efficiencies.gemm(c.dtype, c.fp8, c.fp8_recipe)
    rate = device.peak(c.dtype, c.fp8) * eff
    tokens = c.seq_length / c.cp * c.micro_batch
    return tuple(2 * tokens * k * n / c.tp / rate for k, n in shapes)


def tp_exposed_s(c: Candidate, device: Device, opts: ThroughputOptions) -> float:
    """TP communication per microbatch on one stage left exposed by --overlap tp. Transformer
    Engine's userbuffers overlap pairs each all-gather / reduce-scatter with one GEMM (the
    configs of NeMo's tp_overlap_configs/userbuffers.py, used by Megatron-Bridge: ring-exchange
    AG with qkv_fprop and fc1_fprop, pipelined RS with proj_fprop and fc2_fprop; in backward
    with the dgrad/wgrad GEMMs), so a collective hides at most behind its GEMM: per layer and
    pass, sum over the four linears of max(C (1 - overlap), C - G_i), C = one AG or RS
    ((t-1)/t e (s/c) b h / bw), G_i the linear's forward GEMM (x2 in backward: dgrad + wgrad).
    TP comm grows with t per GPU while G_i shrinks as 1/t, so at TP8 the small QKV and
    projection GEMMs of a 70B no longer cover theirs. MoE layers (expert GEMMs under expert TP,
    not modelled per GEMM) keep the plain fraction."""
    raw = tp_comm_s(c, device, opts)
    if c.tp == 1 or c.model.is_moe:
        return raw * (1 - opts.tp_overlap)
    one = c.act_bytes * c.seq_length / c.cp * c.micro_batch * c.model.hidden_size * (c.tp - 1) / c.tp / _bandwidth(
        c.tp, device, opts)
    gemms = linear_gemm_s(c, device, opts)
    forward = sum(max(one * (1 - opts.tp_overlap), one - g) for g in gemms)
    backward = sum(max(one * (1 - opts.tp_overlap), one - 2 * g) for g in gemms)
    return c.max_stage_layers * ((_passes(c) - 1) * forward + backward)


def cp_comm_s(c: Candidate, device: Device, opts: ThroughputOptions) -> float:
    """CP ring attention per microbatch on one stage: forward passes the K,V block
    (2 e (s/c) b g d / t bytes; MLA: e (s/c) b mla_kv_channels / t) c-1 times, backward passes
    K,V and dK,dV (2 (c-1) blocks),
    full recompute one forward more: (L/p) x (c-1) x (1 + 2 [+1]) x KV / bw(TP x CP)."""
    if c.cp == 1:
        return 0.0
    m = c.model
    if m.multi_latent_attention:
        kv = c.act_bytes * (c.seq_length / c.cp) * c.micro_batch * mla_kv_channels(m) / c.tp
    else:
        kv = 2 * c.act_bytes * (c.seq_length / c.cp) * c.micro_batch * m.query_groups * m.head_dim / c.tp
    hops = (c.cp - 1) * (3 + (1 if c.recompute == "full" else 0))
    return c.max_stage_layers * hops * kv / _bandwidth(c.tp * c.cp, device, opts)


def mla_kv_channels(m) -> int:
    """Key + value channels per token that ring attention passes with MLA: its keys and values
    are per head after the up projection, n (dq + dr) + n dv."""
    return m.num_attention_heads * (m.q_head_dim + m.v_head_dim)


def ep_comm_s(c: Candidate, device: Device, opts: ThroughputOptions) -> float:
    """EP all-to-all per microbatch on one stage: dispatch + combine in forward and in
    backward (2 more under full recompute); each sends k e (s/c) b h / z bytes of routed
    tokens, (EP-1)/EP of them off-rank: (L/p) x 2 x passes x that / bw(ETP x EP)."""
    if c.ep == 1 or not c.model.is_moe:
        return 0.0
    z = c.tp if c.layout.sequence_parallel else 1
    m = c.model
    routed = m.moe_router_topk * c.act_bytes * (c.seq_length / c.cp) * c.micro_batch * m.hidden_size / z
    per_all_to_all = routed * (c.ep - 1) / c.ep / _bandwidth(c.etp * c.ep, device, opts)
    return _max_moe_layers(c) * 2 * _passes(c) * per_all_to_all


def pp_comm_s(c: Candidate, device: Device, opts: ThroughputOptions) -> float:
    """PP per step on one rank: every microbatch enters each of its v chunks once forward
    and once backward: 2 v M x e (s/c) b h / z bytes / bw (PP neighbours are world/p ranks
    apart: NVLink only when the whole job is one node)."""
    if c.pp == 1:
        return 0.0
    z = c.tp if c.layout.sequence_parallel else 1
    size = c.act_bytes * (c.seq_length / c.cp) * c.micro_batch * c.model.hidden_size / z
    return 2 * c.vpp * c.num_microbatches * size / _bandwidth(c.world_size, device, opts)


def pp_overlap(c: Candidate, opts: ThroughputOptions) -> float:
    """The share of PP send/recv hidden: only the interleaved schedule (VPP > 1) can overlap it
    (Megatron-Core's overlap_p2p_comm; its non-interleaved 1F1B raises "Non-interleaved pipeline
    parallelism does not support overlapping p2p communication", pipeline_parallel/schedules.py),
    so without VPP every send/recv is exposed whatever --overlap pp says."""
    return opts.pp_overlap if c.vpp > 1 else 0.0


def _worst_params(c: Candidate):
    return max((params_on_rank(c, s) for s in edge_stages(c)), key=lambda p: p.total)


def _shard_span(c: Candidate) -> int:
    """Consecutive ranks a ZeRO-2/3 shard group covers: TP x CP x DP / replicas (rank order
    tp-cp-ep-dp-pp; HSDP's shard groups are runs of consecutive DP ranks)."""
    return c.tp * c.dense_zero_shard


def dp_comm_s(c: Candidate, device: Device, opts: ThroughputOptions) -> float:
    """DP synchronisation once per step, on the rank with most parameters P (dense over
    d = DP x CP, expert over expert-DP; the group spans world/p ranks):
      ZeRO-0: all-reduce of the fp32 grads 2 (d-1)/d x 4 P;
      ZeRO-1: reduce-scatter (d-1)/d x 4 P + all-gather of the updated params (d-1)/d x e P;
              Muon's layer-wise optimizer: all-reduce 2 (d-1)/d x 4 P + that all-gather;
      ZeRO-2: all-gather of the updated params inside the shard group of s = d / r ranks,
              (s-1)/s x e P (its reduce-scatters are per microbatch: zero_comm_s);
      ZeRO-3: nothing here (parameters are gathered where they are used);
      HSDP (r > 1 replicas): + all-reduce of the sharded fp32 grads across the replicas,
              2 (r-1)/r x 4 P / s, over the whole DP span (InfiniBand across nodes)."""
    worst = _worst_params(c)
    if c.fsdp:
        total = 0.0
        if c.zero == 2:
            s = c.dense_zero_shard
            total += (s - 1) / s * worst.total * c.param_bytes / _bandwidth(_shard_span(c), device, opts)
        r = c.hsdp_replicas
        if r > 1:
            total += 2 * (r - 1) / r * c.grad_bytes * worst.total / c.dense_zero_shard / _bandwidth(
                c.world_size // c.pp, device, opts)
        return total
    bw = _bandwidth(c.world_size // c.pp, device, opts)
    total = 0.0
    for count, d in ((worst.dense, c.dense_shard), (worst.expert, c.expert_shard)):
        if d == 1 or count == 0:
            continue
        if (c.muon or c.lion) and _muon.layer_wise(c):
            # Megatron's layer-wise optimizer: DDP all-reduces the grads, then the updated
            # parameters are all-gathered.
            total += (2 * c.grad_bytes + c.param_bytes) * (d - 1) / d * count / bw
        elif c.distributed_optimizer:
            total += (d - 1) / d * count * (c.grad_bytes + c.param_bytes) / bw
        else:
            total += 2 * (d - 1) / d * count * c.grad_bytes / bw
    return total


def dp_exposed_s(dp_s: float, overlap: float, *, window_s: float) -> float:
    """The DP synchronisation left exposed: `overlap` of it hidden, but never more than the
    compute it can hide behind. Megatron-Core's schedules run every microbatch but the last
    under DDP's no_sync (pipeline_parallel/schedules.py: forward_backward_no_pipelining's
    `for i in range(num_microbatches - 1)` inside no_sync_func; the 1F1B schedules call
    enable_grad_sync only at each model chunk's last microbatch), so overlap_grad_reduce's
    reduce-scatters start in the last microbatch's backward; overlap_param_gather's
    all-gathers run in the next step's first forward. Together: one microbatch's time on the
    rank plus its pipeline idle (the warm-up wait before its first forward, the cool-down wait
    after its last backward, the bubble); the rest waits at the optimizer step. At PP1 with
    many microbatches this is one microbatch of 30-70: an 0.8 overlap there hid several
    times the compute there is."""
    return max(dp_s * (1 - overlap), dp_s - window_s)


def zero_comm_s(c: Candidate, device: Device, opts: ThroughputOptions) -> float:
    """ZeRO-2/3 per microbatch (Megatron-FSDP reduce-scatters after every backward, not only
    the last), inside the shard group of s = DP x CP / r ranks, for the P parameters of the
    rank: ZeRO-2: gradient reduce-scatter (s-1)/s x 4 P; ZeRO-3: + parameter all-gathers in
    forward and in backward, 2 (s-1)/s x e P (full recompute re-runs the forward inside the
    backward on the parameters gathered for it). Expert parameters over expert-DP likewise."""
    if not c.fsdp:
        return 0.0
    worst = _worst_params(c)
    per_param = c.grad_bytes + (2 * c.param_bytes if c.zero == 3 else 0)
    groups = ((worst.dense, c.dense_zero_shard, _shard_span(c)),
              (worst.expert, c.expert_zero_shard, c.world_size // c.pp))
    return sum((s - 1) / s * count * per_param / _bandwidth(span, device, opts)
               for count, s, span in groups if s > 1 and count)


def offload_s(c: Candidate, device: Device, opts: ThroughputOptions) -> float:
    """Optimizer CPU offload per step, for the rank's shard of S parameters: fp32 gradients
    down and fp32 parameters up over PCIe, 2 x 4 S / bw(PCIe), plus the CPU Adam step,
    memory bound: 28 S bytes (reads parameter, gradient and two moments, writes parameter
    and moments) / (host DRAM bandwidth per GPU x host_efficiency)."""
    if not c.offload:
        return 0.0
    shard = max(host_bytes(c, s) for s in edge_stages(c)) / 16  # 16 bytes per sharded parameter
    pcie = 2 * 4 * shard / (device.pcie_gbps * 1e9 * opts.bus_efficiency)
    cpu = 28 * shard / (device.host_memory_gbps * 1e9 * opts.host_efficiency)
    return pcie + cpu


def muon_optimizer_s(c: Candidate, device: Device, opts: ThroughputOptions) -> float:
    """Newton-Schulz per step on the busiest edge stage: its FLOPs (launch.planner.muon
    .ns_flops_per_step) at the GEMM efficiency of their dtype (bf16 at fp32_matmul_prec=medium);
    0 without Muon."""
    if not c.muon:
        return 0.0
    dtype = _muon.ns_peak_dtype(c)
    efficiency = opts.efficiency if opts.efficiency is not None else opts.efficiencies.gemm(dtype, False)
    flops = max(_muon.ns_flops_per_step(c, s) for s in edge_stages(c))
    return flops / (device.peak(dtype) * efficiency)


def muon_comm_s(c: Candidate, device: Device, opts: ThroughputOptions) -> float:
    """Muon's TP communication per step (launch.planner.muon.ns_comm_bytes_per_step) over the
    TP group's link; not overlapped (it runs inside the optimizer step)."""
    if not c.muon or max(c.tp, c.etp) == 1:
        return 0.0
    volume = max(_muon.ns_comm_bytes_per_step(c, s) for s in edge_stages(c))
    return volume / _bandwidth(max(c.tp, c.etp), device, opts)


def estimate_step(c: Candidate, device: Device, opts: ThroughputOptions = ThroughputOptions()) -> StepEstimate:
    """Time per step, tokens/s, model TFLOP/s per GPU and MFU for `c` on `device`."""
    compute_mb = max(stage_compute_s(c, s, device, opts) for s in edge_stages(c))
    zero = zero_comm_s(c, device, opts)
    exposed = {
        "tp": tp_exposed_s(c, device, opts),
        "cp": cp_comm_s(c, device, opts) * (1 - opts.cp_overlap),
        "ep": ep_comm_s(c, device, opts) * (1 - opts.ep_overlap),
        "zero": max(zero * (1 - opts.zero_overlap), zero - compute_mb),
    }
    t_mb = compute_mb + sum(exposed.values())
    m = c.num_microbatches
    bubble = t_mb * (c.pp - 1) / c.vpp
    comm = {k: v * m for k, v in exposed.items()}
    comm["pp"] = pp_comm_s(c, device, opts) * (1 - pp_overlap(c, opts))
    comm["dp"] = dp_exposed_s(dp_comm_s(c, device, opts), opts.dp_overlap, window_s=t_mb + bubble)
    comm["offload"] = offload_s(c, device, opts) * (1 - opts.offload_overlap)
    if c.muon:  # AdamW plans keep their JSON keys
        comm["muon"] = muon_comm_s(c, device, opts)
    optimizer = muon_optimizer_s(c, device, opts)
    step = t_mb * m + bubble + comm["pp"] + comm["dp"] + comm["offload"] + comm.get("muon", 0.0) + optimizer
    tokens = c.global_batch * c.seq_length
    model_flops = training_flops_per_step(c.model, c.seq_length, c.global_batch)
    tflops = model_flops / step / c.world_size / 1e12
    return StepEstimate(
        step_s=step, compute_s=compute_mb * m, bubble_s=bubble, comm_s=comm,
        tokens_per_s=tokens / step, tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / device.peak(c.dtype, c.fp8), optimizer_s=optimizer,
    )

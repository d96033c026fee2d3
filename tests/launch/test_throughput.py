"""Throughput model terms against hand-computed values, and its TFLOP/s against the
training metrics' own formula."""

from __future__ import annotations

import dataclasses

import pytest

from launch.planner.candidate import Candidate
from launch.planner.devices import Device, UnknownDeviceError, get_device
from launch.planner.throughput import (
    ThroughputOptions,
    cp_comm_s,
    dp_comm_s,
    ep_comm_s,
    estimate_step,
    layer_and_logit_flops,
    offload_s,
    pp_comm_s,
    recompute_flops_per_layer,
    stage_compute_s,
    tp_comm_s,
    zero_comm_s,
)
from models.config import ModelConfig
from models.layout import ParallelLayout
from pretrain.metrics import Throughput

# The config of tests/models/test_config_flops.py: per layer 1408 forward FLOPs/token
# (of which 256 are attention scores at s=16), logits 2048.
M = ModelConfig(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=1,
                vocab_size=128, max_seq_length=16)
# 1 TFLOP/s, 1 GB/s inside a node of 4, 0.1 GB/s across nodes: easy numbers.
DEV = Device(name="test", memory_gib=1.0, peak_tflops={"bf16": 1.0, "fp8": 2.0, "fp32": 0.5, "fp16": 1.0},
             intra_node_gbps=1.0, inter_node_gbps=0.1, gpus_per_node=4)
IDEAL = ThroughputOptions(efficiency=1.0, bus_efficiency=1.0, cp_overlap=0.0)


def cand(model=M, *, world=1, mbs=2, gbs=None, recompute="none", zero=1, hsdp=1, offload=False,
         **layout) -> Candidate:
    lay = ParallelLayout(**layout)
    return Candidate(model=model, layout=lay, world_size=world, micro_batch=mbs,
                     global_batch=gbs or mbs * lay.data_parallel(world), seq_length=16,
                     recompute=recompute, zero=zero, hsdp_replicas=hsdp, offload=offload)


def test_flops_split_from_models_flops():
    assert layer_and_logit_flops(cand()) == (1408, 2048)
    assert recompute_flops_per_layer(cand(recompute="selective")) == 256
    assert recompute_flops_per_layer(cand(recompute="full")) == 1408
    assert recompute_flops_per_layer(cand()) == 0


def test_stage_compute():
    tokens = 2 * 16
    assert stage_compute_s(cand(), 0, DEV, IDEAL) == pytest.approx(tokens * (3 * 2 * 1408 + 3 * 2048) / 1e12)
    pp = cand(world=2, pipeline_parallel=2)
    assert stage_compute_s(pp, 0, DEV, IDEAL) == pytest.approx(tokens * 3 * 1408 / 1e12)
    assert stage_compute_s(pp, 1, DEV, IDEAL) == pytest.approx(tokens * (3 * 1408 + 3 * 2048) / 1e12)
    half = ThroughputOptions(efficiency=0.5)
    assert stage_compute_s(cand(), 0, DEV, half) == pytest.approx(2 * stage_compute_s(cand(), 0, DEV, IDEAL))


def test_tp_and_cp_ring_formulas():
    size = 2 * 16 * 2 * 8  # e s b h bytes
    tp2 = cand(world=2, tensor_parallel=2)
    # 2 layers x 2 all-reduces x (fwd + bwd) x 2 (t-1)/t x B / 1 GB/s
    assert tp_comm_s(tp2, DEV, IDEAL) == pytest.approx(2 * 2 * 2 * 1.0 * size / 1e9)
    full = cand(world=2, tensor_parallel=2, recompute="full")
    assert tp_comm_s(full, DEV, IDEAL) == pytest.approx(1.5 * tp_comm_s(tp2, DEV, IDEAL))
    tp8 = cand(world=8, tensor_parallel=8)  # 8 > 4 GPUs per node: InfiniBand
    assert tp_comm_s(tp8, DEV, IDEAL) == pytest.approx(2 * 2 * 2 * (2 * 7 / 8) * size / 0.1e9)
    cp2 = cand(world=2, context_parallel=2)
    kv = 2 * 2 * 8 * 2 * 1 * 4  # 2 (K,V) x e x s/c x b x g d
    assert cp_comm_s(cp2, DEV, IDEAL) == pytest.approx(2 * 1 * 3 * kv / 1e9)
    assert tp_comm_s(cand(), DEV, IDEAL) == cp_comm_s(cand(), DEV, IDEAL) == 0


def test_ep_pp_dp():
    moe = M.model_copy(update=dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8))
    ep2 = cand(moe, world=2, expert_parallel=2)
    routed = 2 * 2 * 16 * 2 * 8  # k e s b h
    assert ep_comm_s(ep2, DEV, IDEAL) == pytest.approx(2 * 2 * 2 * routed * 0.5 / 1e9)
    pp = cand(world=2, gbs=8, pipeline_parallel=2)  # M = 4
    assert pp_comm_s(pp, DEV, IDEAL) == pytest.approx(2 * 1 * 4 * (2 * 16 * 2 * 8) / 1e9)
    dp2 = cand(world=2)
    P = 2 * 592 + 128 * 8 + 8 + 128 * 8  # layers + embedding + final norm + output layer
    assert dp_comm_s(dp2, DEV, IDEAL) == pytest.approx(0.5 * P * (4 + 2) / 1e9)  # RS fp32 + AG bf16
    no_dist = cand(world=2, zero=0)
    assert dp_comm_s(no_dist, DEV, IDEAL) == pytest.approx(2 * 0.5 * P * 4 / 1e9)  # all-reduce fp32


def test_step_bubble_overlap_and_metrics_formula():
    deep = M.model_copy(update=dict(num_layers=8))
    c = cand(deep, world=4, gbs=16, pipeline_parallel=4, virtual_pipeline=2)  # M = 8
    est = estimate_step(c, DEV, IDEAL)
    t_mb = max(stage_compute_s(c, s, DEV, IDEAL) for s in range(4))
    assert est.bubble_s == pytest.approx(t_mb * 3 / 2)
    assert est.step_s == pytest.approx(8 * t_mb + est.bubble_s + est.comm_s["pp"] + est.comm_s["dp"])
    # TFLOP/s per GPU is what pretrain.metrics would report for the same step time.
    tps, _, tflops, mfu = Throughput(deep, 16, 16, 4, 1.0).compute(est.step_s)
    assert est.tflops_per_gpu == pytest.approx(tflops)
    assert est.mfu == pytest.approx(mfu)
    assert est.tokens_per_s == pytest.approx(tps)
    # Full TP overlap hides all where every GEMM outlasts its collective (a fast link here;
    # test_tp_overlap_hides_at_most_the_paired_gemm has the slow case).
    fast = dataclasses.replace(DEV, intra_node_gbps=1e6)
    hidden = estimate_step(cand(world=2, tensor_parallel=2), fast, ThroughputOptions(tp_overlap=1.0))
    assert hidden.comm_s["tp"] == 0


def test_device_table():
    assert get_device("h100").memory_gib == pytest.approx(79.6, abs=0.1)
    assert get_device("H200").name == "h200-141gb"
    assert get_device("h100-80gb").peak("bf16") == 989.4e12
    with pytest.raises(UnknownDeviceError, match="unknown GPU type 'a100'.*Known: b200-180gb, cpu, gb200-186gb, h100-80gb"):
        get_device("a100")


# P = 2 * 592 + 128 * 8 + 8 + 128 * 8 parameters on a rank of M (TP1, PP1); bf16 (e = 2).
P_M = 2 * 592 + 128 * 8 + 8 + 128 * 8


def test_zero2_zero3_communication():
    z2, z3 = cand(world=2, zero=2), cand(world=2, zero=3)
    # per microbatch: ZeRO-2 reduce-scatters the fp32 gradients; ZeRO-3 also all-gathers
    # the bf16 parameters in forward and in backward.
    assert zero_comm_s(z2, DEV, IDEAL) == pytest.approx(0.5 * 4 * P_M / 1e9)
    assert zero_comm_s(z3, DEV, IDEAL) == pytest.approx(0.5 * (4 + 2 * 2) * P_M / 1e9)
    # per step: ZeRO-2 all-gathers the updated parameters once; ZeRO-3 nothing more.
    assert dp_comm_s(z2, DEV, IDEAL) == pytest.approx(0.5 * 2 * P_M / 1e9)
    assert dp_comm_s(z3, DEV, IDEAL) == 0
    assert zero_comm_s(cand(world=2), DEV, IDEAL) == 0  # ZeRO-1: Megatron DDP, once per step


def test_hsdp_shards_on_nvlink_and_all_reduces_across_nodes():
    # 8 ranks on nodes of 4: shard groups of 4 (one node, 1 GB/s), 2 replicas (0.1 GB/s across).
    h = cand(world=8, zero=3, hsdp=2)
    assert zero_comm_s(h, DEV, IDEAL) == pytest.approx(0.75 * 8 * P_M / 1e9)
    assert dp_comm_s(h, DEV, IDEAL) == pytest.approx(2 * 0.5 * 4 * P_M / 4 / 0.1e9)
    flat = cand(world=8, zero=3)  # one shard group over both nodes: every gather on InfiniBand
    assert zero_comm_s(flat, DEV, IDEAL) == pytest.approx(7 / 8 * 8 * P_M / 0.1e9)


def test_zero_overlap_hides_at_most_the_compute():
    z3 = cand(world=2, zero=3, gbs=16)  # 4 microbatches of 2 on each of 2 DP ranks
    comm, compute = zero_comm_s(z3, DEV, IDEAL), stage_compute_s(z3, 0, DEV, IDEAL)
    for overlap in (0.0, 0.5, 1.0):
        est = estimate_step(z3, DEV, dataclasses.replace(IDEAL, zero_overlap=overlap))
        assert est.comm_s["zero"] == pytest.approx(4 * max(comm * (1 - overlap), comm - compute))
    slow_link = dataclasses.replace(DEV, intra_node_gbps=1e-6)  # communication far beyond compute
    est = estimate_step(z3, slow_link, dataclasses.replace(IDEAL, zero_overlap=1.0))
    assert est.comm_s["zero"] == pytest.approx(4 * (zero_comm_s(z3, slow_link, IDEAL) - compute))


def test_offload_time():
    host = dataclasses.replace(DEV, pcie_gbps=2.0, host_memory_gbps=4.0)
    off = cand(world=2, zero=1, offload=True)
    shard = P_M / 2
    # fp32 gradients down + fp32 parameters up over PCIe; CPU Adam reads 16 and writes 12 bytes.
    assert offload_s(off, host, IDEAL) == pytest.approx(8 * shard / 2e9 + 28 * shard / (4e9 * IDEAL.host_efficiency))
    assert offload_s(cand(world=2), host, IDEAL) == 0
    est = estimate_step(off, host, IDEAL)
    assert est.comm_s["offload"] == pytest.approx(offload_s(off, host, IDEAL))
    assert est.step_s == pytest.approx(estimate_step(cand(world=2), host, IDEAL).step_s + est.comm_s["offload"])


def test_document_masking_shortens_only_the_attention_work_the_kernel_skips():
    """At s=16 a layer's attention scores + weighted values are 2 x 256 x 1/2 = 256 of its 1408
    forward FLOPs/token (causal). Documents of 4 tokens run 4 x (4 x 5) / (16 x 17) = 80/272 of
    that: the te spec (flash attention) estimate drops by the rest; the portable spec computes
    every score; the reported FLOP/s stay on the dense formula."""
    from models.flops import packed_attention_fraction

    assert packed_attention_fraction(4, 16) == pytest.approx(80 / 272)
    assert packed_attention_fraction(5, 16) == pytest.approx((3 * 30 + 2) / 272)  # 5, 5, 5 and a cut 1
    dense = cand(mbs=1, gbs=1)
    masked = dataclasses.replace(dense, attention_fraction=80 / 272)
    assert layer_and_logit_flops(masked)[0] == pytest.approx(1408 - 256 * (1 - 80 / 272))
    portable = dataclasses.replace(masked, flash_attention=False)
    assert layer_and_logit_flops(portable) == layer_and_logit_flops(dataclasses.replace(dense, flash_attention=False))
    fast, slow = estimate_step(masked, DEV, IDEAL), estimate_step(dense, DEV, IDEAL)
    assert fast.compute_s == pytest.approx(slow.compute_s * (3 * (2 * (1408 - 256 * (1 - 80 / 272))) + 3 * 2048)
                                           / (3 * (2 * 1408) + 3 * 2048))
    assert fast.tflops_per_gpu * fast.step_s == pytest.approx(slow.tflops_per_gpu * slow.step_s)  # same FLOPs


def test_pp_overlap_hides_send_recv_only_in_the_interleaved_schedule():
    """Megatron-Core's non-interleaved 1F1B refuses overlap_p2p_comm (pipeline_parallel/
    schedules.py): --overlap pp=1 hides every PP send/recv of a VPP layout and none without VPP."""
    deep = M.model_copy(update=dict(num_layers=8))
    opts = ThroughputOptions(pp_overlap=1.0)
    plain = cand(deep, world=2, gbs=8, pipeline_parallel=2)
    interleaved = cand(deep, world=2, gbs=8, pipeline_parallel=2, virtual_pipeline=2)
    assert pp_comm_s(plain, DEV, opts) > 0
    assert estimate_step(plain, DEV, opts).comm_s["pp"] == pytest.approx(pp_comm_s(plain, DEV, opts))
    assert estimate_step(interleaved, DEV, opts).comm_s["pp"] == 0


def test_moe_element_wise_work_counts_the_dispatch():
    """An MoE layer whose k experts run as many FFN elements as the dense layer (k f_e = f =
    16) moves the same element-wise bytes plus the dispatch's: router 12 E + permute/unpermute
    (3k + 1) e h = 12 x 4 + 7 x 2 x 8 bytes per token."""
    from launch.planner.throughput import elementwise_bytes_per_token, moe_dispatch_bytes_per_token

    moe = M.model_copy(update=dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8))
    assert moe_dispatch_bytes_per_token(cand(moe)) == 12 * 4 + 7 * 2 * 8
    assert moe_dispatch_bytes_per_token(cand()) == 0
    assert elementwise_bytes_per_token(cand(moe)) - elementwise_bytes_per_token(cand()) == 12 * 4 + 7 * 2 * 8


def test_dp_overlap_hides_at_most_one_microbatch_and_the_pipeline_idle():
    """Megatron-Core syncs gradients only in the last microbatch's backward (no_sync before) and
    gathers parameters in the next step's first forward: however large --overlap dp is, no more
    than one microbatch's time plus the rank's pipeline idle (the bubble) is hidden."""
    slow_link = dataclasses.replace(DEV, intra_node_gbps=1e-6)  # DP sync far beyond the compute
    hide_all = dataclasses.replace(IDEAL, dp_overlap=1.0)
    dp2 = cand(world=2, gbs=16)  # 4 microbatches of 2 on each of 2 DP ranks, no pipeline
    t_mb = stage_compute_s(dp2, 0, slow_link, IDEAL)
    est = estimate_step(dp2, slow_link, hide_all)
    assert est.comm_s["dp"] == pytest.approx(dp_comm_s(dp2, slow_link, IDEAL) - t_mb)
    # With PP2 the warm-up and cool-down idle (the bubble, t_mb x (p-1)/v) hides more.
    pp2 = cand(world=4, gbs=16, pipeline_parallel=2)
    t_mb = max(stage_compute_s(pp2, s, slow_link, IDEAL) for s in range(2))
    est = estimate_step(pp2, slow_link, hide_all)
    assert est.bubble_s == pytest.approx(t_mb)
    assert est.comm_s["dp"] == pytest.approx(dp_comm_s(pp2, slow_link, IDEAL) - 2 * t_mb)
    # On a fast link the overlap fraction is what limits: half hidden at 0.5.
    fast_link = dataclasses.replace(DEV, intra_node_gbps=1e3)
    dp_s = dp_comm_s(dp2, fast_link, IDEAL)
    assert dp_s < stage_compute_s(dp2, 0, fast_link, IDEAL)  # the window is not the limit here
    est = estimate_step(dp2, fast_link, dataclasses.replace(IDEAL, dp_overlap=0.5))
    assert est.comm_s["dp"] == pytest.approx(0.5 * dp_s)


def test_tp_overlap_hides_at_most_the_paired_gemm():
    """Userbuffers pair each TP all-gather / reduce-scatter with one GEMM: however large
    --overlap tp is, a collective longer than its GEMM stays exposed by the difference. M at
    TP2, 32 tokens, 1 TFLOP/s: forward GEMMs 2 x 32 x K x N / 2 of QKV 8x16, projection 8x8,
    fc1 8x32 (gated), fc2 16x8; one AG or RS moves (1/2) x 2 x 32 x 8 bytes at 1 GB/s."""
    from launch.planner.throughput import tp_exposed_s

    tp2 = cand(world=2, tensor_parallel=2, sequence_parallel=True)
    assert M.gated
    gemms = [2 * 32 * k * n / 2 / 1e12 for k, n in ((8, 16), (8, 8), (8, 32), (16, 8))]
    one = 0.5 * 2 * 32 * 8 / 1e9
    assert 8 * 2 * one == pytest.approx(tp_comm_s(tp2, DEV, IDEAL))  # 2 layers x 8 collectives
    hide_all = dataclasses.replace(IDEAL, tp_overlap=1.0)
    want = 2 * sum(max(0.0, one - g) + max(0.0, one - 2 * g) for g in gemms)
    assert tp_exposed_s(tp2, DEV, hide_all) == pytest.approx(want)
    assert estimate_step(tp2, DEV, hide_all).comm_s["tp"] == pytest.approx(want)  # one microbatch
    # No overlap: all of it; a link fast enough that every GEMM covers its collective: the fraction.
    assert tp_exposed_s(tp2, DEV, IDEAL) == pytest.approx(tp_comm_s(tp2, DEV, IDEAL))
    fast = dataclasses.replace(DEV, intra_node_gbps=1e6)
    half = dataclasses.replace(IDEAL, tp_overlap=0.5)
    assert tp_exposed_s(tp2, fast, half) == pytest.approx(0.5 * tp_comm_s(tp2, fast, IDEAL))

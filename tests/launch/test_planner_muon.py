"""launch.planner.muon: Muon's state and Newton-Schulz time in the planner, against independent
counts (the planner's own parameter totals, hand formulas) and against the real iteration
(emerging_optimizers' newton_schulz and Megatron-Core's TensorParallelMuon, FLOPs counted by
torch.utils.flop_counter). The bytes Megatron-Core really allocates: test_memory_measured.py."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from launch.planner import muon
from launch.planner.candidate import Candidate
from launch.planner.devices import get_device
from launch.planner.memory import memory_on_stage, params_on_rank
from launch.planner.throughput import ThroughputOptions, dp_comm_s, estimate_step
from models.config import get_flavor
from pretrain.config import apply_overrides
from pretrain.recipes import get_recipe

needs_emerging_optimizers = pytest.mark.skipif(
    importlib.util.find_spec("emerging_optimizers") is None,
    reason="SKIPPED, NOT PASSED: needs the emerging-optimizers package (pip install emerging-optimizers==0.3.0)")


def _cand(flavor: str = "tiny-llama", world: int = 1, overrides: tuple[str, ...] = (), recipe: str = "tiny-llama"
          ) -> Candidate:
    base = get_recipe(recipe)
    if flavor:
        base = base.model_copy(update={"model": get_flavor(flavor)})
    config = apply_overrides(base, overrides=["optimizer.name=muon", *overrides])
    return Candidate.from_config(config, world)


@pytest.mark.parametrize("flavor,world,overrides", [
    ("tiny-llama", 1, ()), ("tiny-llama", 2, ("parallel.tensor_parallel=2",)),
    ("tiny-gpt", 2, ("parallel.pipeline_parallel=2",)), ("tiny-moe", 2, ("parallel.expert_parallel=2",)),
    ("tiny-qwen3-moe", 4, ("parallel.expert_parallel=2", "parallel.tensor_parallel=2",
                           "parallel.sequence_parallel=true")),
])
def test_params_list_adds_up_to_the_planner_counts(flavor, world, overrides):
    """The per-tensor list Muon's model uses holds exactly the parameters launch.planner.memory
    counts on each stage (dense and expert apart)."""
    c = _cand(flavor, world, overrides)
    for stage in range(c.pp):
        params = muon.params_list(c, stage)
        want = params_on_rank(c, stage)
        assert sum(p.numel for p in params if not p.expert) == want.dense
        assert sum(p.numel for p in params if p.expert) == want.expert


def test_llama_state_is_one_momentum_for_hidden_matrices():
    """Llama-3 8B at ZeRO-0: Muon elements = L (h (n+2g) d + n d h + 3 h f), counted by hand;
    state = 4 x those + 8 x the rest (embedding, output layer, norms) = 8 P - 4 P_muon."""
    c = dataclasses.replace(_cand(None, 8, ("parallel.tensor_parallel=8",), recipe="llama3-8b"), zero=0)
    m = c.model
    h, d, f = m.hidden_size, m.head_dim, m.ffn_hidden_size
    hidden = m.num_layers * (h * (m.num_attention_heads + 2 * m.query_groups) * d
                             + m.num_attention_heads * d * h + 3 * h * f) // 8
    total = params_on_rank(c, 0).total
    assert muon.optimizer_state_bytes(c, 0) == 4 * hidden + 8 * (total - hidden)
    adamw = memory_on_stage(dataclasses.replace(c, muon=None), 0).optimizer_states
    assert memory_on_stage(c, 0).optimizer_states == adamw - 4 * hidden
    assert memory_on_stage(c, 0).main_params == 4 * total  # bf16: fp32 main weights of everything


def test_lion_state_is_one_momentum_for_every_element():
    """optimizer.name=lion: 4 bytes per element of every parameter (half AdamW's 8), fp32 main
    weights of everything in bf16; at ZeRO-1 over DP2 the layer-wise deal's fullest rank."""
    base = apply_overrides(get_recipe("llama3-8b"), overrides=["optimizer.name=lion", "parallel.tensor_parallel=8"])
    c = dataclasses.replace(Candidate.from_config(base, 8), zero=0)
    assert c.lion and c.muon is None and c.optimizer_name == "lion"
    total = params_on_rank(c, 0).total
    adamw = memory_on_stage(dataclasses.replace(c, lion=False), 0)
    assert memory_on_stage(c, 0).optimizer_states == 4 * total == adamw.optimizer_states / 2
    assert memory_on_stage(c, 0).main_params == 4 * total
    sharded = dataclasses.replace(Candidate.from_config(base, 16), zero=1)
    shares = muon.rank_shares(sharded, 0)
    assert len(shares) == 2 and sum(s.total for s in shares) == total
    assert memory_on_stage(sharded, 0).optimizer_states == 4 * max(s.total for s in shares) < 4 * total


def test_ping_pong_deals_like_megatron():
    """Megatron-Core 0.19's docstring example: 4 ranks, p0..p9 sorted -> [[p0,p7,p8],[p1,p6,p9],
    [p2,p5],[p3,p4]]."""
    shares = muon.ping_pong([(10 ** i, True) for i in range(10)], 4)
    want = [[0, 7, 8], [1, 6, 9], [2, 5], [3, 4]]
    assert [s.muon for s in shares] == [sum(10 ** i for i in idx) for idx in want]


@pytest.mark.parametrize("rows,cols,steps", [(64, 160, 5), (160, 64, 5), (96, 96, 3), (32, 200, 1)])
@needs_emerging_optimizers
def test_ns_flops_equal_counted_flops_of_the_real_iteration(rows, cols, steps):
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    with FlopCounterMode(display=False) as counter:
        newton_schulz(torch.randn(rows, cols), steps, "quintic")
    assert counter.get_total_flops() == muon.ns_flops(rows, cols, steps)


@pytest.mark.parametrize("split_qkv", [True, False])
@needs_emerging_optimizers
def test_qkv_blocks_equal_counted_flops_of_megatron_muon(split_qkv):
    """Megatron-Core's TensorParallelMuon.orthogonalize on a fused QKV weight (GQA: 4 heads,
    2 groups): the FLOPs it runs = the planner's blocks (Q, K, V apart with split_qkv)."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    c = _cand("tiny-llama", 1, (f"optimizer.muon.split_qkv={str(split_qkv).lower()}",))
    m = c.model
    qkv = next(p for p in muon.layer_params_list(c) if p.muon)
    weight = torch.nn.Parameter(torch.randn(qkv.rows, qkv.cols))
    weight.is_qkv = True
    weight.qkv_split_shapes = [m.num_attention_heads // m.query_groups * m.head_dim, m.head_dim, m.head_dim]
    opt = TensorParallelMuon([weight], split_qkv=split_qkv, is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
                             num_ns_steps=c.muon.num_ns_steps, coefficient_type=c.muon.coefficient_type)
    with FlopCounterMode(display=False) as counter:
        opt.orthogonalize(weight, torch.randn_like(weight))
    want = sum(muon.ns_flops(r, k, c.muon.num_ns_steps) for r, k in qkv.matrices())
    assert counter.get_total_flops() == want
    assert len(qkv.matrices()) == (3 if split_qkv else 1)


def test_tp_modes_flops_and_traffic():
    """TP2 on one layer's attention output (row parallel, h x nd split in columns): duplicated
    runs the whole matrix and all-gathers (t-1)/t x 4 bytes x its elements; blockwise runs
    the shard and moves nothing; distributed iterates on the un-split side."""
    base = _cand("tiny-llama", 2, ("parallel.tensor_parallel=2", "model.num_layers=1"))
    h, nd = base.model.hidden_size, base.model.num_attention_heads * base.model.head_dim
    proj = [p for p in muon.layer_params_list(base) if p.muon and p.partition_dim == 1 and p.cols == nd][0]
    steps = base.muon.num_ns_steps

    def with_mode(mode):
        return dataclasses.replace(base, muon=base.muon.model_copy(update={"tp_mode": mode}))

    assert muon._block_flops(with_mode("duplicated"), proj, h, nd) == muon.ns_flops(h, nd, steps)
    assert muon._block_flops(with_mode("blockwise"), proj, h, nd) == muon.ns_flops(h, nd // 2, steps)
    assert muon._block_flops(with_mode("distributed"), proj, h, nd) == steps * (4 * h * h * nd / 2 + 2 * h ** 3)
    hidden = sum(p.numel * p.split for p in muon.params_list(base, 0) if p.muon)  # whole matrices
    assert muon.ns_comm_bytes_per_step(with_mode("duplicated"), 0) == 0.5 * 4 * hidden
    assert muon.ns_comm_bytes_per_step(with_mode("blockwise"), 0) == 0


def test_step_estimate_adds_newton_schulz_and_layer_wise_gather():
    """llama3-8b on 8 H100: Muon's step = AdamW's + Newton-Schulz at the bf16 GEMM efficiency
    + its TP all-gathers; at DP2 layer-wise the DP sync is an all-reduce + a parameter gather."""
    device = get_device("h100")
    opts = ThroughputOptions()
    c = _cand(None, 8, ("parallel.tensor_parallel=4",), recipe="llama3-8b")
    adamw = estimate_step(dataclasses.replace(c, muon=None), device, opts)
    got = estimate_step(c, device, opts)
    ns = muon.ns_flops_per_step(c, 0) / (device.peak("bf16") * opts.efficiencies.gemm_bf16)
    assert got.optimizer_s == pytest.approx(ns)
    gather = muon.ns_comm_bytes_per_step(c, 0) / (device.intra_node_gbps * 1e9 * opts.bus_efficiency)
    assert got.comm_s["muon"] == pytest.approx(gather)
    # Layer-wise at DP2: each rank orthogonalizes about half the matrices.
    assert muon.ns_flops_per_step(c, 0) == pytest.approx(
        muon.ns_flops_per_step(dataclasses.replace(c, zero=0), 0) / 2)
    P = params_on_rank(c, 0).total
    assert dp_comm_s(c, device, opts) == pytest.approx(0.5 * P * (2 * 4 + 2) / (450e9 * 0.8))
    adamw_rest = adamw.step_s - adamw.comm_s["dp"]
    assert got.step_s == pytest.approx(adamw_rest + got.comm_s["dp"] + ns + gather)

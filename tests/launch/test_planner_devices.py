"""Blackwell devices in the planner (launch.planner.devices): B200 and GB200 peaks as NVIDIA's
table gives them (dense = the table's sparse figure / 2), MXFP8 allowed there and not on H100,
and GB200 NVL72's 72-GPU NVLink domain built from 4-GPU trays."""

from __future__ import annotations

import pytest

from launch.planner.devices import get_device
from launch.planner.search import PlanError, SearchSpace, _layouts, check_world
from launch.planner.throughput import ThroughputOptions, _bandwidth
from pretrain.config import apply_overrides
from pretrain.metrics import detect_device_peak
from pretrain.recipes import get_recipe

# NVIDIA's "Individual Blackwell GPU Specifications" (with sparsity) for HGX B200 / GB200 NVL72.
SPARSE_PFLOPS = {"b200": {"fp8": 9, "bf16": 4.5}, "gb200": {"fp8": 10, "bf16": 5}}


@pytest.mark.parametrize("alias", ["b200", "gb200"])
def test_peaks_are_the_vendor_table_at_dense(alias):
    device = get_device(alias)
    for dtype, sparse in SPARSE_PFLOPS[alias].items():
        assert device.peak(dtype) == sparse / 2 * 1e15
    assert detect_device_peak(alias, "bf16", True) == SPARSE_PFLOPS[alias]["fp8"] / 2 * 1e3  # TFLOP/s
    assert device.capability == (10, 0)


def test_mxfp8_runs_on_blackwell_only():
    assert get_device("b200").fp8_problem("mxfp8") is None
    assert get_device("gb200").fp8_problem("mxfp8") is None
    assert "needs compute capability 10.0" in get_device("h100").fp8_problem("mxfp8")


def test_gb200_nvlink_spans_the_rack_and_nodes_are_trays():
    gb200, b200, opts = get_device("gb200"), get_device("b200"), ThroughputOptions()
    assert _bandwidth(72, gb200, opts) == 900e9 * opts.bus_efficiency  # NVLink across the rack
    assert _bandwidth(144, gb200, opts) == 50e9 * opts.bus_efficiency  # InfiniBand between racks
    assert _bandwidth(16, b200, opts) == 50e9 * opts.bus_efficiency  # B200: NVLink inside 8 only
    check_world(148, gb200)  # 37 trays of 4
    with pytest.raises(PlanError, match="4 GPUs each"):
        check_world(146, gb200)


def test_gb200_tp_stays_inside_a_rack():
    """At 144 GPUs TP may be any divisor of 72 (groups never straddle racks); 16 does not divide 72."""
    config = apply_overrides(get_recipe("llama3-70b"), overrides=[])
    tps = {lay["tp"] for lay in _layouts(config, 144, get_device("gb200"), SearchSpace(pp=(1,), cp=(1,)))}
    assert 8 in tps and 16 not in tps
    assert all(72 % t == 0 for t in tps)

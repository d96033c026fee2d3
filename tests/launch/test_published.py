"""The planner against measured runs (launch/planner/published.yaml): every row within +-15%
and every published layout fitting with its published recompute setting; the efficiencies
in launch.planner.efficiency are the fit's, not hand-set; FP8 changes only what runs in FP8."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from launch.planner import published
from launch.planner.candidate import Candidate
from launch.planner.efficiency import DEFAULT_EFFICIENCIES
from launch.planner.memory import activation_bytes, fp8_buffer_bytes, linear_layer_params_on_rank
from models.config import get_flavor
from models.layout import ParallelLayout

# Calibration rows in published.yaml: 8 Megatron-Bridge DGX-H100 FP8 rows + 3 of our H100 runs;
# + 2 MoE rows (Qwen3-30B-A3B) reported, not fitted.
EXPECTED_ROWS = 11
EXPECTED_MOE_ROWS = 2


@pytest.fixture(scope="module")
def table():
    return published.table_rows(published.calibration_rows(published.load_rows()))


def test_every_row_within_15_percent_and_fits(table):
    assert len(table) == EXPECTED_ROWS
    bad = [f"{r['source']} {r['model']} {r['gpus']} GPUs: predicted {r['predicted']:.0f}, measured "
           f"{r['tokens_per_s_per_gpu']} ({r['error']:+.1%}), {r['memory_gib']:.1f} GiB"
           for r in table if abs(r["error"]) > 0.15 or not r["fits"]]
    assert not bad, "\n".join(bad)


def test_constants_are_the_fit():
    """Refitting from the same start reproduces the constants (to the 3 decimals kept): no
    per-row or hand tuning hides in them."""
    fitted = published.fit_efficiencies(published.calibration_rows(published.load_rows()))
    for kind in published.FITTED_KINDS:
        assert getattr(fitted, kind) == pytest.approx(getattr(DEFAULT_EFFICIENCIES, kind), abs=0.003), kind


def test_moe_rows_are_reported_with_the_known_gap():
    """The published MoE rows (Qwen3-30B-A3B on 16 H100s, EP8) are estimated at their layout and
    printed in the table, not fitted. Both fit an H100 with their published recompute setting
    (none). The planner over-predicts their throughput by far more than 15% even with MoE's
    dispatch passes and all-to-all: two thirds of the measured step is neither FLOPs nor bytes
    in the model. When a change brings them within 15%, move them into calibration (drop
    `fit: false`) rather than loosening this test."""
    rows = [r for r in published.load_rows() if not r.get("fit", True)]
    assert len(rows) == EXPECTED_MOE_ROWS
    table = published.table_rows(rows)
    assert all(published.row_candidate(r).ep == 8 and published.row_candidate(r).model.is_moe for r in rows)
    assert all(r["error"] > 0.15 for r in table), [(r["source"], r["error"]) for r in table]
    assert all(r["fits"] for r in table), [(r["source"], r["memory_gib"]) for r in table]
    assert "[not fitted]" in published.markdown(table)


def _llama8b(fp8: bool) -> Candidate:
    return Candidate(model=get_flavor("llama3-8b"), layout=ParallelLayout(), world_size=8, micro_batch=1,
                     global_batch=8, seq_length=8192, fp8=fp8, fp8_recipe="tensorwise" if fp8 else None)


def test_fp8_memory_keeps_linear_inputs_in_one_byte_and_caches_fp8_weights():
    """Llama-3 8B at TP1: the linear layers of a layer hold 4096 x 6144 (QKV) + 4096 x 4096
    (projection) + 3 x 4096 x 14336 (SwiGLU MLP) = 218,103,808 parameters; TE caches a rowwise
    and a columnwise FP8 byte of each (current scaling keeps no amax history). The saved
    inputs of QKV, projection, fc1 (h each) and fc2 (f) drop from 2 bytes to 1 per element."""
    bf16, fp8 = _llama8b(False), _llama8b(True)
    assert linear_layer_params_on_rank(fp8) == 218_103_808
    assert fp8_buffer_bytes(fp8, 0) == 32 * 2 * 218_103_808
    assert fp8_buffer_bytes(bf16, 0) == 0
    tokens, layers = 8192, 32
    saved_per_layer = tokens * (3 * 4096 + 14336)  # one byte less per element
    assert activation_bytes(bf16, 0) - activation_bytes(fp8, 0) == pytest.approx(layers * saved_per_layer)


def test_embedding_and_loss_in_the_pipeline_split():
    """126 layers + embedding + loss = 128 slots over PP8: edge stages 15 layers, the others 16."""
    c = published.row_candidate(next(r for r in published.load_rows() if r["model"] == "llama3.1-405b"))
    layers = [c.layers_on_stage(s) for s in range(c.pp)]
    assert layers == [15, 16, 16, 16, 16, 16, 16, 15]
    assert sum(layers) == 126


def test_fp8_speeds_up_only_the_linear_gemms():
    """With the FP8 GEMM as fast as the BF16 one (same FLOP/s), FP8 can only add time (the
    casts); with FP8 GEMMs infinitely fast, attention, logits and element-wise work remain."""
    from launch.planner.devices import get_device
    from launch.planner.throughput import ThroughputOptions, stage_compute_s

    h100 = get_device("h100-80gb")
    bf16, fp8 = _llama8b(False), _llama8b(True)
    base = stage_compute_s(bf16, 0, h100, ThroughputOptions())
    same_speed = dataclasses.replace(DEFAULT_EFFICIENCIES, gemm_fp8=DEFAULT_EFFICIENCIES.gemm_bf16 / 2)
    assert stage_compute_s(fp8, 0, h100, ThroughputOptions(efficiencies=same_speed)) > base
    fast = stage_compute_s(fp8, 0, h100, ThroughputOptions())
    assert base / 2 < fast < base


def test_fp8_recipes_the_device_lacks_are_refused(capsys):
    """MXFP8 needs compute capability 10.0 (models.precision.FP8_RECIPES): planning it for an
    H100 is refused in one line, as the training would refuse it at start-up."""
    from launch.planner import cli

    rc = cli.main(["--recipe", "llama3-8b", "--gpus", "8", "runtime.fp8=hybrid", "runtime.fp8_recipe=mxfp8"])
    assert rc == cli.BAD_INPUT
    assert "MXFP8 (runtime.fp8_recipe=mxfp8) needs compute capability 10.0" in capsys.readouterr().err


def _fastest(model: str) -> dict:
    """The first row marked fastest for `model` (rows of one model share GPUs and layout)."""
    return next(r for r in published.load_rows() if r.get("fastest") and r["model"] == model)


def test_every_fastest_row_is_a_case_below():
    """Each model with a row marked fastest has a ranking case here."""
    assert {r["model"] for r in published.load_rows() if r.get("fastest")} == set(FASTEST_CASES)


# Known gap (`python -m launch.planner.published --rank --top 10`): 70B's PP8 last stage carries
# the logits and the loss (a BF16 GEMM of h x V/t: 2.1 layers' time on top of its 10 layers in
# the model), so its compute per step is 10% above the TP4 x PP4 x CP2 layouts that lead (10.26
# vs 9.36 s at GBS 128; NVIDIA's own H100 BF16 preset layout is among them), which spread the
# logits over 20 layers. Bounding the DP overlap by the one microbatch and pipeline idle it can
# hide behind (throughput.dp_exposed_s), the refit that follows, and each TP collective's
# overlap by its paired GEMM (throughput.tp_exposed_s) moved 405B from 6th to 1st and 70B from
# 246th to 195th. Since the search tries uneven first / last stages (search.uneven_splits) the
# leaders are TP4 x PP4 (19 | 21 x 2 | 19) x CP2 (compute 8.94 s) and the 70B ranks 236th of 1121.
# The same pricing moved the 405B from 1st to 11th of 1136: layouts whose last stage holds 2
# layers fewer than the others (compute 11.50 s) lead the published one, whose loss takes one
# layer's slot (compute 11.67 s). Pricing narrow GEMMs (launch.planner.gemms: TP8 x CP8 layouts'
# 1024-wide attention output in FP8) moved the 70B to 207th and the 405B to 6th of 1136 (0.9%
# behind TP8 x PP32 x VPP2 x CP4 with a last stage of 2; 17th of 1134 at GBS 1536, 2.3%). The logits' price is measured, not only modelled: on one H200 the
# 70B TP4 last stage's output layer + loss took 2.14 layers' GEMMs + attention in FP8, the
# planner charges 2.28 (test_gemm_benchmark, fixtures/h200-runs): the gap is not a mispriced
# last stage. Strict: when a change fixes either, its xfail fails; drop it.
_GAP_70B = ("70B TP4xPP8xVPP5 ranks 207th of 1121 (recipe's settings), 44th of 836 (ours): the last stage's logits "
            "(2.1 layers, as one H200 measured them)")
_GAP_405B = ("405B TP8xPP8xVPP8xCP2 + emb/loss split ranks 6th of 1136 (recipe's settings, 0.9% behind): uneven "
             "layouts with a last stage 2 layers lighter lead, the logits priced at ~2 FP8 layers")
FASTEST_CASES = {
    "llama3-8b": (),
    "llama3-70b": (pytest.mark.xfail(strict=True, reason=_GAP_70B),),
    "llama3.1-405b": (pytest.mark.xfail(strict=True, reason=_GAP_405B),),
}


@pytest.mark.parametrize("model", [pytest.param(m, marks=marks) for m, marks in FASTEST_CASES.items()])
def test_published_fastest_layout_ranks_in_the_top_5(model):
    """A layout its source presents as the fastest (published.yaml `fastest: true`) is among the
    planner's 5 fastest for that model, GPU count, precision, batch and micro batch, under the
    settings it ran with (its TP/DP/PP overlaps and bf16 gradient reduction) or under ours (no
    overlap, fp32 gradient reduction: our training's). The 8B passes with ours (2nd of 697;
    13th of 748 with the recipe's, 3.6% behind the best)."""
    r = _fastest(model)
    ranks = [published.rank_of_published_layout(r, recipe_settings=s) for s in (True, False)]
    assert any(0 < rank <= 5 for rank, _ in ranks), ranks


def test_the_readme_table_is_the_planners_current_one():
    """README.md's copy of the table (after `<!-- table: published -->`) is what
    `python -m launch.planner.published` prints now."""
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    copy = readme.split("<!-- table: published -->\n", 1)[1].split("\n\n", 1)[0].strip()
    assert copy == published.markdown(published.table_rows(published.load_rows()))

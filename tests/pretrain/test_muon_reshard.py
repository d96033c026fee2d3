"""Muon state resharded on load (issue 46): stop a Muon run at step 3 at one layout and resume it
at another; steps 4-6 (loss and grad norm) within 1e-5 relative of the uninterrupted run, and the
final checkpoints' weights and optimizer state within 1e-5 of each tensor's largest value.

Nothing of ours does it: Megatron-Core saves each Muon momentum buffer (and AdamW moment) as a
ShardedTensor like its parameter's (`optim_state_to_sharding_state`: `chained_<i>.optimizer.state.
momentum_buffer.<weight key>`), so dist_checkpointing reshards it as it reshards the weight: the
fused QKV matrix by whole query groups along its rows, the SwiGLU fc1 by its gate and up halves.
The layer-wise distributed optimizer (DP2, bf16) writes each buffer from the rank that owns it,
under the same keys, so its checkpoints load unsharded (DP1, or DP2 without it) and back. fp32
(the layer-wise cases bf16: the only precision it runs) with fp32 Newton-Schulz; no dropout, so
the per-rank RNG states, not restored across layouts, play no part."""

from __future__ import annotations

import pytest
import torch

from checkpoints_tools.dcp_io import CheckpointReader
from checkpoints_tools.reshard import reshard
from models.layout import ParallelLayout
from tests.compare import assert_steps_close, relative_differences
from tests.distributed import run_ranks
from tests.pretrain.test_muon import needs_emerging_optimizers
from tests.pretrain.workers import logged_grad_norms, logged_losses

pytestmark = [pytest.mark.distributed, needs_emerging_optimizers]

STEPS, STOP = 6, 3
BASE = [
    f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2", "schedule.global_batch_size=4",
    "schedule.seq_length=64", "schedule.eval_interval=0", "data.demo=false", "data.mock=true",
    "runtime.spec=portable", "logging.tensorboard=false", f"checkpoint.save_interval={STOP}",
    "model.num_layers=2", "optimizer.lr=1e-2", "optimizer.name=muon", "optimizer.muon.fp32_matmul_prec=highest",
]
UNSHARDED = ["optimizer.distributed=false"]  # plain Muon; at DP 1 the same as the default
BF16 = ["runtime.dtype=bf16", "optimizer.clip_grad=0"]
FOUR_LAYERS = ["model.num_layers=4"]  # PP2 x VPP2 needs a layer per chunk
# name: (ranks and layout of the uninterrupted run, ranks and layout of the resume[, recipe])
CASES = {
    "TP2-to-TP1": ((2, ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"] + UNSHARDED),
                   (1, UNSHARDED)),
    "PP2-to-PP1": ((2, ["parallel.pipeline_parallel=2"] + UNSHARDED), (1, UNSHARDED)),
    "PP2xVPP2-to-TP2": ((2, ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"] + FOUR_LAYERS + UNSHARDED),
                        (2, ["parallel.tensor_parallel=2"] + FOUR_LAYERS + UNSHARDED)),
    # Experts' momentum: dense and expert optimizers are separate chained optimizers at any EP.
    "MoE-EP2-to-EP1": ((2, ["parallel.expert_parallel=2"] + UNSHARDED), (1, UNSHARDED), "tiny-moe"),
    "DP2-layer-wise-to-DP1": ((2, BF16), (1, BF16)),
    "DP2-layer-wise-to-DP2-unsharded": ((2, BF16), (2, BF16 + UNSHARDED)),
    "DP2-unsharded-to-DP2-layer-wise": ((2, BF16 + UNSHARDED), (2, BF16)),
}


def _run(nproc: int, extra: list[str], run_dir, recipe: str = "tiny-llama") -> dict:
    results = run_ranks(nproc, "tests.pretrain.workers:train", recipe=recipe,
                        overrides=BASE + extra + [f"logging.run_dir={run_dir}"])
    return {"losses": logged_losses(results), "grad_norms": logged_grad_norms(results)}


def _tensors(checkpoint) -> dict[str, torch.Tensor]:
    """Every global tensor of a checkpoint (dist_checkpointing's layout-free keys): the weights
    and the optimizer state (`chained_<i>.optimizer.state.<momentum_buffer|exp_avg|...>.<weight>`)."""
    reader = CheckpointReader(checkpoint)
    return {key: reader.read(key) for key in reader.tensor_keys()}


def _worst_tensor_difference(got: dict, want: dict, rtol: float, what: str) -> float:
    """Largest |got - want| of each tensor relative to the largest |want| of that tensor."""
    assert sorted(got) == sorted(want), f"{what}: the checkpoints hold different tensors"
    assert want, f"{what}: no tensors"
    worst = 0.0
    for key in want:
        scale = want[key].float().abs().max().item()
        diff = (got[key].float() - want[key].float()).abs().max().item() / max(scale, 1e-30)
        assert diff <= rtol, f"{what}: {key} differs by {diff:.2e} of its largest value (tolerance {rtol})"
        worst = max(worst, diff)
    return worst


def _uninterrupted(name: str, tmp_path) -> dict:
    """The case's run at its first layout, saving at step STOP and at the end."""
    (nproc, layout), _, *recipe = CASES[name]
    return _run(nproc, layout + [f"checkpoint.dir={tmp_path / 'full'}", "checkpoint.resume=none"],
                tmp_path / "a", *recipe)


def _resumed(name: str, checkpoint, tmp_path) -> dict:
    _, (nproc, layout), *recipe = CASES[name]
    return _run(nproc, layout + [f"checkpoint.dir={tmp_path / 'resumed'}", f"checkpoint.resume={checkpoint}"],
                tmp_path / "b", *recipe)


def _assert_continues(name: str, full: dict, resumed: dict, tmp_path) -> None:
    """Steps STOP+1.. of the resumed run and its final checkpoint vs the uninterrupted run's."""
    assert len(resumed["losses"]) == STEPS - STOP
    worst = {kind: assert_steps_close(resumed[kind], full[kind][STOP:], rtol=1e-5, start=STOP + 1,
                                      what=f"Muon {name} resumed {kind}") for kind in ("losses", "grad_norms")}
    final = f"step_{STEPS:08d}"
    got, want = _tensors(tmp_path / "resumed" / final), _tensors(tmp_path / "full" / final)
    assert any("momentum_buffer" in key for key in want), "no Muon momentum in the checkpoint"
    if "MoE" in name:
        assert any("momentum_buffer" in key and "experts" in key for key in want), "no experts' momentum"
    for kind, is_state in (("weights", False), ("optimizer state", True)):
        def part(tensors):
            return {k: v for k, v in tensors.items() if (".optimizer.state." in k) == is_state}
        worst[kind] = _worst_tensor_difference(part(got), part(want), 1e-5, f"Muon {name} final {kind}")
    print(f"{name}: worst rel diff " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))


@pytest.mark.parametrize("name", list(CASES))
def test_muon_resume_across_layouts(name, tmp_path):
    full = _uninterrupted(name, tmp_path)
    _assert_continues(name, full, _resumed(name, tmp_path / "full" / f"step_{STOP:08d}", tmp_path), tmp_path)


def test_muon_state_survives_the_offline_reshard(tmp_path):
    # checkpoints_tools.reshard keeps every optimizer tensor (momentum buffers included) and
    # rewrites it for the target layout: TP2 + SP -> TP1 offline, then resumed at TP1.
    full = _uninterrupted("TP2-to-TP1", tmp_path)
    tp1 = tmp_path / "tp1"
    assert reshard(tmp_path / "full" / f"step_{STOP:08d}", tp1, layout=ParallelLayout())["optimizer"]
    _assert_continues("TP2-to-TP1 offline", full, _resumed("TP2-to-TP1", tp1, tmp_path), tmp_path)


# Layer-wise at another DP or TP: each rank of the new layout owns other matrices, and in bf16 the
# new layout's own gradient sums move the run (DP2 vs DP4 layer-wise: 1e-5 relative at step 4,
# 9e-5 at step 6), beyond a 1e-5 check of a continued run; so what is checked is the state itself:
# loaded at the new layout and saved at once, every tensor of the checkpoint comes back bitwise.
# name: the layout's overrides on 4 ranks (DP is what the ranks leave over).
ROUND_TRIPS = {"DP4-layer-wise": [], "TP2xDP2-layer-wise": ["parallel.tensor_parallel=2"]}


@pytest.mark.parametrize("name", list(ROUND_TRIPS))
def test_layer_wise_state_loads_bitwise_at_another_layout(name, tmp_path):
    bf16 = BASE + BF16 + ["schedule.micro_batch_size=1"]  # DP4 x 1 sample = the global batch of 4
    run_ranks(2, "tests.pretrain.workers:train", recipe="tiny-llama",
              overrides=bf16 + [f"schedule.train_steps={STOP}", f"checkpoint.dir={tmp_path / 'dp2'}",
                                "checkpoint.resume=none", f"logging.run_dir={tmp_path / 'a'}"])
    saved = tmp_path / "dp2" / f"step_{STOP:08d}"
    run_ranks(4, "tests.pretrain.workers:load_and_save", recipe="tiny-llama", out_dir=str(tmp_path / "again"),
              overrides=bf16 + ROUND_TRIPS[name] + [f"checkpoint.resume={saved}", f"logging.run_dir={tmp_path / 'b'}"])
    want, got = _tensors(saved), _tensors(tmp_path / "again" / f"step_{STOP:08d}")
    assert any("momentum_buffer" in key for key in want), "no Muon momentum in the checkpoint"
    assert sorted(got) == sorted(want), "the checkpoints hold different tensors"
    differ = [key for key in want if not torch.equal(got[key], want[key])]
    assert not differ, f"{name}: loaded and saved again, {len(differ)} tensors changed, e.g. {differ[0]}"


def train_with_momentum_zeroed(recipe: str, overrides: list[str]) -> dict:
    """Rank function: workers.train, with every Muon momentum buffer zeroed right after the
    checkpoint is loaded (what a load that silently dropped Muon's state would leave)."""
    import pretrain.loop

    from tests.pretrain import workers

    setup = pretrain.loop.setup

    def setup_then_zero(config):
        run = setup(config)
        zeroed = 0
        for wrapper in run.state.optimizer.chained_optimizers:
            for state in wrapper.optimizer.state.values():
                if "momentum_buffer" in state:
                    state["momentum_buffer"].zero_()
                    zeroed += 1
        assert zeroed, "no Muon momentum buffer found after the load"
        return run

    pretrain.loop.setup = setup_then_zero
    try:
        return workers.train(recipe, overrides)
    finally:
        pretrain.loop.setup = setup


def test_the_check_fails_when_the_momentum_is_not_loaded(tmp_path):
    # The control: the TP2 -> TP1 resume above with Muon's loaded momentum zeroed must fail the
    # same 1e-5 check (the AdamW moments and the weights still loaded).
    _, (dst_n, dst) = CASES["TP2-to-TP1"]
    full = _uninterrupted("TP2-to-TP1", tmp_path)
    stopped = tmp_path / "full" / f"step_{STOP:08d}"
    results = run_ranks(dst_n, "tests.pretrain.test_muon_reshard:train_with_momentum_zeroed", recipe="tiny-llama",
                        overrides=BASE + dst + [f"checkpoint.dir={tmp_path / 'resumed'}",
                                                f"checkpoint.resume={stopped}", f"logging.run_dir={tmp_path / 'b'}"])
    losses = logged_losses(results)
    assert len(losses) == STEPS - STOP  # else the check below would fail for the wrong reason
    with pytest.raises(AssertionError):
        assert_steps_close(losses, full["losses"][STOP:], rtol=1e-5, start=STOP + 1, what="momentum zeroed")
    print(f"momentum zeroed: worst rel diff {max(relative_differences(losses, full['losses'][STOP:])):.2e}")

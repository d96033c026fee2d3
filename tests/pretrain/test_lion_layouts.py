"""Lion across layouts vs one-rank Lion: same initial weights, same global batch, fp32, per-step
loss, grad norm and every final weight within 1e-5 (issue 46). Lion's update is the sign of a
momentum mix, blind to the gradient's scale: the losses alone would not show a doubled gradient,
the grad norm does. Lion is elementwise, so a TP shard's update is the whole
matrix's update restricted to it: TP2 + SP and DP2 must equal one rank. DP2 with the distributed
optimizer (Megatron-Core's layer-wise one, bf16 only: fp32 is refused, test_lion_config) must
equal DP2 without it, bitwise, in bf16.
"""

from __future__ import annotations

import pytest

from tests.compare import assert_steps_equal
from tests.distributed import run_ranks
from tests.pretrain.test_muon import needs_emerging_optimizers
from tests.pretrain.layout_parity import assert_run_matches, count_sign_flips_allowed, train_to_checkpoint
from tests.pretrain.workers import logged_losses

pytestmark = [pytest.mark.distributed, needs_emerging_optimizers]

STEPS = 4
BASE = [
    f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2", "schedule.global_batch_size=4",
    "schedule.seq_length=64", "schedule.eval_interval=0", "schedule.warmup_steps=1",
    "data.demo=false", "data.mock=true", "runtime.spec=portable", "logging.tensorboard=false",
    "model.num_layers=2", "optimizer.lr=1e-3", "optimizer.name=lion",
]
LAYOUTS = {
    "TP2+SP": ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"],
    "DP2-no-distopt": ["optimizer.distributed=false"],
}


def _run(nproc: int, extra: list[str], run_dir) -> list[dict]:
    return run_ranks(nproc, "tests.pretrain.workers:train", recipe="tiny-llama",
                     overrides=BASE + extra + [f"logging.run_dir={run_dir}"])


def _losses(nproc: int, extra: list[str], run_dir) -> list[float]:
    losses = logged_losses(_run(nproc, extra, run_dir))
    assert len(losses) == STEPS
    return losses


@pytest.fixture(scope="module")
def one_rank(module_tmp_factory):
    return train_to_checkpoint(1, "tiny-llama", BASE + ["optimizer.distributed=false"], module_tmp_factory.mktemp("one"),
                               STEPS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lion_layout_matches_one_rank(name, one_rank, tmp_path):
    got = train_to_checkpoint(2, "tiny-llama", BASE + LAYOUTS[name], tmp_path, STEPS)
    elements = sum(w.numel() for w in one_rank[2].values())
    # lr 1e-3 at most (warmup 1, then decay), STEPS steps: a flipped element ends at most 2 lr x STEPS away.
    print(assert_run_matches(got, one_rank, f"Lion {name}", sign_flips=(count_sign_flips_allowed(elements), 2e-3 * STEPS)))
    losses = got[0]
    assert losses[-1] < losses[0]


def test_lion_dp2_layer_wise_distributed_optimizer_equals_unsharded_dp2_in_bf16(tmp_path):
    # No clipping: the layer-wise optimizer sums the grad norm in another order (test_muon_layouts).
    bf16 = ["runtime.dtype=bf16", "optimizer.clip_grad=0"]
    plain = _losses(2, bf16 + ["optimizer.distributed=false"], tmp_path / "plain")
    sharded = _losses(2, bf16, tmp_path / "layer_wise")  # optimizer.distributed=true: layer-wise ZeRO-1
    assert_steps_equal(sharded, plain, what="Lion DP2 layer-wise vs unsharded, bf16")
    assert sharded[-1] < sharded[0]

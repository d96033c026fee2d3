"""Lion checkpoints (issue 46): stop at step 3 and resume = uninterrupted, bitwise, at DP1 (Lion's
momentum saved and loaded) and at DP2 with the layer-wise distributed optimizer (bf16, the only
precision it runs); a Lion checkpoint resumed as AdamW or Muon is refused in one line."""

from __future__ import annotations

import pytest

from tests.compare import assert_steps_equal
from tests.distributed import RankFailure, run_ranks
from tests.pretrain.test_muon import needs_emerging_optimizers
from tests.pretrain.workers import logged_losses

pytestmark = [pytest.mark.distributed, needs_emerging_optimizers]

BASE = [
    "schedule.train_steps=6", "schedule.micro_batch_size=2", "schedule.global_batch_size=4",
    "schedule.seq_length=64", "schedule.eval_interval=0", "data.demo=false", "data.mock=true",
    "runtime.spec=portable", "logging.tensorboard=false", "checkpoint.save_interval=3", "model.num_layers=2",
    "optimizer.lr=1e-3",
]


def _train(nproc, tmp_path, tag, extra):
    return logged_losses(run_ranks(nproc, "tests.pretrain.workers:train", recipe="tiny-llama",
                                   overrides=BASE + extra + [f"logging.run_dir={tmp_path / tag}"]))


@pytest.mark.parametrize("nproc, layout", [(1, []), (2, ["runtime.dtype=bf16"])],
                         ids=["DP1", "DP2-layer-wise-bf16"])
def test_lion_resume_is_bitwise(tmp_path, nproc, layout):
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    lion = ["optimizer.name=lion"] + layout + [ckpt]
    full = _train(nproc, tmp_path, "full", lion + ["checkpoint.resume=none"])
    resumed = _train(nproc, tmp_path, "resumed", lion + ["checkpoint.resume=3", "checkpoint.on_newer=move_aside"])
    assert_steps_equal(resumed, full[3:], what="Lion resumed loss", start=4)
    assert full[-1] < full[0]


@pytest.mark.parametrize("other", ["adamw", "muon"])
def test_resume_of_a_lion_checkpoint_with_another_optimizer_is_refused_in_one_line(tmp_path, other):
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    _train(1, tmp_path, "lion", ["schedule.train_steps=3", ckpt, "optimizer.name=lion", "checkpoint.resume=none"])
    with pytest.raises(RankFailure, match=rf"holds lion optimizer state, this run has optimizer.name={other}; "
                                          rf"resume with optimizer.name=lion, or start {other} from the weights"):
        _train(1, tmp_path, other, [ckpt, f"optimizer.name={other}"])

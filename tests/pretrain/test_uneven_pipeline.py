"""Uneven pipeline stages (Megatron-Core's embedding/loss-in-split and first/last stage counts)
against one rank: same initial weights and batch, fp32, per-step loss and grad norm within 1e-5
relative, every final weight in the checkpoint within 1e-5 (the checkpoint holds global tensors,
so it reshards), and a resume of the uneven run's checkpoint on one rank continues it."""

from __future__ import annotations

import pytest

from checkpoints_tools.dcp_io import CheckpointReader
from tests.compare import assert_steps_close
from tests.distributed import run_ranks
from tests.pretrain.workers import logged_grad_norms, logged_losses

pytestmark = [pytest.mark.distributed]

STEPS = 4
# 4 micro-batches of 2 per step (as tests/pretrain/test_parity.py); an lr where a doubled
# gradient moves the next losses by far more than the tolerance (test_sharded_dp shows it).
BASE = [
    f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2", "schedule.global_batch_size=8",
    "schedule.seq_length=64", "schedule.eval_interval=0", "schedule.warmup_steps=2",
    "data.demo=false", "data.mock=true", "runtime.spec=portable", "logging.tensorboard=false",
    "logging.log_interval=1", "optimizer.lr=3e-3", "optimizer.clip_grad=1e9", "checkpoint.save_interval=2",
    "checkpoint.resume=none",
]
# tiny-llama has 4 layers: 4 + 2 = 6 slots over PP3 -> [1, 2, 1] transformer layers.
EMB_LOSS = ["parallel.pipeline_parallel=3", "parallel.account_for_embedding_in_pipeline_split=true",
            "parallel.account_for_loss_in_pipeline_split=true"]


def _train(root, tag, nproc, extra):
    results = run_ranks(nproc, "tests.pretrain.workers:train", recipe="tiny-llama",
                        overrides=BASE + extra + [f"checkpoint.dir={root / tag / 'ckpt'}",
                                                  f"logging.run_dir={root / tag}"])
    return results, root / tag / "ckpt"


def _weights(step_dir):
    reader = CheckpointReader(step_dir)
    return {k: reader.read(k) for k in reader.tensor_keys() if not k.startswith("optimizer.")}


@pytest.fixture(scope="module")
def one_rank(module_tmp_factory):
    return _train(module_tmp_factory.mktemp("uneven"), "one", 1, [])


def test_embedding_and_loss_in_the_split_match_one_rank(one_rank, tmp_path):
    one, one_ckpt = one_rank
    three, three_ckpt = _train(tmp_path, "pp3", 3, EMB_LOSS)
    # Megatron-Core built the split the layout promised: global layer numbers per stage.
    assert [r["layers"] for r in three] == [[1], [2, 3], [4]]
    assert_steps_close(logged_losses(three), logged_losses(one), rtol=1e-5, what="PP3 emb/loss loss")
    assert_steps_close(logged_grad_norms(three), logged_grad_norms(one), rtol=1e-5, what="PP3 emb/loss grad norm")
    final = f"step_{STEPS:08d}"
    mine, theirs = _weights(three_ckpt / final), _weights(one_ckpt / final)
    assert mine.keys() == theirs.keys() and any("decoder.layers" in k for k in mine)
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
    assert worst <= 1e-5, worst
    # The uneven checkpoint resumes at one rank (another split) and continues the run.
    resumed = run_ranks(1, "tests.pretrain.workers:train", recipe="tiny-llama", overrides=BASE + [
        f"checkpoint.resume={three_ckpt / 'step_00000002'}", f"checkpoint.dir={tmp_path / 'resumed' / 'ckpt'}",
        f"logging.run_dir={tmp_path / 'resumed'}"])
    assert_steps_close(logged_losses(resumed), logged_losses(three)[2:], rtol=1e-5, what="resumed at PP1")


def test_first_stage_count_matches_one_rank(one_rank, tmp_path):
    one, _ = one_rank
    two, _ = _train(tmp_path, "pp2", 2, ["parallel.pipeline_parallel=2", "parallel.num_layers_in_first_pipeline_stage=1"])
    assert [r["layers"] for r in two] == [[1], [2, 3, 4]]
    assert_steps_close(logged_losses(two), logged_losses(one), rtol=1e-5, what="PP2 [1, 3] loss")
    assert_steps_close(logged_grad_norms(two), logged_grad_norms(one), rtol=1e-5, what="PP2 [1, 3] grad norm")

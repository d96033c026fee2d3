"""schedule.final_eval_steps: the held-out set is the same documents for every run with the
same data, seed, sequence and batch, whatever its train_steps or periodic evaluations, and
it comes from the validation split (no document the training reads)."""

from __future__ import annotations

import numpy as np
import pytest

from pretrain.config import apply_overrides
from pretrain.data import build_datasets, heldout_samples
from pretrain.recipes import get_recipe

BASE = ["runtime.spec=portable", "schedule.seq_length=64", "schedule.micro_batch_size=8",
        "schedule.global_batch_size=8", "schedule.final_eval_steps=4"]


def _config(tmp_path, *extra):
    return apply_overrides(get_recipe("tiny-llama"), overrides=[
        *BASE, f"data.cache_dir={tmp_path / 'cache'}", f"logging.run_dir={tmp_path / 'run'}", *extra])


def _tokens(dataset, n):
    return np.stack([np.asarray(dataset[i]["tokens"]) for i in range(n)])


def test_the_held_out_set_does_not_depend_on_train_steps_or_eval_interval(tmp_path):
    short = _config(tmp_path, "schedule.train_steps=10", "schedule.eval_interval=0")
    # 1001 periodic evaluations of 20 batches: far more validation samples than one epoch of
    # the split holds, so Megatron shuffles several epochs together for that dataset.
    long = _config(tmp_path, "schedule.train_steps=1000", "schedule.eval_interval=1", "schedule.eval_steps=20")
    a, b = build_datasets(short, 1), build_datasets(long, 1)
    n = heldout_samples(short)
    assert n == 32 and len(a.heldout) >= n
    np.testing.assert_array_equal(_tokens(a.heldout, n), _tokens(b.heldout, n))
    # The periodic evaluations' dataset of the long run orders its samples otherwise: the reason
    # the held-out set is a build of its own.
    assert not np.array_equal(_tokens(b.valid, n), _tokens(a.heldout, n))
    # Held out: none of its samples is a training sample of the run.
    train = {np.asarray(a.train[i]["tokens"]).tobytes() for i in range(len(a.train))}
    assert not any(np.asarray(a.heldout[i]["tokens"]).tobytes() in train for i in range(n))
    assert build_datasets(_config(tmp_path, "schedule.final_eval_steps=0"), 1).heldout is None


def test_a_held_out_evaluation_needs_a_validation_split(tmp_path):
    from pretrain.config import ConfigError

    with pytest.raises(ConfigError, match="schedule.final_eval_steps=4 needs validation data"):
        _config(tmp_path, "data.split=100,0,0", "schedule.eval_interval=0")


def test_a_held_out_set_larger_than_the_validation_split_is_refused_before_it_repeats(tmp_path):
    """The demo's validation split holds 50 batches of 8 x 64 tokens: the 51st would make
    Megatron start a second epoch (documents counted twice), so it is refused in one line."""
    from pretrain.config import ConfigError
    from pretrain.config.validation import validate_data

    fits = _config(tmp_path, "schedule.final_eval_steps=50")
    validate_data(fits, prepare_demo=True)
    too_many = _config(tmp_path, "schedule.final_eval_steps=51")
    with pytest.raises(ConfigError, match=r"final_eval_steps=51 .* \(405 samples before its documents repeat\); "
                                          r"set schedule.final_eval_steps<=50"):
        validate_data(too_many, prepare_demo=True)
    # The boundary is Megatron's own: 50 batches are one epoch of the split, 51 are two.
    documents = [len(build_datasets(c, 1).heldout.document_index) for c in (fits, too_many)]
    assert documents[1] == 2 * documents[0]

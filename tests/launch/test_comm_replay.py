"""launch.comm_replay: one ZeRO-3 step's collectives (flight recorder), replayed by fresh gloo ranks."""

import json

from launch import comm_replay
from models.flops import total_params
from pretrain.cli import resolve_config

OVERRIDES = ["data.demo=false", "data.mock=true", "runtime.spec=portable", "parallel.sharding=zero3",
             "schedule.seq_length=32", "schedule.micro_batch_size=2", "schedule.global_batch_size=8"]


def test_a_zero3_step_replays_its_gathers_and_reduce_scatters(capsys):
    code = comm_replay.main(["--recipe", "tiny-llama", "--nproc", "2", "--steps", "2", "--iters", "2",
                             "--repeats", "2", *OVERRIDES])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["comm_only_s"] > 0 and len(result["comm_only_per_repeat_s"]) == 2
    elements = result["input_elements"]
    n_params = total_params(resolve_config("tiny-llama", None, OVERRIDES).model)
    # gbs 8 / (mbs 2 x DP 2) = 2 micro-batches per rank. ZeRO-3 reduce-scatters every
    # gradient after each of them, which gloo runs as an all-reduce of the whole bucket:
    # twice the (padded) parameters per step, plus a few scalars (loss, grad norm). The
    # tensor-parallel group's collectives (TP 1: one rank) are not replayed.
    assert 2 * n_params <= elements["all_reduce"] <= 2 * 1.01 * n_params
    # Every weight is gathered at least once per step, each rank sending its half.
    assert elements["all_gather"] >= n_params / 2
    # fp32 weights and gradients (a few int64 counters besides).
    assert 4 * sum(elements.values()) <= result["input_bytes_per_step"] <= 4 * sum(elements.values()) + 64

"""tiny-llama trains at world size 4 in several layouts on real text; each PP stage builds
only its own layers; the run leaves metrics.jsonl and TensorBoard events."""

from __future__ import annotations

import json

import pytest

from models.config import get_flavor
from models.flops import embedding_params, layer_params, output_params
from tests.distributed import run_ranks
from tests.pretrain.workers import logged_losses

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 30
BASE = [
    f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2", "schedule.global_batch_size=8",
    "schedule.seq_length=64", "schedule.eval_interval=0", "schedule.warmup_steps=5",
    "data.demo=true", "runtime.spec=portable", "logging.log_interval=10",
]
LAYOUTS = {
    "TP2xPP2": ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"],
    "PP2xVPP2xDP2": ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"],
    "TP2xDP2": ["parallel.tensor_parallel=2"],
    "DP4": [],
}


def _expected_params(tp: int, first: bool, last: bool, layers: int) -> int:
    """Parameters one rank should hold: its layers (TP-sharded), plus embedding/output if it
    is the first/last stage. Norm weights are replicated, everything else split by TP."""
    model = get_flavor("tiny-llama")
    h = model.hidden_size
    norms = 2 * h
    count = layers * ((layer_params(model) - norms) // tp + norms)
    if first:
        count += embedding_params(model) // tp
    if last:
        count += (output_params(model) - h) // tp + h
    return count


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trains_and_each_stage_builds_its_layers(name, tmp_path):
    extra = LAYOUTS[name]
    results = run_ranks(4, "tests.pretrain.workers:train", recipe="tiny-llama",
                        overrides=BASE + extra + [f"logging.run_dir={tmp_path}"])
    losses = logged_losses(results)
    assert len(losses) == STEPS
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, f"loss did not fall: {losses[0]} -> {losses[-5:]}"

    tp = 2 if "parallel.tensor_parallel=2" in extra else 1
    pp = 2 if "parallel.pipeline_parallel=2" in extra else 1
    num_layers = get_flavor("tiny-llama").num_layers
    for rank, r in enumerate(results):
        assert len(r["layers"]) == num_layers // pp, f"rank {rank} built layers {r['layers']}"
        want = _expected_params(tp, r["first_stage"], r["last_stage"], len(r["layers"]))
        assert r["params"] == want, f"rank {rank}: {r['params']} parameters, expected {want}"
    if pp == 2:
        built = sorted({layer for r in results for layer in r["layers"]})
        assert built == list(range(1, num_layers + 1))

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30]
    assert all(r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0 for r in records)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "config.yaml").is_file()

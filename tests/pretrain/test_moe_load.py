"""Per-layer expert load in metrics.jsonl (pretrain.moe_load): the numbers of one rank are the
numbers of EP2 (experts and the batch split over two ranks), PP2 (layers split over two
stages) and full activation recompute, for the same run of tiny-qwen3-moe (8 experts, top-4,
4 layers), logged every 2 steps (the load counts every micro-batch of the 2 steps since the
last log)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pretrain.moe_load import ExpertLoad
from tests.distributed import run_ranks

STEPS, INTERVAL = 5, 2
BASE = [
    "model=tiny-qwen3-moe", f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2",
    "schedule.global_batch_size=8", "schedule.seq_length=64", "schedule.eval_interval=0",
    "schedule.warmup_steps=2", "data.demo=false", "data.mock=true", "runtime.spec=portable",
    "logging.tensorboard=false", f"logging.log_interval={INTERVAL}", "optimizer.lr=1e-2",
    "checkpoint.save_interval=0", "checkpoint.resume=none",
]
LOAD_KEYS = ("moe_load_max", "moe_load_min", "moe_load_cv", "moe_aux_loss_layers")
# name -> (ranks, overrides); full recompute re-runs each layer's forward inside backward,
# which must not count twice.
LAYOUTS = {"EP2": (2, ["parallel.expert_parallel=2"]), "PP2": (2, ["parallel.pipeline_parallel=2"]),
           "recompute": (1, ["runtime.recompute=full"])}


def _logged(root, tag: str, nproc: int, extra: list[str]) -> list[dict]:
    run_ranks(nproc, "tests.pretrain.workers:train", recipe="tiny-llama",
              overrides=BASE + extra + [f"checkpoint.dir={root / tag / 'ckpt'}", f"logging.run_dir={root / tag}"])
    records = [json.loads(line) for line in (root / tag / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("step",) + LOAD_KEYS} for r in records]


@pytest.fixture(scope="module")
def one_rank(module_tmp_factory) -> list[dict]:
    records = _logged(module_tmp_factory.mktemp("moe-load"), "ref", 1, [])
    assert [r["step"] for r in records] == [2, 4, 5]
    for r in records:
        assert all(len(r[k]) == 4 for k in LOAD_KEYS), r  # every layer is a MoE layer
        assert all(hi > 1.0 > lo >= 0.0 for hi, lo in zip(r["moe_load_max"], r["moe_load_min"])), r
        assert all(cv > 0 for cv in r["moe_load_cv"]) and all(a > 0 for a in r["moe_aux_loss_layers"]), r
    return records


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logged_load_is_layout_invariant(one_rank, tmp_path, layout):
    got = _logged(tmp_path, layout, *LAYOUTS[layout])
    assert [r["step"] for r in got] == [r["step"] for r in one_rank]
    worst = 0.0
    for ours, ref in zip(got, one_rank):
        for key in LOAD_KEYS:
            # Token counts are integers (exact); the aux loss is a float sum in another order.
            diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours[key], ref[key])]
            assert len(ours[key]) == len(ref[key]) and max(diffs) <= 1e-5, (layout, ours["step"], key, ours, ref)
            worst = max(worst, max(diffs))
    print(f"\n{layout}: logged expert load and per-layer aux loss vs one rank, max relative difference {worst:.1e}")


def test_take_summarises_each_layer_and_resets():
    """The formulas on known counts: layer 0 even, layer 1 (no tokens: a dense layer) left
    out, layer 2 one expert with all tokens."""
    load = ExpertLoad([], num_layers=3, num_experts=4, device=torch.device("cpu"))
    load.counts[0] = torch.tensor([5.0, 5.0, 5.0, 5.0])
    load.counts[2] = torch.tensor([8.0, 0.0, 0.0, 0.0])
    got = load.take()
    assert got["moe_load_max"] == [1.0, 4.0] and got["moe_load_min"] == [1.0, 0.0]
    assert got["moe_load_cv"][0] == 0.0 and math.isclose(got["moe_load_cv"][1], math.sqrt(3.0))
    assert load.counts.sum() == 0

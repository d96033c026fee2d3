"""Aux-loss-free routing (model.moe_router_enable_expert_bias, sigmoid scores): the expert bias
that Megatron-Core's finalize_model_grads moves after every global batch is trained the same at
EP2 and at ZeRO-3 DP2 (Megatron-FSDP; slow) as on one rank, kept in the checkpoint and restored
on resume; bad settings are refused in one line before any process group.

tiny-qwen3-moe with sigmoid scores, the bias on at rate 1e-2 and the aux loss off (so only the
bias balances), fp32, at test_parity.py's lr: per-step loss and grad norm within 1e-5, the
logged expert load equal, and every final weight and bias within 1e-5.
"""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints_tools.dcp_io import CheckpointReader
from models.config import ModelConfig, get_flavor
from tests.compare import assert_steps_close
from tests.distributed import run_ranks

STEPS, RATE = 5, 1e-2
BASE = [
    "model=tiny-qwen3-moe", f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2",
    "schedule.global_batch_size=8", "schedule.seq_length=64", "schedule.eval_interval=0",
    "schedule.warmup_steps=2", f"schedule.decay_steps={STEPS}", "data.demo=false", "data.mock=true",
    "runtime.spec=portable", "logging.tensorboard=false", "logging.log_interval=1", "optimizer.lr=1e-2",
    "checkpoint.resume=none",
    "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
    f"model.moe_router_bias_update_rate={RATE}", "model.moe_aux_loss_coeff=0",
]
BIAS = "decoder.layers.mlp.router.expert_bias"
OPTIMIZER_PREFIXES = ("optimizer.", "chained_")


def _run(root, tag: str, nproc: int, extra: list[str], steps: int = STEPS) -> dict:
    run_ranks(nproc, "tests.pretrain.workers:train", recipe="tiny-llama",
              overrides=BASE + extra + [f"checkpoint.dir={root / 'ckpt'}", f"logging.run_dir={root / tag}"])
    records = [json.loads(line) for line in (root / tag / "metrics.jsonl").read_text().splitlines()]
    reader = CheckpointReader(root / "ckpt" / f"step_{steps:08d}")
    weights = {k: reader.read(k) for k in reader.tensor_keys() if not k.startswith(OPTIMIZER_PREFIXES)}
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
            "load": [v for r in records for v in r["moe_load_max"] + r["moe_load_cv"]], "weights": weights}


@pytest.fixture(scope="module")
def reference(module_tmp_factory) -> dict:
    ref = _run(module_tmp_factory.mktemp("bias-ref"), "ref", 1, [f"checkpoint.save_interval={STEPS}"])
    bias = ref["weights"][BIAS]
    assert bias.shape == (4, 8), "layers x experts"
    # One step of +-RATE (or 0 at an exactly mean load) per expert and global batch.
    steps = bias / RATE
    assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= STEPS, bias
    assert (bias != 0).sum() >= 16, f"the bias barely moved: {bias}"
    # Balanced means: the update moves each layer's biases toward opposite signs.
    assert all((row > 0).any() and (row < 0).any() for row in bias), bias
    return ref


LAYOUTS = {"EP2": ["parallel.expert_parallel=2"],
           # Megatron-FSDP: the router (and its bias buffer) in a sharded wrapper, experts over expert-DP 2.
           "DP2-ZeRO3": ["parallel.sharding=zero3"]}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["EP2", pytest.param("DP2-ZeRO3", marks=pytest.mark.slow)])
def test_expert_bias_layout_matches_one_rank(reference, tmp_path, name):
    got = _run(tmp_path, name, 2, LAYOUTS[name] + [f"checkpoint.save_interval={STEPS}"])
    loss = assert_steps_close(got["loss"], reference["loss"], rtol=1e-5, what=f"{name} loss")
    norm = assert_steps_close(got["grad_norm"], reference["grad_norm"], rtol=1e-5, what=f"{name} grad norm")
    assert got["load"] == pytest.approx(reference["load"], rel=1e-9), f"{name} logged another expert load"
    keys = sorted(reference["weights"])
    assert keys == sorted(got["weights"]) and BIAS in keys
    assert torch.equal(got["weights"][BIAS], reference["weights"][BIAS]), "the expert bias differs"
    worst = {k: (got["weights"][k] - reference["weights"][k]).abs().max().item() for k in keys}
    top = max(worst, key=worst.get)
    print(f"\n{name} with the expert bias: loss {loss:.1e}, grad norm {norm:.1e} (max relative), "
          f"weights {worst[top]:.1e} ({top}); bias equal")
    assert worst[top] <= 1e-5, (top, worst[top])


@pytest.mark.distributed
def test_resume_restores_the_expert_bias(reference, tmp_path):
    """Steps 1-3 at EP2, then 4-5 resumed from the step-3 checkpoint at one rank (the LR
    schedule spans 5 steps in both): the bias comes back from the checkpoint (a bias restarted
    at zero would route differently)."""
    _run(tmp_path, "first", 2, ["parallel.expert_parallel=2", "schedule.train_steps=3",
                                "checkpoint.save_interval=3"], steps=3)
    got = _run(tmp_path, "resumed", 1, ["checkpoint.resume=auto", f"checkpoint.save_interval={STEPS}"])
    assert_steps_close(got["loss"], reference["loss"][3:], rtol=1e-5, what="resumed loss")
    diff = (got["weights"][BIAS] - reference["weights"][BIAS]).abs().max().item()
    assert diff == 0.0, f"resumed bias differs from the uninterrupted run's by {diff}"


@pytest.mark.parametrize("update, message", [
    ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias=true needs moe_router_score_function="
                                              "sigmoid"),
    ({"moe_router_bias_update_rate": 1e-3}, "moe_router_bias_update_rate is set but moe_router_enable_expert_bias"
                                            "=false"),
    ({"moe_router_score_function": "sigmoid", "moe_router_pre_softmax": True}, "moe_router_pre_softmax=true is a "
                                                                               "softmax option"),
    ({"moe_router_score_function": "softplus"}, "moe_router_score_function"),
    ({"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid",
      "moe_router_bias_update_rate": 0.0}, "moe_router_bias_update_rate"),
])
def test_bad_router_settings_are_refused(update, message):
    fields = {**get_flavor("tiny-qwen3-moe").model_dump(), **update}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ModelConfig(**fields)


def test_router_settings_need_experts():
    fields = {**get_flavor("tiny-qwen3").model_dump(), "moe_router_score_function": "sigmoid",
              "moe_router_enable_expert_bias": True}
    with pytest.raises(ValueError, match="moe_router_enable_expert_bias, moe_router_score_function need"):
        ModelConfig(**fields)


def test_export_refuses_what_mixtral_and_qwen3_moe_cannot_hold():
    """Neither HF class has sigmoid routing or a routing bias: the export names both fields
    (before it reads any tensor)."""
    from checkpoints_tools.mapping import check_hf_compatible

    fields = {**get_flavor("tiny-qwen3-moe").model_dump(), "moe_router_score_function": "sigmoid",
              "moe_router_enable_expert_bias": True}
    with pytest.raises(ValueError) as error:
        check_hf_compatible(ModelConfig(**fields))
    message = str(error.value)
    assert "\n" not in message and "moe_router_score_function=sigmoid" in message
    assert "moe_router_enable_expert_bias=true" in message

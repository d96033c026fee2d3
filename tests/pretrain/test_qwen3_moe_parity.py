"""tiny-qwen3-moe (q/k RMSNorm, head_dim 32 != hidden / heads, 8 experts of 64, top-4
renormalised, aux loss 1e-3) in parallel layouts against one rank (issue 45).

Same initial weights (layout-invariant init: router and every expert included), same global
batch, fp32, at test_parity.py's lr: per-step loss, grad norm and MoE aux loss within 1e-5
relative for 5 steps, and every final weight (read from the checkpoints the runs write: global
tensors, all experts, whatever the layout) within 1e-5 absolute (the TP layouts: grad norm 1e-4
and a few near-zero-gradient elements up to 1e-3, `NEAR_ZERO` says why). EP2 puts 4 whole experts on
each rank (tokens exchanged by the all-to-all dispatcher); TP2 + SP splits every expert's 64
columns over the two ranks (expert TP = TP) and the q/k norms' gradients are summed over TP;
PP2 x VPP2 gives each of the 4 chunks one layer (the aux loss summed over stages); ZeRO-3 DP2
shards every expert over expert-DP 2 (Megatron-FSDP). All but EP2 are marked slow.
"""

from __future__ import annotations

import json

import pytest

from checkpoints_tools.dcp_io import CheckpointReader
from tests.compare import assert_steps_close
from tests.distributed import run_ranks

pytestmark = [pytest.mark.distributed]

STEPS = 5
BASE = [
    "model=tiny-qwen3-moe", f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2",
    "schedule.global_batch_size=8", "schedule.seq_length=64", "schedule.eval_interval=0",
    "schedule.warmup_steps=2", "data.demo=false", "data.mock=true", "runtime.spec=portable",
    "logging.tensorboard=false", "logging.log_interval=1", "optimizer.lr=1e-2",
    f"checkpoint.save_interval={STEPS}", "checkpoint.resume=none",
]
EP2 = ["parallel.expert_parallel=2"]
TP2_SP = ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]
LAYOUTS = {  # name -> (ranks, overrides)
    "EP2": (2, EP2),
    "TP2-SP": (2, TP2_SP),
    "EP2xTP2-SP": (4, EP2 + TP2_SP),
    "PP2xVPP2": (2, ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"]),  # one layer per chunk
    "DP2-ZeRO3": (2, ["parallel.sharding=zero3"]),  # Megatron-FSDP: experts sharded over expert-DP 2
}
# TP layouts: (grad norm rtol, share of weight elements allowed past 1e-5, bound on every element).
# fp32 Adam at lr 1e-2 steps an element by m / (sqrt(v) + eps): where the gradient is a cancellation
# near 0, TP's other summation order changes that step by up to ~lr. On a Sapphire Rapids VM
# (AVX512-FP16, 2026-11-29) TP2-SP ended with 177 weight elements past 1e-5 (worst 1.5e-4, an
# embedding row), loss 2.7e-7 and aux loss 3.1e-7 relative, grad norm 4.9e-5 at step 5 (EP2xTP2-SP:
# 5.1e-5, 1.5e-4); earlier VMs passed at 1e-5 everywhere. Losses and aux losses stay at 1e-5.
NEAR_ZERO = {"TP2-SP": (1e-4, 5e-4, 1e-3), "EP2xTP2-SP": (1e-4, 5e-4, 1e-3)}
OPTIMIZER_PREFIXES = ("optimizer.", "chained_")
EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
ROUTER = "decoder.layers.mlp.router.weight"


def _run(root, tag: str, nproc: int, extra: list[str]) -> dict:
    results = run_ranks(nproc, "tests.pretrain.workers:train", recipe="tiny-llama",
                        overrides=BASE + extra + [f"checkpoint.dir={root / tag / 'ckpt'}",
                                                  f"logging.run_dir={root / tag}"])
    records = [json.loads(line) for line in (root / tag / "metrics.jsonl").read_text().splitlines()]
    reader = CheckpointReader(root / tag / "ckpt" / f"step_{STEPS:08d}")
    weights = {k: reader.read(k) for k in reader.tensor_keys() if not k.startswith(OPTIMIZER_PREFIXES)}
    log_rank = next(r for r in results if r["log_rank"])
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
            "aux": log_rank["moe_aux_losses"], "weights": weights}


@pytest.fixture(scope="module")
def reference(module_tmp_factory) -> dict:
    ref = _run(module_tmp_factory.mktemp("qwen3-moe-ref"), "ref", 1, [])
    assert len(ref["loss"]) == STEPS and ref["loss"][-1] < ref["loss"][0], "the run must train"
    assert ref["weights"][EXPERT_FC1].shape == (4, 8, 128, 128), "layers x experts x (gate 64 + up 64) x hidden"
    assert ref["weights"][ROUTER].shape == (4, 8, 128)
    assert all(a is not None and a > 0 for a in ref["aux"]), f"aux loss not reported: {ref['aux']}"
    return ref


@pytest.mark.parametrize("name", ["EP2"] + [pytest.param(n, marks=pytest.mark.slow)
                                           for n in ("TP2-SP", "EP2xTP2-SP", "PP2xVPP2", "DP2-ZeRO3")])
def test_qwen3_moe_layout_matches_one_rank(reference, tmp_path, name):
    nproc, extra = LAYOUTS[name]
    got = _run(tmp_path, name, nproc, extra)
    loss = assert_steps_close(got["loss"], reference["loss"], rtol=1e-5, what=f"{name} loss")
    norm = assert_steps_close(got["grad_norm"], reference["grad_norm"], rtol=NEAR_ZERO.get(name, (1e-5,))[0],
                              what=f"{name} grad norm")
    aux = assert_steps_close(got["aux"], reference["aux"], rtol=1e-5, what=f"{name} aux loss")
    keys = sorted(reference["weights"])
    assert keys == sorted(got["weights"]), "the two checkpoints hold different model tensors"
    assert EXPERT_FC1 in keys and ROUTER in keys and any("k_layernorm" in k for k in keys)
    diffs = {k: (got["weights"][k] - reference["weights"][k]).abs() for k in keys}
    worst = {k: d.max().item() for k, d in diffs.items()}
    top = max(worst, key=worst.get)
    over = {k: int((d > 1e-5).sum()) for k, d in diffs.items()}
    print(f"\n{name}: loss {loss:.1e}, grad norm {norm:.1e}, aux {aux:.1e} (max relative), "
          f"weights {worst[top]:.1e} ({top}); elements past 1e-5: { {k: v for k, v in over.items() if v} }")
    if name in NEAR_ZERO:
        _, fraction, bound = NEAR_ZERO[name]
        assert sum(over.values()) <= fraction * sum(w.numel() for w in reference["weights"].values()), over
        assert worst[top] <= bound, (top, worst[top])
    else:
        assert worst[top] <= 1e-5, (top, worst[top])

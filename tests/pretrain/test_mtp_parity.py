"""tiny-deepseek with one multi-token prediction layer (Megatron-Core's MultiTokenPredictionBlock on
our portable spec: MLA + a MoE layer like the last, PortableNorm norms) in parallel layouts against
one rank (issue 45).

Same initial weights (the layout-invariant init covers mtp.*), same global batch, fp32, at
test_deepseek_parity.py's lr: per-step loss, MTP loss and grad norm within 1e-5 relative for 5
steps, and every final weight (the MTP layer's included, read from the checkpoints the runs
write) within 1e-5 absolute. TP2 + SP splits the MTP layer's 2h -> h projection and its MLA
(the embedding and hidden norms run on sequence-sharded tokens); EP2 splits its experts; PP2 and
PP2 x VPP2 put it on the last stage, beside a synchronised copy of the embedding (Megatron-Core
all-reduces the two copies' gradients over the embedding group); DP2 under ZeRO-3 (Megatron-FSDP)
shards it with the rest.

At this lr a doubled MTP gradient shows: mtp_loss_scaling_factor 0.2 instead of 0.1 (twice the
MTP layer's gradient, and twice its share in the shared weights') moves the step-5 loss far
beyond 1e-5 (test_a_doubled_mtp_gradient_shows).
"""

from __future__ import annotations

import json

import pytest

from checkpoints_tools.dcp_io import CheckpointReader
from models.config import get_flavor
from models.flops import mtp_params, total_params
from tests.compare import assert_steps_close, relative_differences
from tests.distributed import run_ranks

pytestmark = [pytest.mark.distributed]

STEPS = 5
BASE = [
    "model=tiny-deepseek", "model.mtp_num_layers=1", f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2",
    "schedule.global_batch_size=8", "schedule.seq_length=64", "schedule.eval_interval=0",
    "schedule.warmup_steps=2", "data.demo=false", "data.mock=true", "runtime.spec=portable",
    "logging.tensorboard=false", "logging.log_interval=1", "optimizer.lr=1e-2",
    f"checkpoint.save_interval={STEPS}", "checkpoint.resume=none",
]
LAYOUTS = {  # name -> (ranks, overrides)
    "EP2": (2, ["parallel.expert_parallel=2"]),
    "TP2-SP": (2, ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]),
    "PP2": (2, ["parallel.pipeline_parallel=2"]),
    "PP2-VPP2": (2, ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"]),
    "DP2-ZeRO3": (2, ["parallel.sharding=zero3"]),  # Megatron-FSDP shards the MTP layer too
}
OPTIMIZER_PREFIXES = ("optimizer.", "chained_")
EH_PROJ = "mtp.layers.0.eh_proj.weight"
MTP_EXPERT_BIAS = "mtp.layers.0.transformer_layer.mlp.router.expert_bias"  # its checkpoint name


def _run(root, tag: str, nproc: int, extra: list[str]) -> dict:
    results = run_ranks(nproc, "tests.pretrain.workers:train", recipe="tiny-deepseek",
                        overrides=BASE + extra + [f"checkpoint.dir={root / tag / 'ckpt'}",
                                                  f"logging.run_dir={root / tag}"])
    records = [json.loads(line) for line in (root / tag / "metrics.jsonl").read_text().splitlines()]
    reader = CheckpointReader(root / tag / "ckpt" / f"step_{STEPS:08d}")
    weights = {k: reader.read(k) for k in reader.tensor_keys() if not k.startswith(OPTIMIZER_PREFIXES)}
    return {"loss": [r["loss"] for r in records], "mtp_loss": [r["mtp_loss"] for r in records],
            "grad_norm": [r["grad_norm"] for r in records], "weights": weights, "ranks": results,
            "moe_load_max": records[-1]["moe_load_max"]}


@pytest.fixture(scope="module")
def reference(module_tmp_factory) -> dict:
    ref = _run(module_tmp_factory.mktemp("mtp-ref"), "ref", 1, [])
    assert len(ref["loss"]) == STEPS and ref["loss"][-1] < ref["loss"][0], "the run must train"
    assert ref["mtp_loss"][-1] < ref["mtp_loss"][0], "the MTP loss must fall"
    w = ref["weights"]
    assert w[EH_PROJ].shape == (128, 256), w[EH_PROJ].shape  # [h, 2h]: joins hidden state and embedding
    assert w[MTP_EXPERT_BIAS].abs().max() > 0, "the MTP layer's expert bias never moved"
    # 3 MoE decoder layers + the MTP layer's routers count their tokens (pretrain.moe_load).
    assert len(ref["moe_load_max"]) == 4, ref["moe_load_max"]
    return ref


def test_parameter_count_matches_the_formula(reference):
    """models.flops counts the MTP layer (2h -> h, three norms, a MoE layer like the last)."""
    model = get_flavor("tiny-deepseek").model_copy(update=dict(mtp_num_layers=1))
    built = reference["ranks"][0]["params"]
    assert built == total_params(model)
    assert built - total_params(get_flavor("tiny-deepseek")) == mtp_params(model) > 0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mtp_layout_matches_one_rank(reference, tmp_path, name):
    nproc, extra = LAYOUTS[name]
    got = _run(tmp_path, name, nproc, extra)
    loss = assert_steps_close(got["loss"], reference["loss"], rtol=1e-5, what=f"{name} loss")
    mtp = assert_steps_close(got["mtp_loss"], reference["mtp_loss"], rtol=1e-5, what=f"{name} MTP loss")
    norm = assert_steps_close(got["grad_norm"], reference["grad_norm"], rtol=1e-5, what=f"{name} grad norm")
    keys = sorted(reference["weights"])
    assert keys == sorted(got["weights"]), "the two checkpoints hold different model tensors"
    assert EH_PROJ in keys and MTP_EXPERT_BIAS in keys, keys
    worst = {k: (got["weights"][k] - reference["weights"][k]).abs().max().item() for k in keys}
    top = max(worst, key=worst.get)
    print(f"\n{name}: loss {loss:.1e}, MTP loss {mtp:.1e}, grad norm {norm:.1e} (max relative), "
          f"weights {worst[top]:.1e} ({top})")
    assert worst[top] <= 1e-5, (top, worst[top])


def test_a_doubled_mtp_gradient_shows(reference, tmp_path):
    """The parity tolerance catches an MTP gradient twice too large (e.g. a layout summing it
    twice): mtp_loss_scaling_factor 0.2 for 0.1 at the same lr."""
    doubled = _run(tmp_path, "doubled", 1, ["model.mtp_loss_scaling_factor=0.2"])
    assert doubled["loss"][0] == reference["loss"][0]  # same start: only the gradient differs
    worst = max(relative_differences(doubled["loss"], reference["loss"], what="loss"))
    assert worst > 1e-3, worst
    worst_mtp = max(relative_differences(doubled["mtp_loss"], reference["mtp_loss"], what="MTP loss"))
    assert worst_mtp > 1e-3, worst_mtp

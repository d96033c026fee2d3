"""Sharded data parallelism (ZeRO-2, ZeRO-3, HSDP through Megatron-FSDP) against one rank.

Every layout trains 5 steps from the same initial weights and global batch, fp32, at an lr
where a doubled gradient moves the next losses (checked below), with clipping out of reach
(a clipped norm would hide a gradient-scale bug). Per-step loss and grad norm within 1e-5
relative, and every final weight (read from the checkpoints the runs write: global tensors,
whatever the layout) within 1e-5. The same runs save asynchronously at step 2, and resuming
there must reproduce steps 3-5 bit for bit. A checkpoint moves between ZeRO-3 and plain DDP
at TP2 x PP2 with every tensor (optimizer state and the fused SwiGLU fc1 included) unchanged.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from checkpoints_tools.dcp_io import CheckpointReader
from tests.compare import assert_steps_close, assert_steps_equal, relative_differences
from tests.distributed import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 5
BASE = [
    f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2", "schedule.global_batch_size=8",
    "schedule.seq_length=64", "schedule.eval_interval=0", "schedule.warmup_steps=2",
    "data.demo=false", "data.mock=true", "runtime.spec=portable", "logging.tensorboard=false",
    "logging.log_interval=1", "optimizer.lr=3e-3", "optimizer.clip_grad=1e9",
    "checkpoint.save_interval=2", "checkpoint.async_save=true", "checkpoint.resume=none",
]
# name -> (recipe, ranks, overrides)
LAYOUTS = {
    "DP2-ZeRO2": ("tiny-llama", 2, ["parallel.sharding=zero2"]),
    "DP2-ZeRO3": ("tiny-llama", 2, ["parallel.sharding=zero3"]),
    "DP2xTP2-SP-ZeRO3": ("tiny-llama", 4, ["parallel.sharding=zero3", "parallel.tensor_parallel=2",
                                           "parallel.sequence_parallel=true"]),
    "HSDP2x2-ZeRO3": ("tiny-llama", 4, ["parallel.sharding=zero3", "parallel.hsdp_replicas=2"]),
    # 16 sequences over DP2 in micro-batches of 2: 4 micro-batches of gradient accumulation.
    "DP2-ZeRO3-4mb": ("tiny-llama", 2, ["parallel.sharding=zero3", "schedule.global_batch_size=16"]),
    # EP2 over 4 ranks: experts sharded over an expert-DP group of 2 (a group of 1 is refused).
    "MoE-EP2-ZeRO3": ("tiny-moe", 4, ["parallel.sharding=zero3", "parallel.expert_parallel=2"]),
    # Refused on megatron-core 0.16.1 (wrong gradients or weights there: pretrain/megatron_fixes/fsdp.py),
    # equal to one rank on 0.19.2: a shard group of one rank (one rank; HSDP with one rank per
    # replica), MoE with expert DP 1, MoE with HSDP.
    "ZeRO3-one-rank": ("tiny-llama", 1, ["parallel.sharding=zero3"]),
    "HSDP2x1-ZeRO2": ("tiny-llama", 2, ["parallel.sharding=zero2", "parallel.hsdp_replicas=2"]),
    "MoE-EP2-ZeRO3-expertDP1": ("tiny-moe", 2, ["parallel.sharding=zero3", "parallel.expert_parallel=2"]),
    "MoE-HSDP2x2-ZeRO3": ("tiny-moe", 4, ["parallel.sharding=zero3", "parallel.hsdp_replicas=2"]),
}
# Document masking (issue 24) in every kind of layout, on real text with short documents
# (tests.pretrain.workers.document_data: 1-3 document boundaries per 64-token sample), against one rank
# with masking on. TP2 x PP2 x VPP2 has middle chunks (they need the document ids too); CP2 masks
# documents whose boundaries fall in the other rank's chunk; the 4-rank layouts combine TP + SP
# (each rank computes attention over the whole gathered sequence, with its own heads) with PP,
# CP and EP. Plain DDP over data-parallel replicas is in CP2 and MoE-EP2xTP2 (DP 2 for the dense
# weights). REPEAT_ONLY layouts (below) are run by tests.pretrain.repeat_sharded, not by the suite
# (its time; issue 24's note has their repeat counts).
# Real text has tokens seen once in 5 steps, whose embedding rows get gradient elements near
# 0: there Adam turns fp32's absolute noise (~1e-10 between layouts) into weight differences
# of noise x lr / eps (x 3e5 at eps 1e-8: CP2 vs one rank measured 3.3e-5 in one embedding
# element with masking, over the 1e-5 bar, and 1.4e-6 without; every other tensor <= 1.2e-7,
# and tests/pretrain/test_document_mask.py shows CP's masked gradients exact to 5e-7
# relative). eps 1e-6 keeps that factor at 3e3.
# lr 1e-3, not BASE's 3e-3: at 3e-3 this text's 5 steps cross a sharp region (the grad norm
# doubles at step 5) where any fp32-level difference grows about 10x a step. Measured (issue 24's
# note): TP2+SP's step-1 and step-2 gradients equal one rank's to <= 3.4e-7 per tensor, yet its grad
# norm drifted 3e-8, 1e-7, 1.7e-6, 2.05e-5 at steps 2-5; those two steps' TP2+SP gradients put into
# the one-rank run reproduce 1.4e-5, and one rank alone with every gradient element scaled by
# (1 + 1e-7 N(0, 1)) drifts 1.2e-6 to 1.3e-5 by step 5. At lr 1e-3 the same TP2+SP run stays
# within 4e-8 at every step, and a doubled gradient still moves the losses by far more than 1e-5
# (test_a_doubled_gradient_would_show). To see it: python -m tests.pretrain.grad_drift TP2-SP-docs
# optimizer.lr=3e-3 (add --noise 1e-7 --seed 2 for the one-rank case).
DOC_TEXT = ["data.mock=false", "optimizer.adam_eps=1e-6", "optimizer.lr=1e-3"]
DOCS = DOC_TEXT + ["data.reset_attention_mask=true", "data.reset_position_ids=true"]
TP2_SP = ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]
LAYOUTS.update({
    "TP2-SP-docs": ("tiny-llama", 2, TP2_SP + DOCS),
    "TP2xPP2xVPP2-SP-docs": ("tiny-llama", 4, TP2_SP + ["parallel.pipeline_parallel=2",
                                                        "parallel.virtual_pipeline=2"] + DOCS),
    "CP2-docs": ("tiny-llama", 2, ["parallel.context_parallel=2"] + DOCS),
    "CP2xTP2-SP-docs": ("tiny-llama", 4, ["parallel.context_parallel=2"] + TP2_SP + DOCS),
    "DP2-ZeRO3-docs": ("tiny-llama", 2, ["parallel.sharding=zero3"] + DOCS),
    "MoE-EP2xTP2-SP-docs": ("tiny-moe", 4, ["parallel.expert_parallel=2"] + TP2_SP + DOCS),
})
# Run by tests.pretrain.repeat_sharded, not by the suite. Their masking code runs in the suite's
# layouts above (TP2xPP2xVPP2, MoE-EP2xTP2, CP2's data-parallel replicas); the non-interleaved PP
# schedule of PP2 and TP2xPP2 is in test_parity.py (unmasked), ZeRO-2 in this file's DP2-ZeRO2.
REPEAT_ONLY = {
    "PP2-docs": ("tiny-llama", 2, ["parallel.pipeline_parallel=2"] + DOCS),
    "PP2xVPP2-docs": ("tiny-llama", 2, ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"] + DOCS),
    "TP2xPP2-SP-docs": ("tiny-llama", 4, TP2_SP + ["parallel.pipeline_parallel=2"] + DOCS),
    "MoE-EP2-docs": ("tiny-moe", 2, ["parallel.expert_parallel=2"] + DOCS),
    "DP2-docs": ("tiny-llama", 2, DOCS),
    "DP2-ZeRO2-docs": ("tiny-llama", 2, ["parallel.sharding=zero2"] + DOCS),
}

# Optimizer tensors: "optimizer.state..." (one optimizer) or "chained_<i>.optimizer.state..." (a MoE
# model's dense and expert optimizers under DDP).
OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
# One-rank references: key -> (recipe, overrides).
REFERENCE = {"tiny-llama": ("tiny-llama", []), "tiny-llama-16": ("tiny-llama", ["schedule.global_batch_size=16"]),
             "tiny-moe": ("tiny-moe", []), "tiny-llama-docs": ("tiny-llama", DOCS),
             "tiny-moe-docs": ("tiny-moe", DOCS),
             # The same text without masking: masking must change the run (else parity is trivial).
             "tiny-llama-docdata": ("tiny-llama", DOC_TEXT)}


def _reference_of(name: str) -> str:
    recipe, _, extra = {**LAYOUTS, **REPEAT_ONLY}[name]
    if "schedule.global_batch_size=16" in extra:
        return "tiny-llama-16"
    return f"{recipe}-docs" if DOCS[-1] in extra else recipe


def _run(root, tag, recipe, nproc, extra, **kwargs) -> dict:
    from tests.pretrain.workers import document_data

    data = document_data(root) if "data.mock=false" in extra else []
    run_ranks(nproc, "tests.pretrain.workers:train", recipe=recipe,
              overrides=BASE + extra + data + [f"checkpoint.dir={root / tag / 'ckpt'}", f"logging.run_dir={root / tag}",
                                               # One index cache for the module's runs (38 MB each otherwise).
                                               f"data.cache_dir={root / 'data_cache'}"],
              **kwargs)
    records = [json.loads(line) for line in (root / tag / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
            "ckpt": root / tag / "ckpt"}


class _Runs(dict):
    """Each one-rank reference ("ref:<key>") and layout run once, when a test first asks for
    it, for all the tests of the module (so `-k docs` trains only what those tests need)."""

    def __init__(self, root):
        super().__init__(root=root)

    def __missing__(self, name: str) -> dict:
        root = self["root"]
        if name.startswith("ref:"):
            recipe, extra = REFERENCE[name[4:]]
            self[name] = _run(root, f"ref-{name[4:]}", recipe, 1, extra)
        else:
            recipe, nproc, extra = LAYOUTS[name]
            self[name] = _run(root, name, recipe, nproc, extra)
        return self[name]


@pytest.fixture(scope="module")
def runs(module_tmp_factory) -> dict:
    return _Runs(module_tmp_factory.mktemp("sharded"))


def _tensors(checkpoint, prefix=""):
    reader = CheckpointReader(checkpoint)
    return {key: reader.read(key) for key in reader.tensor_keys() if key.startswith(prefix)}


def _close(got: list[float], want: list[float], rel: float, what: str) -> float:
    return assert_steps_close(got, want, rtol=rel, what=what)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_layout_matches_one_rank(runs, name):
    got, want = runs[name], runs[f"ref:{_reference_of(name)}"]
    loss = _close(got["loss"], want["loss"], 1e-5, f"{name} loss")
    norm = _close(got["grad_norm"], want["grad_norm"], 1e-5, f"{name} grad norm")
    final = f"step_{STEPS:08d}"
    mine = _tensors(got["ckpt"] / final)
    theirs = _tensors(want["ckpt"] / final)
    model_keys = sorted(k for k in theirs if not OPTIMIZER_KEY.match(k))
    assert model_keys and set(model_keys) <= set(mine)
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in model_keys)
    print(f"{name}: loss {loss:.2e}, grad norm {norm:.2e}, weights {worst:.2e} (max abs)")
    assert worst <= 1e-5, worst
    assert got["loss"][-1] < got["loss"][0]  # it trains


def test_document_masking_changes_the_run(runs):
    """The masked layouts above are compared with a reference that really masks: on the same
    text, without masking, the losses move by far more than the parity tolerance."""
    masked, unmasked = runs["ref:tiny-llama-docs"]["loss"], runs["ref:tiny-llama-docdata"]["loss"]
    assert len(masked) == STEPS
    moved = max(relative_differences(masked, unmasked, what="masked vs unmasked loss"))
    assert moved > 1e-3, moved


@pytest.mark.parametrize("key", ["tiny-llama", "tiny-llama-docs"])
def test_a_doubled_gradient_would_show(runs, key, tmp_path):
    """The tolerance above is meaningful: twice the gradient at step 3, once, moves the
    losses after it by far more than 1e-5 (Adam is scale-invariant only over many steps),
    also at the masked layouts' lower lr."""
    recipe, extra = REFERENCE[key]
    doubled = _run(tmp_path, "doubled", recipe, 1, extra, double_grad_at_step=3)
    reference = runs[f"ref:{key}"]
    assert_steps_equal(doubled["loss"][:3], reference["loss"][:3], what="loss before the doubled gradient")
    # After it: the losses and grad norms of steps 4-5 (step 3's logged norm is the doubled one).
    moved = max(max(relative_differences(doubled[metric][3:], reference[metric][3:], what=f"{metric} after it"))
                for metric in ("loss", "grad_norm"))
    assert moved > 1e-3, moved


@pytest.mark.parametrize("name", ["DP2-ZeRO2", "DP2-ZeRO3", "HSDP2x2-ZeRO3", "MoE-EP2-ZeRO3", "CP2-docs"])
def test_resume_from_the_async_save_is_exact(runs, name, tmp_path):
    """MoE: each EP rank's experts (and their Adam moments) are saved by that rank, the rank
    0 of its expert shard group (a save by data-parallel rank 0 alone lost them and hung)."""
    recipe, nproc, extra = LAYOUTS[name]
    resumed = _run(tmp_path, "resumed", recipe, nproc, extra + [
        f"checkpoint.resume={runs[name]['ckpt'] / 'step_00000002'}"])
    assert resumed["loss"] == runs[name]["loss"][2:]
    assert resumed["grad_norm"] == runs[name]["grad_norm"][2:]
    final = f"step_{STEPS:08d}"
    a, b = _tensors(resumed["ckpt"] / final), _tensors(runs[name]["ckpt"] / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


TP2PP2 = ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"]


@pytest.mark.parametrize("source, target, nproc, layout", [
    ("DP2-ZeRO3", "TP2xPP2", 4, TP2PP2),
    ("ref:tiny-llama", "DP2-ZeRO3", 2, ["parallel.sharding=zero3"]),
])
def test_checkpoint_moves_between_zero3_and_plain_ddp_unchanged(runs, source, target, nproc, layout, tmp_path):
    """Loaded at the other layout and saved again at once: every tensor (weights, fp32 main
    weights, Adam moments; fc1 is the fused [gate; up] one) comes back bit for bit."""
    step2 = runs[source]["ckpt"] / "step_00000002"
    run_ranks(nproc, "tests.pretrain.workers:load_and_save", recipe="tiny-llama",
              overrides=BASE + layout + [f"checkpoint.resume={step2}", f"logging.run_dir={tmp_path / 'run'}"],
              out_dir=str(tmp_path / "out"))
    before, after = _tensors(step2), _tensors(tmp_path / "out" / "step_00000002")
    assert before.keys() == after.keys()
    assert any(k.endswith("linear_fc1.weight") for k in before)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in before)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed


@pytest.mark.parametrize("sharded, one_rank", [("DP2-ZeRO3", "ref:tiny-llama"),
                                                ("DP2-ZeRO3-docs", "ref:tiny-llama-docs")])
def test_zero3_checkpoint_exports_and_verifies_without_conversion(runs, sharded, one_rank, tmp_path):
    """checkpoints_tools read a ZeRO-3 checkpoint as it is: the HF export computes the one-rank
    run's logits (its final weights are the same to 1e-5), and verify passes it. Trained with
    document masking too: masking changes no weight or format (transformers runs each
    sequence as one document, as verify's prompts are)."""
    pytest.importorskip("transformers")
    from checkpoints_tools.export_hf import export_hf
    from tests.checkpoints_tools.conftest import SP_MODEL
    from tests.checkpoints_tools.test_export_hf import _verify_cli, hf_logits

    final = f"step_{STEPS:08d}"
    logits = {}
    for name in (sharded, one_rank):
        out = tmp_path / name.replace(":", "-")
        export_hf(runs[name]["ckpt"] / final, out, tokenizer=SP_MODEL)
        logits[name] = hf_logits(out, json.loads((out / "config.json").read_text())["vocab_size"])
    diff = (logits[sharded] - logits[one_rank]).abs().max().item()
    assert diff <= 1e-4, diff
    proc = _verify_cli(runs[sharded]["ckpt"] / final, tmp_path / sharded)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    report = json.loads(proc.stdout.read().strip().splitlines()[-1])
    assert report["passed"] and report["max_abs_diff"] <= 1e-4

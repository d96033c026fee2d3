"""An imported HF model trains like the original: padded vocabulary ids (vocab 4000 padded to
4096) take no part in the softmax, the loss or the gradient (models/padded_vocab.py), at TP1
and at TP2, where only the second rank's vocab slice holds padding."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints_tools.dcp_io import CheckpointReader
from checkpoints_tools.export_hf import export_hf
from checkpoints_tools.import_hf import import_hf
from launch.compare_runs import compare_records
from launch.sweeps.results import read_metrics
from tests.checkpoints_tools.workers import first
from tests.distributed import run_ranks

pytestmark = [pytest.mark.distributed]
transformers = pytest.importorskip("transformers")

STEPS = 4
# Real text (the demo corpus, in the imported tokenizer's ids), fp32, an LR where a doubled
# gradient would show within the steps compared.
OVERRIDES = [
    "data.demo=true", "data.mock=false", f"schedule.train_steps={STEPS}", "schedule.warmup_steps=1",
    "schedule.micro_batch_size=2", "schedule.global_batch_size=4", "schedule.seq_length=64",
    "schedule.eval_interval=0", "runtime.spec=portable", "logging.tensorboard=false", "logging.log_interval=1",
    "optimizer.lr=1e-2",
]


def _hf_loss(hf_dir, batch: dict) -> float:
    """transformers' mean cross entropy over the loss-masked tokens of the batch (fp32)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    total, count = torch.zeros((), dtype=torch.float64), 0.0
    with torch.no_grad():
        for tokens, labels, mask, positions in zip(*(batch[k] for k in ("tokens", "labels", "loss_mask",
                                                                         "position_ids")), strict=True):
            logits = model(input_ids=torch.tensor(tokens), position_ids=torch.tensor(positions)).logits.float()
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.tensor(labels).flatten(),
                                                       reduction="none")
            mask = torch.tensor(mask, dtype=torch.float32).flatten()
            total += (losses * mask).sum().double()
            count += mask.sum().item()
    return float(total / count)



def train_one_step_after_import(hf_dir, tmp_path):
    """Import `hf_dir`, train one step at TP2 + SP (no warm-up: a warm-up's first step runs at LR
    0 and would leave the weights as imported), check its loss is transformers' on the same
    batch, export step 1 and verify it: transformers gives our trained model's logits (1e-4),
    which moved from the import's. Returns the step-1 checkpoint."""
    imported, ckpt = tmp_path / "imported", tmp_path / "ckpt"
    import_hf(hf_dir, imported)
    overrides = [o for o in OVERRIDES if not o.startswith(("schedule.train_steps", "schedule.warmup_steps"))] + [
        "schedule.train_steps=1", "schedule.warmup_steps=0", "parallel.tensor_parallel=2", "parallel.sequence_parallel=true",
        f"checkpoint.resume={imported}", f"checkpoint.dir={ckpt}", "checkpoint.save_interval=1",
        f"logging.run_dir={tmp_path / 'run'}"]
    run = first(run_ranks(2, "tests.checkpoints_tools.workers:first_step_and_batch", recipe="tiny-llama",
                          config_file=str(imported / "config.yaml"), overrides=overrides))
    want = _hf_loss(hf_dir, run)
    print(f"\nfirst-step loss {run['loss']:.6f}, transformers {want:.6f}")
    assert abs(run["loss"] - want) <= 1e-5 * want, (run["loss"], want)
    step1 = ckpt / "step_00000001"
    export_hf(step1, tmp_path / "hf", with_tokenizer=False)
    after, before = run_ranks(1, "tests.checkpoints_tools.workers:verify_imports",
                              pairs=[[str(step1), str(tmp_path / "hf")], [str(step1), str(hf_dir)]])[0]
    print(f"export of step 1 vs ours: {after['max_abs_diff']:.1e}; the import's HF model vs ours after the step: "
          f"{before['max_abs_diff']:.1e}")
    assert after["passed"] and after["max_abs_diff"] <= 1e-4, after
    assert before["max_abs_diff"] > 1e-3, f"one step at lr 1e-2 did not move the logits: {before}"
    return step1

def test_imported_model_first_loss_is_transformers_loss_at_tp1_and_tp2(hf_models, tmp_path):
    hf_dir = hf_models["llama"]  # untied, vocab 4000 -> 4096 rows
    imported = tmp_path / "imported"
    import_hf(hf_dir, imported)
    runs = {}
    for tp in (1, 2):
        name = f"tp{tp}"
        overrides = OVERRIDES + [f"parallel.tensor_parallel={tp}", f"checkpoint.resume={imported}",
                                 f"checkpoint.dir={tmp_path / name / 'ckpt'}", f"logging.run_dir={tmp_path / name}"]
        runs[name] = first(run_ranks(tp, "tests.checkpoints_tools.workers:first_step_and_batch", recipe="tiny-llama",
                                     config_file=str(imported / "config.yaml"), overrides=overrides))
    assert runs["tp1"]["tokens"] == runs["tp2"]["tokens"]
    want = _hf_loss(hf_dir, runs["tp1"])
    for name, run in runs.items():
        assert abs(run["loss"] - want) <= 1e-5 * want, f"{name}: first-step loss {run['loss']} vs transformers {want}"

    # TP2 (padding on rank 1 only) trains as TP1 does, step by step.
    records = [read_metrics(tmp_path / name / "metrics.jsonl") for name in ("tp1", "tp2")]
    comparison = compare_records(*records, metrics=["loss", "grad_norm"], rtol=1e-5)
    assert len(comparison.rows) == STEPS and comparison.ok, comparison.summary()
    assert records[0][-1]["loss"] < records[0][0]["loss"] - 0.05  # it trains: parity is not trivial

    # No gradient reached the padded rows: imported as zeros, they are zeros after 4 AdamW
    # steps, while the real rows moved.
    vocab = json.loads((imported / "meta.json").read_text())["model"]["vocab_size"]
    before = CheckpointReader(imported).read("output_layer.weight")
    for name in ("tp1", "tp2"):
        after = CheckpointReader(tmp_path / name / "ckpt" / f"step_{STEPS:08d}").read("output_layer.weight")
        assert after.shape[0] == 4096 and vocab == 4000
        assert torch.count_nonzero(after[vocab:]) == 0, f"{name}: padded output rows were updated"
        assert not torch.equal(after[:vocab], before[:vocab])

"""export_hf of muP models (issue 44): Megatron-Core's muP forward (embedding and logit multipliers,
softmax scale 1/d) has no field in LlamaConfig, so such an export is refused in one line before
anything is written; a muP model whose forward is the plain one (multipliers 1, softmax scale
1/sqrt(d): muP only in init and LR) exports, and transformers computes its logits."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints_tools.export_hf import export_hf
from tests.bad_input import run_cli
from tests.checkpoints_tools.conftest import BASE, SP_MODEL
from tests.checkpoints_tools.workers import tokens
from tests.distributed import run_ranks

pytestmark = [pytest.mark.distributed]
transformers = pytest.importorskip("transformers")

MUP = ["model.use_mup=true", "model.mup_base_hidden_size=64"]  # tiny-llama is 128 wide: width_mult 2
# tiny-llama's head_dim is 128 / 8 = 16: Megatron-Core's sqrt(base 16) / 16 ** 1 is the standard 1/sqrt(16).
PLAIN_FORWARD = MUP + ["model.mup_output_mult=1.0", "model.mup_base_head_dim=16"]
JOBS = {"mup": MUP + ["model.mup_embedding_mult=2.0"], "mup-plain-forward": PLAIN_FORWARD}


@pytest.fixture(scope="module")
def mup_trained(module_tmp_factory):
    base = module_tmp_factory.mktemp("mup-export")
    jobs = [{"recipe": "tiny-llama", "overrides": BASE + extra + [
        "schedule.train_steps=2", f"checkpoint.dir={base / name}", f"logging.run_dir={base / name}-run"]}
        for name, extra in JOBS.items()]
    reports = run_ranks(1, "tests.checkpoints_tools.workers:train_jobs", jobs=jobs, rendezvous=str(base))[0]
    return {name: (base / name / (base / name / "latest").read_text().strip(), torch.tensor(report["logits"]))
            for name, report in zip(JOBS, reports, strict=True)}


def test_mup_forward_export_is_refused_in_one_line(mup_trained, tmp_path):
    checkpoint, _ = mup_trained["mup"]
    out = tmp_path / "hf"
    result = run_cli("checkpoints_tools.export_hf", [str(checkpoint), str(out), "--tokenizer", str(SP_MODEL)])
    assert result.code == 2 and len(result.error_lines) == 1 and "Traceback" not in result.output, result.output
    line = result.error_lines[0]
    assert "model.use_mup" in line and "embeddings x 2" in line and "logits x 0.5" in line, line
    assert "attention softmax scale 0.0625 instead of 1/sqrt(head_dim) = 0.25" in line, line
    assert not out.exists()


def test_mup_model_with_the_plain_forward_exports_with_matching_logits(mup_trained, tmp_path):
    checkpoint, logits = mup_trained["mup-plain-forward"]
    out = tmp_path / "hf"
    export_hf(checkpoint, out, tokenizer=SP_MODEL)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        hf = model(input_ids=tokens(4000)).logits
    diff = (hf - logits[..., :4000]).abs().max().item()
    assert diff <= 1e-4, f"muP (plain forward) export: max |logit difference| {diff}"

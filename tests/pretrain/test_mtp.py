"""Multi-token prediction (model.mtp_num_layers, issue 45) besides layout parity
(test_mtp_parity.py): it is training-only, and the tools treat it so.

- The main model's logits and per-token losses do not depend on the MTP layers: the same
  seed builds identical main weights with and without them (the init is by global name), and
  the two models' outputs are equal bit for bit; the MTP weights get Megatron-Core's init
  methods (2h -> h projection at init_std, its layer's output projections scaled, norms 1).
- The HF export of a model with MTP layers (tiny-llama + 1 dense MTP layer, trained 2 steps)
  drops them with a printed note, and transformers' logits from it equal our model's (built
  with its MTP layer, from the checkpoint) within verify's 1e-4; reshard keeps them.
- Config: strict keys, refused combinations in one line, shown by --dry-run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from checkpoints_tools.dcp_io import CheckpointReader
from pretrain.config import ConfigError, apply_overrides, validate_for_world
from pretrain.recipes import get_recipe
from tests.distributed import REPO, run_module, run_ranks

OPTIMIZER_PREFIXES = ("optimizer.", "chained_")


def main_outputs_with_and_without_mtp() -> dict:
    """Rank function: tiny-deepseek built twice (mtp_num_layers 1 and 0, same seed) on one rank;
    its main weights, logits (eval, no labels) and per-token training losses compared."""
    import torch

    from models.build import build_model_chunks
    from models.config import get_flavor
    from models.layout import ParallelLayout
    from models.runtime import RuntimeOptions
    from pretrain.runtime import init_distributed, shutdown

    init_distributed(ParallelLayout(), seed=0)
    base = get_flavor("tiny-deepseek")
    runtime = RuntimeOptions(seed=0, spec="portable")
    (with_mtp,) = build_model_chunks(base.model_copy(update=dict(mtp_num_layers=1)), ParallelLayout(), runtime)
    (without,) = build_model_chunks(base, ParallelLayout(), runtime)
    mine, theirs = dict(with_mtp.named_parameters()), dict(without.named_parameters())
    extra = sorted(set(mine) - set(theirs))
    main_equal = sorted(theirs) == sorted(set(mine) & set(theirs)) and all(
        torch.equal(mine[k], theirs[k]) for k in theirs)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, base.vocab_size, (2, 32), generator=gen)
    positions = torch.arange(32).expand(2, 32)
    labels = torch.randint(0, base.vocab_size, (2, 32), generator=gen)
    out = {}
    for tag, chunk in (("with", with_mtp), ("without", without)):
        chunk.eval()
        with torch.no_grad():
            logits = chunk(tokens, positions, None)
        chunk.train()
        loss = chunk(tokens, positions, None, labels=labels)  # per-token main loss [b, s]
        out[tag] = (logits, loss.detach())
    init = {name.removeprefix("mtp.layers.0."): [p.std().item(), p.mean().item()]
            for name, p in mine.items() if name in extra and p.numel() > 1}
    shutdown()
    return {"extra": extra, "main_equal": main_equal,
            "logits_equal": torch.equal(out["with"][0], out["without"][0]),
            "loss_equal": torch.equal(out["with"][1], out["without"][1]),
            "logits_shape": list(out["with"][0].shape), "init": init}


def test_main_model_is_unchanged_by_mtp_layers_and_they_get_megatrons_init():
    (result,) = run_ranks(1, "tests.pretrain.test_mtp:main_outputs_with_and_without_mtp")
    assert result["extra"] and all(k.startswith("mtp.layers.0.") for k in result["extra"]), result["extra"]
    assert result["main_equal"], "the main model's weights differ with an MTP layer (init must be by name)"
    assert result["logits_shape"] == [2, 32, 4096]
    assert result["logits_equal"] and result["loss_equal"]
    init = result["init"]
    assert init["eh_proj.weight"][0] == pytest.approx(0.02, rel=0.05)
    # The MTP layer's output projections: init_std / sqrt(2 x 4 layers), as the decoder's.
    for name in ("mtp_model_layer.self_attention.linear_proj.weight",
                 "mtp_model_layer.mlp.shared_experts.linear_fc2.weight",
                 "mtp_model_layer.mlp.experts.local_experts.7.linear_fc2.weight"):
        assert init[name][0] == pytest.approx(0.02 / 8 ** 0.5, rel=0.05), (name, init[name])
    assert init["mtp_model_layer.mlp.router.weight"][0] == pytest.approx(0.02, rel=0.1)


TOOLS = ["model=tiny-llama", "model.mtp_num_layers=1", "schedule.train_steps=2", "schedule.micro_batch_size=2",
         "schedule.global_batch_size=4", "schedule.seq_length=64", "schedule.eval_interval=0",
         "schedule.warmup_steps=1", "data.demo=true", "runtime.spec=portable", "logging.tensorboard=false",
         "checkpoint.save_interval=2", "checkpoint.resume=none", "logging.log_interval=1"]


@pytest.fixture(scope="module")
def trained(module_tmp_factory):
    root = module_tmp_factory.mktemp("mtp-tools")
    run_ranks(1, "tests.pretrain.workers:train", recipe="tiny-llama",
              overrides=TOOLS + [f"checkpoint.dir={root / 'ckpt'}", f"logging.run_dir={root / 'run'}"])
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["mtp_loss"] > 0 for r in records), records
    return root / "ckpt" / "step_00000002"


def _model_tensors(path) -> dict:
    reader = CheckpointReader(path)
    return {k: reader.read(k) for k in reader.tensor_keys() if not k.startswith(OPTIMIZER_PREFIXES)}


def test_hf_export_drops_mtp_layers_with_a_note_and_matches_our_logits(trained, tmp_path):
    pytest.importorskip("transformers")  # verify imports it
    out = tmp_path / "hf"
    done = run_module("checkpoints_tools.export_hf", [str(trained), str(out)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("note: the model's 1 multi-token prediction layer(s) (10 mtp.* tensors) are training-only and not "
            "exported") in done.stdout, done.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not [k for k in index["weight_map"] if "mtp" in k]
    assert len(index["weight_map"]) == 3 + 4 * 9  # embed, norm, lm_head + 4 Llama layers of 9 tensors
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    verify = subprocess.run([sys.executable, "-m", "checkpoints_tools.verify", str(trained), str(out), "--json"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stderr[-3000:]
    report = json.loads(verify.stdout)
    print(f"\nverify: {report}")
    assert report["max_abs_diff"] <= 1e-4


def test_reshard_keeps_mtp_layers(trained, tmp_path):
    out = tmp_path / "tp2"
    done = run_module("checkpoints_tools.reshard", [str(trained), str(out), "--tp", "2", "--drop-optimizer"],
                      timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before = _model_tensors(trained)
    after = _model_tensors(next(out.glob("step_*")) if any(out.glob("step_*")) else out)
    mtp = sorted(k for k in before if k.startswith("mtp."))
    assert len(mtp) == 10 and sorted(after) == sorted(before)
    assert all((after[k] == before[k]).all() for k in mtp)


@pytest.mark.parametrize("overrides, world, message", [
    (["model.mtp_loss_scaling_factor=0.3"], 1,
     "mtp_loss_scaling_factor is set but mtp_num_layers=0; set mtp_num_layers (DeepSeek-V3: 1) or remove it"),
    (["model.mtp_num_layers=-1"], 1, "model.mtp_num_layers"),
    (["model.mtp_num_layers=2", "data.reset_position_ids=true"], 1,
     "model.mtp_num_layers=2 with document masking needs data.reset_attention_mask=true (got reset_attention_mask=false)"),
    (["model=tiny-llama", "model.mtp_num_layers=1", "parallel.context_parallel=2"], 2,
     "model.mtp_num_layers at context_parallel=2 is not supported here (untested); MTP runs with TP/SP, PP/VPP, "
     "EP and DP: set parallel.context_parallel=1"),
])
def test_bad_mtp_configs_are_refused_in_one_line(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        validate_for_world(apply_overrides(get_recipe("tiny-deepseek"), overrides=overrides), world)
    assert message in str(err.value) and "\n" not in str(err.value).strip(), str(err.value)


def test_dry_run_shows_mtp_keys():
    ok = run_module("pretrain", ["--recipe", "deepseek-v3", "--dry-run", "--world-size", "1024"], timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "mtp_num_layers: 1\n  mtp_loss_scaling_factor: 0.1" in ok.stdout

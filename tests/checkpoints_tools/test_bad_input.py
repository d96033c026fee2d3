"""Bad input: a clear error (exit 2 from the CLIs) and no partial output directory."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from checkpoints_tools import export_hf, import_hf, reshard
from tests.checkpoints_tools.conftest import _save_hf

pytest.importorskip("transformers")


def run_main(module, argv, capsys) -> tuple[int, str]:
    code = module.main([*map(str, argv), "--no-progress"])
    return code, capsys.readouterr().err


def assert_nothing_written(parent, name) -> None:
    leftovers = [p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.")]
    assert leftovers == [], f"partial output left behind: {leftovers}"


@pytest.fixture
def llama_dir(hf_models, tmp_path):
    """A private copy of the tiny HF Llama that a test may damage."""
    return shutil.copytree(hf_models["llama"], tmp_path / "llama")


def test_unknown_architecture(llama_dir, tmp_path, capsys):
    config = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    code, err = run_main(import_hf, [llama_dir, tmp_path / "out"], capsys)
    assert code == 2 and "unsupported architecture 'GPT2LMHeadModel'" in err and "LlamaForCausalLM" in err
    assert_nothing_written(tmp_path, "out")


def test_missing_shard(tmp_path, capsys):
    src = tmp_path / "sharded"
    import transformers

    _save_hf(src, "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    shutil.rmtree(src)
    model.save_pretrained(src, max_shard_size="200KB")
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    code, err = run_main(import_hf, [src, tmp_path / "out"], capsys)
    assert code == 2 and "missing" in err and shards[1].name in err
    assert_nothing_written(tmp_path, "out")


def test_shape_contradicting_config(llama_dir, tmp_path, capsys):
    config = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    code, err = run_main(import_hf, [llama_dir, tmp_path / "out"], capsys)
    assert code == 2 and "model.layers.0.mlp.gate_proj.weight has shape (96, 64)" in err and "(128, 64)" in err
    assert_nothing_written(tmp_path, "out")


def test_layout_that_does_not_divide_the_model(hf_models, trained, tmp_path, capsys):
    code, err = run_main(import_hf, [hf_models["llama"], tmp_path / "out", "--tp", "4"], capsys)
    assert code == 2 and "TP=4 does not divide num_query_groups=2; valid TP: 1, 2" in err
    code, err = run_main(reshard, [trained["untied"].latest, tmp_path / "out", "--pp", "3"], capsys)
    assert code == 2 and "num_layers=4 cannot be split evenly" in err
    assert_nothing_written(tmp_path, "out")


def test_existing_output_needs_overwrite(hf_models, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("someone's model")
    code, err = run_main(import_hf, [hf_models["llama"], out], capsys)
    assert code == 2 and "--overwrite" in err and (out / "model.safetensors").read_text() == "someone's model"
    code, _ = run_main(import_hf, [hf_models["llama"], out, "--overwrite"], capsys)
    assert code == 0 and not (out / "model.safetensors").exists() and (out / "COMPLETE").is_file()
    assert_nothing_written(tmp_path, ".out")  # no staging directories left


def test_failure_mid_conversion_leaves_nothing(hf_models, tmp_path, monkeypatch):
    from checkpoints_tools.safetensors_io import HFWeights

    calls = {"n": 0}
    original = HFWeights.get

    def failing_get(self, name):
        calls["n"] += 1
        if calls["n"] > 5:
            raise OSError("disk went away")
        return original(self, name)

    monkeypatch.setattr(HFWeights, "get", failing_get)
    with pytest.raises(OSError, match="disk went away"):
        import_hf.import_hf(hf_models["llama"], tmp_path / "out")
    assert_nothing_written(tmp_path, "out")


def test_pickles_refused_by_the_cli(llama_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    weights = load_file(str(llama_dir / "model.safetensors"))
    (llama_dir / "model.safetensors").unlink()
    torch.save(weights, llama_dir / "pytorch_model.bin")
    code, err = run_main(import_hf, [llama_dir, tmp_path / "out"], capsys)
    assert code == 2 and "refused" in err and "--trust-pickle" in err
    assert_nothing_written(tmp_path, "out")


def test_damaged_or_incomplete_checkpoints(trained, tmp_path, capsys):
    ckpt = shutil.copytree(trained["untied"].latest, tmp_path / "ckpt")
    shard = next(ckpt.glob("__1_*.distcp"))
    shard.unlink()
    code, err = run_main(reshard, [ckpt, tmp_path / "out"], capsys)
    assert code == 2 and f"is damaged: {shard.name} is missing" in err
    code, err = run_main(export_hf, [ckpt, tmp_path / "out", "--no-tokenizer"], capsys)
    assert code == 2 and f"is damaged: {shard.name} is missing" in err
    (ckpt / "COMPLETE").unlink()
    code, err = run_main(export_hf, [ckpt, tmp_path / "out"], capsys)
    assert code == 2 and "incomplete" in err
    code, err = run_main(reshard, [tmp_path, tmp_path / "out"], capsys)
    assert code == 2 and "is not a training checkpoint" in err
    assert_nothing_written(tmp_path, "out")


def test_export_refuses_what_hf_cannot_express(trained, tmp_path, capsys):
    ckpt = shutil.copytree(trained["untied"].latest, tmp_path / "ckpt")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["model"].update(activation="gelu", normalization="LayerNorm")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    code, err = run_main(export_hf, [ckpt, tmp_path / "out", "--no-tokenizer"], capsys)
    assert code == 2 and "no Llama/Mistral/Mixtral or GPT-2 equivalent" in err and "activation=gelu" in err
    assert "position_embedding=rope (GPT-2 learns absolute positions)" in err
    code, err = run_main(export_hf, [trained["untied"].latest, tmp_path / "out", "--architecture",
                                     "MixtralForCausalLM", "--no-tokenizer"], capsys)
    assert code == 2 and "cannot hold a dense model" in err
    code, err = run_main(export_hf, [trained["untied"].latest, tmp_path / "out"], capsys)
    assert code == 2 and "--tokenizer" in err  # mock-data run: no tokenizer recorded
    good = shutil.copytree(trained["untied"].latest, tmp_path / "good")
    code, err = run_main(export_hf, [good, good / "hf", "--no-tokenizer"], capsys)
    assert code == 2 and "overlaps the input" in err and not (good / "hf").exists()
    assert_nothing_written(tmp_path, "out")

"""Bad input: a clear error (exit 2 from the CLIs) and no partial output directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def test_qwen3_refusals(hf_models, llama_dir, tmp_path, capsys):
    """Qwen3 (issue 45): a sliding window turned on, a "Qwen3" without q/k norm tensors, a Qwen3
    checkpoint exported as Llama, and q/k norms on a model Qwen3 cannot hold: one line each."""
    qwen3 = shutil.copytree(hf_models["qwen3"], tmp_path / "qwen3")
    config = json.loads((qwen3 / "config.json").read_text())
    (qwen3 / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 64}))
    code, err = run_main(import_hf, [qwen3, tmp_path / "out"], capsys)
    assert code == 2 and "sliding_window=64 (sliding-window attention is not implemented)" in err
    config = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    code, err = run_main(import_hf, [llama_dir, tmp_path / "out"], capsys)
    assert code == 2 and "model.layers.0.self_attn.q_norm.weight is missing" in err
    assert_nothing_written(tmp_path, "out")
    ckpt = tmp_path / "ckpt"
    import_hf.import_hf(hf_models["qwen3"], ckpt)
    code, err = run_main(export_hf, [ckpt, tmp_path / "out", "--architecture", "LlamaForCausalLM",
                                     "--no-tokenizer"], capsys)
    assert code == 2 and "LlamaForCausalLM cannot hold this model" in err and "use Qwen3ForCausalLM" in err
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["model"].update(normalization="LayerNorm")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    code, err = run_main(export_hf, [ckpt, tmp_path / "out", "--no-tokenizer"], capsys)
    assert code == 2 and "q/k norms but no Qwen3 equivalent: normalization=LayerNorm" in err
    assert len(err.strip().splitlines()) == 1, err
    assert_nothing_written(tmp_path, "out")


# --- the command lines (tests/bad_input.py): exit 2, one error line, nothing written ---------


@pytest.fixture(scope="module")
def imported(hf_models, module_tmp_factory):
    """A model-only checkpoint of the tiny HF Llama (import_hf: one process, no training)."""
    out = module_tmp_factory.mktemp("imported") / "ckpt"
    import_hf.import_hf(hf_models["llama"], out)
    return out


def _hf_copy(hf_models, tmp_path, edit_config=None, cut: int = 0) -> Path:
    src = shutil.copytree(hf_models["llama"], tmp_path / "hf")
    if edit_config is not None:
        (src / "config.json").write_text(edit_config(json.loads((src / "config.json").read_text())))
    if cut:
        weights = src / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) - cut])
    return src


def _sharded_truncated(hf_models, tmp_path) -> Path:
    import transformers

    src = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(str(hf_models["llama"])).save_pretrained(
        src, max_shard_size="200KB")
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-4096])
    return src


def _occupied(tmp_path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("someone's model\n")
    return out


def _a_file(tmp_path) -> Path:
    (tmp_path / "a-file").write_text("not a directory\n")
    return tmp_path / "a-file"


def _with_dict(**change):
    return lambda config: json.dumps({**config, **change})


TOOL_CASES = {  # name -> (module, arguments given (tmp dir, hf models, imported checkpoint), fragments)
    "import: config.json not JSON": ("checkpoints_tools.import_hf", lambda t, h, c: [
        _hf_copy(h, t, lambda cfg: '{"architectures": ["LlamaForCausalLM"],'), t / "out"], ["config.json", "JSON"]),
    "import: config.json a list": ("checkpoints_tools.import_hf", lambda t, h, c: [
        _hf_copy(h, t, lambda cfg: "[1, 2]"), t / "out"], ["config.json", "object"]),
    "import: config.json lacks hidden_size": ("checkpoints_tools.import_hf", lambda t, h, c: [
        _hf_copy(h, t, lambda cfg: json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"})), t / "out"],
        ["config.json", "hidden_size"]),
    "import: config.json hidden_size a string": ("checkpoints_tools.import_hf", lambda t, h, c: [
        _hf_copy(h, t, _with_dict(hidden_size="64")), t / "out"], ["config.json", "hidden_size"]),
    "import: config.json negative layers": ("checkpoints_tools.import_hf", lambda t, h, c: [
        _hf_copy(h, t, _with_dict(num_hidden_layers=-2)), t / "out"], ["config.json", "num_layers"]),
    "import: safetensors truncated": ("checkpoints_tools.import_hf", lambda t, h, c: [
        _hf_copy(h, t, cut=4096), t / "out"], ["model.safetensors"]),
    "import: a shard of many truncated": ("checkpoints_tools.import_hf", lambda t, h, c: [
        _sharded_truncated(h, t), t / "out"], ["model-00002-of-"]),
    "import: --tp 0": ("checkpoints_tools.import_hf", lambda t, h, c: [h["llama"], t / "out", "--tp", "0"], ["--tp"]),
    "import: --world-size 0": ("checkpoints_tools.import_hf", lambda t, h, c: [
        h["llama"], t / "out", "--world-size", "0"], ["--world-size"]),
    "import: --vocab-multiple 0": ("checkpoints_tools.import_hf", lambda t, h, c: [
        h["llama"], t / "out", "--vocab-multiple", "0"], ["--vocab-multiple"]),
    "import: output not empty": ("checkpoints_tools.import_hf", lambda t, h, c: [h["llama"], _occupied(t)],
                                 ["out", "--overwrite"]),
    "import: output under a file": ("checkpoints_tools.import_hf", lambda t, h, c: [
        h["llama"], _a_file(t) / "out"], ["a-file"]),
    "reshard: source missing": ("checkpoints_tools.reshard", lambda t, h, c: [t / "none", t / "out"], ["none"]),
    "reshard: --pp 0": ("checkpoints_tools.reshard", lambda t, h, c: [c, t / "out", "--pp", "0"], ["--pp"]),
    "reshard: --world-size -4": ("checkpoints_tools.reshard", lambda t, h, c: [c, t / "out", "--world-size", "-4"],
                                 ["--world-size"]),
    "reshard: output not empty": ("checkpoints_tools.reshard", lambda t, h, c: [c, _occupied(t)],
                                  ["out", "--overwrite"]),
    "reshard: output under a file": ("checkpoints_tools.reshard", lambda t, h, c: [c, _a_file(t) / "out"],
                                     ["a-file"]),
    "export: --max-shard-size 0": ("checkpoints_tools.export_hf", lambda t, h, c: [
        c, t / "out", "--max-shard-size", "0"], ["--max-shard-size"]),
    "export: --tokenizer missing": ("checkpoints_tools.export_hf", lambda t, h, c: [
        c, t / "out", "--tokenizer", t / "none.model"], ["none.model"]),
    "export: output under a file": ("checkpoints_tools.export_hf", lambda t, h, c: [
        c, _a_file(t) / "out", "--no-tokenizer"], ["a-file"]),
    "verify: --seq 0": ("checkpoints_tools.verify", lambda t, h, c: [c, h["llama"], "--seq", "0"], ["--seq"]),
    "verify: --batch 0": ("checkpoints_tools.verify", lambda t, h, c: [c, h["llama"], "--batch", "0"], ["--batch"]),
    "verify: --seq beyond the model": ("checkpoints_tools.verify", lambda t, h, c: [c, h["llama"], "--seq", "4096"],
                                       ["max_seq_length"]),
    "verify: config.json and weights disagree": ("checkpoints_tools.verify", lambda t, h, c: [
        c, _hf_copy(h, t, _with_dict(intermediate_size=128))], ["hf"]),
    "verify: safetensors truncated": ("checkpoints_tools.verify", lambda t, h, c: [c, _hf_copy(h, t, cut=4096)],
                                      ["hf"]),
    "verify: another model's export": ("checkpoints_tools.verify", lambda t, h, c: [c, h["mixtral"]], ["mixtral"]),
    "verify: not an HF directory": ("checkpoints_tools.verify", lambda t, h, c: [c, t], ["config.json"]),
    "verify: checkpoint missing": ("checkpoints_tools.verify", lambda t, h, c: [t / "none", h["llama"]], ["none"]),
}


@pytest.mark.parametrize("case", list(TOOL_CASES))
def test_tool_cli_refuses(case, tmp_path, hf_models, imported):
    from tests.bad_input import expect_refusal

    module, build, names = TOOL_CASES[case]
    argv = [*build(tmp_path, hf_models, imported), "--no-progress"] if "verify" not in module else \
        build(tmp_path, hf_models, imported)
    expect_refusal(module, argv, names=names, cwd=tmp_path)


def test_hf_mapping_refuses_mla_and_deepseek_routing():
    """MLA goes to DeepseekV3ForCausalLM only where transformers computes the same (top-2 within 2
    chosen groups of 4 scores a group by 1 expert, transformers by 2: refused by name; tiny-deepseek
    as shipped, top-2 in 1 of 2 groups, exports); DeepSeek's MoE parts are refused by name in the
    Llama-family classes."""
    from checkpoints_tools.mapping import hf_family
    from models.config import get_flavor

    with pytest.raises(ValueError, match="moe_router_topk / moe_router_group_topk = 2/2"):
        hf_family(get_flavor("tiny-deepseek").model_copy(update=dict(moe_router_num_groups=4, moe_router_group_topk=2)))
    assert hf_family(get_flavor("tiny-deepseek")) == "deepseek_v3"
    for update, field in ((dict(moe_layer_freq=[0, 1, 1, 1]), "moe_layer_freq"),
                          (dict(moe_router_topk_scaling_factor=2.5), "moe_router_topk_scaling_factor")):
        with pytest.raises(ValueError, match=field):
            hf_family(get_flavor("tiny-moe").model_copy(update=update))

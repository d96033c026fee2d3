"""import_hf: HF -> our checkpoint at TP2xPP2 -> export is bit-identical; our model loaded
from an import computes the HF model's logits; pickles only when trusted."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open

from checkpoints_tools.export_hf import export_hf
from checkpoints_tools.import_hf import import_hf
from checkpoints_tools.safetensors_io import HFWeights
from models.layout import ParallelLayout
from tests.distributed import run_ranks

pytest.importorskip("transformers")
TP2PP2 = ParallelLayout(tensor_parallel=2, pipeline_parallel=2)


def tensors_of(directory) -> dict[str, torch.Tensor]:
    weights = HFWeights(directory)
    try:
        return {name: weights.get(name).clone() for name in weights.names()}
    finally:
        weights.close()


def assert_model_tensors_equal(before_dir, after_dir, vocab: int) -> dict[str, torch.Tensor]:
    """Every model tensor of two of our checkpoints is bit-identical, except the padded vocab
    rows past `vocab`, which HF does not hold: after a trip through HF they must be zeros (never
    looked up, their logits masked: models/padded_vocab.py). Returns the first one's tensors."""
    from checkpoints_tools.dcp_io import CheckpointReader

    def model_tensors(path) -> dict[str, torch.Tensor]:
        reader = CheckpointReader(path)
        return {k: reader.read(k) for k in reader.tensor_keys() if not k.startswith(("optimizer.", "chained_"))}

    before, after = model_tensors(before_dir), model_tensors(after_dir)
    assert sorted(before) == sorted(after)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in after:
            assert torch.equal(after[key][vocab:], torch.zeros_like(after[key][vocab:])), key
            before[key], after[key] = before[key][:vocab], after[key][:vocab]
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed
    return before


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "mistral", "mixtral", "qwen3", "qwen3-tied"])
def test_round_trip_is_bit_identical(hf_models, tmp_path, kind):
    src = hf_models[kind]
    # Megatron-Core's MoE layer needs sequence parallelism under TP.
    layout = TP2PP2.model_copy(update={"expert_parallel": 2, "sequence_parallel": True}) if kind == "mixtral" else TP2PP2
    imported = import_hf(src, tmp_path / "ckpt", layout=layout)
    assert imported["layout"].startswith("TP2xPP2") and imported["tokenizer"].endswith("tokenizer.model")
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["has_optimizer"] is False and meta["step"] == 0 and meta["model"]["vocab_size"] == 4000
    config = yaml.safe_load((tmp_path / "ckpt" / "config.yaml").read_text())
    assert config["data"]["tokenizer"] == str((tmp_path / "ckpt" / "tokenizer" / "tokenizer.model").absolute())
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    before, after = tensors_of(src), tensors_of(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    old, new = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "out"))
    head_dim = lambda c: c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]  # noqa: E731
    assert head_dim(new) == head_dim(old)
    for key in ("architectures", "model_type", "vocab_size", "num_key_value_heads", "intermediate_size",
                "tie_word_embeddings", "rms_norm_eps", "num_local_experts", "num_experts_per_tok", "sliding_window",
                "use_sliding_window"):
        assert new.get(key) == old.get(key), key
    assert new["rope_parameters"] == old["rope_parameters"] and old["rope_parameters"]["rope_theta"] == 50000.0
    assert (old["rope_parameters"]["rope_type"] == "llama3") == (kind == "llama-tied")
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()


@pytest.mark.distributed
def test_our_model_from_imports_matches_transformers(hf_models, tmp_path):
    pairs = []
    for kind, layout in [("llama-tied", TP2PP2), ("mixtral", ParallelLayout(expert_parallel=2))]:
        import_hf(hf_models[kind], tmp_path / kind, layout=layout)
        pairs.append([str(tmp_path / kind), str(hf_models[kind])])
    reports = run_ranks(1, "tests.checkpoints_tools.workers:verify_imports", pairs=pairs)[0]
    assert pairs and len(reports) == len(pairs), reports
    for (checkpoint, _), report in zip(pairs, reports, strict=True):
        assert report["passed"] and report["max_abs_diff"] <= 1e-4, (checkpoint, report)
        assert report["greedy_agreement"] == 1.0


def test_pickled_weights_need_trust(hf_models, tmp_path):
    src = tmp_path / "pickled"
    src.mkdir()
    shutil.copyfile(hf_models["llama"] / "config.json", src / "config.json")
    torch.save(tensors_of(hf_models["llama"]), src / "pytorch_model.bin")
    with pytest.raises(Exception, match="pickle weights .* --trust-pickle"):
        import_hf(src, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    import_hf(src, tmp_path / "trusted", trust_pickle=True)
    import_hf(hf_models["llama"], tmp_path / "safe")
    trusted, safe = sorted((tmp_path / "trusted").glob("*.distcp")), sorted((tmp_path / "safe").glob("*.distcp"))
    assert trusted and [a.name for a in trusted] == [b.name for b in safe], (trusted, safe)
    for a, b in zip(trusted, safe, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


@pytest.mark.distributed
def test_llama3_rope_scaling_with_any_values(hf_models, tmp_path):
    """An HF Llama with low/high frequency factors and original context other than Llama-3.1's
    imports (it was refused before), our model at TP2 computes transformers' logits, and the
    export carries the values back bit-identically (vLLM on it: test_verify_vllm)."""
    from tests.checkpoints_tools.conftest import LLAMA3_OTHER_VALUES
    from tests.checkpoints_tools.workers import first, tokens

    import transformers

    src = hf_models["llama-rope"]
    import_hf(src, tmp_path / "ckpt", layout=ParallelLayout(tensor_parallel=2))
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())["model"]
    assert (meta["rope_scaling"], meta["rope_scaling_factor"], meta["rope_scaling_low_freq_factor"],
            meta["rope_scaling_high_freq_factor"], meta["rope_scaling_original_max_position_embeddings"]) == (
        True, *LLAMA3_OTHER_VALUES.values())
    ours = torch.tensor(first(run_ranks(2, "tests.checkpoints_tools.workers:checkpoint_logits",
                                        checkpoint=str(tmp_path / "ckpt"), layout={"tensor_parallel": 2})))
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        theirs = hf(input_ids=tokens(4000)).logits
    diff = (ours[..., :4000] - theirs).abs().max().item()
    assert diff <= 1e-4, f"our TP2 model vs transformers: max |logit difference| {diff}"
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", **LLAMA3_OTHER_VALUES}
    before, after = tensors_of(src), tensors_of(tmp_path / "out")
    assert sorted(before) == sorted(after) and all(torch.equal(after[n], t) for n, t in before.items())


@pytest.mark.distributed
@pytest.mark.parametrize("kind, layout", [("qwen3", {"tensor_parallel": 2}), ("qwen3-tied", {"pipeline_parallel": 2})])
def test_qwen3_import_computes_transformers_logits(hf_models, tmp_path, kind, layout):
    """A random Qwen3ForCausalLM (q/k norms away from 1, head_dim 32 != hidden 64 / 4 heads,
    GQA 4 / 2): our model built from its import, at TP2 (heads split, q/k norms replicated)
    or PP2 (tied embedding and head on different stages), computes transformers' logits."""
    from tests.checkpoints_tools.workers import first, tokens

    import transformers

    src = hf_models[kind]
    import_hf(src, tmp_path / "ckpt", layout=ParallelLayout(**layout))
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())["model"]
    assert (meta["qk_layernorm"], meta["kv_channels"], meta["tie_embeddings"]) == (True, 32, kind == "qwen3-tied")
    ours = torch.tensor(first(run_ranks(2, "tests.checkpoints_tools.workers:checkpoint_logits",
                                        checkpoint=str(tmp_path / "ckpt"), layout=layout)))
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        theirs = hf(input_ids=tokens(4000)).logits
    diff = (ours[..., :4000] - theirs).abs().max().item()
    print(f"\n{kind} import at {layout}: max |logit difference| {diff:.1e}")
    assert diff <= 1e-4, f"our model from the import vs transformers: max |logit difference| {diff}"


def test_qwen3_ours_to_hf_to_ours_is_bit_identical(trained, tmp_path):
    """Our trained TP2 x PP2 Qwen3 checkpoint -> Qwen3ForCausalLM -> our checkpoint (cut for
    TP2 again): every model tensor, q/k norms included, comes back bit for bit, except the
    padded vocab rows (4000 -> 4096), which HF does not hold: they come back as zeros (never
    looked up, their logits masked: models/padded_vocab.py)."""
    run = trained["qwen3"]
    summary = export_hf(run.latest, tmp_path / "hf", with_tokenizer=False)
    assert summary["architecture"] == "Qwen3ForCausalLM"
    import_hf(tmp_path / "hf", tmp_path / "back", layout=ParallelLayout(tensor_parallel=2))
    before = assert_model_tensors_equal(run.latest, tmp_path / "back", vocab=4000)
    assert "decoder.layers.self_attention.q_layernorm.weight" in before

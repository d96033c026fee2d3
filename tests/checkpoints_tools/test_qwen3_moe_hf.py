"""Qwen3-MoE <-> Qwen3MoeForCausalLM (issue 45): import from transformers' own random model
computes its logits (top-k renormalised and not), HF -> ours -> HF and ours -> HF -> ours are
bitwise, and what Qwen3-MoE cannot hold is refused in one line. The export's logits against
transformers are in test_export_hf.py (the trained `qwen3-moe` checkpoint)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from checkpoints_tools import export_hf, import_hf
from models.layout import ParallelLayout
from tests.checkpoints_tools.test_bad_input import run_main
from tests.checkpoints_tools.test_import_hf import assert_model_tensors_equal, tensors_of
from tests.distributed import run_ranks

transformers = pytest.importorskip("transformers")
EP2_TP2 = {"expert_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3-moe-unnormalised"])
def test_import_computes_transformers_logits(hf_models, tmp_path, kind):
    """A random Qwen3MoeForCausalLM (8 experts of 32, top-2, q/k norms away from 1, head_dim 32 !=
    hidden 64 / 4 heads): our model from its import, with the experts over EP2 and each expert's
    columns over TP2, computes transformers' logits. norm_topk_prob=false (transformers' default)
    is the pre-softmax router: without the flag mapped, the expert weights would differ."""
    from tests.checkpoints_tools.workers import first, tokens

    src = hf_models[kind]
    import_hf.import_hf(src, tmp_path / "ckpt", layout=ParallelLayout(**EP2_TP2))
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())["model"]
    normalised = kind == "qwen3-moe"
    assert (meta["num_experts"], meta["moe_router_topk"], meta["moe_ffn_hidden_size"], meta["qk_layernorm"],
            meta["moe_router_pre_softmax"]) == (8, 2, 32, True, not normalised)
    ours = torch.tensor(first(run_ranks(4, "tests.checkpoints_tools.workers:checkpoint_logits",
                                        checkpoint=str(tmp_path / "ckpt"), layout=EP2_TP2)))
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        assert hf.config.norm_topk_prob == normalised
        theirs = hf(input_ids=tokens(4000)).logits
    diff = (ours[..., :4000] - theirs).abs().max().item()
    print(f"\n{kind} import at EP2 x TP2: max |logit difference| {diff:.1e}")
    assert diff <= 1e-4, f"our model from the import vs transformers: max |logit difference| {diff}"


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3-moe-unnormalised"])
def test_hf_to_ours_to_hf_is_bit_identical(hf_models, tmp_path, kind):
    src = hf_models[kind]
    imported = import_hf.import_hf(src, tmp_path / "ckpt", layout=ParallelLayout(pipeline_parallel=2, expert_parallel=2))
    assert imported["architecture"] == "Qwen3MoeForCausalLM"
    export_hf.export_hf(tmp_path / "ckpt", tmp_path / "out")
    before, after = tensors_of(src), tensors_of(tmp_path / "out")
    assert sorted(before) == sorted(after) and "model.layers.1.mlp.experts.7.up_proj.weight" in before
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    old, new = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "out"))
    for key in ("architectures", "model_type", "head_dim", "intermediate_size", "moe_intermediate_size",
                "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                "router_aux_loss_coef", "use_sliding_window", "sliding_window", "rms_norm_eps", "rope_parameters"):
        assert new.get(key) == old.get(key), key
    # transformers writes num_experts under its alias num_local_experts; the published files (and ours) num_experts.
    assert new["num_experts"] == old["num_local_experts"] == 8


def test_ours_to_hf_to_ours_is_bit_identical(trained, tmp_path):
    """Our trained TP2+SP x EP2 tiny-qwen3-moe -> Qwen3MoeForCausalLM -> ours (at EP4): every model
    tensor (router, all 8 experts of every layer, q/k norms) comes back bit for bit, except the
    padded vocab rows (4000 -> 4096), which HF does not hold: they come back as zeros."""
    run = trained["qwen3-moe"]
    summary = export_hf.export_hf(run.latest, tmp_path / "hf", with_tokenizer=False)
    assert summary["architecture"] == "Qwen3MoeForCausalLM"
    import_hf.import_hf(tmp_path / "hf", tmp_path / "back", layout=ParallelLayout(expert_parallel=4))
    before = assert_model_tensors_equal(run.latest, tmp_path / "back", vocab=4000)
    assert "decoder.layers.mlp.router.weight" in before
    assert before["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (4, 8, 128, 128)
    config = json.loads((tmp_path / "back" / "meta.json").read_text())["model"]
    assert config == json.loads((run.latest / "meta.json").read_text())["model"]


def test_refusals(hf_models, trained, tmp_path, capsys):
    """Dense layers among the routed ones (mlp_only_layers, decoder_sparse_step), and our models
    Qwen3-MoE or Mixtral cannot hold: one line each."""
    src = hf_models["qwen3-moe"]
    config = json.loads((src / "config.json").read_text())
    for extra, words in [({"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
                         ({"decoder_sparse_step": 2}, "decoder_sparse_step=2")]:
        copy = shutil.copytree(src, tmp_path / f"bad-{len(words)}")
        (copy / "config.json").write_text(json.dumps({**config, **extra}))
        code, err = run_main(import_hf, [copy, tmp_path / "out"], capsys)
        assert code == 2 and "has dense MLP layers" in err and words in err, err
    # Our tiny-qwen3-moe checkpoint as Mixtral (no q/k norms there) or as dense Qwen3.
    run = trained["qwen3-moe"]
    code, err = run_main(export_hf, [run.latest, tmp_path / "mixtral", "--architecture", "MixtralForCausalLM",
                                     "--no-tokenizer"], capsys)
    assert code == 2 and "MixtralForCausalLM cannot hold this model" in err and "use Qwen3MoeForCausalLM" in err, err
    code, err = run_main(export_hf, [run.latest, tmp_path / "dense", "--architecture", "Qwen3ForCausalLM",
                                     "--no-tokenizer"], capsys)
    assert code == 2 and "cannot hold this model" in err and "Qwen3MoeForCausalLM" in err, err


@pytest.mark.distributed
def test_verify_passes_export_and_catches_swapped_experts(trained, tmp_path):
    """checkpoints_tools.verify on the export of our trained tiny-qwen3-moe passes; the same export
    with two experts' gate projections swapped in one layer, or one expert's gate and up, fails."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    run = trained["qwen3-moe"]
    dirs = {name: tmp_path / name for name in ("good", "experts", "gate_up")}
    for out in dirs.values():
        export_hf.export_hf(run.latest, out, with_tokenizer=False)
    swaps = {"experts": ("model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.5.gate_proj.weight"),
             "gate_up": ("model.layers.2.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight")}
    for name, (a, b) in swaps.items():
        shard = next(dirs[name].glob("*.safetensors"))
        with safe_open(str(shard), "pt") as f:
            weights = {n: f.get_tensor(n) for n in f.keys()}
        weights[a], weights[b] = weights[b], weights[a]
        save_file(weights, str(shard), metadata={"format": "pt"})
    pairs = [[str(run.latest), str(path)] for path in dirs.values()]
    good, *bad = run_ranks(1, "tests.checkpoints_tools.workers:verify_imports", pairs=pairs)[0]
    assert good["passed"] and good["max_abs_diff"] <= 1e-4 and good["greedy_agreement"] == 1.0, good
    for name, report in zip(swaps, bad, strict=True):
        assert not report["passed"] and report["max_abs_diff"] > 1e-3, (name, report)


@pytest.mark.distributed
def test_import_trains_one_step_and_exports_what_it_trained(hf_models, tmp_path):
    """A random Qwen3MoeForCausalLM imported and trained one step at TP2+SP (each expert's columns
    split over the two ranks) on real text: the step's loss is transformers' loss on the same batch
    (so the imported router and experts compute HF's forward); the exported step-1 checkpoint
    gives our trained model's logits in transformers (verify, 1e-4), and they moved from the import's."""
    from tests.checkpoints_tools.test_import_trains import train_one_step_after_import

    train_one_step_after_import(hf_models["qwen3-moe"], tmp_path)

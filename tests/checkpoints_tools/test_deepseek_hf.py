"""DeepSeek-V3 <-> DeepseekV3ForCausalLM (issue 45): a random model of transformers' own class
(multi-latent attention with and without a query latent, dense-first + MoE layers, shared
experts, sigmoid routing with a non-zero e_score_correction_bias, group-limited routing,
routed_scaling_factor) imported computes transformers' logits; imported, trained one step and
exported, transformers computes the trained model's logits; HF -> ours -> HF and ours -> HF ->
ours are bitwise; what DeepseekV3ForCausalLM cannot hold is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from checkpoints_tools import export_hf, hf_format, import_hf
from models.config import get_flavor
from models.layout import ParallelLayout
from tests.checkpoints_tools.conftest import SP_MODEL, _randomize_norms
from tests.checkpoints_tools.test_bad_input import run_main
from tests.checkpoints_tools.test_import_hf import assert_model_tensors_equal, tensors_of
from tests.distributed import run_ranks

transformers = pytest.importorskip("transformers")
EP2_TP2 = {"expert_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True}
# latent: a query latent, layer 0 dense, 8 experts top-4 in 4 groups (2 chosen: top 4 / 2 = 2 per
# group, as DeepSeek-V3's 8 / 4), 2 shared experts, routed_scaling_factor 2.5.
# stacked: every layer MoE (Megatron-Core's stacked layer keys), no groups, top-2, scaling 1.
# q_lora_rank None is refused (test_refusals: Megatron-Core's MLA would normalise the query input).
KINDS = {
    "latent": dict(num_hidden_layers=3, q_lora_rank=48, first_k_dense_replace=1, num_experts_per_tok=4, n_group=4,
                   topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5),
    "stacked": dict(num_hidden_layers=2, q_lora_rank=48, first_k_dense_replace=0, num_experts_per_tok=2, n_group=1,
                    topk_group=1, n_shared_experts=1, routed_scaling_factor=1.0),
}


def _save_hf(path, kind: str, rope: dict | None = None):
    torch.manual_seed(45 + list(KINDS).index(kind))
    config = transformers.DeepseekV3Config(
        vocab_size=4000, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, max_position_embeddings=128, initializer_range=0.1,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 50000.0}, **KINDS[kind])
    model = transformers.DeepseekV3ForCausalLM(config)
    _randomize_norms(model)  # q_a / kv_a latent norms and the layer norms away from 1
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if ".mlp." in name and "norm" not in name:
                # transformers leaves the router at zero; a non-zero bias must move the choice of experts.
                scale = 0.3 if name.endswith("e_score_correction_bias") else 0.1
                tensor.copy_(scale * torch.randn_like(tensor))
    model.save_pretrained(path)
    (path / "tokenizer.model").write_bytes(SP_MODEL.read_bytes())
    (path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}')
    return path


@pytest.fixture(scope="module")
def hf_models(module_tmp_factory):
    base = module_tmp_factory.mktemp("deepseek-hf")
    return {kind: _save_hf(base / kind, kind) for kind in KINDS}


def _hf_logits(hf_dir, tokens):
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        return model(input_ids=tokens).logits


# What the import must read from each config.json: q_lora_rank, moe_layer_freq, groups, group top-k,
# shared expert width, routed scaling factor.
EXPECTED_FIELDS = {"latent": (48, [0, 1, 1], 4, 2, 64, 2.5), "stacked": (48, 1, None, None, 32, None)}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", list(EXPECTED_FIELDS))
def test_import_computes_transformers_logits_at_ep2_tp2(hf_models, tmp_path, kind):
    """Our model from the import, experts over EP2 and attention / experts over TP2 + SP,
    computes transformers' logits; with the router bias dropped it does not (the bias is live)."""
    from tests.checkpoints_tools.workers import first, tokens

    src = hf_models[kind]
    import_hf.import_hf(src, tmp_path / "ckpt", layout=ParallelLayout(**EP2_TP2))
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())["model"]
    assert (meta["q_lora_rank"], meta["moe_layer_freq"], meta["moe_router_num_groups"], meta["moe_router_group_topk"],
            meta["moe_shared_expert_hidden_size"], meta["moe_router_topk_scaling_factor"]) == EXPECTED_FIELDS[kind]
    ours = torch.tensor(first(run_ranks(4, "tests.checkpoints_tools.workers:checkpoint_logits",
                                        checkpoint=str(tmp_path / "ckpt"), layout=EP2_TP2)))
    theirs = _hf_logits(src, tokens(4000))
    diff = (ours[..., :4000] - theirs).abs().max().item()
    print(f"\nDeepSeek-V3 ({kind}) import at EP2 x TP2+SP: max |logit difference| {diff:.1e}")
    assert diff <= 1e-4, f"our model from the import vs transformers: max |logit difference| {diff}"
    unbiased = shutil.copytree(src, tmp_path / "unbiased")
    weights = tensors_of(unbiased)
    for name in [n for n in weights if n.endswith("e_score_correction_bias")]:
        weights[name] = torch.zeros_like(weights[name])
    from safetensors.torch import save_file

    for shard in unbiased.glob("*.safetensors"):
        shard.unlink()
    save_file(weights, str(unbiased / "model.safetensors"), metadata={"format": "pt"})
    moved = (_hf_logits(unbiased, tokens(4000)) - theirs).abs().max().item()
    assert moved > 1e-3, f"the router bias changes nothing in this model ({moved}): the test could not see it"


@pytest.mark.parametrize("kind", list(KINDS))
def test_hf_to_ours_to_hf_is_bit_identical(hf_models, tmp_path, kind):
    src = hf_models[kind]
    layout = ParallelLayout(pipeline_parallel=KINDS[kind]["num_hidden_layers"], expert_parallel=2)
    imported = import_hf.import_hf(src, tmp_path / "ckpt", layout=layout)
    assert imported["architecture"] == "DeepseekV3ForCausalLM"
    export_hf.export_hf(tmp_path / "ckpt", tmp_path / "out")
    before, after = tensors_of(src), tensors_of(tmp_path / "out")
    assert sorted(before) == sorted(after) and "model.layers.1.mlp.experts.7.up_proj.weight" in before
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    old, new = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "out"))
    for key in ("architectures", "model_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "rope_interleave",
                "intermediate_size", "moe_intermediate_size", "rms_norm_eps", "rope_parameters"):
        assert new.get(key) == old.get(key), key


# YaRN as transformers' rope_parameters: DeepSeek-V3's released values (at a 32-token original
# context, so the 64-token check reaches past it); mscale and mscale_all_dim apart; the factor alone
# (transformers then scales cos/sin by m(1) and leaves the softmax scale).
YARN_ROPES = {
    "deepseek": {"factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                 "mscale": 1.0, "mscale_all_dim": 1.0},
    "ratio": {"factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16, "beta_slow": 2, "mscale": 0.8,
              "mscale_all_dim": 0.6},
    "factor-only": {"factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.distributed
@pytest.mark.parametrize("variant", list(YARN_ROPES))
def test_yarn_import_computes_transformers_logits_and_round_trips(tmp_path, variant):
    """A DeepseekV3ForCausalLM with YaRN RoPE imported runs Megatron-Core's YaRN (MLA rope_type
    yarn) and computes transformers' logits at TP2 + SP; the same weights under plain RoPE give
    other logits (YaRN is live in the check); exported back, the tensors are bitwise and
    transformers computes the source's logits from the written rope_parameters."""
    from tests.checkpoints_tools.workers import first, tokens

    rope = {"rope_type": "yarn", "rope_theta": 50000.0, **YARN_ROPES[variant]}
    src, plain = _save_hf(tmp_path / "hf", "stacked", rope), _save_hf(tmp_path / "plain", "stacked")
    import_hf.import_hf(src, tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())["model"]
    assert meta["yarn_scaling_factor"] == rope["factor"], meta
    layout = {"tensor_parallel": 2, "sequence_parallel": True}
    ours = torch.tensor(first(run_ranks(2, "tests.checkpoints_tools.workers:checkpoint_logits",
                                        checkpoint=str(tmp_path / "ckpt"), layout=layout)))
    theirs = _hf_logits(src, tokens(4000))
    diff = (ours[..., :4000] - theirs).abs().max().item()
    live = (_hf_logits(plain, tokens(4000)) - theirs).abs().max().item()
    print(f"\nDeepSeek-V3 with YaRN ({variant}) at TP2+SP: max |logit difference| {diff:.1e} (plain RoPE: {live:.1e})")
    assert diff <= 1e-4 and live > 1e-2, (diff, live)
    export_hf.export_hf(tmp_path / "ckpt", tmp_path / "out")
    before, after = tensors_of(src), tensors_of(tmp_path / "out")
    assert sorted(before) == sorted(after) and all(torch.equal(after[n], t) for n, t in before.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    assert torch.equal(_hf_logits(tmp_path / "out", tokens(4000)), theirs)


@pytest.mark.distributed
def test_import_trains_one_step_exports_what_it_trained_and_round_trips(hf_models, tmp_path):
    """The latent model imported and trained one step at TP2+SP on real text: the step's loss is
    transformers' on the same batch; the exported step-1 checkpoint gives our trained model's
    logits in transformers (verify, 1e-4), which moved from the import's; and step 1 -> HF ->
    ours is bitwise (router bias moved by the step included)."""
    from tests.checkpoints_tools.test_import_trains import train_one_step_after_import

    hf_dir = hf_models["latent"]
    step1 = train_one_step_after_import(hf_dir, tmp_path)
    import_hf.import_hf(tmp_path / "hf", tmp_path / "back", layout=ParallelLayout(expert_parallel=4))
    tensors = assert_model_tensors_equal(step1, tmp_path / "back", vocab=4000)
    bias = tensors["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and not torch.equal(bias, tensors_of(hf_dir)[
        "model.layers.1.mlp.gate.e_score_correction_bias"]), "the step did not move the router bias"


def test_refusals(hf_models, tmp_path, capsys):
    """One line each: HF configs whose forward we do not reproduce, and our models
    DeepseekV3ForCausalLM cannot hold (1 expert per chosen group among them)."""
    src = hf_models["latent"]
    config = json.loads((src / "config.json").read_text())
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    for i, (extra, words) in enumerate([({"rope_parameters": {**yarn, "mscale": 0.707, "mscale_all_dim": 0}},
                                         "YaRN mscale=0.707 with mscale_all_dim=0"),
                                        ({"rope_parameters": {**yarn, "attention_factor": 1.0}}, "attention_factor"),
                                        ({"rope_interleave": False}, "rope_interleave=false"),
                                        ({"topk_group": 1}, "num_experts_per_tok / topk_group = 4/1"),
                                        ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
                                        ({"q_lora_rank": None}, "q_lora_rank=null")]):
        copy = shutil.copytree(src, tmp_path / f"bad-{i}")
        (copy / "config.json").write_text(json.dumps({**config, **extra}))
        code, err = run_main(import_hf, [copy, tmp_path / f"out-{i}"], capsys)
        assert code == 2 and "DeepseekV3ForCausalLM uses features we cannot reproduce" in err and words in err, err
        assert len(err.strip().splitlines()) == 1, err
    tiny = get_flavor("tiny-deepseek")
    for model, words in [(tiny.model_copy(update={"moe_router_num_groups": 4, "moe_router_group_topk": 2}),
                          "moe_router_topk / moe_router_group_topk = 2/2"),
                         (tiny.model_copy(update={"norm_eps": 1e-5}), "norm_eps=1e-05"),
                         (tiny.model_copy(update={"q_lora_rank": None}), "q_lora_rank=None"),
                         (tiny.model_copy(update={"yarn_scaling_factor": 4.0, "yarn_mscale": 0.5,
                                                  "yarn_mscale_all_dim": 0.0}), "yarn_mscale=0.5"),
                         (tiny.model_copy(update={"moe_layer_freq": [1, 0, 1, 1]}), "moe_layer_freq=[1, 0, 1, 1]")]:
        with pytest.raises(ValueError, match="no DeepseekV3ForCausalLM equivalent") as error:
            hf_format.to_hf_config(model, architecture="DeepseekV3ForCausalLM", dtype=torch.float32, bos_id=None,
                                   eos_id=None)
        assert words in str(error.value), str(error.value)


def test_mtp_layers_are_left_out_with_a_note(hf_models, tmp_path, capsys):
    """An HF directory holding DeepSeek's MTP layer (model.layers.N, N = num_hidden_layers, as the
    released files do) imports without it, saying so; an export leaves our MTP tensors out."""
    copy = shutil.copytree(hf_models["stacked"], tmp_path / "with-mtp")
    weights = tensors_of(copy)
    weights.update({name.replace("model.layers.1.", "model.layers.2."): tensor.clone()
                    for name, tensor in weights.items() if name.startswith("model.layers.1.")})
    from safetensors.torch import save_file

    for shard in copy.glob("*.safetensors"):
        shard.unlink()
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    code, err = run_main(import_hf, [copy, tmp_path / "ckpt"], capsys)
    assert code == 0 and "note: MTP layers are training-only; not imported" in err, err
    _add_mtp_tensor(tmp_path / "ckpt", tmp_path / "with-mtp-ckpt")
    # (The note a model trained with MTP layers gets is tests/pretrain/test_mtp.py's.)
    code, err = run_main(export_hf, [tmp_path / "with-mtp-ckpt", tmp_path / "hf", "--no-tokenizer"], capsys)
    assert code == 0, err
    exported = tensors_of(tmp_path / "hf")
    assert not any("mtp" in name or ".layers.2." in name for name in exported)
    assert sorted(exported) == sorted(tensors_of(hf_models["stacked"]))


def _add_mtp_tensor(src, dst) -> None:
    """A copy of checkpoint `src` with one more tensor named as an MTP layer's would be (MTP
    itself is another branch's: only the name matters to the export)."""
    from checkpoints_tools.common import checkpoint_model, read_experiment_config, write_training_meta
    from checkpoints_tools.dcp_io import CheckpointReader, read_common, write_checkpoint

    meta, model = checkpoint_model(src)
    reader = CheckpointReader(src)
    extra = {"mtp.layers.0.eh_proj.weight": torch.randn(model.hidden_size, 2 * model.hidden_size)}
    shapes = {key: reader.shape(key) for key in reader.tensor_keys()} | {k: tuple(v.shape) for k, v in extra.items()}
    tensors = {key: (shape, torch.float32, [((0,) * len(shape), shape)]) for key, shape in shapes.items()}
    objects = {key: reader.read_object(key) for key in reader.object_keys()}
    write_checkpoint(dst, tensors, lambda key, offsets, sizes: extra[key] if key in extra else reader.read(key),
                     objects, read_common(src))
    write_training_meta(dst, model=model, layout=ParallelLayout(**meta.layout), world_size=meta.world_size, step=0,
                        consumed_samples=0, has_optimizer=False, config=read_experiment_config(src, model),
                        provenance=meta.converted_by)


def test_verify_vllm_refuses_deepseek_on_the_cpu_build(hf_models, tmp_path, capsys):
    """vLLM's CPU build loads DeepseekV3ForCausalLM but does not compute transformers' logits
    (checkpoints_tools/verify_vllm.py CPU_UNSERVED says what was measured): one line, before any
    model loads."""
    from checkpoints_tools import verify_vllm

    if not verify_vllm.DEFAULT_VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {verify_vllm.DEFAULT_VLLM_PYTHON} (bash dev.sh vllm-env creates it)")
    import_hf.import_hf(hf_models["latent"], tmp_path / "ckpt")
    export_hf.export_hf(tmp_path / "ckpt", tmp_path / "hf")
    code, err = verify_vllm.main([str(tmp_path / "hf")]), capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "does not serve DeepseekV3ForCausalLM as transformers computes it" in err and "576" in err, err


def test_deepseek_v3_flavor_exports_as_the_published_config():
    """Our deepseek-v3 flavor's config.json has the published shape: transformers' DeepseekV3Config
    defaults (which document deepseek-ai/DeepSeek-V3's config.json) field by field, plain RoPE (the
    pretraining's), no MTP layer exported; with yarn_scaling_factor=40 the released long-context
    model's rope_scaling (factor 40, original 4096, beta 32 / 1, mscale 1 / 1)."""
    ours = hf_format.to_hf_config(get_flavor("deepseek-v3"), architecture="DeepseekV3ForCausalLM",
                                  dtype=torch.bfloat16, bos_id=0, eos_id=1)
    published = transformers.DeepseekV3Config()
    fields = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
              "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
              "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
              "norm_topk_prob", "rms_norm_eps", "rope_interleave", "tie_word_embeddings")
    assert {f: ours[f] for f in fields} == {f: getattr(published, f) for f in fields}
    assert ours["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert ours["num_nextn_predict_layers"] == 0 and hf_format.serving_warnings(get_flavor("deepseek-v3")) == []
    long = get_flavor("deepseek-v3").model_copy(update={"yarn_scaling_factor": 40.0})
    rope = hf_format.to_hf_config(long, architecture="DeepseekV3ForCausalLM", dtype=torch.bfloat16, bos_id=0,
                                  eos_id=1)["rope_parameters"]
    assert rope == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_tiny_deepseek_as_shipped_trains_exports_and_verifies(tmp_path, capsys):
    """The CPU flavor's own routing (top-2 inside 1 of 2 groups) is one DeepseekV3ForCausalLM
    computes the same, so `python -m pretrain --recipe tiny-deepseek` -> export_hf -> verify
    passes with no override (until this stop it needed model.moe_router_topk=4 to export)."""
    from tests.bad_input import run_cli

    ckpt = tmp_path / "ckpt"
    result = run_cli("pretrain", ["--recipe", "tiny-deepseek", "schedule.train_steps=3", f"checkpoint.dir={ckpt}",
                                  f"logging.run_dir={tmp_path / 'run'}"], subprocess=True)
    assert result.code == 0, result.output
    code, err = run_main(export_hf, [ckpt, tmp_path / "hf", "--no-tokenizer"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["topk_group"] == 1
    # In its own process, as a user runs it: verify initialises a process group for its one rank
    # and leaves it to the process's exit (in this worker it broke later tests that start one).
    result = run_cli("checkpoints_tools.verify", [str(ckpt), str(tmp_path / "hf")], subprocess=True)
    assert result.code == 0 and "PASS" in result.output, result.output

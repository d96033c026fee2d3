"""muP (issue 44) on Megatron-Core 0.19.2's own: the model.use_mup / mup_* keys refused where they
cannot work, in one line before any process group; Megatron-Core's muP optimizer groups and init
std in our training (compared with Megatron-Core's own TransformerConfig numbers); and the
layout-invariant muP init, so TP2+SP, PP2, PP2xVPP2, CP2, ZeRO-3 DP2 and MoE EP2 train as one rank does: per-step loss
and grad norm within 1e-5 relative and every final weight within 1e-5, fp32."""

from __future__ import annotations

import math

import pytest

from checkpoints_tools.dcp_io import CheckpointReader
from pretrain.cli import resolve_config
from pretrain.config import dump_yaml
from tests.bad_input import run_cli
from tests.compare import assert_steps_close
from tests.distributed import run_ranks
from tests.pretrain.workers import logged_grad_norms, logged_losses

BASE = ["data.mock=true", "data.demo=false", "runtime.spec=portable"]
# tiny-llama is 128 wide: base 64 gives width_mult 2, so every muP rule changes something.
MUP = ["model.use_mup=true", "model.mup_base_hidden_size=64", "model.mup_embedding_mult=2.0"]


@pytest.mark.parametrize("world, overrides, message", [
    (1, ["model.mup_base_hidden_size=64"], "mup_base_hidden_size is set but use_mup=false"),
    (1, ["model.mup_embedding_mult=4.0"], "mup_embedding_mult is set but use_mup=false"),
    (1, ["model.use_mup=true", "model.mup_base_hidden_size=256"], "mup_base_hidden_size=256 exceeds hidden_size=128"),
    (1, ["model.use_mup=true", "model.mup_base_hidden_size=0"], "mup_base_hidden_size"),
    (1, ["model.use_mup=true", "model.mup_attn_scale_power=2.0"], "mup_attn_scale_power"),
    (1, ["model.use_mup=true", "optimizer.name=muon"], "model.use_mup=true with optimizer.name=muon"),
])
def test_what_mup_cannot_run_is_refused_in_one_line(world, overrides, message):
    result = run_cli("pretrain", ["--recipe", "tiny-llama", "--dry-run", "--world-size", str(world), *BASE,
                                  *overrides])
    assert result.code == 2 and message in result.output and result.crash is None, result
    assert "Traceback" not in result.output and len(result.error_lines) == 1, result.output


def test_dry_run_shows_the_mup_keys_and_old_configs_load_without_them():
    text = dump_yaml(resolve_config("tiny-llama", None, BASE + MUP))
    assert "use_mup: true" in text and "mup_base_hidden_size: 64" in text and "mup_attn_scale_power: 1.0" in text
    plain = resolve_config("tiny-llama", None, BASE).model
    assert not plain.use_mup and plain.mup_width_mult == 1.0
    result = run_cli("pretrain", ["--recipe", "tiny-llama", "--dry-run", "--world-size", "1", *BASE, *MUP])
    assert result.code == 0, result.output
    assert ("# muP: width_mult 2, embeddings x 2, logits x 0.5, softmax scale 0.0625; hidden matrices' AdamW LR "
            "and eps x 0.5") in result.output, result.output


def _megatron_mup_config():
    """Megatron-Core's own TransformerConfig for tiny-llama with muP and its default init methods:
    the independent source of the std and softmax scale our build must reproduce."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model = resolve_config("tiny-llama", None, BASE + MUP).model
    return model, TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups, ffn_hidden_size=model.ffn_hidden_size, init_method_std=model.init_std,
        use_mup=True, mup_base_hidden_size=64, mup_embedding_mult=2.0)


def test_transformer_config_carries_megatrons_mup_fields():
    from models.build import transformer_config
    from models.layout import ParallelLayout

    model, megatron = _megatron_mup_config()
    config = resolve_config("tiny-llama", None, BASE + MUP)
    ours = transformer_config(model, ParallelLayout(), config.runtime, spec="portable")
    assert ours.use_mup and ours.mup_width_mult == 2.0 == megatron.mup_width_mult
    assert ours.mup_output_mult == 0.5 == megatron.mup_output_mult
    assert ours.mup_embedding_mult == 2.0
    assert ours.softmax_scale == megatron.softmax_scale == 1.0 / model.head_dim  # muP: 1/d, not 1/sqrt(d)
    # What the dry run and the HF export read: Megatron-Core's derived values.
    assert model.mup_forward == (megatron.mup_embedding_mult, megatron.mup_output_mult, megatron.softmax_scale)
    explicit = model.model_copy(update={"mup_output_mult": 1.0})
    assert transformer_config(explicit, ParallelLayout(), config.runtime, spec="portable").mup_output_mult == 1.0


def test_optimizer_groups_and_init_are_megatrons_mup(tmp_path):
    model, megatron = _megatron_mup_config()
    lr, eps = 1e-3, 1e-8
    result = run_ranks(1, "tests.pretrain.workers:mup_setup", recipe="tiny-llama", overrides=BASE + MUP + [
        f"optimizer.lr={lr}", "optimizer.min_lr=1e-4", f"optimizer.adam_eps={eps}", "optimizer.distributed=false",
        f"logging.run_dir={tmp_path}", "logging.tensorboard=false"])[0]
    groups, stds = result["groups"], result["stds"]
    assert len(groups) == len(stds) > 0
    width = 128 / 64
    for name, group in groups.items():
        # Megatron-Core's rule: 2-D hidden matrices at lr / width_mult and eps / width_mult; the
        # embedding, the output layer (base LR: muP's "vector-like") and every 1-D parameter at base.
        hidden = name.startswith("decoder.layers.") and name.endswith(".weight") and "norm" not in name
        want = (lr / width, 1e-4 / width, eps / width) if hidden else (lr, 1e-4, eps)
        assert (group["max_lr"], group["min_lr"], group["eps"]) == pytest.approx(want, rel=1e-12), name
    # Init std: hidden matrices Megatron's init_method, output projections its
    # mup_scaled_init_method_normal, embedding and output layer its embedding_init_method.
    want_std = {
        "decoder.layers.0.mlp.linear_fc1.weight": megatron.init_method.keywords["std"],
        "decoder.layers.0.self_attention.linear_qkv.weight": megatron.init_method.keywords["std"],
        "decoder.layers.0.mlp.linear_fc2.weight": megatron.output_layer_init_method.keywords["std"],
        "decoder.layers.3.self_attention.linear_proj.weight": megatron.output_layer_init_method.keywords["std"],
        "embedding.word_embeddings.weight": megatron.embedding_init_method.keywords["std"],
        "output_layer.weight": megatron.embedding_init_method.keywords["std"],
    }
    assert megatron.init_method.keywords["std"] == pytest.approx(0.02 / math.sqrt(2))  # the muP scaling is on
    for name, std in want_std.items():
        # Sample std of >= 16k draws: within 3% of the std drawn from.
        assert stds[name] == pytest.approx(std, rel=0.03), name


STEPS = 4
PARITY = BASE + MUP + [
    f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2", "schedule.global_batch_size=8",
    "schedule.seq_length=64", "schedule.eval_interval=0", "schedule.warmup_steps=1",
    "logging.tensorboard=false", "logging.log_interval=1", "optimizer.lr=1e-2", "optimizer.clip_grad=1e9",
    f"checkpoint.save_interval={STEPS}", "checkpoint.resume=none",
]
LAYOUTS = {
    "TP2+SP": (2, ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]),
    "PP2": (2, ["parallel.pipeline_parallel=2"]),
    "PP2xVPP2": (2, ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"]),
    "CP2": (2, ["parallel.context_parallel=2"]),  # our CP attention takes Megatron-Core's muP softmax scale
    "ZeRO1-DP2": (2, ["parallel.sharding=zero1"]),
    "ZeRO2-DP2": (2, ["parallel.sharding=zero2"]),
    "ZeRO3-DP2": (2, ["parallel.sharding=zero3"]),
    "HSDP2x2-ZeRO3": (4, ["parallel.sharding=zero3", "parallel.hsdp_replicas=2"]),
}


def _train(root, tag: str, nproc: int, extra: list[str], recipe: str = "tiny-llama"):
    results = run_ranks(nproc, "tests.pretrain.workers:train", recipe=recipe, overrides=PARITY + extra + [
        f"checkpoint.dir={root / tag / 'ckpt'}", f"logging.run_dir={root / tag}"])
    reader = CheckpointReader(root / tag / "ckpt" / f"step_{STEPS:08d}")
    weights = {k: reader.read(k) for k in reader.tensor_keys() if not k.startswith("optimizer.")}
    return logged_losses(results), logged_grad_norms(results), weights


@pytest.fixture(scope="module")
def one_rank(module_tmp_factory):
    return _train(module_tmp_factory.mktemp("mup"), "one", 1, [])


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mup_layout_matches_one_rank(name, one_rank, tmp_path):
    nproc, extra = LAYOUTS[name]
    losses, norms, weights = _train(tmp_path, name, nproc, extra)
    want_losses, want_norms, want_weights = one_rank
    assert len(losses) == STEPS and losses[-1] < losses[0]
    assert_steps_close(losses, want_losses, rtol=1e-5, what=f"muP {name} loss vs one rank")
    assert_steps_close(norms, want_norms, rtol=1e-5, what=f"muP {name} grad norm vs one rank")
    assert weights.keys() == want_weights.keys() and any("decoder.layers" in k for k in weights)
    worst = max((weights[k] - want_weights[k]).abs().max().item() for k in weights)
    assert worst <= 1e-5, f"muP {name}: final weights differ by up to {worst:.2e}"


@pytest.mark.distributed
def test_mup_moe_ep2_matches_one_rank(tmp_path):
    """tiny-moe (4 experts, top-2): the 2-D router and the experts are hidden matrices to
    Megatron-Core's muP (init / sqrt(m), LR / m); EP2 holds half the experts per rank."""
    want_losses, want_norms, want_weights = _train(tmp_path, "one", 1, [], recipe="tiny-moe")
    losses, norms, weights = _train(tmp_path, "ep2", 2, ["parallel.expert_parallel=2"], recipe="tiny-moe")
    assert len(losses) == STEPS and losses[-1] < losses[0]
    assert_steps_close(losses, want_losses, rtol=1e-5, what="muP MoE EP2 loss vs one rank")
    assert_steps_close(norms, want_norms, rtol=1e-5, what="muP MoE EP2 grad norm vs one rank")
    assert weights.keys() == want_weights.keys() and any(".experts." in k for k in weights)
    worst = max((weights[k] - want_weights[k]).abs().max().item() for k in weights)
    assert worst <= 1e-5, f"muP MoE EP2: final weights differ by up to {worst:.2e}"

"""Sequence, context and expert parallelism vs the single-rank run (issue 6).

Same initial weights (layout-invariant init), same global batch, fp32, gloo on CPU:
per-step losses must match within 1e-5 relative for 5 steps. Plus the checks parity alone
would not show: norm weights stay identical across TP ranks under SP, the MoE aux loss is
reported (and is itself layout-invariant), CP chunks carry different tokens, and a
checkpoint saved at CP2 x EP2 resumes at CP1 x EP1 on the same trajectory.
"""

from __future__ import annotations


import pytest

from pretrain.cli import resolve_config
from pretrain.config import ConfigError, validate_for_machine, validate_for_world
from tests.compare import assert_steps_close
from tests.distributed import run_module, run_ranks
from tests.pretrain.workers import logged_losses

STEPS = 5
BASE = [
    f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2", "schedule.global_batch_size=8",
    "schedule.eval_interval=0", "schedule.warmup_steps=2", "data.demo=false", "data.mock=true",
    "runtime.spec=portable", "logging.tensorboard=false", "optimizer.lr=1e-2",
]
SEQ64, SEQ128 = ["schedule.seq_length=64"], ["schedule.seq_length=128"]
TP2 = ["parallel.tensor_parallel=2"]
SP = ["parallel.sequence_parallel=true"]
CP2 = ["parallel.context_parallel=2"]
EP2 = ["parallel.expert_parallel=2"]
# The tiny-gpt flavor's architecture through the tiny-llama recipe.
GPT = ["model.normalization=LayerNorm", "model.activation=gelu", "model.position_embedding=learned_absolute",
       "model.add_bias_linear=true", "model.add_qkv_bias=true", "model.tie_embeddings=true",
       "model.num_attention_heads=4", "model.num_query_groups=null", "model.ffn_hidden_size=512"]
# tiny-moe (4 experts, top-2, aux loss) plus the optional parts: a shared expert and the
# router z-loss, so one set of runs covers all of them.
MOE = SEQ64 + ["model.moe_shared_expert_hidden_size=128", "model.moe_z_loss_coeff=0.001"]


def _run(nproc: int, recipe: str, overrides: list[str], run_dir, **kwargs) -> list[dict]:
    return run_ranks(nproc, "tests.pretrain.workers:train", recipe=recipe,
                     overrides=BASE + overrides + [f"logging.run_dir={run_dir}"], **kwargs)


def _assert_close(name: str, got: list[float], want: list[float]) -> None:
    worst = assert_steps_close(got, want, rtol=1e-5, what=name)
    print(f"\n{name}: {len(got)} steps, max relative difference {worst:.1e}")  # shown with -s


def _log_rank(results: list[dict]) -> dict:
    return next(r for r in results if r["log_rank"])


# --- sequence parallelism -------------------------------------------------------------------

@pytest.mark.distributed
def test_sequence_parallel_matches_tp2_and_keeps_norms_identical(tmp_path):
    off = logged_losses(_run(2, "tiny-llama", SEQ64 + TP2, tmp_path / "off"))
    on = _run(2, "tiny-llama", SEQ64 + TP2 + SP, tmp_path / "on", report_norms=True)
    _assert_close("TP2 SP on vs off", logged_losses(on), off)
    assert off[-1] < off[0], "the run must train, or parity would be trivial"
    norms0, norms1 = on[0]["norms"], on[1]["norms"]
    assert len(norms0) == 9  # 2 per layer x 4 layers + final norm
    # Each TP rank sees half the tokens: without the sequence-parallel grad all-reduce the
    # two ranks' norm weights would drift apart from the first update on.
    assert norms0 == norms1, "norm weights differ between TP ranks after training with SP"
    assert any(abs(x - 1.0) > 1e-3 for values in norms0.values() for x in values), "norms never trained"


# --- context parallelism --------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense_reference(module_tmp_factory) -> list[float]:
    losses = logged_losses(_run(1, "tiny-llama", SEQ128, module_tmp_factory.mktemp("cp1")))
    assert len(losses) == STEPS and min(losses) < losses[0] - 0.1, "the run must train"
    return losses


def test_cp_chunks_differ_in_content(tmp_path):
    """Mock samples at seq 128 give 4 chunks (CP2) with different, unmasked tokens."""
    from pretrain.data import build_datasets

    config = resolve_config("tiny-llama", None, BASE + SEQ128 + [f"logging.run_dir={tmp_path}"])
    sample = build_datasets(config, 1).train[0]
    tokens, mask = sample["tokens"], sample["loss_mask"]
    chunks = [tuple(tokens[i * 32:(i + 1) * 32].tolist()) for i in range(4)]
    assert len(set(chunks)) == 4, "CP chunks hold identical tokens"
    assert all(mask[i * 32:(i + 1) * 32].sum() > 0 for i in range(4)), "a CP chunk is all padding"


@pytest.mark.distributed
@pytest.mark.parametrize("name, nproc, layout", [
    ("CP2", 2, CP2),
    ("CP2xTP2-SP", 4, CP2 + TP2 + SP),
    # Pipeline messages carry seq / CP tokens (the schedule must get the full length).
    pytest.param("CP2xPP2", 4, CP2 + ["parallel.pipeline_parallel=2"], marks=pytest.mark.slow),
    pytest.param("CP2-recompute", 2, CP2 + ["runtime.recompute=selective"], marks=pytest.mark.slow),
])
def test_context_parallel_matches_cp1(name, nproc, layout, dense_reference, tmp_path):
    _assert_close(name, logged_losses(_run(nproc, "tiny-llama", SEQ128 + layout, tmp_path)), dense_reference)


@pytest.mark.distributed
def test_gpt_layernorm_learned_positions_cp2_tp2_sp(tmp_path):
    """tiny-gpt: LayerNorm (weight and bias) under SP, learned absolute positions (sliced
    with the CP split of position_ids, not by RoPE), tied embeddings, biases."""
    want = logged_losses(_run(1, "tiny-llama", GPT + SEQ128, tmp_path / "ref"))
    got = _run(4, "tiny-llama", GPT + SEQ128 + CP2 + TP2 + SP, tmp_path / "cp2tp2", report_norms=True)
    _assert_close("tiny-gpt CP2xTP2-SP", logged_losses(got), want)
    # Ranks 0 and 1 are the TP group of CP rank 0 (TP is innermost); all four hold the
    # same norm parameters (CP ranks are data-parallel replicas for the weights).
    assert any(name.endswith("bias") for name in got[0]["norms"])
    assert got[0]["norms"] == got[1]["norms"] == got[2]["norms"] == got[3]["norms"]


# --- mixture of experts / expert parallelism -----------------------------------------------

@pytest.fixture(scope="module")
def moe_reference(module_tmp_factory) -> dict:
    ref = _log_rank(_run(1, "tiny-moe", MOE, module_tmp_factory.mktemp("ep1")))
    assert ref["losses"][-1] < ref["losses"][0]
    return ref


@pytest.mark.distributed
@pytest.mark.parametrize("name, nproc, layout", [
    ("EP2", 2, EP2),
    ("EP2xTP2-SP", 4, EP2 + TP2 + SP),
    pytest.param("EP2xPP2", 4, EP2 + ["parallel.pipeline_parallel=2"], marks=pytest.mark.slow),
])
def test_expert_parallel_matches_ep1(name, nproc, layout, moe_reference, tmp_path):
    got = _log_rank(_run(nproc, "tiny-moe", MOE + layout, tmp_path))
    _assert_close(name, got["losses"], moe_reference["losses"])
    # Reported, and (being global means) the same at every layout.
    aux, z = got["moe_aux_losses"], got["moe_z_losses"]
    assert all(a is not None and 0.5 < a < 4.0 for a in aux), f"aux loss not reported: {aux}"
    assert all(v is not None and v > 0 for v in z), f"z-loss not reported: {z}"
    _assert_close(f"{name} aux loss", aux, moe_reference["moe_aux_losses"])
    _assert_close(f"{name} z-loss", z, moe_reference["moe_z_losses"])


@pytest.mark.distributed
@pytest.mark.slow
def test_allgather_dispatcher_and_expert_tp1_match_ep1(moe_reference, tmp_path):
    """The other dispatcher, with expert TP 1 under TP2 (experts whole, attention split)."""
    layout = EP2 + TP2 + SP + ["parallel.moe_dispatcher=allgather", "parallel.expert_tensor_parallel=1"]
    got = _log_rank(_run(4, "tiny-moe", MOE + layout, tmp_path))
    _assert_close("EP2xTP2xETP1 allgather", got["losses"], moe_reference["losses"])


@pytest.mark.distributed
@pytest.mark.slow
def test_token_dropping_at_capacity_matches_ep1(tmp_path):
    """Capacity 1.0 drops tokens; each EP rank routes the same micro-batch as the single
    rank does, so the same tokens are dropped (with TP or CP the router sees a shard and
    capacity is per shard, so dropping is layout-dependent by design)."""
    capacity = SEQ64 + ["model.moe_capacity_factor=1.0"]
    want = logged_losses(_run(1, "tiny-moe", capacity, tmp_path / "ep1"))
    got = logged_losses(_run(2, "tiny-moe", capacity + EP2, tmp_path / "ep2"))
    _assert_close("EP2 capacity 1.0", got, want)


@pytest.mark.distributed
def test_save_at_cp2_ep2_resume_at_cp1_ep1(moe_reference, tmp_path):
    """CP2 x EP2 (2 ranks: EP reuses the CP ranks) matches EP1; its step-3 checkpoint
    resumed on one rank continues on the same losses."""
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.save_interval=3"]
    full = logged_losses(_run(2, "tiny-moe", MOE + CP2 + EP2 + ckpt + ["checkpoint.resume=none"],
                              tmp_path / "full"))
    _assert_close("CP2xEP2", full, moe_reference["losses"])
    resumed = logged_losses(_run(1, "tiny-moe", MOE + ckpt + ["checkpoint.resume=3", "checkpoint.on_newer=move_aside"],
                                 tmp_path / "resumed"))
    _assert_close("resumed at CP1xEP1", resumed, full[3:])


# --- bad input: clear errors before any process group --------------------------------------

@pytest.mark.parametrize("recipe, overrides, world, message", [
    ("tiny-llama", CP2 + ["schedule.seq_length=66"], 2, "seq_length=66 must be divisible by 2 x CP = 4"),
    ("tiny-llama", SP, 1, "sequence_parallel=true needs tensor_parallel > 1"),
    ("tiny-moe", ["parallel.expert_parallel=3"], 3, "EP=3 does not divide num_experts=4; valid EP: 1, 2, 4"),
    ("tiny-moe", TP2, 2, "needs sequence_parallel=true"),
    ("tiny-llama", CP2 + ["parallel.cp_comm_type=p2p"], 2,
     "parallel.cp_comm_type=p2p needs the Transformer Engine spec"),
    ("tiny-moe", ["runtime.moe_grouped_gemm=true"], 1, "runtime.moe_grouped_gemm=true needs the Transformer Engine spec"),
])
def test_bad_layouts_fail_before_any_process_group(recipe, overrides, world, message):
    config = resolve_config(recipe, None, BASE + SEQ64 + overrides)
    with pytest.raises(ConfigError) as err:
        validate_for_world(config, world)
    assert message in str(err.value)


def test_te_spec_without_transformer_engine_is_refused_at_setup(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine may run the te spec")
    config = resolve_config("tiny-llama", None, BASE + SEQ64 + CP2 + ["runtime.spec=te"])
    with pytest.raises(ConfigError, match="layer spec 'te' needs Transformer Engine"):
        validate_for_machine(config)
    # The entry point reports it and exits 2 before creating a process group.
    proc = run_module("pretrain", ["--recipe", "tiny-llama", *BASE, *SEQ64, "runtime.spec=te",
                                   f"logging.run_dir={tmp_path}"], timeout=120)
    assert proc.returncode == 2 and "needs Transformer Engine" in proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr

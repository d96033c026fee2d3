"""launch.planner.memory against what Megatron-Core actually allocates on CPU ranks.

Static memory (params, fp32 grad buffer, fp32 main params, Adam moments) must equal the
bytes allocated through `pretrain.wrap.wrap_for_training` within 1% for every layout of
the matrix: TP, PP (also with uneven first / last stages), VPP, DP, EP, distributed optimizer on/off, ZeRO-2/3 and HSDP
(Megatron-FSDP's padded buffers), fp32 and bf16, tied embeddings, biases, MoE, DeepSeek-style
MLA with a dense layer among MoE layers and a shared expert (tiny-deepseek, also under ZeRO-2/3),
multi-token prediction layers (model.mtp_num_layers); and for
optimizer.name=muon (Muon's momentum + AdamW's moments, unsharded and under Megatron-Core's
layer-wise distributed optimizer at DP2: launch.planner.muon) and optimizer.name=lion (one
momentum per element, the same wrapping).

Activations: the bytes autograd saves in one forward pass, where the CPU implementation
matches the published analysis' assumptions (GPT style: MHA, GeLU, LayerNorm; fp32, so no
mixed-precision copies; unfused attention): no parallelism, TP, TP + SP, selective and
full recompute, within 5%. Outside those assumptions the portable CPU path saves more than
the fused GPU path the planner models (fp32 norm internals and softmax under bf16, unfused
SwiGLU, GQA keys/values expanded to every head), so those cases are not compared here.
"""

from __future__ import annotations

import importlib.util

import pytest

from launch.planner.candidate import Candidate
from launch.planner.memory import activation_bytes, memory_on_stage, recompute_working_bytes
from models.config import get_flavor
from pretrain.config import apply_overrides
from pretrain.recipes import get_recipe
from tests.distributed import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BF16, FP32 = "runtime.dtype=bf16", "runtime.dtype=fp32"
NO_DISTOPT = "optimizer.distributed=false"
TP2, SP = "parallel.tensor_parallel=2", "parallel.sequence_parallel=true"
ZERO2, ZERO3 = "parallel.sharding=zero2", "parallel.sharding=zero3"
STATIC = {  # world size -> (flavor, overrides)
    2: [
        ("tiny-llama", [TP2, FP32]),
        ("tiny-llama", ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2", BF16, NO_DISTOPT]),
        # Uneven stages, as the planner's search offers them (launch.planner.search.uneven_splits):
        # stage 0 holds the embedding and 1 layer, stage 1 the other 3 and the output layer.
        ("tiny-llama", ["parallel.pipeline_parallel=2", "parallel.num_layers_in_first_pipeline_stage=1", BF16]),
        ("tiny-llama", [BF16]),  # DP2, distributed optimizer shards main params + moments
        ("tiny-gpt", ["parallel.pipeline_parallel=2", BF16]),  # tied embedding copy on the last stage
        ("tiny-gpt", [TP2, BF16, NO_DISTOPT]),  # replicated row-parallel biases
        ("tiny-moe", ["parallel.expert_parallel=2", BF16]),  # experts split by EP, not sharded by DP
        # Qwen3-MoE: fine-grained experts (moe_ffn_hidden_size != ffn_hidden_size), q/k norms, head_dim != h / n.
        ("tiny-qwen3-moe", ["parallel.expert_parallel=2", BF16]),
        ("tiny-llama", [ZERO2, FP32]),  # Megatron-FSDP: gradients sharded, padded buckets
        ("tiny-llama", [ZERO3, BF16]),  # + parameters sharded, fp32 main weights
        # DeepSeek-V3's parts: MLA (the portable spec splits its down projections over TP, keeps
        # the latent norms whole), layer 1 dense among MoE layers 2-4, a shared expert.
        ("tiny-deepseek", [TP2, SP, BF16]),
        ("tiny-deepseek", ["parallel.pipeline_parallel=2", BF16]),  # stage 0: the dense layer + 1 MoE
        ("tiny-deepseek", ["parallel.expert_parallel=2", BF16]),  # routed experts split, shared expert not
        # Multi-token prediction: its layer (MoE, like the decoder's last), projection and norms on
        # the last stage, with that stage's own copy of the word embedding at PP > 1.
        ("tiny-deepseek", ["model.mtp_num_layers=1", "parallel.pipeline_parallel=2", BF16]),
        ("tiny-llama", ["model.mtp_num_layers=1", TP2, FP32]),  # a dense MTP layer, projection split over TP
        # Megatron-FSDP's buckets of tiny-deepseek: a dense and three MoE units of MLA layers.
        ("tiny-deepseek", [ZERO3, BF16]),
        ("tiny-deepseek", [ZERO2, BF16]),
        ("tiny-deepseek", [ZERO3, "model.mtp_num_layers=1", BF16]),  # MTP's layer a unit, its norms/eh_proj not
    ],
    4: [
        ("tiny-llama", [TP2, BF16]),  # TP2 x DP2
        ("tiny-gpt", ["parallel.pipeline_parallel=2", FP32]),  # PP2 x DP2
        ("tiny-moe", ["parallel.expert_parallel=2", BF16]),  # DP4, EP2 -> expert-DP 2
        ("tiny-llama", [ZERO3, TP2, SP, BF16]),  # ZeRO-3 over DP2 inside TP2
        ("tiny-llama", [ZERO3, "parallel.hsdp_replicas=2", FP32]),  # HSDP: shard over 2, replicate over 2
        ("tiny-moe", [ZERO3, "parallel.expert_parallel=2", BF16]),  # experts sharded over expert-DP
        ("tiny-qwen3-moe", [TP2, SP, "parallel.expert_parallel=2", BF16]),  # TP2 x DP2, experts EP2 x expert-TP2
        ("tiny-deepseek", [TP2, SP, "parallel.expert_parallel=2", BF16]),  # MLA at TP2, experts EP2 x expert-TP2
        ("tiny-deepseek", [ZERO3, "parallel.expert_parallel=2", BF16]),  # experts sharded over expert-DP 2
        ("tiny-deepseek", [ZERO3, TP2, SP, BF16]),  # MLA's down projections split (portable) in the units
    ],
}
MUON = "optimizer.name=muon"
LION = "optimizer.name=lion"
MUON_STATIC = [  # world size 2; needs emerging-optimizers (Megatron-Core's Muon)
    ("tiny-llama", [MUON, TP2, FP32]),  # DP1: unsharded, QKV split, TP shards
    ("tiny-llama", [MUON, BF16]),  # DP2: layer-wise optimizer deals whole parameters
    ("tiny-gpt", [MUON, "parallel.pipeline_parallel=2", BF16]),  # biases, LayerNorm, learned positions
    ("tiny-moe", [MUON, "parallel.expert_parallel=2", BF16]),  # router on AdamW, experts on Muon
    ("tiny-llama", [MUON, FP32, NO_DISTOPT]),  # DP2 unsharded (fp32 needs it)
    # optimizer.name=lion: one momentum for every parameter, the same wrapping as Muon's.
    ("tiny-llama", [LION, TP2, FP32]),  # DP1: unsharded
    ("tiny-llama", [LION, BF16]),  # DP2: layer-wise optimizer
    ("tiny-moe", [LION, "parallel.expert_parallel=2", BF16]),  # experts dealt over expert-DP
    # tiny-deepseek: MLA's five matrices on Muon, its latent norms on AdamW, dense and MoE layers.
    ("tiny-deepseek", [MUON, BF16]),  # DP2: layer-wise optimizer
    ("tiny-deepseek", [MUON, "model.mtp_num_layers=1", "parallel.pipeline_parallel=2", BF16]),  # MTP + embedding copy
    ("tiny-deepseek", [LION, BF16]),
]
ACT_COMMON = ["schedule.seq_length=256", "schedule.micro_batch_size=2", "schedule.global_batch_size=4", FP32]
ACTIVATIONS = [  # tiny-gpt at world size 2 (DP2 has the activations of one rank alone)
    [], ["runtime.recompute=selective"], ["runtime.recompute=full"],
    [TP2], [TP2, SP], [TP2, SP, "runtime.recompute=selective"],
]
KINDS = ("params", "grads", "main_params", "optimizer_states")


def _cases(world: int) -> list[dict]:
    cases = [{"kind": "static", "flavor": f, "overrides": o} for f, o in STATIC[world]]
    if world == 2:
        cases += [{"kind": "activations", "flavor": "tiny-gpt", "overrides": ACT_COMMON + o} for o in ACTIVATIONS]
    return cases


def _run(world: int) -> tuple[list[dict], list[list[dict]]]:
    """Every case of a world size in one spawn: (cases, per-rank results)."""
    cases = _cases(world)
    return cases, run_ranks(world, "tests.launch.workers:measure", cases=cases, timeout=400)


@pytest.fixture(scope="module")
def world2():
    return _run(2)


@pytest.fixture(scope="module")
def world4():
    return _run(4)


@pytest.fixture(scope="module")
def world2_muon():
    if importlib.util.find_spec("emerging_optimizers") is None:
        pytest.skip("SKIPPED, NOT PASSED: Megatron-Core's Muon needs the emerging-optimizers package "
                    "(pip install emerging-optimizers==0.3.0)")
    cases = [{"kind": "static", "flavor": f, "overrides": o} for f, o in MUON_STATIC]
    return cases, run_ranks(2, "tests.launch.workers:measure", cases=cases, timeout=400)


def _candidate(case: dict, world: int) -> Candidate:
    base = get_recipe("tiny-llama").model_copy(update={"model": get_flavor(case["flavor"])})
    return Candidate.from_config(apply_overrides(base, overrides=case["overrides"]), world, flash_attention=False)


@pytest.mark.parametrize("world", sorted(STATIC))
def test_static_memory_matches_allocation(world, request):
    """The planner predicts the fullest rank of each stage: that rank within 1%, and no rank
    above it (Megatron-FSDP's last shard of a padded bucket holds fewer real elements, so
    its Adam moments are smaller there)."""
    cases, per_rank = request.getfixturevalue(f"world{world}")
    failures = _static_failures(cases, per_rank, world)
    assert not failures, "\n".join(failures)


def test_muon_static_memory_matches_allocation(world2_muon):
    """optimizer.name=muon: the same 1% check (the fullest rank per kind under the layer-wise
    optimizer, whose dealing of whole parameters leaves DP ranks unequal)."""
    cases, per_rank = world2_muon
    failures = _static_failures(cases, per_rank, 2)
    assert not failures, "\n".join(failures)


def _static_failures(cases: list[dict], per_rank: list[list[dict]], world: int) -> list[str]:
    failures = []
    for index, case in enumerate(cases):
        if case["kind"] != "static":
            continue
        candidate = _candidate(case, world)
        stages = sorted({results[index]["stage"] for results in per_rank})
        for stage in stages:
            predicted = memory_on_stage(candidate, stage)
            want = {"params": predicted.params, "grads": predicted.grads,
                    "main_params": predicted.main_params, "optimizer_states": predicted.optimizer_states}
            on_stage = [(rank, results[index]) for rank, results in enumerate(per_rank)
                        if results[index]["stage"] == stage]
            for kind in KINDS:
                got = max(measured[kind] for _, measured in on_stage)
                ok = got == want[kind] == 0 or (want[kind] > 0 and abs(got - want[kind]) <= 0.01 * want[kind])
                over = [rank for rank, measured in on_stage if measured[kind] > 1.01 * want[kind]]
                if not ok or over:
                    failures.append(f"{case['flavor']} {case['overrides']} stage {stage}: {kind} measured "
                                    f"{[m[kind] for _, m in on_stage]} B on its ranks, predicted {want[kind]:.0f} B")
    return failures


def test_saved_activations_match_model(world2):
    cases, per_rank = world2
    failures = []
    for index, case in enumerate(cases):
        if case["kind"] != "activations":
            continue
        candidate = _candidate(case, 2)
        # The forward pass saves what backward needs; full recompute's one-layer working set
        # exists only during backward.
        predicted = activation_bytes(candidate, 0) - recompute_working_bytes(candidate)
        for rank, results in enumerate(per_rank):
            saved = results[index]["saved_bytes"]
            if abs(predicted - saved) > 0.05 * saved:
                failures.append(f"{case['overrides'][len(ACT_COMMON):] or 'DP2'} rank {rank}: saved {saved} B, "
                                f"predicted {predicted:.0f} B ({100 * (predicted - saved) / saved:+.1f}%)")
    assert not failures, "\n".join(failures)

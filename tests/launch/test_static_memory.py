"""The planner's static memory (params, fp32 grad buffer, fp32 main params, Adam moments)
equals, within 1%, the bytes Megatron-Core actually allocates per rank through
`pretrain.wrap.wrap_for_training`, for every layout of the matrix (TP, PP, VPP, DP, EP,
distributed optimizer on/off, fp32 and bf16, tied embeddings, biases, MoE)."""

from __future__ import annotations

import pytest

from launch.candidate import Candidate
from launch.memory import memory_on_stage
from models.config import get_flavor
from pretrain.config import apply_overrides
from pretrain.recipes import get_recipe
from tests.distributed import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BF16, FP32 = "runtime.dtype=bf16", "runtime.dtype=fp32"
NO_DISTOPT = "optimizer.distributed=false"
# (flavor, overrides) per world size. One process group per world size; each case builds,
# wraps and measures, then tears the parallel state down (cheaper than new processes).
MATRIX = {
    2: [
        ("tiny-llama", ["parallel.tensor_parallel=2", FP32]),
        ("tiny-llama", ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2", BF16, NO_DISTOPT]),
        ("tiny-llama", [BF16]),  # DP2, distributed optimizer shards main params + moments
        ("tiny-gpt", ["parallel.pipeline_parallel=2", BF16]),  # tied embedding copy on the last stage
        ("tiny-gpt", ["parallel.tensor_parallel=2", BF16, NO_DISTOPT]),  # replicated biases
        ("tiny-moe", ["parallel.expert_parallel=2", BF16]),  # experts split by EP, not sharded by DP
    ],
    4: [
        ("tiny-llama", ["parallel.tensor_parallel=2", BF16]),  # TP2 x DP2
        ("tiny-gpt", ["parallel.pipeline_parallel=2", FP32]),  # PP2 x DP2
        ("tiny-moe", ["parallel.expert_parallel=2", BF16]),  # DP4, EP2 -> expert-DP 2
    ],
}
KINDS = ("params", "grads", "main_params", "optimizer_states")


def _config(flavor: str, overrides: list[str]):
    base = get_recipe("tiny-llama").model_copy(update={"model": get_flavor(flavor)})
    return apply_overrides(base, overrides=overrides)


@pytest.mark.parametrize("world", sorted(MATRIX))
def test_static_memory_matches_allocation(world):
    cases = MATRIX[world]
    per_rank = run_ranks(world, "tests.launch.workers:static_memory",
                         cases=[{"flavor": f, "overrides": o} for f, o in cases], timeout=300)
    failures = []
    for index, (flavor, overrides) in enumerate(cases):
        candidate = Candidate.from_config(_config(flavor, overrides), world)
        for rank, results in enumerate(per_rank):
            measured = results[index]
            predicted = memory_on_stage(candidate, measured["stage"])
            expected = {"params": predicted.params, "grads": predicted.grads,
                        "main_params": predicted.main_params, "optimizer_states": predicted.optimizer_states}
            for kind in KINDS:
                got, want = measured[kind], expected[kind]
                ok = got == want == 0 or (want > 0 and abs(got - want) <= 0.01 * want)
                if not ok:
                    failures.append(f"{flavor} {overrides} rank {rank} stage {measured['stage']}: "
                                    f"{kind} measured {got} B, predicted {want:.0f} B")
    assert not failures, "\n".join(failures)

"""Rank functions for tests/distributed.run_ranks: build this rank's model for a case and
report what memory it actually uses, for comparison with launch.planner.memory.

`measure(cases)` runs every case in one process group (one spawn per world size: start-up
dominates on 2 cores), tearing Megatron's parallel state down between cases:
  kind "static":      build + wrap_for_training; bytes of parameter, gradient, fp32 main
                      weight and Adam moment buffers (DDP, ZeRO-1 or Megatron-FSDP).
  kind "activations": build; bytes autograd saves for backward in one forward pass.
"""

from __future__ import annotations

import gc


def _static(config, chunks) -> dict:
    """Bytes by kind held in parameter, gradient, fp32 main-weight and Adam-moment buffers
    (DDP + distributed optimizer, or Megatron-FSDP): launch.memory_benchmark.static_bytes."""
    from launch.memory_benchmark import static_bytes
    from pretrain.wrap import wrap_for_training

    return static_bytes(wrap_for_training(chunks, config))


def _activations(config, chunks) -> dict:
    """Bytes of the tensors autograd saves in one forward pass of one microbatch
    (parameters excluded; a view counts its whole storage once)."""
    import torch

    sched = config.schedule
    shape = (sched.micro_batch_size, sched.seq_length)
    tokens = torch.randint(0, config.model.vocab_size, shape)
    positions = torch.arange(sched.seq_length).expand(shape)
    params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunks[0](tokens, positions, None, labels=tokens)
    return {"saved_bytes": sum(saved.values())}


def measure(cases: list[dict]) -> list[dict]:
    """For each case {kind, flavor, overrides}: this rank's measurement and pipeline stage."""
    from megatron.core import parallel_state

    from models.build import build_model_chunks
    from models.config import get_flavor
    from pretrain.config import apply_overrides, validate_for_world
    from pretrain.recipes import get_recipe
    from pretrain.runtime import init_distributed, world_size_from_env

    results = []
    for case in cases:
        base = get_recipe("tiny-llama").model_copy(update={"model": get_flavor(case["flavor"])})
        config = apply_overrides(base, overrides=case["overrides"])
        validate_for_world(config, world_size_from_env())
        init_distributed(config.parallel, seed=config.runtime.seed)
        chunks = build_model_chunks(config.model, config.parallel, config.runtime.model_copy(update={"spec": "portable"}))
        measured = (_static if case["kind"] == "static" else _activations)(config, chunks)
        measured["stage"] = parallel_state.get_pipeline_model_parallel_rank()
        results.append(measured)
        del chunks
        gc.collect()
        parallel_state.destroy_model_parallel()
    return results

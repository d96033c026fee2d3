"""Rank functions for tests/distributed.run_ranks: build + wrap a model and report the bytes
the parameters, gradient buffers and optimizer state actually occupy on this rank."""

from __future__ import annotations

import gc


def _storage_bytes(tensors) -> dict[int, int]:
    """{storage address: bytes} of the storages under `tensors` (views counted once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _measure(state) -> dict:
    """Bytes by kind: model params, DDP grad buffers, fp32 main params, Adam moments."""
    params = _storage_bytes(p for chunk in state.model for p in chunk.module.parameters())
    grads = _storage_bytes(
        buffer.grad_data for chunk in state.model
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]
    )
    optimizers = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
    main, moments = {}, {}
    for opt in optimizers:
        # Adam's state is created lazily at the first step; Megatron's init_state_fn creates
        # it now (as checkpoint loading does), with the shapes and dtypes a step would use.
        opt.init_state_fn(opt.optimizer, opt.config)
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in params:  # a copy, not a view of a param
                    main.update(_storage_bytes([p]))
                state_p = opt.optimizer.state[p]
                moments.update(_storage_bytes([state_p["exp_avg"], state_p["exp_avg_sq"]]))
    return {"params": sum(params.values()), "grads": sum(grads.values()),
            "main_params": sum(main.values()), "optimizer_states": sum(moments.values())}


def static_memory(cases: list[dict]) -> list[dict]:
    """For each case {flavor, overrides}: build this rank's chunks, wrap them for training,
    measure, tear the parallel state down (the process group stays for the next case)."""
    from megatron.core import parallel_state

    from models.build import build_model_chunks
    from models.config import get_flavor
    from pretrain.config import apply_overrides, validate_for_world
    from pretrain.recipes import get_recipe
    from pretrain.runtime import init_distributed, world_size_from_env
    from pretrain.wrap import DTYPES, wrap_for_training

    results = []
    for case in cases:
        base = get_recipe("tiny-llama").model_copy(update={"model": get_flavor(case["flavor"])})
        config = apply_overrides(base, overrides=case["overrides"])
        validate_for_world(config, world_size_from_env())
        init_distributed(config.parallel, seed=config.runtime.seed)
        chunks = build_model_chunks(config.model, config.parallel, seed=config.runtime.seed,
                                    spec="portable", params_dtype=DTYPES[config.runtime.dtype])
        state = wrap_for_training(chunks, config)
        measured = _measure(state)
        measured["stage"] = parallel_state.get_pipeline_model_parallel_rank()
        results.append(measured)
        del state, chunks
        gc.collect()
        parallel_state.destroy_model_parallel()
    return results


def saved_activations(cases: list[dict]) -> list[dict]:
    """For each case {flavor, overrides}: one forward pass of this rank's model with autograd
    recording, returning the bytes of the tensors autograd saved for backward (parameters
    excluded; a view counts its whole storage once) - the activation memory of one microbatch."""
    import torch
    from megatron.core import parallel_state

    from models.build import build_model_chunks
    from models.config import get_flavor
    from pretrain.config import apply_overrides
    from pretrain.recipes import get_recipe
    from pretrain.runtime import init_distributed
    from pretrain.wrap import DTYPES

    results = []
    for case in cases:
        base = get_recipe("tiny-llama").model_copy(update={"model": get_flavor(case["flavor"])})
        config = apply_overrides(base, overrides=case["overrides"])
        init_distributed(config.parallel, seed=config.runtime.seed)
        chunks = build_model_chunks(config.model, config.parallel, seed=config.runtime.seed, spec="portable",
                                    params_dtype=DTYPES[config.runtime.dtype], recompute=config.runtime.recompute)
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
            loss = chunks[0](tokens, positions, None, labels=tokens)
        results.append({"saved_bytes": sum(saved.values()), "loss_shape": list(loss.shape)})
        del chunks, loss
        parallel_state.destroy_model_parallel()
    return results

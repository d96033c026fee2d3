"""Rank functions for tests/distributed.run_ranks: train a recipe, report what tests check."""

from __future__ import annotations


def train(recipe: str, overrides: list[str], report_norms: bool = False,
          double_grad_at_step: int | None = None) -> dict:
    """Run setup + train on this rank; return losses (logging rank) and local parameter count.

    report_norms: also return this rank's final norm weights ({global-ish name: values}).
    double_grad_at_step: the optimizer sees twice the gradient at that step (how far a
    gradient-scale bug would move the run: parity tolerances must catch it).
    """
    from pretrain.cli import resolve_config
    from pretrain.runtime import shutdown
    from pretrain.loop import setup, train as train_loop

    config = resolve_config(recipe, None, overrides)
    run = setup(config)
    if double_grad_at_step is not None:
        _double_gradient_at(run, double_grad_at_step)
    failed = True
    try:
        history = train_loop(run, run.start_step)
        failed = False
        models = [_gpt(chunk) for chunk in run.state.model]
        params = sum(p.numel() for model in models for p in model.parameters())
        layers = sorted(layer.layer_number for model in models for layer in model.decoder.layers)
        result = {
            "log_rank": run.log_rank,
            "losses": [m.loss for m in history],
            "grad_norms": [m.grad_norm for m in history],
            "moe_aux_losses": [m.moe_aux_loss for m in history],
            "moe_z_losses": [m.moe_z_loss for m in history],
            "params": params,
            "layers": layers,
            "first_stage": any(model.pre_process for model in models),
            "last_stage": any(model.post_process for model in models),
        }
        if report_norms:
            result["norms"] = {
                f"chunk{i}.{name}": p.detach().flatten().tolist()
                for i, model in enumerate(models)
                for name, p in model.named_parameters() if "norm" in name
            }
        return result
    finally:
        run.writer.close()
        shutdown(barrier=not failed)  # a failed rank's peers may wait in another collective


def document_data(root) -> list[str]:
    """Overrides that train on real text with short documents (data_pipeline's KJV verses,
    made once under `root`)."""
    import os

    from data_pipeline.datasets import ensure_verses_dataset

    prefix, tokenizer = ensure_verses_dataset(os.path.join(str(root), "verses"))
    return ["data.mock=false", "data.demo=false", f"data.blend=[[1.0, {prefix}]]", f"data.tokenizer={tokenizer}"]


def _gpt(chunk):
    """The GPTModel inside a DDP wrapper or a Megatron-FSDP one (FSDP -> MegatronFSDP -> GPTModel)."""
    from pretrain.checkpointing.fsdp_state import is_fsdp_chunk

    return chunk.module.module if is_fsdp_chunk(chunk) else chunk.module


def _double_gradient_at(run, at_step: int) -> None:
    optimizer_step, calls = run.state.optimizer.step, [0]

    def step():
        calls[0] += 1
        if calls[0] == at_step - run.start_step:
            for chunk in run.state.model:
                chunk.scale_gradients(2.0)
        return optimizer_step()

    run.state.optimizer.step = step


def load_and_save(recipe: str, overrides: list[str], out_dir: str) -> dict:
    """Set up (resuming from checkpoint.resume) and save at once, without a step: what a
    layout loads is what it writes back."""
    from pretrain.checkpointing.checkpointer import Checkpointer
    from pretrain.cli import resolve_config
    from pretrain.loop import setup
    from pretrain.runtime import shutdown

    config = resolve_config(recipe, None, overrides + [f"checkpoint.dir={out_dir}"])
    run = setup(config)
    try:
        saver = Checkpointer(config, run.world_size, print)
        saver.save_now(run.start_step, run.state)
        saver.close()
        return {"step": run.start_step}
    finally:
        run.writer.close()
        shutdown()


def logged_losses(results: list[dict]) -> list[float]:
    """The losses reported by the logging rank (every rank computes the same global value)."""
    return next(r["losses"] for r in results if r["log_rank"])


def logged_grad_norms(results: list[dict]) -> list[float]:
    """The grad norms reported by the logging rank (global, after the model-parallel reduction)."""
    return next(r["grad_norms"] for r in results if r["log_rank"])


def optimizer_state_vs_megatron(recipe: str, overrides: list[str]) -> dict:
    """Train, then build the optimizer's save-time sharded state twice: with Megatron's own
    `fully_reshardable` code and with pretrain/megatron_fixes/optimizer_save.py. Returns, for this rank,
    how many state tensors each produced and which differ in metadata or values."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    from pretrain.checkpointing import checkpointer as checkpoint
    from pretrain.megatron_fixes.optimizer import megatron_reshardable_save
    from pretrain.cli import resolve_config
    from pretrain.runtime import shutdown
    from pretrain.loop import setup, train as train_loop

    def tensors(state) -> dict:
        state = extract_sharded_tensors_and_factories(state or {})[0]
        apply_factories(state)  # SwiGLU fc1: into its gate and up ShardedTensors
        found = nested_values(state)
        return {(sh.key, tuple(sh.global_offset)): sh for sh in found}

    run = setup(resolve_config(recipe, None, overrides))
    try:
        train_loop(run, run.start_step)
        model_sd = {f"model{i}" if len(run.state.model) > 1 else "model": c.module.sharded_state_dict()
                    for i, c in enumerate(run.state.model)}
        meta = checkpoint.OPTIM_METADATA
        with megatron_reshardable_save():
            theirs = tensors(run.state.optimizer.sharded_state_dict(model_sd, metadata=meta))
        ours = tensors(run.state.optimizer.sharded_state_dict(model_sd, metadata=meta))
        ours = {k: v for k, v in ours.items() if "optimizer.state." in k[0]}
        theirs_main = {k: v for k, v in theirs.items() if "optimizer.state." in k[0]}
        differ = []
        for key, sh in ours.items():
            ref = theirs_main.get(key)
            same = ref is not None and type(ref) is type(sh) and ref.replica_id == sh.replica_id \
                and tuple(ref.data.shape) == tuple(sh.data.shape) and bool((ref.data == sh.data).all())
            if not same:
                differ.append(f"{key[0]}@{key[1]}")
        zero = sorted(f"{k[0]}@{k[1]}" for k, sh in ours.items() if not bool(sh.data.any()))
        from megatron.core import parallel_state

        return {"ours": len(ours), "theirs": len(theirs_main), "differ": differ, "zero": zero,
                "dp_rank": parallel_state.get_data_parallel_rank(with_context_parallel=True)}
    finally:
        run.writer.close()
        shutdown()


def stop_during_setup(overrides: list[str], signal_rank: int, at: str) -> dict:
    """Run main_train; rank `signal_rank` sends itself SIGTERM when setup reaches `at`
    (a function setup calls: validate_for_machine runs before the process group exists,
    build_model_chunks after). Reports the exit code and whether the loop ever ran."""
    import os
    import signal

    from pretrain import loop
    from pretrain.cli import resolve_config

    rank = int(os.environ.get("RANK", "0"))
    real, real_train, trained = getattr(loop, at), loop.train, []

    def signalled(*args, **kwargs):
        if rank == signal_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    def train(*args, **kwargs):
        trained.append(True)
        return real_train(*args, **kwargs)

    setattr(loop, at, signalled)
    loop.train = train
    code = loop.main_train(resolve_config("tiny-llama", None, overrides))
    return {"code": code, "trained": bool(trained)}


def stuck_in_evaluation(overrides: list[str]) -> dict:
    """Run main_train with an evaluation batch that never ends: in the first evaluation's
    second batch rank 1 stops, the others wait for it in a barrier (as in the batch's
    collectives)."""
    import os
    import time

    import torch.distributed as dist

    from pretrain import loop, step
    from pretrain.cli import resolve_config

    real_run_schedule = step.run_schedule
    forward_only_calls = []

    def run_schedule(*args, forward_only=False, **kwargs):
        if forward_only:
            forward_only_calls.append(True)
            if len(forward_only_calls) == 2:
                stuck_in_an_evaluation_batch()
        return real_run_schedule(*args, forward_only=forward_only, **kwargs)

    def stuck_in_an_evaluation_batch():
        while int(os.environ["RANK"]) == 1:
            time.sleep(1)
        dist.barrier()

    step.run_schedule = run_schedule
    return {"code": loop.main_train(resolve_config("tiny-llama", None, overrides))}


def stuck_in_dataset_build(overrides: list[str], signal_after_s: float | None = None, signame: str = "SIGTERM") -> dict:
    """Run main_train with a dataset build that never ends: rank 0 spins in Python (as
    Megatron-Core's `_get_num_epochs` did on an empty split), the others wait for it in a
    barrier (as for Megatron's index cache). With `signal_after_s`, each rank sends itself
    SIGTERM that long after the build started (as torchrun or Slurm would)."""
    import os
    import signal
    import threading

    import torch.distributed as dist

    from pretrain import loop
    from pretrain.cli import resolve_config

    rank = int(os.environ.get("RANK", "0"))

    def build(*args, **kwargs):
        if signal_after_s is not None:
            threading.Timer(signal_after_s, os.kill, (os.getpid(), getattr(signal, signame))).start()
        while rank == 0:
            pass
        dist.barrier()

    loop.build_datasets = build
    return {"code": loop.main_train(resolve_config("tiny-llama", None, overrides))}


def stuck_in_checkpoint_save(overrides: list[str]) -> dict:
    """Run main_train with a checkpoint save that never ends: rank 1 stops in it, the others
    wait for it in a barrier (as in the save's collectives)."""
    import os
    import time

    import torch.distributed as dist

    from pretrain import loop
    from pretrain.checkpointing.checkpointer import Checkpointer
    from pretrain.cli import resolve_config

    def save_now(self, step, run_state, in_process=False):
        def stuck_writing_shards():
            while int(os.environ["RANK"]) == 1:
                time.sleep(1)
            dist.barrier()

        stuck_writing_shards()

    Checkpointer.save_now = save_now
    return {"code": loop.main_train(resolve_config("tiny-llama", None, overrides))}


def mup_setup(recipe: str, overrides: list[str]) -> dict:
    """Set up (no step); return each parameter's optimizer group (max_lr, min_lr, eps) and its
    initial std, by local name: what muP's optimizer overrides and init did."""
    from pretrain.cli import resolve_config
    from pretrain.loop import setup
    from pretrain.runtime import shutdown

    config = resolve_config(recipe, None, overrides)
    run = setup(config)
    try:
        models = [_gpt(chunk) for chunk in run.state.model]
        names = {id(p): name for model in models for name, p in model.named_parameters()}
        groups = {}
        for group in run.state.optimizer.param_groups:
            for p in group["params"]:
                groups[names[id(p)]] = {"max_lr": group["max_lr"], "min_lr": group["min_lr"], "eps": group["eps"]}
        stds = {name: p.detach().float().std().item() for model in models for name, p in model.named_parameters()}
        return {"groups": groups, "stds": stds}
    finally:
        run.writer.close()
        shutdown()


def norm_grads(recipe: str, overrides: list[str]) -> dict:
    """One training step; return every norm weight's gradient as the optimizer receives it (after
    finalize_model_grads' TP reductions), by local name: a replicated weight's gradient must
    equal one rank's on every TP rank (the parity runs' Adam hides a gradient scale error)."""
    from pretrain.cli import resolve_config
    from pretrain.loop import setup, train as train_loop
    from pretrain.runtime import shutdown

    config = resolve_config(recipe, None, overrides + ["schedule.train_steps=1"])
    run = setup(config)
    grads, optimizer_step = {}, run.state.optimizer.step

    def step():
        for model in (_gpt(chunk) for chunk in run.state.model):
            grads.update({name: p.main_grad.flatten().tolist() for name, p in model.named_parameters() if "norm" in name})
        return optimizer_step()

    run.state.optimizer.step = step
    try:
        train_loop(run, run.start_step)
        return grads
    finally:
        run.writer.close()
        shutdown()

"""Rank functions for tests/distributed.run_ranks: train and report logits, load at a layout."""

from __future__ import annotations

import os
import time

import torch

SEED_TOKENS = 1234


def tokens(vocab_size: int, batch: int = 2, seq: int = 64) -> torch.Tensor:
    """The fixed token batch every parity test feeds both models."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(SEED_TOKENS))


def _fresh_port(rendezvous: str, job: int) -> None:
    """Point MASTER_PORT at a port rank 0 picked just now for this job.

    Re-creating the store on the port of the job just shut down hangs, and a port picked
    by the parent long before its job starts may be taken by then (other tests run
    beside these); rank 0 picks one right before binding it and publishes it in a file.
    """
    path = os.path.join(rendezvous, f"port-{job}")
    if os.environ["RANK"] == "0":
        from tests.distributed import free_port

        with open(path + ".tmp", "w") as f:
            f.write(str(free_port()))
        os.replace(path + ".tmp", path)
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no port for job {job}")
        time.sleep(0.05)
    with open(path) as f:
        os.environ["MASTER_PORT"] = f.read()


def train_jobs(jobs: list[dict], rendezvous: str) -> list[dict]:
    """Train each job ({recipe, overrides}) in turn in these ranks (one process start for
    several models); after each, the trained in-memory model's logits on `tokens`."""
    from checkpoints_tools.verify import forward_logits
    from pretrain.cli import resolve_config
    from pretrain.runtime import shutdown
    from pretrain.loop import setup, train as train_loop

    results = []
    for index, job in enumerate(jobs):
        _fresh_port(rendezvous, index)
        config = resolve_config(job["recipe"], None, job["overrides"])
        run = setup(config)
        try:
            history = train_loop(run, run.start_step)
            logits = forward_logits([c.module for c in run.state.model], tokens(config.model.vocab_size),
                                    config.parallel, vocab_size=config.model.vocab_size)
            results.append({"losses": [m.loss for m in history] if run.log_rank else None,
                            "logits": logits.tolist() if logits is not None else None})
        finally:
            run.writer.close()
            shutdown()
    return results


def checkpoint_logits(checkpoint: str, layout: dict) -> list | None:
    """Our model loaded from `checkpoint` at `layout`; logits on the reporting rank."""
    from checkpoints_tools.common import checkpoint_model
    from checkpoints_tools.verify import model_logits
    from models.layout import ParallelLayout

    _, model = checkpoint_model(checkpoint)
    logits = model_logits(checkpoint, tokens(model.vocab_size), layout=ParallelLayout(**layout))
    return logits.tolist() if logits is not None else None


def resume_jobs(jobs: list[dict], rendezvous: str) -> list[list[float] | None]:
    """Resume training ({recipe, config_file, overrides}) from checkpoints in turn; the
    logging rank's losses per job."""
    from pretrain.cli import resolve_config
    from pretrain.runtime import shutdown
    from pretrain.loop import setup, train as train_loop

    results = []
    for index, job in enumerate(jobs):
        _fresh_port(rendezvous, index)
        run = setup(resolve_config(job["recipe"], job.get("config_file"), job["overrides"]))
        try:
            history = train_loop(run, run.start_step)
            results.append([m.loss for m in history] if run.log_rank else None)
        finally:
            run.writer.close()
            shutdown()
    return results


def first(results: list):
    """The one non-None per-rank result (the reporting rank's)."""
    found = [r for r in results if r is not None]
    assert len(found) == 1, f"expected one reporting rank, got {len(found)}"
    return found[0]


def verify_imports(pairs: list[list[str]]) -> list[dict]:
    """checkpoints_tools.verify for each (checkpoint, HF directory), in one process."""
    from checkpoints_tools.verify import verify

    return [verify(checkpoint, hf_dir) for checkpoint, hf_dir in pairs]


def first_step_and_batch(recipe: str, config_file: str, overrides: list[str]) -> dict | None:
    """Train one step from `checkpoint.resume`; on the logging rank, its loss and the step's
    global batch (tokens, labels, loss mask, positions), read as the trainer reads it."""
    from pretrain.cli import resolve_config
    from pretrain.data import chunk_iterators
    from pretrain.loop import setup, train as train_loop
    from pretrain.runtime import shutdown

    run = setup(resolve_config(recipe, config_file, overrides))
    try:
        # DP1: this rank's stream is the whole global batch of step 1.
        assert run.start_step == 0 and run.config.parallel.data_parallel(run.world_size) == 1
        stream = chunk_iterators(run.datasets.train, run.config, 0, run.config.schedule.global_batch_size)[0]
        batch = [next(stream) for _ in range(run.num_microbatches)]
        history = train_loop(run, run.start_step)
        if not run.log_rank:
            return None
        keys = ("tokens", "labels", "loss_mask", "position_ids")
        return {"loss": history[0].loss, **{key: [mb[key].tolist() for mb in batch] for key in keys}}
    finally:
        run.writer.close()
        shutdown()

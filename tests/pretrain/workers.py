"""Rank functions for tests/distributed.run_ranks: train a recipe, report what tests check."""

from __future__ import annotations


def train(recipe: str, overrides: list[str]) -> dict:
    """Run setup + train on this rank; return losses (logging rank) and local parameter count."""
    from pretrain.cli import resolve_config
    from pretrain.runtime import shutdown
    from pretrain.trainer import setup, train as train_loop

    config = resolve_config(recipe, None, overrides)
    run = setup(config)
    try:
        history = train_loop(run, run.start_step)
        params = sum(p.numel() for chunk in run.state.model for p in chunk.module.parameters())
        layers = sorted(
            layer.layer_number for chunk in run.state.model for layer in chunk.module.decoder.layers
        )
        return {
            "log_rank": run.log_rank,
            "losses": [m.loss for m in history],
            "params": params,
            "layers": layers,
            "first_stage": any(chunk.module.pre_process for chunk in run.state.model),
            "last_stage": any(chunk.module.post_process for chunk in run.state.model),
        }
    finally:
        run.writer.close()
        shutdown()


def logged_losses(results: list[dict]) -> list[float]:
    """The losses reported by the logging rank (every rank computes the same global value)."""
    return next(r["losses"] for r in results if r["log_rank"])

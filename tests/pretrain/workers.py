"""Rank functions for tests/distributed.run_ranks: train a recipe, report what tests check."""

from __future__ import annotations


def train(recipe: str, overrides: list[str], report_norms: bool = False) -> dict:
    """Run setup + train on this rank; return losses (logging rank) and local parameter count.

    report_norms: also return this rank's final norm weights ({global-ish name: values}).
    """
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
        result = {
            "log_rank": run.log_rank,
            "losses": [m.loss for m in history],
            "moe_aux_losses": [m.moe_aux_loss for m in history],
            "moe_z_losses": [m.moe_z_loss for m in history],
            "params": params,
            "layers": layers,
            "first_stage": any(chunk.module.pre_process for chunk in run.state.model),
            "last_stage": any(chunk.module.post_process for chunk in run.state.model),
        }
        if report_norms:
            result["norms"] = {
                f"chunk{i}.{name}": p.detach().flatten().tolist()
                for i, chunk in enumerate(run.state.model)
                for name, p in chunk.module.named_parameters() if "norm" in name
            }
        return result
    finally:
        run.writer.close()
        shutdown()


def logged_losses(results: list[dict]) -> list[float]:
    """The losses reported by the logging rank (every rank computes the same global value)."""
    return next(r["losses"] for r in results if r["log_rank"])

"""Parent-side helpers for optimizer layout parity (tests/pretrain/test_*_layouts.py): train a
layout through tests.distributed.run_ranks, then compare its per-step losses, grad norms and
every final weight with the one-rank run."""

from __future__ import annotations

from pathlib import Path

from checkpoints_tools.dcp_io import CheckpointReader
from tests.compare import assert_steps_close
from tests.distributed import run_ranks
from tests.pretrain.workers import logged_grad_norms, logged_losses


def train_to_checkpoint(nproc: int, recipe: str, overrides: list[str], run_dir: Path,
                        steps: int) -> tuple[list[float], list[float], dict]:
    """Per-step losses and grad norms, and every model weight of the step-`steps` checkpoint
    (global tensors, whatever the layout)."""
    results = run_ranks(nproc, "tests.pretrain.workers:train", recipe=recipe,
                        overrides=overrides + [f"logging.run_dir={run_dir}", f"checkpoint.save_interval={steps}",
                                               f"checkpoint.dir={run_dir / 'ckpt'}", "checkpoint.resume=none"])
    reader = CheckpointReader(run_dir / "ckpt" / f"step_{steps:08d}")
    weights = {k: reader.read(k) for k in reader.tensor_keys() if not k.startswith(("optimizer.", "chained_"))}
    losses, norms = logged_losses(results), logged_grad_norms(results)
    assert len(losses) == len(norms) == steps, (losses, norms)
    return losses, norms, weights


def assert_run_matches(got: tuple, want: tuple, what: str, rtol: float = 1e-5, atol: float = 1e-5) -> str:
    """Losses and grad norms within `rtol` at every step, every final weight within `atol`;
    returns a one-line summary of the worst differences."""
    (losses, norms, weights), (want_losses, want_norms, want_weights) = got, want
    worst = assert_steps_close(losses, want_losses, rtol=rtol, what=f"{what} loss vs one rank")
    worst_norm = assert_steps_close(norms, want_norms, rtol=rtol, what=f"{what} grad norm vs one rank")
    assert weights.keys() == want_weights.keys() and any("decoder.layers" in k for k in weights)
    worst_weight, where = max(((weights[k] - want_weights[k]).abs().max().item(), k) for k in weights)
    assert worst_weight <= atol, f"{what}: final weight {where} differs by {worst_weight:.2e} from one rank's"
    return f"{what}: worst rel diff loss {worst:.2e}, grad norm {worst_norm:.2e}; weights {worst_weight:.2e}"

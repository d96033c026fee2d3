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


def assert_run_matches(got: tuple, want: tuple, what: str, rtol: float = 1e-5, atol: float = 1e-5,
                       sign_flips: tuple[int, float] = (0, 0.0)) -> str:
    """Losses and grad norms within `rtol` at every step, every final weight within `atol`;
    returns a one-line summary of the worst differences. `sign_flips` = (n, bound): for sign
    optimizers (Lion), up to n weight elements may differ by at most `bound` (see
    `count_sign_flips_allowed`)."""
    (losses, norms, weights), (want_losses, want_norms, want_weights) = got, want
    worst = assert_steps_close(losses, want_losses, rtol=rtol, what=f"{what} loss vs one rank")
    worst_norm = assert_steps_close(norms, want_norms, rtol=rtol, what=f"{what} grad norm vs one rank")
    assert weights.keys() == want_weights.keys() and any("decoder.layers" in k for k in weights)
    diffs = {k: (weights[k] - want_weights[k]).abs() for k in weights}
    worst_weight, where = max((d.max().item(), k) for k, d in diffs.items())
    over = sum(int((d > atol).sum()) for d in diffs.values())
    allowed, bound = sign_flips
    assert over <= allowed and (over == 0 or worst_weight <= bound), (
        f"{what}: final weight {where} differs by {worst_weight:.2e} from one rank's; {over} elements differ by "
        f"more than {atol:g} (allowed: {allowed}, each up to {bound:g})")
    return (f"{what}: worst rel diff loss {worst:.2e}, grad norm {worst_norm:.2e}; weights {worst_weight:.2e}, "
            f"{over} elements past {atol:g}")


def count_sign_flips_allowed(elements: int) -> int:
    """How many weight elements a sign optimizer may flip between two fp32 runs that differ only in
    summation order. Lion steps each element by lr x sign(beta1 m + (1 - beta1) g); where that mix
    is within rounding of 0 another layout's (or a plain-PyTorch reference's) reduction order can
    give it the other sign, and that element ends 2 lr away. Measured on a Sapphire Rapids VM
    (AVX512-FP16; 2026-11-29): 1 element of 1.4M, in the output layer, in two tests that had
    passed with 0 on earlier VMs. Allowed: 1 in 100,000 (14 of tiny-llama's 1.4M), at least 2;
    a convention error (swapped betas, coupled decay) moves most elements."""
    return max(2, elements // 100_000)

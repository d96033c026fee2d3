"""An independent Lion run for tests/pretrain/test_lion.py: the same GPT weights and tokens as our
stack, stepped by a plain PyTorch Lion written here (not emerging_optimizers'), on one rank.

emerging_optimizers 0.3's Lion (scalar_optimizers/lion.py, weight_decay_method="decoupled"), the
conventions matched: decay first, p <- p * (1 - lr * wd); then the update sign(beta1 * m + (1 -
beta1) * g) with the momentum BEFORE this step's EMA; then m <- beta2 * m + (1 - beta2) * g; p <- p -
lr * update. No weight decay on 1-D parameters (Megatron-Core's standard overrides). `VARIANTS`
each change one convention, and must then disagree with our stack.
"""

from __future__ import annotations

import torch

from tests.pretrain.muon_reference import _fresh_model, _weights

# name -> (swap beta1 and beta2, weight decay on the gradient (L2, Adam-style) instead of decoupled)
VARIANTS = {"match": (False, False), "swapped_betas": (True, False), "coupled_decay": (False, True)}


def run_ours_and_references(recipe: str, overrides: list[str]) -> dict:
    """Train with our stack, then each VARIANT from the same initial weights and batches. Returns
    {"ours": losses, name: {"losses": ..., "weights": largest relative difference of a final weight}}."""
    from pretrain.cli import resolve_config
    from pretrain.data import chunk_iterators
    from pretrain.loop import setup, train as train_loop
    from pretrain.runtime import shutdown

    config = resolve_config(recipe, None, overrides)
    run = setup(config)
    try:
        gpt = run.state.model[0].module
        initial = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in gpt.state_dict().items()}
        ours = [m.loss for m in train_loop(run, 0)]
        ours_weights = _weights(gpt)
        result = {"ours": ours}
        steps, gbs = config.schedule.train_steps, config.schedule.global_batch_size
        for name, (swap, coupled) in VARIANTS.items():
            batches = chunk_iterators(run.datasets.train, config, 0, steps * gbs)[0]
            losses, weights = _reference_loop(_fresh_model(config, initial), batches, config, steps,
                                              swap_betas=swap, coupled_decay=coupled)
            assert sorted(weights) == sorted(ours_weights)
            deltas = {n: ours_weights[n] - w for n, w in weights.items()}
            worst = max((deltas[n].norm() / w.norm()).item() for n, w in weights.items())
            diffs = torch.cat([d.abs().flatten() for d in deltas.values()])
            result[name] = {"losses": losses, "weights": worst, "elements": diffs.numel(),
                            "differing": int((diffs > 1e-6).sum()), "largest": diffs.max().item()}
        return result
    finally:
        run.writer.close()
        shutdown()


@torch.no_grad()
def lion_step(params, momenta, *, lr, beta1, beta2, weight_decay, coupled_decay=False) -> None:
    for p, m in zip(params, momenta, strict=True):
        grad = p.grad
        if coupled_decay:
            grad = grad + weight_decay * p
        else:
            p.mul_(1 - lr * weight_decay)
        update = torch.sign(beta1 * m + (1 - beta1) * grad)
        m.mul_(beta2).add_(grad, alpha=1 - beta2)
        p.add_(update, alpha=-lr)


def _reference_loop(model, batches, config, steps: int, *, swap_betas: bool, coupled_decay: bool) -> tuple:
    opt = config.optimizer
    beta1, beta2 = (opt.lion_beta2, opt.lion_beta1) if swap_betas else (opt.lion_beta1, opt.lion_beta2)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [(decay, opt.weight_decay), (no_decay, 0.0)]
    momenta = [[torch.zeros_like(p) for p in params] for params, _ in groups]
    losses = []
    for _ in range(steps):
        batch = next(batches)
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"].float()
        loss = (per_token.float() * mask).sum() / mask.sum()
        model.zero_grad(set_to_none=True)
        loss.backward()
        for (params, wd), m in zip(groups, momenta, strict=True):
            lion_step(params, m, lr=opt.lr, beta1=beta1, beta2=beta2, weight_decay=wd, coupled_decay=coupled_decay)
        losses.append(loss.item())
    return losses, _weights(model)

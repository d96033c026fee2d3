"""An independent Muon run for tests/pretrain/test_muon.py: the same GPT weights and tokens as
our stack, stepped by a plain PyTorch loop with torch.optim.Muon (hidden matrices) and
torch.optim.AdamW (the rest), on one rank.

Conventions made to match our config (`MATCHING` in the test): QKV is three matrices (Q, K, V
of every query group, Megatron-Core's split_qkv) held as separate Muon parameters and written
into the fused weight before each forward; the fused gate/up matrix stays one; the LR
adjustment is torch's "original" (= emerging_optimizers' shape_scaling); Newton-Schulz is
torch's fixed (3.4445, -4.775, 2.0315) (= "simple"), in fp32 on both sides: ours with
fp32_matmul_prec=highest, torch's with `_fp32_zeropower` below. In bf16 the two differ by
rounding alone (torch casts to bf16 and then normalizes, emerging_optimizers normalizes in fp32
and then casts): 1.1e-5 relative at step 2, 1.2e-4 at step 6 on the test's run, too much for
a 1e-5 check. `VARIANTS` each change one convention, and must then disagree with our stack.
"""

from __future__ import annotations

import torch
import torch.optim._muon as torch_muon

# name -> (split QKV, torch.optim.Muon adjust_lr_fn)
VARIANTS = {
    "match": (True, "original"),
    "fused_qkv": (False, "original"),
    "match_rms_adamw": (True, "match_rms_adamw"),
}


def run_ours_and_references(recipe: str, overrides: list[str]) -> dict:
    """Train with our stack, then each VARIANT's reference from the same initial weights and
    batches. Returns {"ours": losses, name: {"losses": ..., "weights": the largest relative
    difference (norm of the difference / norm) of a final weight from ours}} (results travel as JSON)."""
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
        torch_muon._zeropower_via_newtonschulz = _fp32_zeropower  # this process only (a rank)
        for name, (split_qkv, adjust) in VARIANTS.items():
            batches = chunk_iterators(run.datasets.train, config, 0, steps * gbs)[0]
            model = _fresh_model(config, initial)
            losses, weights = _reference_loop(model, batches, config, steps, split_qkv=split_qkv, adjust_lr_fn=adjust)
            assert sorted(weights) == sorted(ours_weights)
            worst = max(((ours_weights[n] - w).norm() / w.norm()).item() for n, w in weights.items())
            result[name] = {"losses": losses, "weights": worst}
        return result
    finally:
        run.writer.close()
        shutdown()


def _fp32_zeropower(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz (torch 2.13) without its cast to bf16."""
    a, b, c = ns_coefficients
    ortho = grad.clone()
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        ortho = torch.addmm(ortho, torch.addmm(gram, gram, gram, beta=b, alpha=c), ortho, beta=a)
    return ortho.T if grad.size(0) > grad.size(1) else ortho


def _weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fresh_model(config, state: dict):
    from models.build import build_model_chunks

    model = build_model_chunks(config.model, config.parallel, config.runtime.model_copy(update={"spec": "portable"}))[0]
    model.load_state_dict(state)
    return model


def _split_qkv(weight: torch.Tensor, model) -> list[torch.Tensor]:
    """Q, K and V of a fused [groups x (q + k + v), hidden] weight (Megatron's layout: each
    query group's queries, then its key, then its value)."""
    cfg = model.config
    kv = cfg.kv_channels
    shapes = [cfg.num_attention_heads // cfg.num_query_groups * kv, kv, kv]
    parts = weight.view(cfg.num_query_groups, sum(shapes), -1).split(shapes, dim=1)
    return [p.reshape(-1, weight.shape[-1]) for p in parts]


def _join_qkv(parts: list[torch.Tensor], model) -> torch.Tensor:
    groups = model.config.num_query_groups
    return torch.cat([p.view(groups, -1, p.shape[-1]) for p in parts], dim=1).view(-1, parts[0].shape[-1])


def _reference_loop(model, batches, config, steps: int, *, split_qkv: bool, adjust_lr_fn: str) -> tuple:
    opt, muon = config.optimizer, config.optimizer.muon
    fused = {n: p for n, p in model.named_parameters() if split_qkv and n.endswith("linear_qkv.weight")}
    pieces = {n: [torch.nn.Parameter(t.detach().clone()) for t in _split_qkv(p, model)] for n, p in fused.items()}
    hidden, decay, no_decay = [q for parts in pieces.values() for q in parts], [], []
    for name, p in model.named_parameters():
        if name in fused:
            continue
        # Independent of pretrain.muon: embedding and output layer, vectors -> AdamW.
        if p.dim() == 2 and "embedding" not in name and "output_layer" not in name:
            hidden.append(p)
        else:
            (decay if p.dim() == 2 else no_decay).append(p)
    muon_opt = torch.optim.Muon(hidden, lr=opt.lr, weight_decay=opt.weight_decay, momentum=muon.momentum,
                                nesterov=muon.nesterov, ns_steps=muon.num_ns_steps, adjust_lr_fn=adjust_lr_fn)
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=muon.adamw_lr or opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            for name, parts in pieces.items():
                fused[name].copy_(_join_qkv(parts, model))
        batch = next(batches)
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"].float()
        loss = (per_token.float() * mask).sum() / mask.sum()
        model.zero_grad(set_to_none=True)
        loss.backward()
        for name, parts in pieces.items():
            for part, grad in zip(parts, _split_qkv(fused[name].grad, model), strict=True):
                part.grad = grad.clone()
        muon_opt.step()
        adamw.step()
        losses.append(loss.item())
    with torch.no_grad():
        for name, parts in pieces.items():
            fused[name].copy_(_join_qkv(parts, model))
    return losses, _weights(model)


def optimizer_of_each_param(recipe: str, overrides: list[str]) -> dict:
    """{parameter name: the class of the torch optimizer that steps it} after set-up (one rank)."""
    from pretrain.cli import resolve_config
    from pretrain.loop import setup
    from pretrain.runtime import shutdown

    config = resolve_config(recipe, None, overrides)
    run = setup(config)
    try:
        owner = {}
        for sub in getattr(run.state.optimizer, "chained_optimizers", [run.state.optimizer]):
            for group in sub.optimizer.param_groups:
                owner.update({id(p): type(sub.optimizer).__name__ for p in group["params"]})
        return {name: owner.get(id(p)) for name, p in run.state.model[0].module.named_parameters()}
    finally:
        run.writer.close()
        shutdown()

"""Per-layer expert load of MoE runs, for metrics.jsonl.

Megatron-Core 0.19's `MoEMetricsTracker` keeps only per-layer router *losses* (the aux and
z-loss); it counts tokens per expert only when the aux-loss-free bias is on
(`TopKRouter.local_tokens_per_expert`, zeroed by `finalize_model_grads` every step). So we
count ourselves: a forward hook on every `TopKRouter` adds its routing map's column sums
(the tokens each expert received) to a [num_layers, num_experts] tensor, row = the layer's
global number (VPP chunks and PP stages fill their own rows); MTP layers' routers
(model.mtp_num_layers) take the rows after the decoder's, as Megatron-Core's tracker numbers them.

Layout invariance: each rank routes distinct tokens (MoE under TP needs sequence
parallelism, CP splits the sequence, DP/EP split the batch) and each layer lives on one PP
stage, so one SUM all-reduce over all ranks gives every layer's global counts; one rank, EP2
and PP2 log the same integers. The counts cover every micro-batch of the steps since the
last log (log_interval steps), once each under activation recompute, not the evaluation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class ExpertLoad:
    """Counts routed tokens per (layer, expert); `take()` reduces, summarises and resets."""

    def __init__(self, model_chunks: list, num_layers: int, num_experts: int, device: torch.device):
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.handles = []
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    self.handles.append(module.register_forward_hook(self._hook))
        self.moe_layers: Optional[list[int]] = None  # global 0-based indices, known after take()

    def _hook(self, router, inputs, output) -> None:
        # As Megatron-Core's own count for the expert bias (TopKRouter._apply_expert_bias): only
        # forwards with grad. Evaluation runs without; under full recompute the first forward
        # runs without grad and its re-run inside backward with it, so each token counts once.
        if not torch.is_grad_enabled():
            return
        routing_map = output[1]
        # An MTP layer's router numbers itself from 1 within the MTP block; Megatron-Core's own
        # tracker files it after the decoder's layers (router.py), and so do we: its rows follow.
        row = router.layer_number - 1 + (router.config.num_layers if router.is_mtp_layer else 0)
        with torch.no_grad():
            self.counts[row] += routing_map.sum(dim=0).to(self.counts.dtype)

    def take(self) -> dict[str, list[float]]:
        """Every rank calls this at the same steps (one all-reduce); per MoE layer (in layer
        order): max and min expert load over the mean load (1.0 = even) and the coefficient of
        variation (std / mean) of the tokens per expert."""
        counts = self.counts.clone()
        self.counts.zero_()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        rows = counts[counts.sum(dim=1) > 0]
        mean = rows.mean(dim=1)
        return {
            "moe_load_max": (rows.max(dim=1).values / mean).tolist(),
            "moe_load_min": (rows.min(dim=1).values / mean).tolist(),
            "moe_load_cv": (rows.std(dim=1, correction=0) / mean).tolist(),
        }

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class _PerLayerWriter:
    """Catches Megatron-Core's per-layer values (`moe/{name}_layer_{i}`) that its tracker's
    public `report(per_layer_logging=True)` writes to a TensorBoard-like writer."""

    def __init__(self):
        self.values: dict[str, dict[int, float]] = {}

    def add_scalar(self, name: str, value, step) -> None:
        if name.startswith("moe/") and "_layer_" in name:
            metric, layer = name[len("moe/"):].rsplit("_layer_", 1)
            self.values.setdefault(metric, {})[int(layer)] = float(value)


def router_losses(num_layers: int, num_microbatches: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Reduce and reset Megatron-Core's MoE loss tracker (every rank calls this every step).

    Returns (mean over MoE layers per loss name, the per-layer values of the layers that
    recorded one). The routers add each micro-batch's share; `report` sums them over PP and
    TP x CP and averages over DP, as Megatron-LM's training loop does.
    """
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    totals: dict = {}
    writer = _PerLayerWriter()
    get_moe_metrics_tracker().report(loss_scale=1.0 / num_microbatches, iteration=0, total_loss_dict=totals,
                                     num_layers=num_layers, writer=writer, per_layer_logging=True)
    per_layer = {name: [v for _, v in sorted(layers.items()) if v != 0.0] for name, layers in writer.values.items()}
    return {name: float(value) for name, value in totals.items()}, per_layer

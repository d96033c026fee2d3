"""Mixture-of-experts pieces of the layer specs: the router, and how specs get it.

`LayoutInvariantRouter` is Megatron-Core's `TopKRouter` with the load-balancing and
z-loss gradients made independent of TP x CP. With `calculate_per_token_loss=True`
(which we always use), Megatron-Core 0.16 multiplies each rank's share of the aux loss
by the rank's *local* token count before `finalize_model_grads` divides every gradient
by the *global* token count. Under sequence or context parallelism each of the TP x CP
ranks holds 1/(TP x CP) of the tokens, so the aux-loss gradient shrinks by TP x CP and
runs at different layouts train differently (Megatron-LM issue #1652, fixed upstream
by pull request #5047, after 0.16). We scale by the token count of the whole TP x CP
group instead, which is what the single-rank run uses.

The z-loss is also logged with its TP x CP reduction group, so the logged value is the
global mean rather than one rank's share.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    save_to_aux_losses_tracker,
    z_loss_func,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec


class LayoutInvariantRouter(TopKRouter):
    """TopKRouter whose aux-loss and z-loss gradients do not depend on TP x CP."""

    def attach_and_log_load_balancing_loss(
        self,
        activation: torch.Tensor,
        aux_loss_coeff: float,
        aux_loss: torch.Tensor,
        aux_loss_name: str,
        reduce_group: torch.distributed.ProcessGroup,
        reduce_group_has_dp: bool = False,
        valid_token_count=None,
    ):
        if self.calculate_per_token_loss:
            local = valid_token_count if valid_token_count is not None else activation.shape[0]
            # The aux loss is split over the TP x CP group (each rank's share sums to the
            # group's loss); scale every share by the group's token count, not the rank's.
            valid_token_count = local * self.tp_cp_group.size()
        return super().attach_and_log_load_balancing_loss(
            activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
            reduce_group_has_dp=reduce_group_has_dp, valid_token_count=valid_token_count,
        )

    def apply_z_loss(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not self.training or not torch.is_grad_enabled():
            return logits
        group_size = self.tp_cp_group.size()
        # This rank's share of the group's mean z-loss: local mean / (TP x CP).
        z_loss = z_loss_func(logits, coeff / group_size, padding_mask=padding_mask)
        if self.calculate_per_token_loss:
            local = (~padding_mask).sum() if padding_mask is not None else logits.shape[0]
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss * local * group_size)
        else:
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        save_to_aux_losses_tracker("z_loss", z_loss / coeff, self.layer_number, num_layers,
                                   reduce_group=self.tp_cp_group)
        return logits


def with_layout_invariant_router(layer: ModuleSpec) -> ModuleSpec:
    """A transformer-layer spec whose MoE MLP (if any) uses `LayoutInvariantRouter`."""
    mlp = layer.submodules.mlp
    if not isinstance(mlp, ModuleSpec) or not isinstance(mlp.submodules, MoESubmodules):
        return layer
    moe = dataclasses.replace(mlp.submodules, router=LayoutInvariantRouter)
    new_mlp = dataclasses.replace(mlp, submodules=moe)
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=new_mlp))

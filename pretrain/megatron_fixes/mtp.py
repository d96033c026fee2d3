"""Multi-token prediction's loss mask, one per depth (document masking with mtp_num_layers >= 2).

What upstream does (megatron-core 0.19.2, `transformer/multi_token_prediction.py`,
`process_mtp_loss`, called by `GPTModel._postprocess` through gpt_model.py's module global): it
takes one `loss_mask` [b, s] for every depth and, before depth d's loss, rolls the labels and
that mask left by one more (`roll_tensor`: the vacated last position gets 0). So depth d at
position i, which predicts token i+d+1 (labels[i+d]), counts with loss_mask[i+d]. With
`calculate_per_token_loss` it weighs depth d by loss_mask.sum() before any roll over the rolled
mask's sum.

Why it matters: in a packed sample a prediction may count only when its target lies in the
document of position i; at depth d that drops the last d+1 positions of every document
(models.documents.mtp_depth_loss_masks). One rolled mask cannot say that for two depths: with a
document starting at token j, the entry at j+1 is read by depth 1 for position j (the new
document's first token predicting j+2: keep) and by depth 2 for position j-1 (the previous
document's EOD predicting j+2: drop). So document masking accepted only mtp_num_layers=1.
Megatron-Core 0.19 offers no per-depth hook (GPTModel hands `loss_mask` straight through; so
does HybridModel).

What we do instead: gpt_model's `process_mtp_loss` binding becomes a wrapper. For any
`loss_mask` other than a models.documents.MTPDepthMasks it calls upstream unchanged (every run
without document-masked MTP). Given one, it runs upstream's depth loop with the same operations
in the same order (output layer, scale_logits_fn, label roll, loss, tracker with acceptance
counts, MTPLossAutoScaler), but depth d's mask is `masks[d-1]`, already aligned with the
positions (no roll), and the weight's numerator is the given `num_tokens` instead of the
unrolled mask's sum. With masks = the rolls of one mask and num_tokens = its sum, that is
upstream's computation bit for bit (tests/pretrain/test_mtp_depth_masks.py checks it), so
depth 1 is what the single document mask gave before. Only CP 1 without packed_seq_params (the
portable spec's document masking; validation refuses MTP at CP > 1 and on the te spec with
documents): the wrapper raises otherwise. Known for 0.19.2; the guard pins process_mtp_loss (the
loop copied), roll_tensor and GPTModel._postprocess (the call site and its keywords).
"""

from __future__ import annotations

import functools

from pretrain.megatron_fixes._guard import UpstreamChanged, expect_sources

_MTP = "megatron.core.transformer.multi_token_prediction"
SOURCES = {
    f"{_MTP}:process_mtp_loss": "7a459bac5884e8bf",
    f"{_MTP}:roll_tensor": "576f3fcb1c365bc9",
    "megatron.core.models.gpt.gpt_model:GPTModel._postprocess": "41700c5f809c197c",
}


def per_depth_mtp_loss(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output,
                       is_training, compute_language_model_loss, config, cp_group=None, tp_group=None,
                       packed_seq_params=None, scale_logits_fn=None, input_ids=None):
    """Upstream's `process_mtp_loss` (0.19.2) with `loss_mask` an MTPDepthMasks: depth d counts
    with `loss_mask.masks[d - 1]` as given; the per-token weight's numerator is `loss_mask.num_tokens`."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    depths = config.mtp_num_layers
    if labels is None or packed_seq_params is not None or (cp_group is not None and cp_group.size() > 1):
        raise ValueError("per-depth MTP loss masks need labels, no packed_seq_params and CP 1 "
                         "(pretrain/megatron_fixes/mtp.py)")
    if tuple(loss_mask.masks.shape) != (depths, *labels.shape):
        raise ValueError(f"per-depth MTP loss masks of shape {tuple(loss_mask.masks.shape)} for "
                         f"{depths} depths and labels {tuple(labels.shape)}")
    hidden_states_list = torch.chunk(hidden_states, 1 + depths, dim=0)
    hidden_states = hidden_states_list[0]
    if config.mtp_detach_heads:
        output_weight = output_weight.detach() if output_weight is not None else output_layer.weight.detach()
    mtp_labels = labels.clone()
    original_num_tokens = loss_mask.num_tokens
    for depth in range(depths):
        mtp_logits, _ = output_layer(hidden_states_list[depth + 1], weight=output_weight,
                                     runtime_gather_output=runtime_gather_output)
        if scale_logits_fn is not None:
            mtp_logits = scale_logits_fn(mtp_logits)
        mtp_labels, _ = mtp.roll_tensor(mtp_labels, shifts=-1, dims=-1, cp_group=cp_group)
        # Upstream: loss_mask, num_tokens = roll_tensor(loss_mask) (the rolled mask and its sum).
        mask = loss_mask.masks[depth]
        num_tokens = mask.sum()
        mtp_loss = mask * compute_language_model_loss(mtp_labels, mtp_logits)
        if is_training:
            mtp_loss_for_log = (torch.sum(mtp_loss) * (num_tokens > 0).to(mtp_loss.dtype)) / num_tokens.clamp(min=1)
            correct, total = mtp._compute_mtp_acceptance_counts(mtp_logits, mtp_labels, mask, output_layer,
                                                                runtime_gather_output, tp_group)
            mtp.MTPLossLoggingHelper.save_metrics_to_tracker(
                mtp_loss_for_log, correct, total, depth, depths,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        mtp_loss_scale = config.mtp_loss_scaling_factor / depths
        if config.calculate_per_token_loss:
            num_tokens_safe = torch.clamp(num_tokens, min=1)
            mtp_loss_normalized = mtp_loss_scale * mtp_loss * (original_num_tokens / num_tokens_safe)
            hidden_states = mtp.MTPLossAutoScaler.apply(hidden_states, mtp_loss_normalized)
        else:
            hidden_states = mtp.MTPLossAutoScaler.apply(hidden_states,
                                                        mtp_loss_scale * mtp_loss / num_tokens.clamp(min=1))
    return hidden_states


def _wrap(upstream):
    from models.documents import MTPDepthMasks

    @functools.wraps(upstream)
    def process_mtp_loss(*args, **kwargs):
        if isinstance(kwargs.get("loss_mask"), MTPDepthMasks):
            return per_depth_mtp_loss(*args, **kwargs)
        return upstream(*args, **kwargs)

    process_mtp_loss.takes_depth_masks = True
    return process_mtp_loss


def apply() -> None:
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction

    expect_sources("mtp", SOURCES)
    if getattr(gpt_model.process_mtp_loss, "takes_depth_masks", False):
        return  # applied already
    if gpt_model.process_mtp_loss is not multi_token_prediction.process_mtp_loss:
        raise UpstreamChanged("megatron_fixes.mtp: GPTModel no longer calls multi_token_prediction.process_mtp_loss "
                              "through gpt_model's module global; read pretrain/megatron_fixes/mtp.py")
    gpt_model.process_mtp_loss = _wrap(gpt_model.process_mtp_loss)

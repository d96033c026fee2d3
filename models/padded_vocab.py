"""Padded vocabulary entries take no part in the softmax, the loss or the gradient.

The embedding and output layer hold `ModelConfig.padded_vocab_size` rows (the vocabulary
rounded up to `make_vocab_size_divisible_by`, 128 by default: GPT-2's 50,257 -> 50,304), so
that TP can split them evenly and the matrix shapes suit the GPU. Megatron-Core's GPTModel
computes logits for every row, and its cross entropy (`vocab_parallel_cross_entropy`, or the
fused native/TE ones) normalises over all of them: the padded ids take part in the softmax.
A model imported from Hugging Face (padded rows zero, so their logits 0) then starts with a
higher loss than transformers computes on the same tokens (+4% at vocab 300, reported in
issue 27; +0.2% measured at vocab 4000 -> 4096 by tests/checkpoints_tools/test_import_trains), and
training spends gradient pushing logits down that no token ever uses.

`mask_padded_logits(gpt, model)` is the one place this is fixed: a forward hook on the output
layer sets this rank's padded logit columns to -inf. Under TP the output layer
(ColumnParallelLinear) returns the vocab slice [r*V/TP, (r+1)*V/TP) of rank r; the columns at
or past `vocab_size` are masked on the ranks that hold them (usually only the last). With
`runtime_gather_output` (inference) the full padded vocabulary comes back; masked the same
way. exp(-inf) = 0, so the padded ids add nothing to the softmax denominator, and the loss's
gradient with respect to their logits (softmax - one-hot) is 0: their output-weight rows get
no gradient (their embedding rows are never looked up). Logits handed out for inference and
verification are -inf there too, so no padded id can be sampled; compare logits over
`[:vocab_size]` (checkpoints_tools.verify does). Megatron-Core's label smoothing would average
log(0) = -inf over the vocabulary: we do not expose it; a change that does must exclude the
padded ids there too.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state


class PaddedLogitsMask:
    """The output layer's forward hook (kept as an object so tests and readers can find it)."""

    def __init__(self, vocab_size: int, padded_vocab_size: int, tp_size: int, tp_rank: int) -> None:
        if padded_vocab_size % tp_size:
            raise ValueError(f"padded vocab {padded_vocab_size} is not divisible by TP={tp_size}")
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size
        self.local_size = padded_vocab_size // tp_size
        self.local_start = tp_rank * self.local_size
        self._masks: dict[tuple, torch.Tensor] = {}

    def _mask(self, width: int, start: int, device: torch.device) -> torch.Tensor:
        key = (width, start, device)
        if key not in self._masks:
            ids = torch.arange(start, start + width, device=device)
            self._masks[key] = ids >= self.vocab_size
        return self._masks[key]

    def __call__(self, module, inputs, output):
        logits, bias = output
        width = logits.shape[-1]
        if width == self.local_size:
            start = self.local_start
        elif width == self.padded_vocab_size:  # gathered over TP (runtime_gather_output)
            start = 0
        else:  # loud: a Megatron-Core change in what the output layer returns
            raise RuntimeError(f"output layer returned {width} logit columns; expected this rank's "
                               f"{self.local_size} or the padded vocabulary's {self.padded_vocab_size}")
        if start + width <= self.vocab_size:
            return output  # this rank holds no padded column
        # Not in place: the output of Megatron's linear autograd function may be a view.
        masked = logits.masked_fill(self._mask(width, start, logits.device), float("-inf"))
        return masked, bias


def mask_padded_logits(gpt, model) -> None:
    """Hook the output layer of a post-process GPTModel chunk so padded ids get -inf logits.

    `model` is the ModelConfig (vocab_size, padded_vocab_size). A no-op without padding."""
    if not gpt.post_process or model.padded_vocab_size == model.vocab_size:
        return
    hook = PaddedLogitsMask(model.vocab_size, model.padded_vocab_size,
                            parallel_state.get_tensor_model_parallel_world_size(),
                            parallel_state.get_tensor_model_parallel_rank())
    gpt.output_layer.register_forward_hook(hook)

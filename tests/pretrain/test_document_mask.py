"""Document-masked packed samples equal training each document alone (issue 24).

One sample packs three documents of different lengths (each ending with EOD). With
`reset_attention_mask` + `reset_position_ids` the real Megatron-Core GPTModel (tiny flavors,
fp32, portable spec) must give per-token losses and parameter gradients equal, to 1e-6
relative, to running each document alone as its own sequence from position 0. With
masking off the same check must fail by a wide margin (else it would prove nothing).
The batch goes through the training data path: Megatron's own position reset
(`_get_ltor_masks_and_position_ids`) and pretrain.data's collate (document ids).
"""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks

LENGTHS = (13, 29, 22)  # three documents, EOD included: one sample of 64 tokens
EOD = 3


def _packed_sample(vocab: int, reset: bool):
    import torch

    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    gen = torch.Generator().manual_seed(11)
    docs = []
    for length in LENGTHS:
        body = torch.randint(EOD + 1, vocab, (length - 1,), generator=gen)
        docs.append(torch.cat([body, torch.tensor([EOD])]))
    tokens = torch.cat(docs)
    labels = torch.cat([tokens[1:], torch.randint(EOD + 1, vocab, (1,), generator=gen)])
    _, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
        tokens, EOD, reset_position_ids=reset, reset_attention_mask=reset, eod_mask_loss=False,
        create_attention_mask=False)
    return dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids)


def _losses_and_grads(model, batch: dict, document_ids=None):
    model.zero_grad(set_to_none=True)
    kwargs = {} if document_ids is None else {"document_ids": document_ids}
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **kwargs)
    losses.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses.detach()[0], grads


def packed_vs_alone(flavor: str, masking: bool) -> dict:
    """On one rank: max relative differences between the packed sample and the documents alone."""
    import torch

    from models.build import build_model_chunks
    from models.config import get_flavor
    from models.layout import ParallelLayout
    from models.runtime import RuntimeOptions
    from pretrain.data import _collate
    from pretrain.runtime import init_distributed, shutdown

    layout = ParallelLayout()
    init_distributed(layout, seed=0)
    try:
        model_config = get_flavor(flavor)
        (model,) = build_model_chunks(model_config, layout, RuntimeOptions(seed=0, spec="portable"),
                                      reset_position_ids=masking)
        sample = _packed_sample(model_config.vocab_size, reset=masking)
        batch = _collate([sample], EOD if masking else None)
        assert ("document_ids" in batch) == masking
        packed_losses, packed_grads = _losses_and_grads(model, batch, batch.get("document_ids"))

        alone_losses, alone_grads, start = [], {}, 0
        for length in LENGTHS:
            piece = {k: batch[k][:, start:start + length] for k in ("tokens", "labels")}
            piece["position_ids"] = torch.arange(length)[None]  # its own sequence, from 0
            losses, grads = _losses_and_grads(model, piece)
            alone_losses.append(losses)
            for name, grad in grads.items():
                alone_grads[name] = alone_grads.get(name, 0) + grad
            start += length
        alone = torch.cat(alone_losses)
        assert packed_losses.shape == alone.shape and packed_grads.keys() == alone_grads.keys()
        loss_error = ((packed_losses - alone).abs() / alone.abs()).max().item()
        grad_error = max(((packed_grads[n] - alone_grads[n]).abs().max() / alone_grads[n].abs().max()).item()
                         for n in alone_grads)
        return {"loss": loss_error, "grad": grad_error, "params": len(alone_grads),
                "documents": int(batch["document_ids"].max()) + 1 if masking else None}
    finally:
        shutdown()


@pytest.mark.distributed
@pytest.mark.parametrize("flavor", ["tiny-llama", "tiny-gpt"])  # RoPE; learned absolute positions
def test_packed_documents_equal_each_document_alone(flavor):
    (result,) = run_ranks(1, "tests.pretrain.test_document_mask:packed_vs_alone", flavor=flavor, masking=True)
    print(f"\n{flavor} masked: {result}")
    assert result["documents"] == len(LENGTHS)
    assert result["params"] >= 10
    assert result["loss"] <= 1e-6, result
    assert result["grad"] <= 1e-6, result


@pytest.mark.distributed
def test_without_masking_the_same_check_fails_widely():
    (result,) = run_ranks(1, "tests.pretrain.test_document_mask:packed_vs_alone", flavor="tiny-llama",
                          masking=False)
    print(f"\nunmasked: {result}")
    assert result["loss"] > 1e-2 and result["grad"] > 1e-2, result

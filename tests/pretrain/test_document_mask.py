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


def _losses_and_grads(model, batch: dict, document_ids=None, cp_group=None):
    """Per-token losses [s] and parameter gradients of their sum; under CP the gradients are
    summed over the CP ranks (each holds part of the sequence; the weights are replicas)."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    kwargs = {} if document_ids is None else {"document_ids": document_ids}
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **kwargs)
    losses.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if cp_group is not None:
        for grad in grads.values():
            dist.all_reduce(grad, group=cp_group)
    return losses.detach()[0], grads


def _alone(model, batch: dict):
    """Each document of the packed sample as its own sequence from position 0: per-token
    losses [s] and the gradients of their sum over all documents."""
    import torch

    alone_losses, alone_grads, start = [], {}, 0
    for length in LENGTHS:
        piece = {k: batch[k][:, start:start + length] for k in ("tokens", "labels")}
        piece["position_ids"] = torch.arange(length)[None]
        losses, grads = _losses_and_grads(model, piece)
        alone_losses.append(losses)
        for name, grad in grads.items():
            alone_grads[name] = alone_grads.get(name, 0) + grad
        start += length
    return torch.cat(alone_losses), alone_grads


def save_alone(flavor: str, path: str) -> None:
    """One rank: the documents alone, saved for the context-parallel comparison."""
    import torch

    from models.build import build_model_chunks
    from models.config import get_flavor
    from models.layout import ParallelLayout
    from models.runtime import RuntimeOptions
    from pretrain.data import _collate
    from pretrain.runtime import init_distributed, shutdown

    init_distributed(ParallelLayout(), seed=0)
    try:
        model_config = get_flavor(flavor)
        (model,) = build_model_chunks(model_config, ParallelLayout(), RuntimeOptions(seed=0, spec="portable"))
        batch = _collate([_packed_sample(model_config.vocab_size, reset=True)], EOD)
        torch.save(_alone(model, batch), path)
    finally:
        shutdown()


def packed_vs_alone(flavor: str, masking: bool, reference: str | None = None) -> dict:
    """Max relative differences between the packed sample and the documents alone. With
    several ranks: context parallelism over all of them (the packed run sees only this
    rank's two chunks; documents cross the chunk boundaries)."""
    import torch

    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from models.build import build_model_chunks
    from models.config import get_flavor
    from models.layout import ParallelLayout
    from models.runtime import RuntimeOptions
    from pretrain.data import _collate
    from pretrain.runtime import init_distributed, read_dist_env, shutdown

    cp = read_dist_env().world_size
    layout = ParallelLayout(context_parallel=cp)
    init_distributed(layout, seed=0)
    try:
        model_config = get_flavor(flavor)
        (model,) = build_model_chunks(model_config, layout, RuntimeOptions(seed=0, spec="portable"),
                                      reset_position_ids=masking)
        sample = _packed_sample(model_config.vocab_size, reset=masking)
        batch = _collate([sample], EOD if masking else None)
        assert ("document_ids" in batch) == masking
        local = get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False,  # as pretrain.step does; no-op at CP 1
                                          cp_group=parallel_state.get_context_parallel_group())
        cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None
        packed_losses, packed_grads = _losses_and_grads(model, local, local.get("document_ids"), cp_group)

        if reference is None:
            alone_losses, alone_grads = _alone(model, batch)
        else:  # made by `save_alone` on one rank (same weights: layout-invariant init)
            alone_losses, alone_grads = torch.load(reference)
        alone = get_batch_on_this_cp_rank({"losses": alone_losses[None]}, is_hybrid_cp=False,
                                          cp_group=parallel_state.get_context_parallel_group())["losses"][0]
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
@pytest.mark.parametrize("cp", [2, 4])
def test_packed_documents_equal_each_document_alone_under_context_parallelism(cp, tmp_path):
    """CP 2: chunks of 16 tokens, the second document spans chunks 0-2 (rank 0 and 1); CP 4:
    chunks of 8, every document spans ranks. Per-token losses of this rank's chunks and the
    CP-summed gradients equal the documents run alone on one rank."""
    reference = str(tmp_path / "alone.pt")
    run_ranks(1, "tests.pretrain.test_document_mask:save_alone", flavor="tiny-llama", path=reference)
    results = run_ranks(cp, "tests.pretrain.test_document_mask:packed_vs_alone", flavor="tiny-llama",
                        masking=True, reference=reference)
    print(f"\nCP{cp} masked: {results}")
    assert len(results) == cp
    for result in results:
        assert result["loss"] <= 1e-6 and result["grad"] <= 1e-6, result


@pytest.mark.distributed
def test_without_masking_the_same_check_fails_widely():
    (result,) = run_ranks(1, "tests.pretrain.test_document_mask:packed_vs_alone", flavor="tiny-llama",
                          masking=False)
    print(f"\nunmasked: {result}")
    assert result["loss"] > 1e-2 and result["grad"] > 1e-2, result


# --- bad input: before any process group ---------------------------------------------------

BASE = ["data.demo=false", "data.mock=true", "schedule.seq_length=64", "schedule.micro_batch_size=2",
        "schedule.global_batch_size=8", "schedule.train_steps=2", "schedule.eval_interval=0"]
BOTH = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]


@pytest.mark.parametrize("overrides, message", [
    (BOTH + ["parallel.context_parallel=2"], "te spec at CP=2 is not supported"),
    (["data.reset_attention_mask=true"], "which reset both; set both true"),
    (BOTH + ["parallel.pipeline_parallel=2"], "needs schedule.micro_batch_size=1 (got 2)"),
])
def test_layouts_the_te_spec_cannot_mask_are_refused(overrides, message):
    from pretrain.cli import resolve_config
    from pretrain.config import ConfigError, check_document_masking

    config = resolve_config("tiny-llama", None, BASE + overrides)
    with pytest.raises(ConfigError) as err:
        check_document_masking(config, "te")
    assert message in str(err.value)
    check_document_masking(config, "portable")  # the portable spec masks every layout


def test_dry_run_shows_the_keys_and_warns_on_data_without_eod(tmp_path):
    """A dataset preprocessed without --append-eod: masking has nothing to mask. The dry run
    warns with the counts and goes on (exit 0); the keys are in the resolved config."""
    from data_pipeline.datasets import DEMO_CORPUS, DEMO_TOKENIZER
    from data_pipeline.preprocess import preprocess
    from tests.bad_input import run_cli

    prefix = tmp_path / "no-eod"
    preprocess([DEMO_CORPUS], tokenizer=DEMO_TOKENIZER, output_prefix=str(prefix), append_eod=False, workers=0)
    args = ["--recipe", "tiny-llama", "data.demo=false", f"data.blend=[[1.0, {prefix}]]",
            f"data.tokenizer={DEMO_TOKENIZER}", *BOTH, "data.eod_mask_loss=true",
            f"logging.run_dir={tmp_path / 'run'}", "--dry-run"]
    result = run_cli("pretrain", args, cwd=tmp_path)
    assert result.code == 0, result.output
    warning = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "has no EOD token (id 2)" in warning[0] and str(prefix) in warning[0], result.output
    assert "reset_attention_mask: true" in result.output and "eod_mask_loss: true" in result.output
    preprocess([DEMO_CORPUS], tokenizer=DEMO_TOKENIZER, output_prefix=str(tmp_path / "with-eod"), append_eod=True,
               workers=0)
    with_eod = run_cli("pretrain", [a.replace("no-eod", "with-eod") for a in args], cwd=tmp_path)
    assert with_eod.code == 0 and "warning:" not in with_eod.output, with_eod.output


# --- FLOPs: per-document causal attention does less work ---------------------------------

def test_attention_flops_with_documents():
    from models.config import get_flavor
    from models.flops import document_attention_fraction, forward_flops_per_token
    from pretrain.data import _attention_fractions, _collate

    assert document_attention_fraction([64], 64) == 1.0
    assert document_attention_fraction([16] * 4, 64) == 4 * 16 * 17 / (64 * 65)
    m = get_flavor("tiny-llama")
    dense = forward_flops_per_token(m, 64)
    quarter = forward_flops_per_token(m, 64, attention_fraction=0.25)
    # Only the scores and weighted values shrink: 2 terms x 2 s n d x 1/2 per layer.
    attention = m.num_layers * 2 * 64 * m.num_attention_heads * m.head_dim
    assert abs((dense - quarter) - 0.75 * attention) < 1e-6 * dense
    batch = _collate([_packed_sample(m.vocab_size, reset=True)], EOD)
    (fraction,) = _attention_fractions(batch["document_ids"])
    assert fraction == document_attention_fraction(LENGTHS, sum(LENGTHS))

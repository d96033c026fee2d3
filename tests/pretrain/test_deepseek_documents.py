"""Document masking on tiny-deepseek: multi-latent attention's RoPE at per-token positions, and
multi-token prediction that drops the predictions crossing a document (issue 45).

Against independent references, fp32, one rank, the real Megatron-Core model (portable spec):
- The packed sample of test_document_mask.py (three documents, EOD included) with
  reset_attention_mask + reset_position_ids gives the logits of each document run alone from
  position 0 (1e-5).
- MLA follows the position ids it is given: a document at positions 0, 2, 4, ... gives the
  logits that the same tokens get at the even places of a sequence twice as long whose odd
  places are hidden from them, run at the natural positions 0..2L-1 by upstream's own MLA RoPE
  (1e-5); a model without reset_position_ids ignores the gaps and misses by far more.
- With one MTP layer the packed sample's MTP loss is the token-weighted MTP loss of the
  documents run alone (1e-5), counting the same predictions: per document, every position but
  its last two (whose target, labels[i + 1], lies in the next document); without the document
  mask Megatron-Core's MTP would count those too and miss.
Two and three MTP depths (a mask per depth): tests/pretrain/test_mtp_depth_masks.py.
Layouts against one rank with masking on, on KJV verses as documents (tests.pretrain.workers.
document_data), 5 steps: per-step loss (and MTP loss, per depth with two) and grad norm within
1e-5 relative, every final weight within 1e-5; with one MTP layer, and with two at TP2+SP and PP2. `python -m tests.pretrain.repeat_deepseek_documents --times 20` repeats
them.
"""

from __future__ import annotations

import json

import pytest

from checkpoints_tools.dcp_io import CheckpointReader
from tests.compare import assert_steps_close
from tests.distributed import run_ranks
from tests.pretrain.test_document_mask import EOD, LENGTHS, _packed_sample

pytestmark = [pytest.mark.distributed]


# YaRN at tiny size: frequencies past 16 / beta_slow positions divided by 4, m(0.8) / m(0.6) on cos/sin.
YARN = dict(yarn_scaling_factor=4.0, yarn_original_max_position_embeddings=16, yarn_beta_fast=8.0, yarn_mscale=0.8,
            yarn_mscale_all_dim=0.6)


def _build(reset_position_ids: bool, mtp_num_layers: int = 0, yarn: bool = False):
    from models.build import build_model_chunks
    from models.config import get_flavor
    from models.layout import ParallelLayout
    from models.runtime import RuntimeOptions

    model_config = get_flavor("tiny-deepseek").model_copy(update=dict(mtp_num_layers=mtp_num_layers, **(YARN if yarn else {})))
    (model,) = build_model_chunks(model_config, ParallelLayout(), RuntimeOptions(seed=0, spec="portable"),
                                  reset_position_ids=reset_position_ids)
    return model, model_config


def _relative(got, want, vocab: int | None = None) -> float:
    """Max |got - want| over max |want|; logits over the real `vocab` (the padded ids' are -inf)."""
    if vocab is not None:
        got, want = got[..., :vocab], want[..., :vocab]
    assert got.shape == want.shape and bool(want.isfinite().all())
    return ((got - want).abs().max() / want.abs().max()).item()


def mla_logits_vs_alone(yarn: bool = False) -> dict:
    """Rank function: the packed sample's logits against each document alone; and a document at
    gapped positions against the long sequence with hidden odd places (`yarn`: YaRN RoPE)."""
    import torch

    from pretrain.data import _collate
    from pretrain.runtime import init_distributed, shutdown
    from models.layout import ParallelLayout

    init_distributed(ParallelLayout(), seed=0)
    try:
        model, model_config = _build(reset_position_ids=True, yarn=yarn)
        plain, _ = _build(reset_position_ids=False, yarn=yarn)  # same weights (layout-invariant init)
        batch = _collate([_packed_sample(model_config.vocab_size, reset=True)], EOD)
        with torch.no_grad():
            packed = model(batch["tokens"], batch["position_ids"], None, document_ids=batch["document_ids"])[0]
            # Positions not restarted (0..63) with the mask: RoPE is relative, so this matches too,
            # up to the rounding of larger angles (reported, not a proof of the restart).
            unrestarted = model(batch["tokens"], torch.arange(64)[None], None, document_ids=batch["document_ids"])[0]
            alone, start = [], 0
            for length in LENGTHS:
                alone.append(plain(batch["tokens"][:, start:start + length], torch.arange(length)[None], None)[0])
                start += length
            alone = torch.cat(alone)

            # Gapped positions: document 2 (29 tokens) at 0, 2, 4, ...
            doc = batch["tokens"][:, LENGTHS[0]:LENGTHS[0] + LENGTHS[1]]
            n = doc.shape[1]
            gapped = 2 * torch.arange(n)[None]
            got = model(doc, gapped, None, document_ids=torch.zeros_like(doc, dtype=torch.int32))[0]
            ignored = plain(doc, gapped, None)[0]  # upstream MLA: positions 0..n-1 whatever it is given
            long = torch.full((1, 2 * n), 7, dtype=doc.dtype)
            long[:, 0::2] = doc
            later = torch.ones(2 * n, 2 * n, dtype=torch.bool).triu(1)
            odd_key = (torch.arange(2 * n) % 2 == 1)[None, :] & ~torch.eye(2 * n, dtype=torch.bool)
            hidden = (later | odd_key)[None, None]  # True = hidden; odd queries see only themselves
            want = plain(long, torch.arange(2 * n)[None], hidden)[0][0::2]
        vocab = model_config.vocab_size
        return {"packed": _relative(packed, alone, vocab), "unrestarted": _relative(unrestarted, alone, vocab),
                "gapped": _relative(got, want, vocab), "gaps_ignored": _relative(ignored, want, vocab),
                "shape": list(packed.shape)}
    finally:
        shutdown()


@pytest.mark.parametrize("rope", ["plain", "yarn"])
def test_mla_packed_documents_give_each_documents_logits(rope):
    """Also with YaRN: its angles at the given positions, and its cos/sin factor, which upstream's
    own module applies (models.mla._GivenTableRotary)."""
    (result,) = run_ranks(1, "tests.pretrain.test_deepseek_documents:mla_logits_vs_alone", yarn=rope == "yarn")
    print(f"\ntiny-deepseek logits ({rope} RoPE): {result}")
    assert result["shape"] == [sum(LENGTHS), 4096], result
    assert result["packed"] <= 1e-5, result
    assert result["gapped"] <= 1e-5, result
    # The gapped check can fail: a model that ignores the positions misses by 100x its tolerance
    # or more (3.8e-3 with tiny-deepseek's routing of this stop, 5.6e-2 with the earlier one).
    assert result["gaps_ignored"] > 100 * 1e-5, result


def _mtp_call(model, tokens, position_ids, labels, **kwargs):
    """One training-mode forward; (per-token main losses [s], MTP mean loss, MTP predictions
    counted), read from Megatron-Core's own MTP tracker."""
    import torch

    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.clean_metrics_in_tracker()
    with torch.no_grad():
        losses = model(tokens, position_ids, kwargs.pop("attention_mask", None), labels=labels, **kwargs)
    tracker = MTPLossLoggingHelper.tracker
    return losses[0], tracker["loss_values"][0].item(), tracker["total_values"][0].item()


def mtp_loss_vs_alone() -> dict:
    """Rank function: one MTP layer; the packed sample's MTP loss and count against the documents
    alone (each ends with EOD, so its last label is the next document's first token: the alone
    run gets loss_mask 0 there, which Megatron-Core's MTP rolls onto its last-but-one position)."""
    import torch
    from megatron.core.models.gpt import GPTModel

    from models.documents import local_document_mask
    from pretrain.data import _collate
    from pretrain.runtime import init_distributed, shutdown
    from models.layout import ParallelLayout

    init_distributed(ParallelLayout(), seed=0)
    try:
        model, model_config = _build(reset_position_ids=True, mtp_num_layers=1)
        plain, _ = _build(reset_position_ids=False, mtp_num_layers=1)
        batch = _collate([_packed_sample(model_config.vocab_size, reset=True)], EOD)
        tokens, positions, labels = batch["tokens"], batch["position_ids"], batch["labels"]
        main, mtp, count = _mtp_call(model, tokens, positions, labels, document_ids=batch["document_ids"],
                                     label_document_ids=batch["label_document_ids"])
        # Upstream's MTP with the document mask for attention but no MTP loss mask.
        _, unmasked, unmasked_count = _mtp_call(lambda *a, **k: GPTModel.forward(model, *a, **k), tokens, positions,
                                                labels, attention_mask=local_document_mask(batch["document_ids"]))
        alone_main, sums, counts, start = [], 0.0, 0.0, 0
        for length in LENGTHS:
            piece = slice(start, start + length)
            outside = torch.ones(1, length)
            outside[0, -1] = 0  # the label at the EOD is the next document's first token
            losses, mean, n = _mtp_call(plain, tokens[:, piece], torch.arange(length)[None], labels[:, piece],
                                        loss_mask=outside)
            alone_main.append(losses)
            sums, counts, start = sums + mean * n, counts + n, start + length
        return {"mtp": mtp, "alone_mtp": sums / counts, "count": count, "alone_count": counts,
                "unmasked": unmasked, "unmasked_count": unmasked_count,
                "main": _relative(main, torch.cat(alone_main))}
    finally:
        shutdown()


def test_mtp_loss_of_packed_documents_is_the_documents_alone():
    (result,) = run_ranks(1, "tests.pretrain.test_deepseek_documents:mtp_loss_vs_alone")
    print(f"\ntiny-deepseek MTP: {result}")
    assert result["count"] == result["alone_count"] == sum(length - 2 for length in LENGTHS), result
    assert abs(result["mtp"] - result["alone_mtp"]) <= 1e-5 * result["alone_mtp"], result
    assert result["main"] <= 1e-5, result
    # Without the MTP loss mask: 2 more predictions per boundary, a different loss.
    assert result["unmasked_count"] == sum(LENGTHS) - 1, result
    assert abs(result["unmasked"] - result["alone_mtp"]) > 5e-4 * result["alone_mtp"], result  # measured 1.0e-3


# --- layouts against one rank ---------------------------------------------------------------

STEPS = 5
BASE = [
    "model=tiny-deepseek", f"schedule.train_steps={STEPS}", "schedule.micro_batch_size=2",
    "schedule.global_batch_size=8", "schedule.seq_length=64", "schedule.eval_interval=0",
    "schedule.warmup_steps=2", "data.demo=false", "runtime.spec=portable",
    "logging.tensorboard=false", "logging.log_interval=1",
    f"checkpoint.save_interval={STEPS}", "checkpoint.resume=none",
    # test_sharded_dp.py's DOC_TEXT (lr 1e-3: the comment above it says why) with both resets.
    "optimizer.adam_eps=1e-6", "optimizer.lr=1e-3",
    "data.reset_attention_mask=true", "data.reset_position_ids=true",
]
MTP = ["model.mtp_num_layers=1"]
MTP2 = ["model.mtp_num_layers=2"]  # per-depth masks (tests/pretrain/test_mtp_depth_masks.py)
TP2_SP = ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]
LAYOUTS = {  # name -> (ranks, overrides, reference)
    "TP2-SP-docs": (2, TP2_SP, "ref"),
    "TP2-SP-docs-mtp": (2, TP2_SP + MTP, "ref-mtp"),
    "PP2-docs-mtp": (2, ["parallel.pipeline_parallel=2"] + MTP, "ref-mtp"),
    "PP2xVPP2-docs-mtp": (2, ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"] + MTP, "ref-mtp"),
    "EP2-docs-mtp": (2, ["parallel.expert_parallel=2"] + MTP, "ref-mtp"),
    # Whole layers recomputed in the backward: the RoPE table travels as a layer argument.
    "recompute-docs-mtp": (1, ["runtime.recompute=full"] + MTP, "ref-mtp"),
    "TP2-SP-docs-mtp2": (2, TP2_SP + MTP2, "ref-mtp2"),
    "PP2-docs-mtp2": (2, ["parallel.pipeline_parallel=2"] + MTP2, "ref-mtp2"),
}
REFERENCES = {"ref": [], "ref-mtp": MTP, "ref-mtp2": MTP2}
OPTIMIZER_PREFIXES = ("optimizer.", "chained_")


def run_layout(root, tag: str, nproc: int, extra: list[str], data: list[str]) -> dict:
    """Train 5 steps; per-step loss, MTP loss (None without MTP), grad norm and the final weights."""
    run_ranks(nproc, "tests.pretrain.workers:train", recipe="tiny-deepseek",
              overrides=BASE + data + extra + [f"checkpoint.dir={root / tag / 'ckpt'}", f"logging.run_dir={root / tag}"])
    records = [json.loads(line) for line in (root / tag / "metrics.jsonl").read_text().splitlines()]
    reader = CheckpointReader(root / tag / "ckpt" / f"step_{STEPS:08d}")
    weights = {k: reader.read(k) for k in reader.tensor_keys() if not k.startswith(OPTIMIZER_PREFIXES)}
    return {"loss": [r["loss"] for r in records], "mtp_loss": [r.get("mtp_loss") for r in records],
            "mtp_loss_layers": [r.get("mtp_loss_layers") for r in records],
            "grad_norm": [r["grad_norm"] for r in records], "weights": weights}


def compare(got: dict, want: dict, what: str) -> str:
    """Raises AssertionError naming what differs; returns a one-line summary."""
    parts = [f"loss {assert_steps_close(got['loss'], want['loss'], rtol=1e-5, what=f'{what} loss'):.1e}",
             f"grad norm {assert_steps_close(got['grad_norm'], want['grad_norm'], rtol=1e-5, what=f'{what} norm'):.1e}"]
    if want["mtp_loss"][0] is not None:
        mtp = assert_steps_close(got["mtp_loss"], want["mtp_loss"], rtol=1e-5, what=f"{what} MTP loss")
        parts.append(f"MTP loss {mtp:.1e}")
        depths = len(want["mtp_loss_layers"][0])
        for d in range(depths) if depths > 1 else ():
            worst_d = assert_steps_close([r[d] for r in got["mtp_loss_layers"]], [r[d] for r in want["mtp_loss_layers"]],
                                         rtol=1e-5, what=f"{what} MTP depth {d + 1} loss")
            parts.append(f"depth {d + 1} {worst_d:.1e}")
    assert sorted(got["weights"]) == sorted(want["weights"]), f"{what}: the checkpoints hold different tensors"
    worst, where = max(((got["weights"][k] - want["weights"][k]).abs().max().item(), k) for k in want["weights"])
    assert worst <= 1e-5, f"{what}: final weight {where} differs by {worst:.2e}"
    return f"{what}: " + ", ".join(parts) + f" (max relative), weights {worst:.1e} ({where})"


@pytest.fixture(scope="module")
def runs(module_tmp_factory) -> dict:
    from tests.pretrain.workers import document_data

    root = module_tmp_factory.mktemp("deepseek-docs")
    data = document_data(root)
    refs = {tag: run_layout(root, tag, 1, extra, data) for tag, extra in REFERENCES.items()}
    for ref in refs.values():
        assert len(ref["loss"]) == STEPS and ref["loss"][-1] < ref["loss"][0], "the run must train"
    for tag in ("ref-mtp", "ref-mtp2"):
        assert refs[tag]["mtp_loss"][-1] < refs[tag]["mtp_loss"][0], f"{tag}: the MTP loss must fall"
    assert any(k.startswith("mtp.") for k in refs["ref-mtp"]["weights"])
    # The same run without the two resets: masking must change it (else the layouts prove nothing).
    unmasked = run_layout(root, "unmasked", 1, MTP + [f"{k}=false" for k in ("data.reset_attention_mask",
                                                                          "data.reset_position_ids")], data)
    assert min(abs(a - b) for a, b in zip(unmasked["loss"][1:], refs["ref-mtp"]["loss"][1:], strict=True)) > 1e-4
    return {"root": root, "data": data, **refs}


@pytest.mark.parametrize("name", ["TP2-SP-docs", "TP2-SP-docs-mtp", "recompute-docs-mtp", "PP2-docs-mtp2",
                                  *(pytest.param(name, marks=pytest.mark.slow)
                                    for name in ("PP2-docs-mtp", "PP2xVPP2-docs-mtp", "EP2-docs-mtp",
                                                 "TP2-SP-docs-mtp2"))])
def test_deepseek_documents_layout_matches_one_rank(runs, name):
    nproc, extra, ref = LAYOUTS[name]
    got = run_layout(runs["root"], name, nproc, extra, runs["data"])
    print("\n" + compare(got, runs[ref], name))


def test_a_doubled_mtp_gradient_shows(runs):
    """The layouts' tolerance catches an MTP gradient twice too large at this lr (1e-3):
    mtp_loss_scaling_factor 0.2 for 0.1."""
    doubled = run_layout(runs["root"], "doubled", 1, MTP + ["model.mtp_loss_scaling_factor=0.2"], runs["data"])
    want = runs["ref-mtp"]
    assert doubled["loss"][0] == want["loss"][0]  # same start: only the gradient differs
    worst = max(abs(a - b) / abs(b) for a, b in zip(doubled["loss"], want["loss"], strict=True))
    print(f"\ndoubled MTP gradient: loss off by {worst:.1e} relative")
    assert worst > 1e-4, worst


# --- refused, in one line, before any process group (mtp_num_layers=2: test_mtp.py) --------

@pytest.mark.parametrize("overrides, spec, message", [
    (["model.mtp_num_layers=1", "data.reset_position_ids=true"], "portable",
     "needs data.reset_attention_mask=true (got reset_attention_mask=false)"),
    (["model.mtp_num_layers=1", "data.reset_attention_mask=true", "data.reset_position_ids=true"], "te",
     "model.mtp_num_layers with document masking on the te spec is untested here"),
])
def test_what_still_does_not_run_is_refused_in_one_line(overrides, spec, message):
    from pretrain.cli import resolve_config
    from pretrain.config import ConfigError, check_spec_support, validate_for_world

    config = resolve_config("tiny-deepseek", None, ["data.demo=false", "data.mock=true"] + overrides)
    with pytest.raises(ConfigError) as err:
        validate_for_world(config, 1)
        check_spec_support(config, spec)
    assert message in str(err.value) and "\n" not in str(err.value).strip(), str(err.value)


def test_mla_with_reset_position_ids_and_mtp_is_accepted():
    from pretrain.cli import resolve_config
    from pretrain.config import check_spec_support, validate_for_world

    config = resolve_config("tiny-deepseek", None, ["data.demo=false", "data.mock=true", "data.reset_attention_mask=true",
                                                    "data.reset_position_ids=true", "model.mtp_num_layers=1"])
    validate_for_world(config, 2)
    check_spec_support(config, "portable")

"""Verify logits parity between our model (from a checkpoint) and a Hugging Face model.

    python -m checkpoints_tools.verify runs/tiny/checkpoints runs/tiny/hf --tolerance 1e-4
    python -m checkpoints_tools.verify runs/tiny/checkpoints runs/tiny/hf --text "In the beginning" --json

Runs the same token batch through our Megatron-Core model, built at TP1 in this process
and loaded from the checkpoint whatever layout saved it, and through
`transformers.AutoModelForCausalLM` loaded from the HF directory, both in fp32. Reports the
max and mean absolute difference of the logits over the real (unpadded) vocabulary and
the fraction of positions whose greedy next token agrees. Exit status 1 when the max
difference exceeds --tolerance (or agreement is below --min-agreement), 2 on bad input.
Needs `transformers` (a test dependency: pip install '.[test]').
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from checkpoints_tools.common import ToolError, add_input_arguments, checkpoint_model, resolve_checkpoint, run_cli
from data_pipeline.checks import finite_float, positive_int
from models.layout import ParallelLayout


def model_logits(checkpoint: Path, tokens: torch.Tensor, *, layout: Optional[ParallelLayout] = None,
                 seed: int = 0) -> Optional[torch.Tensor]:
    """fp32 logits [batch, seq, vocab] of our model loaded from
    `checkpoint` at `layout` (default TP1 in this process); None on ranks other than the
    last pipeline stage's first tensor-parallel rank. Starts Megatron's parallel state
    (under torchrun / run_ranks for layouts over several ranks)."""
    from models.build import build_model_chunks
    from models.runtime import RuntimeOptions
    from pretrain.checkpointing.checkpointer import load_model_weights
    from pretrain.runtime import init_distributed

    layout = layout or ParallelLayout()
    _, model = checkpoint_model(checkpoint)
    init_distributed(layout, seed=seed)
    chunks = build_model_chunks(model, layout, RuntimeOptions(seed=seed, spec="auto"))
    load_model_weights(checkpoint, chunks)
    return forward_logits(chunks, tokens, layout, vocab_size=model.vocab_size)


def forward_logits(chunks: list, tokens: torch.Tensor, layout: ParallelLayout,
                   vocab_size: Optional[int] = None) -> Optional[torch.Tensor]:
    """Run one batch through this rank's model chunks with Megatron's (pipeline) schedule;
    the vocab-parallel logits are gathered over TP on the last stage. `vocab_size` cuts off
    the padded ids' columns (-inf: models/padded_vocab.py)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    for chunk in chunks:
        chunk.eval()
    batch, seq = tokens.shape
    device = next(chunks[0].parameters()).device
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)

    def forward_step(data_iterator, chunk):
        output = chunk(tokens.to(device), positions.to(device), None)

        def collect(output_tensor, non_loss_data=False):
            return gather_from_tensor_model_parallel_region(output_tensor).float().cpu()

        return output, collect

    # The interleaved schedule needs a multiple of PP microbatches: feed the batch PP times.
    microbatches = layout.pipeline_parallel if layout.virtual_pipeline else 1
    iterators = [iter([None] * microbatches) for _ in chunks]
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=microbatches, seq_length=seq,
            micro_batch_size=batch, forward_only=True, collect_non_loss_data=True)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if not (last and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0):
        return None
    return outputs[0] if vocab_size is None else outputs[0][..., :vocab_size]


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    try:
        import transformers
    except ImportError:
        raise ToolError("verify needs transformers: pip install '.[test]' (or transformers==5.23.0)") from None
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - transformers' many error types on a damaged directory
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ToolError(f"transformers cannot load {hf_dir} ({type(exc).__name__}: {lines[0] if lines else ''}"
                        f"{' ...' if len(lines) > 1 else ''}): its config.json and weights disagree or a file "
                        "is damaged; export it again") from None
    hf.eval()
    with torch.no_grad():
        return hf(input_ids=tokens).logits.float()


def check_same_model(hf_dir: Path, model) -> None:
    """The HF directory's config.json describes the checkpoint's model (before any weight
    is read): comparing logits of two different models says nothing."""
    from checkpoints_tools.import_hf import read_hf_config

    _, theirs = read_hf_config(hf_dir, model.make_vocab_size_divisible_by)
    fields = ("num_layers", "hidden_size", "num_attention_heads", "query_groups", "vocab_size", "num_experts",
              "tie_embeddings")
    diffs = [f"{name} {getattr(model, name)} vs {getattr(theirs, name)}" for name in fields
             if getattr(model, name) != getattr(theirs, name)]
    if diffs:
        raise ToolError(f"{hf_dir} does not hold this checkpoint's model (checkpoint vs config.json: "
                        f"{', '.join(diffs)}); pass the checkpoint's own export")


def compare(ours: torch.Tensor, theirs: torch.Tensor, vocab_size: int) -> dict:
    """Max/mean |difference| over the real vocabulary and greedy next-token agreement."""
    ours = ours[..., :vocab_size]
    if ours.shape != theirs.shape:
        raise ToolError(f"logit shapes differ: ours {tuple(ours.shape)} vs HF {tuple(theirs.shape)}; "
                        "the HF directory is not an export of this checkpoint's model")
    diff = (ours - theirs).abs()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(), "greedy_agreement": agree,
            "positions": int(ours.shape[0] * ours.shape[1])}


def make_tokens(hf_dir: Path, vocab_size: int, *, text: Optional[str], batch: int, seq: int, seed: int) -> torch.Tensor:
    if text is None:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (batch, seq), generator=generator)
    from checkpoints_tools.hf_format import auto_tokenizer

    ids = auto_tokenizer(hf_dir)(text)["input_ids"]
    return torch.tensor([ids])


def _check_length(tokens: torch.Tensor, max_length: int) -> None:
    if tokens.shape[1] > max_length:
        raise ToolError(f"{tokens.shape[1]} tokens exceed the model's max_seq_length {max_length}; "
                        "use a shorter --text or --seq")


def verify(checkpoint: Path, hf_dir: Path, *, tolerance: float = 1e-4, min_agreement: float = 1.0,
           text: Optional[str] = None, batch: int = 2, seq: int = 64, seed: int = 0,
           verify_checksums: bool = True) -> dict:
    """Compare logits; the report's `passed` says whether both thresholds hold."""
    checkpoint = resolve_checkpoint(checkpoint, verify_checksums=verify_checksums)
    _, model = checkpoint_model(checkpoint)
    if not (Path(hf_dir) / "config.json").is_file():
        raise ToolError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    check_same_model(Path(hf_dir), model)
    tokens = make_tokens(Path(hf_dir), model.vocab_size, text=text, batch=batch, seq=seq, seed=seed)
    _check_length(tokens, model.max_seq_length)
    theirs = hf_logits(Path(hf_dir), tokens)
    started = not torch.distributed.is_initialized()
    try:
        ours = model_logits(checkpoint, tokens, seed=seed)
    finally:
        if started:
            # The process group is ours: a caller that goes on in this process (a test, a
            # notebook) would otherwise find one rank's group where it starts its own.
            from pretrain.runtime import shutdown

            shutdown(barrier=False)
    report = compare(ours, theirs, model.vocab_size)
    report.update(tolerance=tolerance, min_agreement=min_agreement,
                  passed=report["max_abs_diff"] <= tolerance and report["greedy_agreement"] >= min_agreement)
    return report


def nonnegative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value:g}")
    return value


def share(text: str) -> float:
    value = finite_float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value:g}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoints_tools.verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="checkpoint step directory, or a checkpoint.dir (newest)")
    parser.add_argument("hf_dir", type=Path, help="Hugging Face model directory")
    parser.add_argument("--tolerance", type=nonnegative_float, default=1e-4, help="max |logit difference| allowed")
    parser.add_argument("--min-agreement", type=share, default=1.0, help="min greedy next-token agreement")
    parser.add_argument("--text", help="encode this text with the HF tokenizer (default: random tokens)")
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--seq", type=positive_int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")
    add_input_arguments(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        report = verify(args.checkpoint, args.hf_dir, tolerance=args.tolerance, min_agreement=args.min_agreement,
                        text=args.text, batch=args.batch, seq=args.seq, seed=args.seed,
                        verify_checksums=not args.no_verify_checksums)
        if args.json:
            print(json.dumps(report))
        else:
            print(f"max |diff| {report['max_abs_diff']:.3e}, mean |diff| {report['mean_abs_diff']:.3e}, "
                  f"greedy agreement {report['greedy_agreement']:.4f} over {report['positions']} positions: "
                  + ("PASS" if report["passed"] else f"FAIL (tolerance {args.tolerance:g}, "
                                                     f"min agreement {args.min_agreement:g})"))
        return 0 if report["passed"] else 1

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

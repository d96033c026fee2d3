"""Import a Hugging Face Llama / Mistral / Mixtral / Qwen3 / Qwen3-MoE / DeepSeek-V3 directory as a training checkpoint.

    # Llama safetensors -> our checkpoint cut for TP2 x PP2, to continue pretraining:
    python -m checkpoints_tools.import_hf /models/llama-hf runs/cont/imported --tp 2 --pp 2
    torchrun --nproc-per-node 4 -m pretrain --recipe tiny-llama --config runs/cont/imported/config.yaml \
        checkpoint.resume=runs/cont/imported checkpoint.dir=runs/cont/checkpoints data.blend='[[1.0, data/web]]'

The model config comes from config.json (architecture, GQA, head_dim, RoPE theta and Llama-3
scaling, tied embeddings, experts and their top-k weighting, Qwen3's q/k norms); the written config.yaml holds it, so passing it with
--config makes the training config match the checkpoint. Weights are read from
safetensors one tensor at a time (pickled `*.bin` weights are refused unless
--trust-pickle), every expected tensor is checked against config.json's shapes, and
tensors are fused the Megatron way (QKV grouped by query group, fc1 = [gate; up],
vocab rows zero-padded to a multiple of --vocab-multiple). The checkpoint holds model
weights only (step 0): training starts with a fresh optimizer. Tokenizer files are
copied to DST/tokenizer (config.yaml's data.tokenizer points there).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from checkpoints_tools.common import (
    DTYPE_NAMES,
    ToolError,
    add_layout_arguments,
    add_output_arguments,
    byte_progress,
    check_layout,
    layout_from_args,
    parse_dtype,
    run_cli,
    staged_output,
    write_training_meta,
)
from checkpoints_tools import deepseek
from checkpoints_tools.dcp_io import layout_chunks, write_checkpoint
from checkpoints_tools.hf_format import ARCHITECTURES, HFConfigError, copy_tokenizer_files, model_from_hf_config
from checkpoints_tools.mapping import (
    extra_state_keys,
    from_hf,
    global_shape,
    hf_layer_shapes,
    hf_name,
    rules_for,
    stack_indices,
)
from checkpoints_tools.reshard import LayerCache
from checkpoints_tools.safetensors_io import HFFormatError, HFWeights
from data_pipeline.checks import positive_int
from models.config import ModelConfig
from models.layout import ParallelLayout
from pretrain.config import ExperimentConfig

# Weights HF files may hold that carry no model state of ours: RoPE buffers are recomputed.
IGNORED_HF = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def read_hf_config(src: Path, vocab_multiple: int = 128) -> tuple[dict, ModelConfig]:
    file = Path(src) / "config.json"
    if not file.is_file():
        raise ToolError(f"{src} is not a Hugging Face model directory (no config.json)")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ToolError(f"{file} is not readable JSON ({exc}); copy the model directory again") from None
    if not isinstance(config, dict) or not isinstance(config.get("architectures", []), list):
        raise ToolError(f"{file} must hold a JSON object with a list of architectures, like transformers writes")
    try:
        return config, model_from_hf_config(config, vocab_multiple=vocab_multiple)
    except HFConfigError as exc:
        raise ToolError(f"{file}: {exc}") from None


def check_hf_tensors(weights: HFWeights, model: ModelConfig, note=lambda message: None) -> None:
    """Every tensor config.json implies exists with its shape, and nothing unknown is left
    (DeepSeek's MTP layers past the last layer are left out on purpose: `note` says so)."""
    expected = set()
    for rule in rules_for(model):
        shapes = hf_layer_shapes(rule, model)
        for index in stack_indices(model, rule.megatron):
            for pattern, shape in zip(rule.hf, shapes):
                name = hf_name(pattern, *index)
                expected.add(name)
                if name not in weights.files:
                    raise ToolError(f"{weights.directory}: tensor {name} is missing (config.json implies it)")
                if weights.shape(name) != shape:
                    raise ToolError(f"{weights.directory}: {name} has shape {weights.shape(name)} but config.json "
                                    f"implies {shape}; the weights and config.json disagree")
    mtp = set(deepseek.mtp_layer_names(weights.names(), model.num_layers)) if model.multi_latent_attention else set()
    if mtp:
        note(f"MTP layers are training-only; not imported ({len(mtp)} tensors of model.layers."
             f"{model.num_layers} and later)")
    unknown = sorted(n for n in weights.names() if n not in expected and not IGNORED_HF.match(n) and n not in mtp
                     and not (model.tie_embeddings and n == "lm_head.weight"))
    if unknown:
        raise ToolError(f"{weights.directory} holds tensors this architecture does not use, e.g. "
                        f"{', '.join(unknown[:5])} ({len(unknown)} in all); importing would silently drop them")


def _extra_state_bytes() -> bytes:
    """What Megatron-Core saves for a module's `_extra_state` without FP8 metadata: [None]."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer.getvalue()


def import_hf(src: Path, dst: Path, *, layout: Optional[ParallelLayout] = None, world_size: Optional[int] = None,
              dtype: Optional[torch.dtype] = None, trust_pickle: bool = False, vocab_multiple: int = 128,
              overwrite: bool = False, progress: bool = False, note=lambda message: None) -> dict:
    """Write a model-only training checkpoint `dst` for the HF directory `src`; returns a summary."""
    start = time.perf_counter()
    src = Path(src)
    hf_config, model = read_hf_config(src, vocab_multiple)
    layout = layout or ParallelLayout()
    world = check_layout(model, layout, world_size)
    try:
        weights = HFWeights(src, trust_pickle=trust_pickle)
    except HFFormatError as exc:
        raise ToolError(str(exc)) from None
    try:
        check_hf_tensors(weights, model, note)
        dtype = dtype or weights.get("model.embed_tokens.weight").dtype
        rules = {rule.megatron: rule for rule in rules_for(model)}
        # DeepSeek-V3's router bias stays fp32, as Megatron-Core keeps it.
        dtypes = {key: torch.float32 if key.endswith("router.expert_bias") else dtype for key in rules}

        def load(key: str, index: tuple) -> torch.Tensor:
            rule = rules[key]
            return from_hf(rule, [weights.get(hf_name(p, *index)) for p in rule.hf], model).to(dtypes[key])

        tensors = {}
        for key in rules:
            shape = global_shape(model, key)
            tensors[key] = (shape, dtypes[key], layout_chunks(key, shape, layout, gated=True))
        total = sum(int(torch.Size(s).numel()) * d.itemsize for s, d, _ in tensors.values())
        cache = LayerCache(load)
        extra = _extra_state_bytes()
        with staged_output(dst, overwrite=overwrite, protect=(src,), what="import") as out, \
                byte_progress(progress) as bar:
            task = bar.add_task(f"import -> {layout.describe(world)}", total=total)

            def produce(key, offsets, sizes):
                chunk = cache.chunk(key, offsets, sizes)
                bar.advance(task, chunk.numel() * dtype.itemsize)
                return chunk

            write_checkpoint(out, tensors, produce, {k: extra for k in extra_state_keys(model)}, common={})
            spec = copy_tokenizer_files(src, out / "tokenizer", Path(dst).absolute() / "tokenizer")
            config = ExperimentConfig(name=f"import-{src.name}", model=model)
            config = config.model_copy(update={"data": config.data.model_copy(update={"tokenizer": spec})})
            arch = hf_config["architectures"][0]
            write_training_meta(
                out, model=model, layout=layout, world_size=world, step=0, consumed_samples=0,
                has_optimizer=False, config=config,
                provenance={"tool": "checkpoints_tools.import_hf", "source": str(src.resolve()),
                            "hf_architecture": arch, "hf_bos_token_id": hf_config.get("bos_token_id"),
                            "hf_eos_token_id": hf_config.get("eos_token_id"), "dtype": DTYPE_NAMES.get(dtype)},
            )
    finally:
        weights.close()
    return {"output": str(Path(dst)), "architecture": arch, "layout": layout.describe(world),
            "dtype": str(dtype).replace("torch.", ""), "bytes": total, "tokenizer": spec,
            "seconds": time.perf_counter() - start}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoints_tools.import_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help=f"Hugging Face directory ({', '.join(ARCHITECTURES)})")
    parser.add_argument("dst", type=Path, help="output checkpoint directory (resume with checkpoint.resume=DST)")
    add_layout_arguments(parser)
    add_output_arguments(parser, dtype_help="weight dtype (default: the HF weights')")
    parser.add_argument("--vocab-multiple", type=positive_int, default=128,
                        help="pad the vocabulary to a multiple of this (model.make_vocab_size_divisible_by)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="allow pickled *.bin weights (they can run code when unpickled: trusted sources only)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        _, model = read_hf_config(args.src, args.vocab_multiple)
        layout, world = layout_from_args(model, args)
        summary = import_hf(args.src, args.dst, layout=layout, world_size=world, dtype=parse_dtype(args.dtype),
                            trust_pickle=args.trust_pickle, vocab_multiple=args.vocab_multiple,
                            overwrite=args.overwrite, progress=not args.no_progress,
                            note=lambda m: print(f"note: {m}", file=sys.stderr))
        print(f"wrote {summary['output']}: {summary['architecture']} -> {summary['layout']} ({summary['dtype']}, "
              f"{summary['bytes'] / 1e9:.3f} GB) in {summary['seconds']:.1f} s; tokenizer: "
              f"{summary['tokenizer'] or 'none found'}; model weights only (fresh optimizer on resume)")
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

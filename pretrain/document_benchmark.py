"""What document masking costs on CPU: the mask itself at a long sequence, and training throughput.

    python -m pretrain.document_benchmark mask --seq 4096 --docs 12 --repeat 5
    python -m pretrain.document_benchmark train --rounds 5 --steps 12

`mask`: per sample, Megatron's dense attention mask (GPTDataset with create_attention_mask=True:
`_get_ltor_masks_and_position_ids` builds an fp32 s x s tril, clears the other documents'
blocks, then converts it to bool) against what our data path carries (`document_ids`, O(s))
and the bool mask the portable model builds from it once per forward
(`models.documents.local_document_mask`). Times are medians over `--repeat` runs; bytes are
the tensors' sizes (the dense path's peak holds the fp32 tril and its bool copy at once).

`train`: tiny-llama on real text with short documents (data_pipeline's KJV verses), masking off and
on in alternating rounds (the machine is shared and noisy), `--steps` steps each; prints the
median step time, tokens/s and the data-loader share of the step (metrics.jsonl's
`overhead_frac`: time outside forward/backward + optimizer, where batches are fetched)
over the steps after the first two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mask_costs(seq: int, docs: int, repeat: int) -> dict:
    """Seconds and bytes per sample of the dense mask vs document ids (+ the model's mask)."""
    import torch

    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from data_pipeline.datasets import document_ids
    from models.documents import local_document_mask

    eod = 2
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 1000, (seq,), generator=gen)
    tokens[torch.randperm(seq, generator=gen)[:docs]] = eod

    def dense():
        return _get_ltor_masks_and_position_ids(tokens, eod, True, True, False, True)

    def ours():
        return _get_ltor_masks_and_position_ids(tokens, eod, True, True, False, False), document_ids(tokens, eod)

    ids = document_ids(tokens[None], eod)
    mask = dense()[0]
    return {
        "seq": seq, "documents": docs + 1,
        "dense_mask_s": _median_seconds(dense, repeat),
        "dense_mask_bytes": mask.numel() * mask.element_size(),
        "dense_mask_peak_bytes": seq * seq * (4 + 1),  # the fp32 tril and its bool copy
        "document_ids_s": _median_seconds(ours, repeat),
        "document_ids_bytes": ids.numel() * ids.element_size(),
        "model_mask_s": _median_seconds(lambda: local_document_mask(ids), repeat),
        "model_mask_bytes": seq * seq,
    }


def _train_once(root: Path, tag: str, steps: int, data: list[str], masked: bool) -> dict:
    run_dir = root / tag
    overrides = [f"schedule.train_steps={steps}", "schedule.micro_batch_size=4", "schedule.global_batch_size=8",
                 "schedule.seq_length=256", "schedule.eval_interval=0", "runtime.spec=portable",
                 "logging.tensorboard=false", "logging.log_interval=1", f"logging.run_dir={run_dir}", *data]
    if masked:
        overrides += ["data.reset_attention_mask=true", "data.reset_position_ids=true"]
    subprocess.run([sys.executable, "-m", "pretrain", "--recipe", "tiny-llama", *overrides], check=True,
                   capture_output=True, text=True, env={"OMP_NUM_THREADS": "2", **os.environ})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
    return {"step_s": statistics.median(r["step_time_s"] for r in records),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
            "data_share": statistics.median(r["overhead_frac"] for r in records),
            "attention_fraction": records[-1]["attention_fraction"]}


def train_comparison(rounds: int, steps: int) -> dict:
    from data_pipeline.datasets import ensure_verses_dataset

    results: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="docmask-bench-") as tmp:
        root = Path(tmp)
        prefix, tokenizer = ensure_verses_dataset(str(root / "verses"))
        data = ["data.mock=false", "data.demo=false", f"data.blend=[[1.0, {prefix}]]", f"data.tokenizer={tokenizer}"]
        for i in range(rounds):
            for name in ("off", "on"):
                results[name].append(_train_once(root, f"{name}-{i}", steps, data, name == "on"))
    return {name: {key: statistics.median(r[key] for r in runs) if runs[0][key] is not None else None
                   for key in runs[0]} | {"rounds": len(runs)} for name, runs in results.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    mask = sub.add_parser("mask")
    mask.add_argument("--seq", type=int, default=4096)
    mask.add_argument("--docs", type=int, default=12, help="EOD tokens in the sample")
    mask.add_argument("--repeat", type=int, default=5)
    train = sub.add_parser("train")
    train.add_argument("--rounds", type=int, default=5)
    train.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    if args.what == "mask":
        print(json.dumps(mask_costs(args.seq, args.docs, args.repeat), indent=1))
    else:
        print(json.dumps(train_comparison(args.rounds, args.steps), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

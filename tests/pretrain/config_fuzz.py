"""The config fuzzer: seeded random configs, the dry run's verdict against real training.

Each case is a recipe, a world size and `key=value` overrides drawn over the layout
(TP/SP/PP/VPP/CP/EP, ZeRO level, HSDP), the model shape (layers, hidden, heads, query
groups, FFN, vocabulary), batch, sequence, precision, recompute, and the data (mock, or an
indexed dataset of a chosen number of documents with a chosen split). The verdict is what
`python -m pretrain --dry-run --world-size N` decides (`validate_for_world` +
`validate_inputs`, in process). Then:
- accepted: the case trains 2 steps on N gloo ranks (tests/distributed.py) with finite
  losses, or the fuzzer reports it as a hole: validation passed what cannot train;
- refused: the refusal is one line of at most MAX_ERROR_CHARS characters (the CLI prints
  it as `error: ...` with exit status 2, tests/pretrain/test_config.py checks that path).

    pytest tests/pretrain/test_config_fuzz.py                      # the quick seeded subset
    pytest tests/pretrain/test_config_fuzz.py --fuzz-cases 200 -s  # long mode: counts printed
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Optional

MAX_ERROR_CHARS = 400
TRAIN_STEPS = 2
# Sizes of the indexed datasets a case may read (documents of the shipped demo corpus):
# 400 and 500 leave a 0.1% test part empty under the default split 969,30,1.
DATASET_DOCUMENTS = (40, 500, 700)
SPLITS = ("969,30,1", "98,2,0", "1,0,0", "90,10,0", "9,0,1")


@dataclasses.dataclass
class Case:
    index: int
    recipe: str
    world_size: int
    overrides: list[str]

    def describe(self) -> str:
        return f"case {self.index}: world {self.world_size}, --recipe {self.recipe} " + " ".join(self.overrides)


@dataclasses.dataclass
class Outcome:
    case: Case
    verdict: str  # "refused" | "trained" | "hole"
    detail: str = ""


def _pick(rng: random.Random, choices, weights=None):
    return rng.choices(list(choices), weights=weights, k=1)[0]


def _layout(rng: random.Random, moe: bool) -> tuple[int, list[str]]:
    world = _pick(rng, (1, 2, 4), (2, 3, 3))
    while True:  # mostly a grid that tiles the world, sometimes any (the refusal is tested too)
        tp = _pick(rng, (1, 2, 4), (4, 3, 1))
        pp = _pick(rng, (1, 2), (3, 1))
        cp = _pick(rng, (1, 2), (4, 1))
        if world % (tp * pp * cp) == 0 or rng.random() < 0.15:
            break
    out = [f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}", f"parallel.context_parallel={cp}"]
    if pp > 1 and rng.random() < 0.4:
        out.append("parallel.virtual_pipeline=2")
    if rng.random() < (0.8 if moe else 0.4) and (tp > 1 or rng.random() < 0.1):
        out.append("parallel.sequence_parallel=true")
    if moe:
        out.append(f"parallel.expert_parallel={_pick(rng, (1, 2, 4), (2, 2, 1))}")
    sharding = _pick(rng, (None, "none", "zero1", "zero2", "zero3"), (3, 1, 1, 1, 1))
    if sharding:
        out.append(f"parallel.sharding={sharding}")
        if sharding in ("zero2", "zero3") and rng.random() < 0.3:
            out.append("parallel.hsdp_replicas=2")
    return world, out


def _model(rng: random.Random, mock: bool, moe: bool) -> list[str]:
    heads = _pick(rng, (2, 4, 8))
    head_dim = _pick(rng, (8, 15, 16, 24), (4, 1, 4, 1))
    hidden = heads * head_dim if rng.random() < 0.9 else _pick(rng, (100, 120, 96))
    out = [f"model.num_layers={_pick(rng, (1, 2, 3, 4), (1, 3, 1, 3))}", f"model.hidden_size={hidden}",
           f"model.num_attention_heads={heads}", f"model.ffn_hidden_size={_pick(rng, (96, 128, 200, 352))}"]
    groups = _pick(rng, [None] + [g for g in (1, 2, 4) if heads % g == 0 or rng.random() < 0.1])
    out.append(f"model.num_query_groups={'null' if groups is None else groups}")
    if mock and rng.random() < 0.5:
        out.append(f"model.vocab_size={_pick(rng, (300, 1000, 4000, 5000))}")
    if moe:
        out.append(f"model.moe_router_topk={_pick(rng, (1, 2, 3), (1, 4, 1))}")
    if rng.random() < 0.15:
        out.append("model.add_bias_linear=true")
    return out


def _schedule(rng: random.Random, world: int) -> list[str]:
    micro = _pick(rng, (1, 2))
    # Mostly a global batch the data-parallel size can divide (world / model-parallel ranks).
    batch = micro * world * _pick(rng, (1, 2)) if rng.random() < 0.7 else _pick(rng, (1, 2, 4, 6, 8))
    out = [f"schedule.seq_length={_pick(rng, (16, 32, 48, 63, 64, 127, 128))}",
           f"schedule.micro_batch_size={micro}",
           f"schedule.global_batch_size={batch}",
           f"runtime.dtype={_pick(rng, ('fp32', 'bf16'), (3, 1))}",
           f"runtime.recompute={_pick(rng, ('none', 'selective', 'full'))}"]
    out.append(f"schedule.eval_interval={1 if rng.random() < 0.2 else 0}")
    return out


def make_case(index: int, seed: int, datasets: dict[int, str]) -> Case:
    """Case `index` of the sequence `seed`; `datasets` maps a document count to a prefix."""
    rng = random.Random(f"{seed}:{index}")
    moe = rng.random() < 0.25
    mock = rng.random() < 0.6
    world, layout = _layout(rng, moe)
    data = ["data.demo=false"]
    if mock:
        data.append("data.mock=true")
    else:
        docs = _pick(rng, DATASET_DOCUMENTS)
        data += [f"data.blend=[[1.0, {datasets[docs]}]]", f"data.tokenizer={_demo_tokenizer()}",
                 f"data.split={_pick(rng, SPLITS)}"]
    fixed = ["runtime.spec=portable", "logging.tensorboard=false", "logging.straggler_interval=0",
             f"schedule.train_steps={TRAIN_STEPS}", "schedule.warmup_steps=1", "schedule.eval_steps=1"]
    overrides = layout + _model(rng, mock, moe) + _schedule(rng, world) + data + fixed
    return Case(index, "tiny-moe" if moe else "tiny-llama", world, overrides)


def _demo_tokenizer() -> str:
    from data_pipeline.datasets import DEMO_TOKENIZER

    return DEMO_TOKENIZER


def make_datasets(out_dir: Path, sizes: tuple[int, ...] = DATASET_DOCUMENTS) -> dict[int, str]:
    """One indexed dataset per document count in `sizes`, from the shipped demo corpus."""
    import gzip
    import json

    from data_pipeline.datasets import DEMO_CORPUS
    from data_pipeline.preprocess import preprocess

    with gzip.open(DEMO_CORPUS, "rt") as f:
        records = [json.loads(line) for _, line in zip(range(max(sizes)), f)]
    prefixes = {}
    for docs in sizes:
        source = out_dir / f"docs{docs}.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in records[:docs]))
        prefix = str(out_dir / f"docs{docs}")
        preprocess([str(source)], tokenizer=_demo_tokenizer(), output_prefix=prefix, append_eod=True, workers=0)
        prefixes[docs] = prefix
    return prefixes


def dry_run_verdict(case: Case, run_dir: Path) -> Optional[str]:
    """None if the dry run accepts the case, else its error message."""
    from pretrain.cli import resolve_config
    from pretrain.config import ConfigError, validate_for_world, validate_inputs

    try:
        config = resolve_config(case.recipe, None, case.overrides + [f"logging.run_dir={run_dir}"])
        validate_for_world(config, case.world_size)
        validate_inputs(config)
    except (ConfigError, ValueError) as exc:
        return str(exc)
    return None


def run_case(case: Case, run_dir: Path) -> Outcome:
    from tests.distributed import RankFailure, run_ranks
    from tests.pretrain.workers import logged_losses

    refusal = dry_run_verdict(case, run_dir)
    if refusal is not None:
        line = refusal.removeprefix("invalid config: ")
        if "\n" in refusal or len(line) > MAX_ERROR_CHARS:
            return Outcome(case, "hole", f"refusal is not one short line ({len(refusal)} chars): {refusal!r}")
        return Outcome(case, "refused", refusal)
    try:
        results = run_ranks(case.world_size, "tests.pretrain.workers:train", recipe=case.recipe,
                            overrides=case.overrides + [f"logging.run_dir={run_dir}"], timeout=600)
    except RankFailure as exc:
        return Outcome(case, "hole", f"accepted by the dry run, failed to train: {_last_error(str(exc))}")
    losses = logged_losses(results)
    if len(losses) != TRAIN_STEPS or not all(math.isfinite(x) for x in losses):
        return Outcome(case, "hole", f"accepted, trained, but losses {losses}")
    return Outcome(case, "trained", f"losses {losses}")


def _last_error(text: str) -> str:
    """The last line of a rank's traceback that names an error: what a user would read."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln or "assert" in ln.lower()]
    return (errors or lines or ["(no output)"])[-1][:500]


def summarize(outcomes: list[Outcome]) -> str:
    counts = {k: sum(o.verdict == k for o in outcomes) for k in ("trained", "refused", "hole")}
    accepted = counts["trained"] + sum(o.verdict == "hole" and o.detail.startswith("accepted") for o in outcomes)
    return (f"config fuzzer: {len(outcomes)} cases, {accepted} accepted, {counts['trained']} trained, "
            f"{counts['refused']} refused cleanly, {counts['hole']} failures")

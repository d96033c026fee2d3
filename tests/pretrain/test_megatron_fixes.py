"""pretrain.megatron_fixes: every fix pinned to the upstream source it was written for, and
nothing outside the package patching Megatron-Core."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.megatron_fixes import _guard, datasets, import_cost, modules

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pretrain", "models", "data_pipeline", "launch", "checkpoints_tools")


def _sample():
    return 1


def test_every_pin_matches_the_installed_megatron_core():
    result = subprocess.run([sys.executable, "-m", "pretrain.megatron_fixes", "--digests"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0 and "CHANGED" not in result.stdout, result.stdout + result.stderr
    pinned = sum(len(m.SOURCES) for m in modules())
    assert result.stdout.count("\nok ") == pinned >= 10


def test_a_changed_upstream_function_stops_start_up_naming_the_fix():
    target = f"{__name__}:_sample"
    right = _guard.source_digest(_sample)
    _guard.expect_source("demo", target, right)
    with pytest.raises(_guard.UpstreamChanged, match=r"megatron_fixes\.demo: .*_sample changed upstream"):
        _guard.expect_source("demo", target, "0" * 16)
    with pytest.raises(_guard.UpstreamChanged, match="no longer exists"):
        _guard.expect_source("demo", f"{__name__}:_gone", right)
    with pytest.raises(_guard.UpstreamChanged, match=r"now takes \('x',\)"):
        _guard.expect_signature("demo", "builtins:abs", ("a", "b"))


def _python_files():
    for package in PACKAGES:
        yield from (REPO / package).rglob("*.py")


def test_production_code_never_imports_unittest_mock():
    offenders = [str(p.relative_to(REPO)) for p in _python_files() if "unittest" in p.read_text()]
    assert not offenders


def test_megatron_core_is_patched_only_inside_megatron_fixes():
    """An assignment to an attribute of something imported from megatron (or of torch.cuda /
    torch.distributed, which the stand-ins replace) outside the package is a stray patch."""
    assignment = re.compile(r"^\s*(?:torch\.cuda|torch\.distributed|dist|[A-Za-z_]*(?:megatron|mcore|MCore|"
                            r"Optimizer|Planner|moe_utils|p2p_communication|filesystem_async))"
                            r"[A-Za-z_]*(?:\.[A-Za-z_]+)+\s*=[^=]", re.M)
    found = []
    for path in _python_files():
        if "megatron_fixes" in path.parts:
            continue
        found += [f"{path.relative_to(REPO)}: {m.group(0).strip()}" for m in assignment.finditer(path.read_text())]
    assert not found


def test_compile_on_first_call_defers_torch_compile_with_its_options():
    calls = []

    def real_compile(model, **options):
        calls.append(options)
        return lambda *args: ("compiled", model(*args))

    deferred = import_cost.compile_on_first_call(real_compile)
    plus_one = deferred(lambda x: x + 1)
    assert calls == []  # decorating compiles nothing
    assert plus_one(1) == ("compiled", 2) and plus_one(2) == ("compiled", 3) and calls == [{}]
    tuned = deferred(mode="max-autotune")(lambda x: x)
    assert tuned(5) == ("compiled", 5) and calls == [{}, {"mode": "max-autotune"}]


def test_on_cpu_a_deferred_function_runs_eagerly(monkeypatch):
    """megatron_fixes.cpu: Megatron's @jit_fuser functions are not compiled on CPU."""
    calls = []
    monkeypatch.setattr(import_cost, "_EAGER", True)
    plus_one = import_cost.compile_on_first_call(lambda model, **options: calls.append(options))(lambda x: x + 1)
    assert plus_one(1) == 2 and plus_one(2) == 3 and calls == []


def test_importing_megatron_core_after_pretrain_builds_no_compile_wrapper():
    """The inductor backend is not imported, torch.compile is torch's own again afterwards,
    megatron.core's `jit_fuser` defers, and megatron.core's loader is its own (inspect works)."""
    code = ("import sys, inspect, torch, pretrain, megatron.core\n"
            "from megatron.core.jit import jit_fuser\n"
            "assert 'torch._inductor.compile_fx' not in sys.modules, 'inductor imported'\n"
            "assert torch.compile.__module__ == 'torch' and torch.compile.__name__ == 'compile'\n"
            "assert getattr(jit_fuser(lambda x: x), 'deferred_compile', False)\n"
            "assert type(megatron.core.__loader__).__name__ == 'SourceFileLoader'\n"
            "assert 'jit' in inspect.getsource(megatron.core.jit)\n")
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_gpt_dataset_loss_mask_does_not_depend_on_the_sample_served_first(tmp_path):
    """megatron_fixes.datasets: Megatron-Core 0.16.1's GPTDataset kept the pad positions of the
    first sample it served in the cached loss mask of every later one. Mock documents count
    through every id, the byte tokenizer's pad (258) included, so some samples have pad labels."""
    import torch

    from data_pipeline.datasets import build_gpt_datasets
    from data_pipeline.tokenizers import load_tokenizer

    datasets.apply()  # idempotent; what pretrain.runtime applies at start-up

    def fresh():
        return build_gpt_datasets(blend=None, split="1,0,0", seq_length=64, seed=1234, num_samples=(16, 0, 0),
                                  tokenizer=load_tokenizer("byte"), cache_dir=str(tmp_path), mock=True)[0]

    masks = [fresh()[i]["loss_mask"] for i in range(16)]  # each served first by its own dataset
    # With the document switches off, a sample's loss mask is 0 exactly at its pad labels.
    padded = [i for i, m in enumerate(masks) if not m.all()]
    clean = [i for i, m in enumerate(masks) if m.all()]
    assert padded and clean, f"samples with pad labels {padded}, without {clean}: the test needs both"
    dataset = fresh()
    dataset[padded[0]]
    for i in clean + padded[1:]:
        assert torch.equal(dataset[i]["loss_mask"], masks[i]), f"sample {i} after sample {padded[0]}"


def test_quiet_drops_exactly_the_pinned_messages_and_guards_their_text(caplog):
    """megatron_fixes.quiet: each pinned message is dropped from its logger, every other record of
    that logger passes, and a message that upstream no longer logs stops start-up."""
    import logging

    from pretrain.megatron_fixes import quiet

    quiet.apply()
    for name, prefixes in {**quiet.MEGATRON_MESSAGES, **quiet.TORCH_MESSAGES}.items():
        logger = logging.getLogger(name)
        with caplog.at_level(logging.WARNING, logger=name):
            caplog.clear()
            for prefix in prefixes:
                logger.warning(prefix + " and the rest of the line")
            logger.warning("another message from %s", name)
        assert [r.getMessage() for r in caplog.records] == [f"another message from {name}"]
    with pytest.raises(_guard.UpstreamChanged, match=r"megatron_fixes\.quiet: .*no longer logs 'GPTModel IS GONE'"):
        quiet.check_messages({"megatron.core.models.gpt.gpt_model": ("GPTModel IS GONE",)})


# What a single-rank run of ours prints (stdout and stderr together): its own lines only.
OWN_LINES = (
    r"\[tiny-llama\] ",  # the banner and the closing line
    r"step \d+/\d+ \| loss ",  # the step lines
    r"saved checkpoint ",
    r"resumed from ",
    r"\[placement\] ",  # launch.local's rank -> host -> coordinates lines
    r"encoder: ",  # preparing the demo data: which tokenizer encodes it (data_pipeline.preprocess)
)


def _own_lines_only(module: str, args: list[str], tmp_path) -> dict[int, list[str]]:
    """Run `python -m module` for 2 steps and then resumed to 4 (a fresh process each, as a
    user runs it, default warning filters); fail on any output line that is not one of ours
    (OWN_LINES). Returns each run's non-blank lines by its step count."""
    from tests.bad_input import run_cli

    runs = {}
    for steps in (2, 4):
        result = run_cli(module, [*args, f"schedule.train_steps={steps}", f"logging.run_dir={tmp_path / 'run'}",
                                  f"checkpoint.dir={tmp_path / 'ckpt'}"],
                         subprocess=True, env={"COLUMNS": "1000"})  # COLUMNS: rich does not wrap the encoder line
        assert result.code == 0, result.output
        runs[steps] = [line for line in result.output.splitlines() if line.strip()]
        unexpected = [line for line in runs[steps] if not any(re.match(own, line) for own in OWN_LINES)]
        assert not unexpected, "\n".join(unexpected)
    return runs


def test_a_single_rank_run_prints_no_library_warning(tmp_path):
    """Issue 48: `python -m pretrain` as a user runs it (tensorboard on, a save at the end)
    printed Megatron's cuda_graph deprecation, the MIMO config's experimental note, a non-leaf
    `.grad` warning raised through our CPU fix, and torch's reduce_scatter_tensor /
    all_gather_into_tensor deprecations; its resume printed torch's checkpoint-loader warnings
    about Megatron's calls (no_dist, the reader's argument order, ShardedTensor's deprecation).
    A new library warning shows up here first."""
    runs = _own_lines_only("pretrain", ["--recipe", "tiny-llama"], tmp_path)
    for steps, lines in runs.items():
        assert any(line.startswith(f"step {steps}/{steps}") for line in lines), lines
        assert (steps == 4) == any(line.startswith("resumed from ") for line in lines), lines


def test_a_two_rank_run_prints_no_library_warning(tmp_path):
    """Issue 48, at DP2 through launch.local: every save logged Megatron's "Rank 1 common state
    dict differs from rank 0 common state dict ... Keys only on 1: [('optimizer', 'param_state')]"
    (the distributed optimizer's save state, None on DP rank 1: megatron_fixes.optimizer_save)."""
    runs = _own_lines_only("launch.local", ["--recipe", "tiny-llama", "--nproc", "2", "checkpoint.save_interval=2"],
                           tmp_path)
    for steps, lines in runs.items():
        assert any(line.startswith(f"saved checkpoint {tmp_path / 'ckpt'}/step_0000000{steps}") for line in lines), \
            lines

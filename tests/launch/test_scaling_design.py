"""launch.scaling design: the IsoFLOP spec it writes loads with launch.sweep's own loader, every
point spends its budget to within half a training step (models/flops.py's formula, computed
here independently of the spec's rounding), WSD budgets of a size become cooldown branches,
and bad input is one line, exit 2, with nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launch.scaling.cli import main as scaling_main
from launch.sweeps.spec import SweepSpecError, expand_with_branches, load_spec
from models.config import get_flavor
from models.flops import non_embedding_params, total_params, training_flops_per_step
from tests.bad_input import expect_refusal

CPU = ["--set", "runtime.spec=portable", "--set", "schedule.seq_length=64", "--set", "schedule.micro_batch_size=8",
       "--set", "schedule.global_batch_size=8", "--set", "schedule.warmup_steps=2"]
BUDGETS = [2e12, 4e12, 8e12]


def _design(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "isoflop.yaml"
    argv = ["design", "--recipe", "tiny-llama", "--budgets", *map(str, BUDGETS), "--sizes", "3",
            "--out", str(out), "--out-dir", str(tmp_path / "sweep"), *CPU, *extra]
    assert scaling_main(argv) == 0
    return out


def test_design_spec_loads_and_spends_each_budget(tmp_path, capsys):
    spec = load_spec(str(_design(tmp_path)))
    points, groups = expand_with_branches(spec, spec_dir=tmp_path)
    assert len(points) == 3 * len(BUDGETS)  # 3 sizes at each budget, the rest excluded
    for budget in BUDGETS:
        mine = [p for p in points if p.budget_flops == budget]
        assert len(mine) == 3 and len({total_params(p.config.model) for p in mine}) == 3
        for p in mine:
            sched = p.config.schedule
            per_step = training_flops_per_step(p.config.model, 64, 8)
            assert abs(sched.train_steps * per_step - budget) <= per_step / 2, p.name
            assert sched.decay_style == "wsd" and sched.final_eval_steps == 16 and sched.eval_interval == 0
    # A size trained at several budgets: one stable run to its largest, branches for the rest.
    assert groups and all(b.branch_of == g.stable.name for g in groups for b in g.branches)
    for g in groups:
        assert g.stable.budget_flops > max(b.budget_flops for b in g.branches)
    # The family's shape rules: tiny-llama's head size 16, 4 heads per query group, FFN 2.75 x hidden.
    base = get_flavor("tiny-llama")
    for p in points:
        m = p.config.model
        assert m.hidden_size // m.num_attention_heads == 16 and m.num_attention_heads == 4 * m.num_query_groups
        assert m.ffn_hidden_size == round(m.hidden_size * base.ffn_hidden_size / base.hidden_size / 16) * 16
    out = capsys.readouterr().out
    assert "compute:" in out and "with cooldown branches" in out


def test_default_ladder_is_spread_in_non_embedding_n(tmp_path):
    """The study's default ladder (budgets 5e11..2e12, 4 sizes, depth and width both varied):
    neighbours differ ~2x in non-embedding N (Kaplan's, what the study fits), while in total
    N (Chinchilla's) the V x h embeddings of these widths make some differ by < 10%."""
    out = tmp_path / "s.yaml"
    assert scaling_main(["design", "--recipe", "tiny-llama", "--budgets", "5e11", "1e12", "2e12", "--sizes", "4",
                         "--out", str(out), *CPU]) == 0
    points, _ = expand_with_branches(load_spec(str(out)), spec_dir=tmp_path)
    for budget in {p.budget_flops for p in points}:
        models = sorted((p.config.model for p in points if p.budget_flops == budget), key=non_embedding_params)
        n = [non_embedding_params(m) for m in models]
        total = [total_params(m) for m in models]
        assert len(n) == 4 and min(b / a for a, b in zip(n, n[1:])) > 1.99, n  # 44k 88k 177k 353k
        assert min(b / a for a, b in zip(total, total[1:])) < 1.1, total


def test_dry_run_prints_the_table_and_writes_nothing(tmp_path, capsys):
    argv = ["design", "--recipe", "tiny-llama", "--budgets", "2e12", "8e12", "--sizes", "2",
            "--out", str(tmp_path / "s.yaml"), "--dry-run", *CPU]
    assert scaling_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["budget", "size", "params", "non-emb", "tokens", "steps", "compute", "vs", "budget", "run"]
    assert len([line for line in lines if line.strip().startswith(("2e+12", "8e+12"))]) == 4
    assert not (tmp_path / "s.yaml").exists()


def test_exclude_entries_are_checked(tmp_path):
    spec = yaml.safe_load(_design(tmp_path).read_text())
    for entry, message in (({"modle": "x"}, "no grid axis 'modle'; did you mean 'model'?"),
                           ({"model": "L99-h64"}, "exclude[0].model: no choice labelled 'L99-h64'")):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({**spec, "exclude": [entry]}))
        with pytest.raises(SweepSpecError, match=message.replace("?", r"\?").replace("[", r"\[")):
            expand_with_branches(load_spec(str(path)), spec_dir=tmp_path)


@pytest.mark.parametrize("argv, names", [
    (["--recipe", "tiny-lama", "--budgets", "1e12"], ["tiny-lama", "tiny-llama"]),
    (["--recipe", "tiny-llama", "--budgets", "1e6"], ["1e+06", "too small", "--min-steps"]),
    (["--recipe", "tiny-llama", "--budgets", "0"], ["--budgets"]),
    (["--recipe", "tiny-llama", "--budgets", "1e13", "--sizes", "1"], ["--sizes 1"]),
    (["--recipe", "tiny-llama", "--budgets", "1e13", "--set", "schedule.seq_lenght=64"], ["seq_lenght"]),
])
def test_bad_input_is_one_line_exit_2(tmp_path, argv, names):
    expect_refusal("launch.scaling", ["design", *argv, "--out", str(tmp_path / "s.yaml")], names=names,
                   cwd=tmp_path, subprocess=True)


def test_heldout_needs_a_sweep_folder(tmp_path):
    expect_refusal("launch.scaling", ["heldout", str(tmp_path / "nowhere")], names=["results.csv"],
                   cwd=tmp_path, subprocess=True)

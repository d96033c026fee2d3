"""launch.sweep: spec errors name the key, the grid expands and validates, results and the
power-law fit are computed from metrics.jsonl, Slurm job arrays group points by allocation,
and (slow) a real CPU sweep of 3 sizes x 2 layouts runs, plots, and skips finished points."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from launch.sweeps import run as sweep
from launch.sweeps.results import fit_power_law, read_metrics
from launch.sweeps.spec import expand_points, load_spec
from tests.launch.slurm_helpers import slurm_env  # noqa: F401 - the Slurm test-cluster fixture

EXAMPLE = Path(__file__).resolve().parents[2] / "launch" / "examples" / "tiny_sweep.yaml"


def write_spec(tmp_path: Path, **changes) -> Path:
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["out_dir"] = str(tmp_path / "out")
    for key, value in changes.items():
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.mark.parametrize("changes, message", [
    (dict(nmae="x"), "unknown key 'nmae'; did you mean 'name'?"),
    (dict(recipe=None), "missing required key 'recipe'"),
    (dict(recipe="tiny-lama"), "recipe: unknown recipe 'tiny-lama'. Did you mean 'tiny-llama'?"),
    (dict(grid={"lr": {"optimizer.lr": [1e-3], "optimizer.min_lr": [0.0]}}), "grid.lr: the shorthand form takes exactly one key"),
    (dict(grid={"layout": [{"gpu": 2}]}), "grid.layout[0]: unknown key 'gpu'"),
    (dict(grid={"layout": [{"gpus": 0}]}), "grid.layout[0].gpus: must be a positive integer"),
    (dict(grid={"model": [{"model.hiden_size": 64}]}), "unknown config key 'model.hiden_size'"),
    (dict(grid={"layout": [{"gpus": 2, "parallel.tensor_parallel": 3}]}), "grid point gpus2-tensor_parallel3 (layout=gpus2-tensor_parallel3) on 2 GPU(s): world size 2 is not divisible by TP(3)"),
    (dict(grid={"a": [{"label": "x"}], "b": [{"label": "x"}, {"label": "x"}]}), "both named 'x_x'"),
    (dict(slurm={"partition": "debug", "time": "10", "gpus_pernode": 8}), "unknown key 'slurm.gpus_pernode'; did you mean 'gpus_per_node'?"),
    (dict(launcher="slurm"), "launcher: slurm needs a `slurm:` section"),
    (dict(grid={"b": [{"flops": -1.0}]}), "grid.b[0].flops: must be a positive number of flops"),
    (dict(grid={"b": [{"flops": 1e10, "tokens": 512}]}), "grid.b[0]: give tokens or flops, not both"),
    (dict(grid={"b": [{"label": "x"}]}, exclude=[{"b": "y"}]), "exclude[0].b: no choice labelled 'y' (labels: x)"),
])
def test_malformed_specs_name_the_key(tmp_path, capsys, changes, message):
    assert sweep.main([str(write_spec(tmp_path, **changes))]) == 2
    assert message in capsys.readouterr().err


def test_grid_expansion_shorthand_and_token_budget(tmp_path):
    spec = load_spec(str(write_spec(tmp_path, grid={
        "lr": {"optimizer.lr": [0.001, 0.003]},
        "budget": [{"label": "small", "tokens": 10000}, {"label": "big", "tokens": 20000}],
    })))
    points = expand_points(spec)
    assert [p.name for p in points] == ["lr0.001_small", "lr0.001_big", "lr0.003_small", "lr0.003_big"]
    # 64 tokens x 8 sequences = 512 tokens per step: ceil(10000 / 512) = 20 steps.
    assert [p.config.schedule.train_steps for p in points] == [20, 40, 20, 40]
    assert points[2].config.optimizer.lr == 0.003
    assert points[0].run_dir == tmp_path / "out" / "points" / "lr0.001_small"
    assert str(points[0].config.logging.run_dir) == str(points[0].run_dir)


def test_power_law_fit_recovers_parameters():
    compute = [1e12, 1e13, 1e14, 1e15]
    fit = fit_power_law(compute, [5.0 * c ** -0.1 for c in compute])
    assert fit["a"] == pytest.approx(5.0) and fit["b"] == pytest.approx(0.1) and fit["r2"] == pytest.approx(1.0)
    assert fit_power_law([1e12, 1e12], [3.0, 2.9]) is None  # one compute value: nothing to fit


def test_metrics_reader_keeps_last_record_per_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n{"step": 2, "eval_loss": 9}\n'
                    '{"step": 1, "loss": 2.5}\n{"step": 3, "lo')  # a resumed run and a cut line
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 2.5), (2, 2.0)]


def test_changed_point_gets_fresh_directory(tmp_path):
    spec = load_spec(str(write_spec(tmp_path)))
    point = expand_points(spec)[0]
    assert sweep.prepare_dir(point) == "todo"
    (point.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 8, "loss": 1.0}) + "\n")
    assert sweep.prepare_dir(point) == "finished"
    changed = load_spec(str(write_spec(tmp_path, overrides={"data.demo": False, "data.mock": True,
                                                            "schedule.train_steps": 9})))
    again = expand_points(changed)[0]
    assert sweep.prepare_dir(again) == "todo"
    assert (point.run_dir.parent / f"{point.name}.replaced-1" / "metrics.jsonl").is_file()


def test_slurm_points_become_job_arrays_per_allocation(tmp_path):
    """launch.slurm writes each point's job.sh (not submitted); points with the same
    allocation share one array whose tasks run those scripts."""
    spec_path = write_spec(tmp_path, launcher="slurm", slurm={"partition": "debug", "time": "10", "cpu": True},
                           grid={"layout": [{"label": "one", "gpus": 1}, {"label": "two", "gpus": 2,
                                                                         "parallel.tensor_parallel": 2}],
                                 "lr": {"optimizer.lr": [0.001, 0.002]}})
    spec = load_spec(str(spec_path))
    points = expand_points(spec)
    assert sweep.run_sweep(spec, points, spec_dir=tmp_path, submit=False) == []
    arrays = sorted((tmp_path / "out").glob("array-*.sh"))
    assert len(arrays) == 2  # 1 rank and 2 ranks per job
    texts = [a.read_text() for a in arrays]
    assert all("#SBATCH --array=0-1" in t for t in texts)
    assert any("--ntasks-per-node=2" in t for t in texts) and any("--ntasks-per-node=1" in t for t in texts)
    for point in points:
        job = (point.run_dir / "job.sh").read_text()
        assert str(point.run_dir / "config.yaml") in job
        assert any(str(point.run_dir / "job.sh") in t for t in texts)


def test_slurm_branches_wait_for_their_stable_runs(tmp_path, monkeypatch):
    """The cooldown branches' job array is submitted after the stable runs', with
    --dependency=afterok on their job: the branch points need its checkpoints."""
    spec_path = write_spec(tmp_path, launcher="slurm", slurm={"partition": "debug", "time": "10", "cpu": True},
                           overrides=WSD, grid={"budget": WSD_GRID["budget"]})
    spec = load_spec(str(spec_path))
    points = expand_points(spec)
    assert sweep.run_sweep(spec, points, spec_dir=tmp_path, submit=False) == []
    by_name = {p.name: p for p in points}
    scripts = {p.name: p.run_dir / "job.sh" for p in points}
    arrays = sweep.write_arrays(spec, scripts, tmp_path / "out", frozenset(n for n, p in by_name.items() if p.branch_of))
    assert [names for _, names in arrays] == [["b80"], ["b20", "b40"]]
    calls = []

    def sbatch(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=f"{100 + len(calls)}\n", stderr="")

    monkeypatch.setattr(sweep.subprocess, "run", sbatch)
    sweep.submit_arrays(arrays, by_name)
    assert calls == [["sbatch", "--parsable", str(arrays[0][0])],
                     ["sbatch", "--parsable", "--dependency=afterok:101", str(arrays[1][0])]]
    saved = yaml.safe_load((by_name["b20"].run_dir / "config.yaml").read_text())["checkpoint"]
    assert saved["branch_from"] == str(by_name["b80"].run_dir / "ckpt" / "step_00000015")
    assert yaml.safe_load((by_name["b80"].run_dir / "config.yaml").read_text())["checkpoint"]["save_steps"] == [15, 30]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
@pytest.mark.distributed
def test_cpu_sweep_three_sizes_two_layouts(tmp_path, capsys):
    spec = write_spec(tmp_path, overrides={**yaml.safe_load(EXAMPLE.read_text())["overrides"],
                                           "schedule.train_steps": 5})
    assert sweep.main([str(spec)]) == 0, capsys.readouterr().err
    out = tmp_path / "out"
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) == 1 + 6 and all(",finished," in row for row in rows[1:])
    assert "| h128x4_tp2 | h128x4 | tp2 | 2 |" in (out / "results.md").read_text()
    for name in ("loss_vs_tokens", "throughput_vs_gpus", "loss_vs_compute"):
        path = out / "plots" / f"{name}.png"
        width, height = _png_size(path)
        assert width > 100 and height > 100 and path.stat().st_size > 5000
    fit = json.loads((out / "fit.json").read_text())
    assert math.isfinite(fit["a"]) and math.isfinite(fit["b"]) and fit["points"] == 6
    # Layout parity: the same model at TP2 trains like at TP1 (same start, same data).
    lines = {r.split(",")[0]: r.split(",") for r in rows[1:]}
    header = rows[0].split(",")
    loss = header.index("final_loss")
    for size in ("h64", "h128", "h128x4"):
        assert float(lines[f"{size}_dp1"][loss]) == pytest.approx(float(lines[f"{size}_tp2"][loss]), rel=1e-3)
    stamps = {p: p.stat().st_mtime_ns for p in (out / "points").glob("*/metrics.jsonl")}
    capsys.readouterr()
    assert sweep.main([str(spec)]) == 0
    assert "6 finished (skipped)" in capsys.readouterr().out
    assert stamps == {p: p.stat().st_mtime_ns for p in (out / "points").glob("*/metrics.jsonl")}


@pytest.mark.slow
@pytest.mark.distributed
def test_slurm_job_array_runs_to_completion(slurm_env, tmp_path, monkeypatch, capsys):
    """Two points submitted as one real job array on the test cluster; collected after."""
    for key, value in slurm_env.items():  # SLURM_CONF for sbatch/squeue run by the sweep and here
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    base = {**yaml.safe_load(EXAMPLE.read_text())["overrides"], "schedule.train_steps": 3}
    spec = write_spec(tmp_path, launcher="slurm", overrides=base,
                      slurm={"partition": "debug", "time": "10", "cpu": True},
                      grid={"model": [{"label": "h64", "model.num_layers": 2, "model.hidden_size": 64,
                                       "model.ffn_hidden_size": 176, "model.num_attention_heads": 4},
                                      {"label": "h128", "model.num_layers": 2}]})
    assert sweep.main([str(spec)]) == 0, capsys.readouterr().err
    job = json.loads((tmp_path / "out" / "points" / "h64" / "slurm_task.json").read_text())["job"]
    deadline = time.monotonic() + 240
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"job array {job} not done after 240 s")
        time.sleep(1.0)
    capsys.readouterr()
    assert sweep.main([str(spec), "--collect-only"]) == 0
    assert "2/2 points finished" in capsys.readouterr().out, sorted((tmp_path / "out" / "logs").iterdir())
    assert sweep.main([str(spec)]) == 0
    assert "2 finished (skipped)" in capsys.readouterr().out


WSD_GRID = {
    "model": [{"label": "h64", "model.hidden_size": 64, "model.ffn_hidden_size": 176, "model.num_attention_heads": 4},
              {"label": "h128"}],
    # 512 tokens a step: 20, 40 and 80 steps; cooldowns of a quarter: 5, 10 and 20 steps.
    "budget": [{"label": "b20", "tokens": 10240}, {"label": "b40", "tokens": 20480},
               {"label": "b80", "tokens": 40960}],
}
WSD = {"data.demo": False, "data.mock": True, "runtime.spec": "portable", "schedule.seq_length": 64,
       "schedule.micro_batch_size": 4, "schedule.global_batch_size": 8, "schedule.eval_interval": 0,
       "logging.tensorboard": False, "schedule.warmup_steps": 2, "schedule.decay_style": "wsd",
       "schedule.wsd_decay_fraction": 0.25}


def test_wsd_budgets_become_a_stable_run_and_cooldown_branches(tmp_path, capsys):
    from models.flops import training_flops_per_step

    grid = {**WSD_GRID, "budget": WSD_GRID["budget"] + [{"label": "b20-lr", "tokens": 10240, "optimizer.lr": 1e-3}]}
    path = write_spec(tmp_path, overrides=WSD, grid=grid)
    points = expand_points(load_spec(str(path)))
    by_name = {p.name: p for p in points}
    assert [p.name for p in points][-4:] == ["h64_b20", "h64_b40", "h128_b20", "h128_b40"]  # branches last
    for size in ("h64", "h128"):
        stable = by_name[f"{size}_b80"]
        assert stable.branch_of is None and stable.config.checkpoint.save_steps == [15, 30]
        assert stable.config.checkpoint.dir == str(stable.run_dir / "ckpt")
        for budget, step in (("b20", 15), ("b40", 30)):
            branch = by_name[f"{size}_{budget}"]
            assert branch.branch_of == stable.name
            assert branch.config.checkpoint.branch_from == str(stable.run_dir / "ckpt" / f"step_{step:08d}")
            assert branch.config.checkpoint.dir == str(branch.run_dir / "ckpt")
        assert by_name[f"{size}_b20-lr"].branch_of is None  # another LR: its own run
    assert sweep.main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "h64_b20-lr runs on its own: the branch must continue the run that saved it with the same settings, " \
           "but optimizer.lr 0.003 there vs 0.001 here" in out
    # Independently: each size spends 80 + 5 + 10 steps and its own-LR run's 20, against 80 + 40 + 20 + 20.
    flops = [training_flops_per_step(by_name[f"{s}_b80"].config.model, 64, 8) for s in ("h64", "h128")]
    spent, separate = sum(f * (95 + 20) for f in flops), sum(f * 160 for f in flops)
    assert (f"[sweep] compute: {spent:.3g} FLOPs with cooldown branches vs {separate:.3g} as separate runs "
            f"({1 - spent / separate:.0%} less)") in out, out
    assert f"h64_b80: stable run of 80 steps, h64_b20 branches at step 15 (5 steps), h64_b40 branches at step 30 " \
           f"(10 steps): {flops[0] * 95:.3g} FLOPs vs {flops[0] * 140:.3g} as separate runs" in out, out


def test_cooldown_branches_off_or_not_wsd_are_separate_runs(tmp_path):
    points = expand_points(load_spec(str(write_spec(tmp_path, overrides={**WSD, "schedule.decay_style": "cosine",
                                                                          "schedule.wsd_decay_fraction": None},
                                                    grid=WSD_GRID))))
    assert not any(p.branch_of or p.config.checkpoint.branch_from for p in points)
    spec = write_spec(tmp_path, overrides=WSD, grid=WSD_GRID, cooldown_branches=False)
    assert not any(p.branch_of for p in expand_points(load_spec(str(spec))))


@pytest.mark.slow
@pytest.mark.distributed
def test_cpu_sweep_branch_is_the_separate_run(tmp_path, capsys):
    """A 5-step and an 8-step WSD budget (cooldowns of 2 steps): the 8-step run saves step 3, the
    5-step point branches from it, and its steps 4-5 are bit for bit those of the 5-step run
    trained separately (one rank, tests.distributed)."""
    from tests.distributed import run_ranks

    overrides = {**WSD, "schedule.wsd_decay_fraction": None, "schedule.wsd_decay_steps": 2, "logging.log_interval": 1}
    grid = {"budget": [{"label": "b5", "tokens": 2560}, {"label": "b8", "tokens": 4096}]}
    spec = write_spec(tmp_path, overrides=overrides, grid=grid)
    assert sweep.main([str(spec)]) == 0, capsys.readouterr().err
    out = tmp_path / "out"
    assert "b5 on 1 rank(s), cooldown branch of b8" in capsys.readouterr().out
    assert (out / "points" / "b8" / "ckpt" / "step_00000003" / "COMPLETE").is_file()
    branch = read_metrics(out / "points" / "b5" / "metrics.jsonl")
    assert [r["step"] for r in branch] == [4, 5]
    point = next(p for p in expand_points(load_spec(str(spec))) if p.name == "b5")
    alone = [o for o in point.overrides if not o.startswith(("checkpoint.", "logging.run_dir="))]
    run_ranks(1, "tests.pretrain.workers:train", recipe="tiny-llama",
              overrides=alone + [f"logging.run_dir={tmp_path / 'alone'}"])
    separate = read_metrics(tmp_path / "alone" / "metrics.jsonl")
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in branch] == [r[key] for r in separate[3:]], key
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",finished," in row for row in rows[1:]), rows

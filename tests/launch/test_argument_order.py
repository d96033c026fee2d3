"""Every CLI that takes `key=value` overrides reads them wherever they stand among the
options, as users type them: `python -m pretrain --recipe tiny-llama model.num_layers=2
--dry-run schedule.train_steps=5` is the same command as with the overrides at the end.
(Plain `parse_args` stops collecting a `nargs="*"` positional at the first option.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launch.launchers.local import main as local_main
from launch.launchers.slurm import main as slurm_main
from launch.planner.cli import main as plan_main
from launch.sweeps.run import main as sweep_main
from pretrain.cli import main as pretrain_main
from tests.distributed import REPO

MOCK = ("data.demo=false", "data.mock=true")


def _local_output(text: str) -> str:
    return re.sub(r"--master-port \d+", "--master-port PORT", text)  # a free port, new each run


def _slurm_output(text: str) -> str:
    # The header repeats the command line as typed; everything after it must not depend on the order.
    return "\n".join(line for line in text.splitlines() if not line.startswith("#   "))


# name -> (main, option groups, overrides the output shows, normalise the output)
CLIS = {
    "pretrain": (pretrain_main, [("--recipe", "tiny-llama"), ("--dry-run",), ("--world-size", "1")],
                 ["model.num_layers=2", "schedule.train_steps=5"], str),
    "launch.local": (local_main, [("--recipe", "tiny-llama"), ("--nproc", "2"), ("--dry-run",)],
                     [*MOCK, "model.num_layers=2"], _local_output),
    "launch.slurm": (slurm_main, [("--recipe", "tiny-llama"), ("--partition", "debug"), ("--cpu",),
                                  ("--ntasks-per-node", "2"), ("--time", "10"), ("--run-dir", "/nonexistent/r"),
                                  ("--dry-run",)],
                     ["name=ordered", "parallel.tensor_parallel=2"], _slurm_output),
    "launch.plan": (plan_main, [("--recipe", "tiny-llama"), ("--gpus", "2"), ("--gpu", "cpu"), ("--json",),
                                ("--top", "1"), ("--show-dropped", "0")],
                    ["model.num_layers=2", "schedule.seq_length=64"], str),
}


def _orders(options: list[tuple[str, ...]], overrides: list[str]) -> dict[str, list[str]]:
    flat = [token for group in options for token in group]
    first, rest = list(options[0]), [token for group in options[1:] for token in group]
    return {
        "before": [*overrides, *flat],
        "between": [*first, overrides[0], *rest[:len(options[1])], overrides[1], *rest[len(options[1]):],
                    *overrides[2:]],
        "between-and-after": [*first, overrides[0], *rest, *overrides[1:]],
    }


def _run(main, argv: list[str], capsys) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"{argv}: exit {code}\n{err}"
    return out


@pytest.mark.parametrize("cli", list(CLIS))
def test_overrides_anywhere_among_the_options(cli, capsys):
    main, options, overrides, normalise = CLIS[cli]
    flat = [token for group in options for token in group]
    canonical = normalise(_run(main, [*flat, *overrides], capsys))
    # The overrides show in the output, so an order that dropped one could not compare equal.
    assert canonical != normalise(_run(main, flat + [o for o in overrides if o in MOCK], capsys))
    for order, argv in _orders(options, overrides).items():
        assert normalise(_run(main, argv, capsys)) == canonical, f"{cli} ({order}): {argv}"


def test_sweep_spec_before_or_after_its_options(capsys):
    """launch.sweep takes no overrides (the spec holds them); its one positional goes anywhere too."""
    spec = str(REPO / "launch" / "examples" / "tiny_sweep.yaml")
    after = _run(sweep_main, ["--dry-run", spec], capsys)
    assert "tiny-sweep" in after
    assert _run(sweep_main, [spec, "--dry-run"], capsys) == after


def test_every_cli_with_overrides_parses_them_intermixed():
    """The benchmarks and tools not run above: each parser that declares the overrides
    positional is read with parse_intermixed_args."""
    declared = re.compile(r"""add_argument\(\s*["']overrides["']""")
    found = []
    paths = [p for package in ("pretrain", "launch", "checkpoints_tools", "data_pipeline", "models")
             for p in sorted((Path(REPO) / package).rglob("*.py"))]
    for path in paths:
        text = path.read_text()
        if declared.search(text):
            found.append(path.relative_to(REPO))
            assert "parse_intermixed_args(" in text and ".parse_args(" not in text, \
                f"{path.relative_to(REPO)}: parse with parse_intermixed_args so overrides may follow options"
    assert len(found) >= 11, found  # pretrain, local, slurm, plan and the benchmarks: the scan saw them

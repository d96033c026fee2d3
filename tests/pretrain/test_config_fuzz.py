"""The config fuzzer (tests/pretrain/config_fuzz.py): what the dry run accepts trains, what it
refuses it refuses in one line. Quick mode: QUICK_CASES seeded cases; `--fuzz-cases N`: N."""

from __future__ import annotations

import pytest

from tests.pretrain.config_fuzz import make_case, make_datasets, run_case, summarize

pytestmark = [pytest.mark.distributed]

QUICK_CASES = 6


@pytest.fixture(scope="module")
def datasets(module_tmp_factory):
    return make_datasets(module_tmp_factory.mktemp("fuzz-data"))


def test_dry_run_verdicts_hold(request, datasets, tmp_path):
    count = request.config.getoption("--fuzz-cases") or QUICK_CASES
    seed = request.config.getoption("--fuzz-seed")
    outcomes = []
    for index in range(count):
        case = make_case(index, seed, datasets)
        outcome = run_case(case, tmp_path / f"case{index}")
        print(f"{outcome.verdict:8s} {case.describe()}\n         {outcome.detail[:300]}", flush=True)
        outcomes.append(outcome)
    print(summarize(outcomes))
    holes = [o for o in outcomes if o.verdict == "hole"]
    assert not holes, "\n".join(f"{o.case.describe()}\n  -> {o.detail}" for o in holes)

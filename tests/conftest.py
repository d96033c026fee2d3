"""Options of the whole suite (pytest reads them from this root conftest only)."""


def pytest_addoption(parser):
    group = parser.getgroup("config fuzzer (tests/pretrain/test_config_fuzz.py)")
    group.addoption("--fuzz-cases", type=int, default=0,
                    help="long mode: this many random configs (default: the quick seeded subset)")
    group.addoption("--fuzz-seed", type=int, default=2026, help="the fuzzer's seed")

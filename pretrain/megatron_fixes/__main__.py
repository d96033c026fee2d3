"""`python -m pretrain.megatron_fixes --digests`: every upstream object a fix is pinned to,
with the digest the fix expects and the installed one (to re-pin a fix after reading the
new upstream source)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.megatron_fixes", description=__doc__)
    parser.add_argument("--digests", action="store_true", help="print expected and installed digests")
    args = parser.parse_args(argv)
    if not args.digests:
        parser.print_help()
        return 0
    from pretrain.megatron_fixes import modules
    from pretrain.megatron_fixes._guard import megatron_core_version, resolve, source_digest

    print(f"megatron-core {megatron_core_version()}")
    changed = 0
    for module in modules():
        for target, expected in module.SOURCES.items():
            try:
                installed = source_digest(resolve(target))
            except (AttributeError, ImportError):
                installed = "missing"
            changed += installed != expected
            mark = "ok     " if installed == expected else "CHANGED"
            print(f"{mark} {module.__name__.rsplit('.', 1)[-1]:<13} {expected}  {installed}  {target}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m pretrain`: see pretrain/cli.py for usage."""

import sys

from pretrain.cli import main

# The guard matters: dist_checkpointing's async writer spawns processes that re-import __main__.
if __name__ == "__main__":
    sys.exit(main())

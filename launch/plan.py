"""`python -m launch.plan`: usage in launch/planner/cli.py."""

import sys

from launch.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())

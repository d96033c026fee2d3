"""`python -m launch.scaling fit RESULTS.csv --approach 3`: usage in launch/scaling/cli.py."""

import sys

from launch.scaling.cli import main

if __name__ == "__main__":
    sys.exit(main())

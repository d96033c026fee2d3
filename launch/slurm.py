"""`python -m launch.slurm`: usage in launch/launchers/slurm.py."""

import sys

from launch.launchers.slurm import main

if __name__ == "__main__":
    sys.exit(main())

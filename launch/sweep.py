"""`python -m launch.sweep`: usage in launch/sweeps/run.py."""

import sys

from launch.sweeps.run import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m launch.local`: usage in launch/launchers/local.py."""

import sys

from launch.launchers.local import main

if __name__ == "__main__":
    sys.exit(main())

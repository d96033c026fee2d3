#!/usr/bin/env bash
# A real single-node Slurm cluster for CI (Debian/Ubuntu, root). Usage:
#   bash launch/launchers/ci_slurm.sh install   # apt-get slurmctld slurmd slurm-client munge (~15 s);
#                                     # the test fixture then starts the cluster and stops it
#   bash launch/launchers/ci_slurm.sh start     # install if needed, start it now; prints SLURM_CONF
#   bash launch/launchers/ci_slurm.sh stop      # stop the daemons `start` began
# The cluster lives in $PRETRAIN_SLURM_DIR (default /tmp/pretrain-slurm); see
# launch/launchers/ci_cluster.py for what is configured and why.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

case "${1:-}" in
    install)
        exec "$PY" -m launch.launchers.ci_cluster install
        ;;
    start)
        "$PY" -m launch.launchers.ci_cluster install
        exec "$PY" -m launch.launchers.ci_cluster start
        ;;
    stop)
        exec "$PY" -m launch.launchers.ci_cluster stop
        ;;
    *)
        echo "usage: bash launch/launchers/ci_slurm.sh install|start|stop" >&2
        exit 2
        ;;
esac

#!/bin/bash
# llama3-70b on 8 node(s) x 8 GPUs = 64 ranks, layout TP8xPP4xVPP5xDP2xSP.
# Written by launch.slurm; regenerate (or change nodes, layout, ...) with:
#   python -m launch.slurm --recipe llama3-70b --nodes 8 --gpus-per-node 8 \
#       --partition batch --time 04:00:00 --account llm-pretrain \
#       --container-image 'nvcr.io#nvidia/pytorch:25.04-py3' \
#       --container-mounts /lustre:/lustre --workdir /lustre/code/pretrain \
#       --run-dir /lustre/runs/llama3-70b/golden
# The training reads only config.yaml beside this script: the recipe with your
# overrides, resolved. Edit it to change this run without regenerating.
# launch.slurm set in it: logging.run_dir=/lustre/runs/llama3-70b/golden
# Submit: sbatch /lustre/runs/llama3-70b/golden/job.sh

#SBATCH --job-name=llama3-70b
#SBATCH --partition=batch
#SBATCH --account=llm-pretrain
#SBATCH --time=04:00:00
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8                  # one task per GPU
#SBATCH --gpus-per-node=8
#SBATCH --exclusive                          # whole nodes: all NVLink peers and NICs
#SBATCH --mem=0                              # all of each node's memory
#SBATCH --output=/lustre/runs/llama3-70b/golden/logs/slurm-%j.out # this script's own log; ranks log per node
#SBATCH --open-mode=append                   # a requeued attempt appends, keeps the first
# Preemption: Slurm sends USR1 to this script (B:) this many seconds before the
# time limit (it checks about every 30 s, so it can come a little earlier). The
# trap below forwards it to every rank, which finishes its step, saves a checkpoint
# and exits 0; the script then requeues the job, which resumes from that checkpoint
# (checkpoint.resume=auto).
#SBATCH --signal=B:USR1@300
# Requeue on node failure or preemption by Slurm (SIGTERM reaches the ranks, which
# save within KillWait / GraceTime); the restarted job resumes the same way.
#SBATCH --requeue

set -uo pipefail  # no -e: the training's exit status is collected below
# The ranks run in --container-workdir (below): relative paths in the config resolve there.

# ---- Environment (override or add with launch.slurm --env KEY=VALUE) ----
# log lines reach the log files as they are printed
export PYTHONUNBUFFERED=1
# as torchrun sets it: 8 ranks x all cores would oversubscribe the CPUs
export OMP_NUM_THREADS=1
# one hardware queue keeps kernel order, so TP/SP/CP communication is issued before the
# compute it overlaps with (Megatron-Core expects it)
export CUDA_DEVICE_MAX_CONNECTIONS=1
# free buffers of async collectives when they finish, not when the allocator notices:
# lower peak memory with overlapped grad reduce / param gather
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
# NVLink SHARP reserves GPU memory for every communicator; many TP/DP/PP groups add up
# to GBs. Set 1 if your all-reduces measure faster with it
export NCCL_NVLS_ENABLE=0
# NCCL errors (IB link down, timeouts) with their cause in the rank logs
export NCCL_DEBUG=WARN
# Ranks come from Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); torchrun's
# variables inherited from the submitting shell would take precedence, so drop them.
unset RANK WORLD_SIZE LOCAL_RANK

# ---- Rendezvous: rank 0 runs on the first node of the allocation, where this script
# runs (the batch host). The port is one found free there now, so two jobs sharing a
# node do not collide, as ports derived from job ids could; drawn below the kernel's
# ephemeral range, where no outgoing connection takes it before rank 0 binds it
# (launch/ports.py). ----
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
if ! MASTER_PORT=$(python3 - <<'PY'
import random
import socket


def free_port(host: str = "127.0.0.1") -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below the range busy: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    print(free_port(""))  # every interface: rank 0 listens on the node's address
PY
); then
    MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
    echo "[launch.slurm] warning: could not pick a free port on $(hostname); using $MASTER_PORT (job id)"
fi
export MASTER_PORT

# ---- Training: one task per rank (srun) ----
# Output: logs/ in the run directory, one file per node, each line prefixed with
# its task id (= rank). --kill-on-bad-exit: one failed task ends the step instead of leaving
# the others blocked in a collective.
PREEMPTED=0
forward_usr1() {
    PREEMPTED=1
    echo "[launch.slurm] USR1: asking the ranks to save a checkpoint and exit"
    kill -USR1 "$TRAIN_PID" 2>/dev/null  # srun forwards it to every task
}
trap forward_usr1 USR1
echo "[launch.slurm] job $SLURM_JOB_ID attempt ${SLURM_RESTART_COUNT:-0}: $SLURM_JOB_NUM_NODES node(s), rendezvous $MASTER_ADDR:$MASTER_PORT, $(date -Is)"
# Marks this attempt's start: hang reports newer than it are this attempt's.
ATTEMPT_STAMP=/lustre/runs/llama3-70b/golden/logs/.attempt-"$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"
touch "$ATTEMPT_STAMP"
srun \
    --output=/lustre/runs/llama3-70b/golden/logs/%j-node%n-%N.log \
    --open-mode=append \
    --label \
    --kill-on-bad-exit=1 \
    --container-image='nvcr.io#nvidia/pytorch:25.04-py3' \
    --container-mounts=/lustre:/lustre \
    --container-workdir=/lustre/code/pretrain \
    --container-env=PYTHONUNBUFFERED,OMP_NUM_THREADS,CUDA_DEVICE_MAX_CONNECTIONS,TORCH_NCCL_AVOID_RECORD_STREAMS,NCCL_NVLS_ENABLE,NCCL_DEBUG,MASTER_ADDR,MASTER_PORT \
    python -m pretrain --recipe llama3-70b --config /lustre/runs/llama3-70b/golden/config.yaml &
TRAIN_PID=$!
# A trap runs only between commands, so wait in the background-and-wait form; a
# wait interrupted by the trap (status > 128) is resumed until srun really ends.
wait "$TRAIN_PID"; RC=$?
while (( RC > 128 )) && kill -0 "$TRAIN_PID" 2>/dev/null; do wait "$TRAIN_PID"; RC=$?; done

if (( PREEMPTED )); then
    echo "[launch.slurm] ranks stopped (exit $RC) after USR1; requeueing job $SLURM_JOB_ID to resume"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
# Hang watchdog (pretrain.observe.watchdog): a rank whose step made no progress within
# watchdog.timeout dumped its stacks into /lustre/runs/llama3-70b/golden/hang/ and exited 75.
HANG_REPORT=$(find /lustre/runs/llama3-70b/golden/hang -name 'rank_*.txt' -newer "$ATTEMPT_STAMP" 2>/dev/null | head -n 1)
if (( RC == 75 )) || [[ -n "$HANG_REPORT" ]]; then
    HANGS=$(cat /lustre/runs/llama3-70b/golden/logs/.hang-requeues 2>/dev/null || echo 0)
    if (( HANGS < 3 )); then  # launch.slurm --hang-requeues
        echo $((HANGS + 1)) > /lustre/runs/llama3-70b/golden/logs/.hang-requeues
        echo "[launch.slurm] the hang watchdog stopped the ranks (exit $RC); stacks: $HANG_REPORT; requeueing job $SLURM_JOB_ID (hang requeue $((HANGS + 1)) of 3) to resume from the last checkpoint"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    echo "[launch.slurm] the hang watchdog stopped the ranks (exit $RC) after 3 hang requeue(s) already; not requeueing: see $HANG_REPORT"
    exit 75
fi
echo "[launch.slurm] training exited with status $RC"
exit "$RC"  # the job's exit code is the training's

"""Multi-node start-up: refuse a network set-up that would hang or bind loopback, and log
where every rank landed (rank -> host -> parallel coordinates).

    check_network(read_dist_env())   # before any process group; raises ConfigError
    log_placement(config.parallel)   # after Megatron's parallel state exists; rank 0 prints

gloo picks the address a rank listens on from its hostname unless GLOO_SOCKET_IFNAME names
an interface. A hostname mapped to 127.0.x.x (Debian's default `127.0.1.1 HOST` line) is
refused on a job of several nodes, so the interface is never left to a fallback (whether a
loopback-resolving hostname breaks the job depends on the torch/gloo version: see the multi-node
troubleshooting table in docs/launching.md).
An interface override naming no interface of the node fails inside the C++ device setup
with a message that does not name the variable. Both are refused here, with the fix.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from pretrain.config import ConfigError

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def nodes_in_job(environ: dict) -> int:
    """How many nodes the job spans now: torchrun's agent count (GROUP_WORLD_SIZE, one agent
    per node), else Slurm's count, else torchrun's world / local world. torchrun's first:
    after an elastic shrink Slurm's SLURM_JOB_NUM_NODES / SLURM_NNODES keep the count the job
    started with (measured on the 3-node cluster, tests/launch/test_multinode_elastic.py)."""
    if environ.get("GROUP_WORLD_SIZE", "").isdigit() and int(environ["GROUP_WORLD_SIZE"]):
        return int(environ["GROUP_WORLD_SIZE"])
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    world, local = environ.get("WORLD_SIZE", ""), environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local):
        return -(-int(world) // int(local))
    return 1


def _interface_problem(var: str, value: str, host: str) -> str | None:
    names = [n for n in value.split(",") if n]
    if value.startswith("^"):
        return None  # NCCL's exclusion list: nothing has to exist
    have = sorted(name for _, name in socket.if_nameindex())
    # NCCL matches prefixes unless the list starts with '='; gloo needs exact names.
    exact = var == "GLOO_SOCKET_IFNAME" or value.startswith("=")
    missing = [n for n in (x.lstrip("=") for x in names)
               if not any(h == n or (not exact and h.startswith(n)) for h in have)]
    if not missing:
        return None
    other = "NCCL_SOCKET_IFNAME" if var == "GLOO_SOCKET_IFNAME" else "GLOO_SOCKET_IFNAME"
    return (f"{var}={value} names no network interface of host {host} (it has: {', '.join(have)}): "
            f"set {var} to this node's inter-node interface (e.g. {var}={_guess_interface(have)}; the same "
            f"for {other}), or unset it to use the interface the hostname resolves to")


def _guess_interface(names: list[str]) -> str:
    real = [n for n in names if n != "lo"]
    return real[0] if real else "eth0"


def _loopback_problem(host: str, nodes: int, ifname_set: bool) -> str | None:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except socket.gaierror as exc:
        return (f"host {host} cannot resolve its own hostname ({exc.strerror}), and this job spans {nodes} "
                "nodes: add the hostname with the node's network address to /etc/hosts (or DNS)")
    if ifname_set or not all(ipaddress.ip_address(a).is_loopback for a in addresses):
        return None
    return (f"host {host}'s hostname resolves to {', '.join(sorted(addresses))} (loopback), and this job spans "
            f"{nodes} nodes: gloo derives the address it tells the other nodes from it. Map the hostname to the node's "
            "network address in /etc/hosts (or DNS), or set GLOO_SOCKET_IFNAME (CPU) / NCCL_SOCKET_IFNAME (GPU) "
            "to its inter-node interface and MASTER_ADDR to a numeric address")


def check_network(environ: dict | None = None) -> None:
    """Raise ConfigError (one line, the fix) before any process group when the node's
    network settings cannot work across nodes. A one-node job only checks the overrides."""
    env = os.environ if environ is None else environ
    host = socket.gethostname()
    for var in IFNAME_VARS:
        if env.get(var):
            problem = _interface_problem(var, env[var], host)
            if problem:
                raise ConfigError(problem)
    nodes = nodes_in_job(env)
    if nodes > 1:
        problem = _loopback_problem(host, nodes, any(env.get(v) for v in IFNAME_VARS))
        if problem:
            raise ConfigError(problem)


def placement() -> list[tuple[int, str, dict[str, int]]]:
    """(rank, host, coordinates) for every rank: one all_gather_object on the default group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    coords = {"TP": ps.get_tensor_model_parallel_rank(), "PP": ps.get_pipeline_model_parallel_rank(),
              "DP": ps.get_data_parallel_rank(), "CP": ps.get_context_parallel_rank(),
              "EP": ps.get_expert_model_parallel_rank()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dist.get_rank(), socket.gethostname(), coords))
    return gathered


def format_placement(rows: list[tuple[int, str, dict[str, int]]], sizes: dict[str, int]) -> list[str]:
    """`rank R -> HOST -> (TP t, PP p, DP d[, CP c, EP e])`: CP/EP only when used."""
    shown = [k for k in ("TP", "PP", "DP", "CP", "EP") if k in ("TP", "PP", "DP") or sizes.get(k, 1) > 1]
    return [f"rank {rank} -> {host} -> (" + ", ".join(f"{k} {coords[k]}" for k in shown) + ")"
            for rank, host, coords in sorted(rows)]


def log_placement(sizes: dict[str, int], emit) -> list[tuple[int, str, dict[str, int]]]:
    """Gather and print (through emit, rank 0) where each rank runs; one line per rank."""
    import torch.distributed as dist

    rows = placement()
    if dist.get_rank() == 0:
        hosts = sorted({host for _, host, _ in rows})
        emit(f"[placement] {len(rows)} ranks on {len(hosts)} host(s): {', '.join(hosts)}")
        for line in format_placement(rows, sizes):
            emit(f"[placement] {line}")
    return rows

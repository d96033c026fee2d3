"""A free TCP port for a rendezvous on this machine (standard library only).

Drawn at random below the kernel's ephemeral range, not by binding port 0: a port from that
range, free when checked, is taken now and then by the next outgoing connection (gloo opens
many, so do Slurm's daemons) before rank 0 binds it, and the job fails with "The server
socket has failed to listen on any local network address" (EADDRINUSE).

launch.local calls free_port(); Slurm batch scripts run this file as it is on the batch host
(`python3 - <<'PY'`), where the package may not be importable (container jobs).
"""

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

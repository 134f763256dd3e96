"""Free ports for listeners started later that cannot take port 0 (test and benchmark servers). A
torch.distributed world's rendezvous binds its own port instead (``kvtransfer.transport.open_rendezvous``)."""

from __future__ import annotations

import random
import socket


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port on ``host`` nobody listens on now, for a listener started later (a server that cannot
    take port 0), outside the OS's ephemeral range. Between this check and
    the listener's bind any process may take the port; one the kernel hands out itself (bind to 0)
    comes from the ephemeral range, where every outgoing connection (Ray's, gRPC's, HTTP clients')
    draws its local port too — a port below that range is taken only by an explicit bind (EADDRINUSE
    was seen once in CI). Tried at random in [10000, the range's start); the kernel's choice if none is free."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(attempts if low > 10_001 else 0):
        port = rng.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])

"""Free TCP ports for the tests' servers and rendezvous, chosen below the kernel's ephemeral range.

A port found free by bind(0) is ephemeral: until the process meant to serve on it binds it (a rank
starts seconds later), another test's gloo sockets, a rendezvous store or a scrape's connection can
be handed the same port. Ports below the range are only ever taken by name.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    """The first port the kernel hands out for bind(0) and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> int:
    """A base port with n consecutive free ports above it, below the ephemeral range."""
    top = max(_ephemeral_low(), 20000 + n)   # where the range starts lower, 10000..20000 is the best left
    for _ in range(200):
        base = random.randrange(10000, top - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports in 10000..{top}")


def free_port() -> int:
    return free_ports(1)

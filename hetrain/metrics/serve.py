"""Serving `/metrics` on prometheus_client's own thread, and the port checks behind `--metrics-port`.

Each local rank serves on PORT + local_rank, so one node's ranks take PORT..PORT+N-1. A scrape
runs in the server's daemon thread: it never waits on the training step or on another rank.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import weakref
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

from hetrain.errors import HetrainError

MAX_PORT = 65535
BIND_ADDR = "0.0.0.0"  # reachable by a Prometheus on another host or pod


def local_world_size() -> int:
    """The node's ranks, as torchrun says (LOCAL_WORLD_SIZE), 1 without a launcher: the ports the node's ranks take."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def check_port_range(base: int, nproc_per_node: int, given_as: str = "--metrics-port {}") -> None:
    """`--metrics-port` (or what `given_as` names) must leave room for PORT..PORT+nproc_per_node-1."""
    last = base + nproc_per_node - 1
    if base < 1 or last > MAX_PORT:
        raise HetrainError(
            f"{given_as.format(base)}: local ranks serve ports {base}..{last}, outside 1..{MAX_PORT}; "
            f"choose a base port between 1024 and {MAX_PORT - nproc_per_node + 1}"
        )


def _taken(base: int, count: int, addr: str) -> int | None:
    """The first of base..base+count-1 that cannot be bound now, or None when all are free."""
    for port in range(base, base + count):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds
            try:
                s.bind((addr, port))
            except OSError as e:
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    return port
                raise
    return None


def _in_use(base: int, port: int, count: int, addr: str) -> HetrainError:
    """The one-line error, suggesting a base port whose ports are free now (checked, not guessed)."""
    free = next((b for b in range(base + 100, MAX_PORT - count + 1, 100) if _taken(b, count, addr) is None), None)
    hint = f", e.g. --metrics-port {free}" if free is not None else ""
    return HetrainError(
        f"--metrics-port {base}: port {port} is already in use; choose a base port whose ports "
        f"{base}.. (one per local rank) are free{hint}"
    )


def check_ports_free(base: int, nproc_per_node: int, addr: str = BIND_ADDR) -> None:
    """Raise the one-line error when one of this node's metrics ports is taken now."""
    check_port_range(base, nproc_per_node)
    port = _taken(base, nproc_per_node, addr)
    if port is not None:
        raise _in_use(base, port, nproc_per_node, addr)


def free_base_port(count: int, start: int = 19400, addr: str = BIND_ADDR) -> int:
    """A base port with `count` free ports after it (for jobs hetrain starts itself, e.g. benchmarks)."""
    for base in range(start, MAX_PORT - count, count):
        if _taken(base, count, addr) is None:
            return base
    raise HetrainError(f"no {count} consecutive free ports from {start}; free some, or pass --metrics-port")


_SERVING: dict[int, Any] = {}   # port -> the server this process started on it (weakly)


def serve(registry: CollectorRegistry, base: int, local_rank: int, addr: str = BIND_ADDR) -> Any:
    """Start serving `registry` on base + local_rank; returns the server (call `.shutdown()`)."""
    port = base + local_rank
    check_port_range(base, local_rank + 1)
    try:
        server, _ = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            held = _SERVING.get(port)
            if held is not None and held() is not None and held().socket.fileno() != -1:
                raise HetrainError(
                    f"--metrics-port {base}: port {port} is served by an earlier hetrain.Session of this process that "
                    "was not closed (a sweep's trial that raised): close each session (session.close(), or with "
                    "hetrain.Session() as session:)") from None
            # the node's ranks (torchrun's LOCAL_WORLD_SIZE): a suggestion must leave room for all of them
            count = max(local_rank + 1, local_world_size())
            raise _in_use(base, port, count, addr) from None
        raise
    _SERVING[port] = weakref.ref(server)
    # a process forked from this rank (a DataLoader worker, persistent ones outliving a closed session) holds a
    # copy of the listening socket, and with it the port: the copy is closed in the child
    os.register_at_fork(after_in_child=functools.partial(_close_in_child, weakref.ref(server)))
    return server


def _close_in_child(ref: Any) -> None:
    server = ref()
    if server is not None:
        try:
            server.socket.close()
        except OSError:
            pass

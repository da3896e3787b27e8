"""Ports for the servers score-worker starts on this host: Kafka nodes, the embedded broker, a tensor-parallel
group's rendezvous. Nothing but the standard library: the light install and the worker both import it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["LOWEST_PICKED", "ephemeral_range", "free_port"]

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
# The lowest port picked: below it lie the ports local services are configured on (Kafka's 9092,
# Prometheus's 9090, Grafana's 3000, 8080 and its kin), which a server started elsewhere may take at any time.
LOWEST_PICKED = 10000
_TRIES = 64
_random = random.SystemRandom()  # no state shared with a forked parent, which would pick the same ports


def ephemeral_range() -> tuple[int, int] | None:
    """The kernel's range of ports for outgoing connections (Linux), or None where it is not known."""
    try:
        low, high = (int(value) for value in _EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now, for a server that binds it right after.

    Picked at random below the kernel's ephemeral range where it is known: a port in that range is also
    what the kernel gives every outgoing connection, so any connection opened between the pick and the
    server's bind can take it (a test run opens thousands; a Kafka node's JVM binds seconds after the pick).
    Ports below the range are only ever taken by a server binding them, and one that is bound now is passed
    over. Where no range is known (not Linux), or it leaves no room below, the kernel picks (port 0)."""
    span = ephemeral_range()
    if span is not None and span[0] - LOWEST_PICKED >= 1024:
        for _ in range(_TRIES):
            port = _random.randrange(LOWEST_PICKED, span[0])
            if _binds(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _binds(host: str, port: int) -> bool:
    """Whether a listening socket could bind (host, port) now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True

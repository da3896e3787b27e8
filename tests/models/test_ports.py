"""Ports picked for the servers score-worker starts (models/ports.py): not where connections land."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from models import ports


def _listening(port: int) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", port))
    server.listen(128)
    return server


def test_picked_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    """The kernel gives outgoing connections ports of its ephemeral range: a port picked there can be taken
    by a connection before the server binds it. Every pick lies below the range, and binds."""
    span = ports.ephemeral_range()
    if span is None or span[0] - ports.LOWEST_PICKED < 1024:
        pytest.skip(f"no room below this host's ephemeral range ({span})")
    picked = {ports.free_port() for _ in range(200)}
    assert all(ports.LOWEST_PICKED <= port < span[0] for port in picked), sorted(picked)
    assert len(picked) > 150  # at random: processes picking at once rarely meet
    for port in list(picked)[:20]:
        _listening(port).close()


def test_a_connection_never_takes_a_picked_port_before_its_server_binds_it() -> None:
    """The race the pick avoids: outgoing connections opened between the pick and the bind."""
    span = ports.ephemeral_range()
    if span is None or span[0] - ports.LOWEST_PICKED < 1024:
        pytest.skip(f"no room below this host's ephemeral range ({span})")
    picked = ports.free_port()
    with _listening(0) as target:
        # 64: within the listener's backlog, so that every connection completes without an accept
        clients = [socket.create_connection(target.getsockname(), timeout=5) for _ in range(64)]
        try:
            assert picked not in {client.getsockname()[1] for client in clients}
            assert all(span[0] <= client.getsockname()[1] <= span[1] for client in clients)
            _listening(picked).close()
        finally:
            for client in clients:
                client.close()


def test_a_port_in_use_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = _listening(0)
    try:
        busy = taken.getsockname()[1]
        with _listening(0) as spare:
            free = spare.getsockname()[1]
        offers = iter([busy, busy, free])
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (60000, 60999))
        monkeypatch.setattr(ports._random, "randrange", lambda low, high: next(offers))
        assert ports.free_port() == free
    finally:
        taken.close()


def test_where_no_range_is_known_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: None)
    monkeypatch.setattr(ports._random, "randrange", lambda low, high: pytest.fail("picked at random"))
    _listening(ports.free_port()).close()
    # A range that leaves no room below it: the kernel's pick too.
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST_PICKED + 10, 60999))
    _listening(ports.free_port()).close()


def test_the_range_is_read_from_the_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text("32768\t60999\n")
    monkeypatch.setattr(ports, "_EPHEMERAL", path)
    assert ports.ephemeral_range() == (32768, 60999)
    path.write_text("garbage\n")
    assert ports.ephemeral_range() is None
    monkeypatch.setattr(ports, "_EPHEMERAL", tmp_path / "absent")
    assert ports.ephemeral_range() is None

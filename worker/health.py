"""Health endpoints on the worker's own event loop: /metrics, /healthz (the loop answers) and /readyz."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST

from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

_READ_TIMEOUT_S = 5.0
_MAX_HEAD_BYTES = 16384


@dataclass
class Readiness:
    """What /readyz checks; the worker flips these as it starts, joins, loses or regains the broker."""

    metrics: WorkerMetrics
    model_loaded: bool = False
    group_joined: bool = False
    broker_reachable: bool = False
    # False once the watchdog found a model call past its limit: the worker is stopping.
    model_responsive: bool = True
    # False while fetching raises (the worker retries it); True again after a fetch that succeeded.
    fetching: bool = True
    # Partitions stopped at records the worker cannot read, by "topic[partition]": offset, cause, message.
    held_partitions: dict[str, dict[str, Any]] = field(default_factory=dict)
    _last: bool | None = None

    def checks(self) -> dict[str, bool]:
        return {
            "model_loaded": self.model_loaded,
            "group_joined": self.group_joined,
            "broker_reachable": self.broker_reachable,
            "model_responsive": self.model_responsive,
            "fetching": self.fetching,
            "partitions_readable": not self.held_partitions,
        }

    def details(self) -> dict[str, Any]:
        """What /readyz shows beside the checks: the held partitions and why each is held."""
        return {"held_partitions": self.held_partitions}

    def hold(self, partitions: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the held partitions (none: every partition reads)."""
        self.held_partitions = {name: dict(info) for name, info in partitions.items()}
        self._changed()

    @property
    def ready(self) -> bool:
        return all(self.checks().values())

    def update(self, **checks: bool) -> None:
        """Set some checks; logs and exports each change of the overall state once."""
        for name, value in checks.items():
            if name not in self.checks() or name == "partitions_readable":
                raise ValueError(f"unknown readiness check {name!r}")
            setattr(self, name, value)
        self._changed()

    def _changed(self) -> None:
        ready = self.ready
        if ready != self._last:
            self._last = ready
            self.metrics.set_ready(ready)
            failing = [name for name, ok in self.checks().items() if not ok]
            if ready:
                log.info("ready")
            else:
                log.info("not ready: %s", ", ".join(failing))


class HealthServer:
    """A minimal HTTP/1.1 server (GET and HEAD, one request per connection) for probes and scrapes.

    It runs on the worker's event loop on purpose: an answer from /healthz proves the loop, which also
    carries the Kafka heartbeats, is not stuck.
    """

    def __init__(
        self,
        host: str,
        port: int,
        exposition: Callable[[], bytes | Awaitable[bytes]],
        checks: Callable[[], dict[str, bool] | Awaitable[dict[str, bool]]],
        details: Callable[[], dict[str, Any]] | None = None,
        listener: socket.socket | None = None,
    ) -> None:
        """`details`: more for /readyz's body beside the checks (why a check fails), asked for after them.
        `exposition` and `checks` may be coroutines (a host's supervisor asks its processes). `listener`: a
        socket already bound and listening (one inherited from the host's supervisor), served in place of
        binding host:port."""
        self._host, self._port = host, port
        self._listener = listener
        self._exposition, self._checks = exposition, checks
        self._details = details
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port (the one asked for, or the one the OS chose for port 0 in tests)."""
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        if self._listener is not None:
            self._server = await asyncio.start_server(self._handle, sock=self._listener)
        else:
            self._server = await asyncio.start_server(self._handle, self._host, self._port)
        log.info("serving /metrics, /healthz and /readyz on %s:%d", self._host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            status, content_type, body, method = await self._respond(head[:_MAX_HEAD_BYTES])
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            writer.close()
            return
        headers = (
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
        )
        try:
            writer.write(headers.encode("ascii") + (b"" if method == "HEAD" else body))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _respond(self, head: bytes) -> tuple[str, str, bytes, str]:
        """(status line, content type, body, method) for one request head."""
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "400 Bad Request", "text/plain", b"bad request\n", "GET"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"GET or HEAD only\n", method
        if target == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, await _value(self._exposition()), method
        if target == "/healthz":
            return "200 OK", "text/plain", b"ok\n", method
        if target == "/readyz":
            checks = await _value(self._checks())
            ready = all(checks.values())
            extra = self._details() if self._details is not None else {}
            body = json.dumps({"ready": ready, "checks": checks, **extra}).encode() + b"\n"
            status = "200 OK" if ready else "503 Service Unavailable"
            return status, "application/json", body, method
        return "404 Not Found", "text/plain", b"not found: try /metrics, /healthz or /readyz\n", method


_T = TypeVar("_T")


async def _value(answer: _T | Awaitable[_T]) -> _T:
    return await answer if inspect.isawaitable(answer) else answer

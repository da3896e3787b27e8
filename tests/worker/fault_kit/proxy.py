"""A TCP proxy in front of a broker that cuts one Kafka client (by client id) and lets the others through."""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any


def kafka_client_id(frame: bytes) -> str:
    """The client id of a Kafka request (header v1 and v2 both carry it as a nullable int16 string)."""
    (length,) = struct.unpack_from(">h", frame, 8)
    return "" if length < 0 else frame[10 : 10 + length].decode("utf-8", "replace")


@dataclass(eq=False)
class _Link:
    client_id: str
    sides: tuple[asyncio.StreamWriter, asyncio.StreamWriter]

    def sever(self) -> None:
        for writer in self.sides:
            writer.transport.abort()


class ClientCutProxy:
    """A TCP proxy in front of a broker that can cut the connections of chosen Kafka clients.

    A broker advertising this proxy sends every client through it, so the clients are told apart by the
    client id in the first request of each connection: the worker's can be cut while the test's producer
    and readers keep going. While cut, chosen clients' new connections are closed after their first request.
    Runs on its own thread and loop, so that nothing the test does can stall the traffic it carries.
    """

    def __init__(self, cut_prefix: str) -> None:
        self.cut_prefix = cut_prefix
        self.upstream_port: int | None = None
        self.port = 0
        self.severed = 0  # open connections closed by cut()
        self.refused = 0  # connections closed while cut
        self._cutting = False
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cut-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    def _call(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)  # type: ignore[arg-type]

    def start(self) -> ClientCutProxy:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def cut(self) -> None:
        async def cut() -> None:
            self._cutting = True
            for link in [k for k in self._links if k.client_id.startswith(self.cut_prefix)]:
                link.sever()
                self.severed += 1

        self._call(cut())

    def restore(self) -> None:
        async def restore() -> None:
            self._cutting = False

        self._call(restore())

    def stop(self) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for link in list(self._links):
                link.sever()

        self._call(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readexactly(4)
            frame = await reader.readexactly(struct.unpack(">i", head)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.transport.abort()
            return
        client_id = kafka_client_id(frame)
        if self._cutting and client_id.startswith(self.cut_prefix):
            self.refused += 1
            writer.transport.abort()
            return
        assert self.upstream_port is not None
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        up_writer.write(head + frame)
        link = _Link(client_id, (writer, up_writer))
        self._links.add(link)
        try:
            pumps = [
                asyncio.create_task(_pump(reader, up_writer)),
                asyncio.create_task(_pump(up_reader, writer)),
            ]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
        finally:
            link.sever()
            self._links.discard(link)


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while chunk := await source.read(1 << 16):
            sink.write(chunk)
            await sink.drain()
    except (ConnectionError, OSError):
        return

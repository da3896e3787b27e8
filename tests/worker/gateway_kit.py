"""A gateway served by uvicorn on a thread of the test process, on a real broker, for the gateway tests."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from worker_testkit import Names, own_cluster_security

from worker.config import KafkaSecurity
from worker.environment import GatewaySettings
from worker.gateway.app import Gateway, build_app
from worker.gateway.command import uvicorn_config

KEYS = ("test-key-one", "test-key-two")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class RunningGateway:
    gateway: Gateway
    url: str
    settings: GatewaySettings
    server: uvicorn.Server


def gateway_settings(bootstrap: str, names: Names, **overrides: Any) -> GatewaySettings:
    values: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "requests_topic": names.requests,
        "results_topic": names.results,
        "gateway_reply_topic": f"{names.results}.gw-test-{uuid.uuid4().hex[:8]}",
        "gateway_host": "127.0.0.1",
        "gateway_port": free_port(),
        "gateway_api_keys": ",".join(KEYS),
        "gateway_probe_interval_s": 0.5,
        "gateway_timeout_s": 30.0,
        **overrides,
    }
    return GatewaySettings(**values)


@contextmanager
def serving_gateway(settings: GatewaySettings) -> Iterator[RunningGateway]:
    """The gateway of `settings` on uvicorn (its own thread and event loop) until the block ends."""
    bootstrap = settings.bootstrap_servers or ""
    security = KafkaSecurity(**own_cluster_security(bootstrap)).kafka_security_kwargs()
    gateway = Gateway(settings, security)
    server = uvicorn.Server(uvicorn_config(build_app(gateway), settings))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive(), "the gateway did not start"
        assert time.monotonic() < deadline, "the gateway did not start within 60 s"
        time.sleep(0.05)
    try:
        yield RunningGateway(gateway, f"http://127.0.0.1:{settings.gateway_port}", settings, server)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive(), "the gateway did not stop"


def auth(key: str = KEYS[1]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}

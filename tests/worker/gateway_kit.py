"""A gateway served by uvicorn on a thread of the test process, on a real broker, for the gateway tests; and
the same requests sent over Kafka through ScoreClient, to compare its answers with."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import uvicorn
from tolerances import assert_scored_alike, forward_atol
from worker_testkit import LiveWorker, Names, client_kwargs, own_cluster_security

from schemas import ResultStatus, ScoreRequest, ScoreResult, Tensor
from worker.client import ScoreClient, new_request_id
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


# The worker lets any topic with ".gw-" in its name be a reply topic (its default allows score.results.*,
# and these tests run on topics of their own names).
REPLY_PATTERN = r".+\.gw-.+"


@contextmanager
def answering_client(gateway: RunningGateway, **headers: str) -> Iterator[httpx.Client]:
    """An HTTP client of the gateway, once the gateway has heard a worker answer its probe."""
    with httpx.Client(base_url=gateway.url, headers={**auth(), **headers}, timeout=60) as client:
        for _ in range(200):
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.1)
        yield client


def direct(worker: LiveWorker, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
    """The same requests over Kafka through ScoreClient, read from the shared results topic."""

    async def run() -> list[ScoreResult]:
        kwargs = client_kwargs(worker.bootstrap)
        bootstrap = kwargs.pop("bootstrap_servers")
        async with ScoreClient(
            bootstrap, requests_topic=worker.names.requests, results_topic=worker.names.results,
            kafka_options=kwargs,
        ) as client:  # fmt: skip
            return await client.score(requests, timeout=60)

    return asyncio.run(run())


def one(worker: LiveWorker, **fields: Any) -> tuple[ScoreRequest, ScoreResult]:
    """A request sent directly, and its result."""
    request = ScoreRequest(request_id=new_request_id(), **fields)
    (result,) = direct(worker, [request])
    assert result.error is None, result.error
    return request, result


def assert_alike(
    worker: LiveWorker, request: ScoreRequest, expected: ScoreResult, scores: Any, states: Any = None
) -> None:
    """The gateway's scores (and hidden states) against the direct result of the same request: two forward
    passes of the worker, perhaps in other batches, so within the project's float32 bound of one forward
    against another (tests/tolerances.py). The gateway itself changes no value: its JSON and base64 carry
    float32 values exactly (test_gateway_units.py)."""
    pooled = None
    if states is not None:
        pooled = tuple(Tensor.from_numpy(np.asarray(state, dtype=np.float32)) for state in states)
    got = ScoreResult(request.request_id, ResultStatus.OK, tuple(map(tuple, scores)), pooled)
    assert_scored_alike(got, expected, worker.scorer, [request])


def sigmoid_atol(worker: LiveWorker, request: ScoreRequest, logits: Any) -> float:
    """How far probabilities through the logistic function may lie from those of the direct logits: its
    slope is at most 1/4, so logits within the forward bound give probabilities within a quarter of it;
    1e-12 more for two float64 evaluations of the function (a few ulps apart)."""
    model_dir = Path(worker.scorer.hf_model.name_or_path)
    longest = max(len(prompt) for prompt in worker.scorer.prepare(request).prompts)
    return forward_atol(model_dir, np.asarray(logits, dtype=np.float64), longest=longest) / 4 + 1e-12


def assert_sigmoid_alike(worker: LiveWorker, request: ScoreRequest, logits: Any, probs: Any) -> None:
    values = np.asarray(logits, dtype=np.float64)
    atol = sigmoid_atol(worker, request, values)
    np.testing.assert_allclose(
        np.asarray(probs, dtype=np.float64), 1 / (1 + np.exp(-values)), atol=atol, rtol=0
    )

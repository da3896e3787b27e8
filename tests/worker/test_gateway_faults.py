"""The gateway when things fail: a worker killed under HTTP load, the brokers unreachable and back, the
gateway itself restarted, slow clients, and a flood of calls. Every call ends with an answer (scores, or a
503, 504, 408 or 429 with its code) within its deadline; none hangs."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from brokers import OwnBroker
from conftest import serving
from fault_kit.proxy import ClientCutProxy
from fault_kit.workers import Spawn, worker_env
from gateway_kit import RunningGateway, auth, gateway_settings, serving_gateway
from worker_testkit import LiveWorker, Names, client_kwargs

from worker.topics import create_missing_topics

pytestmark = pytest.mark.slow

PATTERN = r".+\.gw-.+"  # reply topics the workers allow (see test_gateway.py)
# On a loaded 2-core test machine the gateway's answer to a call whose wait ended may take a moment to be
# scheduled and sent; a call that hangs would take its whole client timeout (60 s) instead.
SLACK_S = 3.0


@contextmanager
def live_worker(bootstrap: str, model_dir: Path) -> Iterator[LiveWorker]:
    generator = serving(bootstrap, model_dir, reply_topic_pattern=PATTERN)
    try:
        yield next(generator)
    finally:
        generator.close()


def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not report a worker within {timeout_s} s")


class Load:
    """`lanes` callers, each making one call after another to /v1/score until stopped; every call's start,
    duration, status and code kept."""

    def __init__(self, url: str, lanes: int) -> None:
        self.url, self.lanes = url, lanes
        self.calls: list[tuple[float, float, int, str | None]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._lane, args=(i,), daemon=True) for i in range(lanes)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)
        assert not any(thread.is_alive() for thread in self._threads), "a call never ended"

    def _lane(self, lane: int) -> None:
        with httpx.Client(base_url=self.url, headers=auth(), timeout=60) as client:
            index = 0
            while not self._stop.is_set():
                started = time.monotonic()
                answer = client.post("/v1/score", json={"items": [f"call {lane}-{index}"]})
                code = answer.json().get("error", {}).get("code") if answer.status_code != 200 else None
                self.calls.append((started, time.monotonic() - started, answer.status_code, code))
                index += 1


def test_a_worker_killed_under_load_leaves_no_call_hanging(
    kafka_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn
) -> None:
    """Two worker processes in one group behind the gateway; one is killed (SIGKILL) while calls flow. Each
    call is answered with scores or ends with 503/504 within its deadline; once the group has moved the
    dead worker's partitions to the other (its session timeout, 3 s, and a rebalance), calls are scored."""
    names = Names.unique("gw-kill")
    kwargs = client_kwargs(kafka_bootstrap)
    asyncio.run(create_missing_topics(kwargs, [names.requests, names.results, names.dlq], 4, 1))
    env = worker_env(kafka_bootstrap, tiny_llama_dir, names, reply_topic_pattern=PATTERN)
    workers = [spawn("doomed", env), spawn("survivor", env)]
    asyncio.run(workers[0].wait_assigned())
    asyncio.run(workers[1].wait_assigned())
    timeout_s = 8.0
    settings = gateway_settings(kafka_bootstrap, names, gateway_timeout_s=timeout_s)
    with serving_gateway(settings) as running:
        wait_healthy(running.url)
        with Load(running.url, lanes=4) as load:
            time.sleep(3)
            killed_at = time.monotonic()
            workers[0].kill()
            time.sleep(14)
    assert workers[1].running(), workers[1].tail()
    statuses = {status for _, _, status, _ in load.calls}
    assert statuses <= {200, 503, 504}, sorted(load.calls, key=lambda call: call[2])[-5:]
    assert max(duration for _, duration, _, _ in load.calls) <= timeout_s + SLACK_S
    before = [status for started, _, status, _ in load.calls if started < killed_at]
    assert before and set(before) == {200}, "calls before the kill were not all scored"
    # By 9 s after the kill (3 s session timeout, a rebalance, the survivor reading the moved partitions
    # from their committed offsets), every new call reaches a live worker.
    late = [status for started, _, status, _ in load.calls if started > killed_at + 9]
    assert late and set(late) == {200}, late


def test_brokers_unreachable_then_back(tiny_llama_dir: Path, own_broker: Callable[..., OwnBroker]) -> None:
    """The gateway's connections to the brokers cut (the worker's are not): calls end with 503 (or 504 for
    one already waiting) within their deadline, health says 503; once they come back, the same gateway
    process reports a worker again and scores calls, without a restart."""
    proxy = ClientCutProxy(cut_prefix="score-gateway").start()
    try:
        broker = own_broker(advertised=("127.0.0.1", proxy.port))
        proxy.upstream_port = broker.listen_port
        bootstrap = f"127.0.0.1:{proxy.port}"
        with live_worker(bootstrap, tiny_llama_dir) as worker:
            settings = gateway_settings(bootstrap, worker.names, gateway_timeout_s=4.0)
            with (
                serving_gateway(settings) as running,
                httpx.Client(base_url=running.url, headers=auth(), timeout=60) as http,
            ):
                wait_healthy(running.url)
                assert http.post("/v1/score", json={"items": ["before"]}).status_code == 200
                proxy.cut()
                outage = []
                for index in range(6):
                    started = time.monotonic()
                    answer = http.post("/v1/score", json={"items": [f"during {index}"]})
                    outage.append((answer.status_code, time.monotonic() - started))
                assert proxy.severed > 0, "the cut closed no connection of the gateway"
                assert {status for status, _ in outage} <= {503, 504}, outage
                assert max(seconds for _, seconds in outage) <= 4.0 + SLACK_S, outage
                # The probe went unanswered: the gateway now says so at once instead of waiting.
                assert outage[-1][0] == 503 and outage[-1][1] < 1.0, outage
                assert http.get("/health").status_code == 503
                proxy.restore()
                wait_healthy(running.url, timeout_s=60)
                answer = http.post("/v1/score", json={"items": ["after"]})
                assert answer.status_code == 200, answer.text
                assert len(answer.json()["scores"]) == 1
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def worker(kafka_bootstrap: str, tiny_llama_dir: Path) -> Iterator[LiveWorker]:
    with live_worker(kafka_bootstrap, tiny_llama_dir) as live:
        yield live


def test_a_restarted_gateway_answers_the_clients_retry(worker: LiveWorker) -> None:
    """The gateway stops (SIGTERM's path) and a new one starts on the same port: a client that retries on
    a refused connection gets its answer, the same scores as before the restart (the same worker, each call
    alone in its batch: the same float32 forward)."""
    settings = gateway_settings(worker.bootstrap, worker.names)
    body = {"items": ["the same question"]}
    with serving_gateway(settings) as first:
        wait_healthy(first.url)
        before = httpx.post(f"{first.url}/v1/score", json=body, headers=auth(), timeout=60)
    assert before.status_code == 200
    answers: list[httpx.Response] = []
    refused = 0

    def client() -> None:
        nonlocal refused
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                answer = httpx.post(f"{first.url}/v1/score", json=body, headers=auth(), timeout=60)
            except httpx.ConnectError:
                refused += 1
                time.sleep(0.2)
                continue
            if answer.status_code == 503:  # up, but has not seen a worker answer yet: Retry-After
                time.sleep(float(answer.headers["retry-after"]))
                continue
            answers.append(answer)
            return

    caller = threading.Thread(target=client)
    caller.start()
    time.sleep(1)
    with serving_gateway(settings):
        caller.join(timeout=120)
    assert refused > 0, "the client never met the stopped gateway"
    (after,) = answers
    assert after.status_code == 200, after.text
    assert after.json()["scores"] == before.json()["scores"]


def test_a_slow_client_holds_no_one_else_and_is_timed_out(worker: LiveWorker) -> None:
    """A client that sends its body a byte at a time: other calls are answered meanwhile, and the slow one
    gets 408 READ_TIMEOUT at its deadline instead of holding a call slot for as long as it likes."""
    settings = gateway_settings(worker.bootstrap, worker.names, gateway_max_calls=2)
    with serving_gateway(settings) as running:
        wait_healthy(running.url)
        port = running.settings.gateway_port
        slow = socket.create_connection(("127.0.0.1", port))
        body = b'{"items": ["slow"]}'
        head = (
            f"POST /v1/score HTTP/1.1\r\nHost: x\r\nAuthorization: {auth()['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nX-Request-Timeout: 3\r\n\r\n"
        )
        started = time.monotonic()  # before the gateway can start the call's clock
        slow.sendall(head.encode() + body[:1])
        while running.gateway.in_flight == 0:  # the slow call holds one of the two slots
            time.sleep(0.01)
        with httpx.Client(base_url=running.url, headers=auth(), timeout=60) as http:
            for index in range(3):  # one slot is the slow client's; the other serves these in turn
                answer = http.post("/v1/score", json={"items": [f"quick {index}"]})
                assert answer.status_code == 200, answer.text
        # All of them answered while the slow client still held its slot (before its 3 s deadline).
        assert time.monotonic() - started < 3.0
        for byte in body[1:4]:  # still trickling
            slow.sendall(bytes([byte]))
            time.sleep(0.2)
        slow.settimeout(3 + SLACK_S)
        reply = slow.recv(65536)
        waited = time.monotonic() - started
        slow.close()
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"READ_TIMEOUT" in reply
        assert 3.0 <= waited <= 3.0 + SLACK_S, waited
        assert running.gateway.in_flight == 0


def test_a_flood_is_bounded_by_the_call_cap(worker: LiveWorker) -> None:
    """Many more calls at once than gateway_max_calls: those over the cap get 429 with Retry-After before
    their body is read, the rest are scored, and no more than the cap is ever in flight (each holding at
    most gateway_max_body_bytes): what bounds the gateway's memory."""
    cap = 4
    settings = gateway_settings(worker.bootstrap, worker.names, gateway_max_calls=cap)
    peak = 0
    with serving_gateway(settings) as running:
        wait_healthy(running.url)
        watching = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not watching.is_set():
                peak = max(peak, running.gateway.in_flight)
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        answers = asyncio.run(_flood(running, 64))
        watching.set()
        watcher.join()
    statuses = [answer.status_code for answer in answers]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= 1
    for answer in answers:
        if answer.status_code == 429:
            assert answer.headers["retry-after"] == "1"
            assert answer.json()["error"]["code"] == "TOO_MANY_CALLS"
    assert 1 <= peak <= cap, peak


async def _flood(running: RunningGateway, calls: int) -> list[Any]:
    limits = httpx.Limits(max_connections=calls)
    async with httpx.AsyncClient(base_url=running.url, headers=auth(), timeout=60, limits=limits) as http:
        posts = [http.post("/v1/score", json={"items": [f"flood {i}"]}) for i in range(calls)]
        return list(await asyncio.gather(*posts))

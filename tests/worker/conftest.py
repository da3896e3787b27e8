"""Fixtures of the worker tests: the brokers (tests/worker/brokers.py), live workers, worker processes."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from brokers import BrokerPool, OwnBroker, own_broker_of
from fault_kit.workers import Spawn, WorkerProcess
from secure_proxy import Pki, make_test_pki
from worker_testkit import LiveWorker, Names, fast_settings

from models import Scorer, ScorerConfig
from worker.app import ScoreWorker
from worker.topics import ensure_topics

log = logging.getLogger(__name__)


_POOL: BrokerPool | None = None


@pytest.fixture(scope="session")
def broker_pool() -> Iterator[BrokerPool]:
    """Every broker the session's worker tests use, started on first use (tests/worker/brokers.py)."""
    global _POOL
    _POOL = BrokerPool()
    try:
        yield _POOL
    finally:
        _POOL.close()


@pytest.fixture(scope="session")
def kafka_bootstrap(broker_pool: BrokerPool) -> str:
    """Bootstrap servers of the session's default broker: Apache Kafka where Java is present (see
    tests/worker/brokers.py for the order). A module runs on several with `broker_tiers`."""
    return broker_pool.broker("default").bootstrap


@pytest.fixture
def own_broker(broker_pool: BrokerPool) -> Iterator[Callable[..., OwnBroker]]:
    """Starts brokers of the default's kind that belong to one test (it stops them, or fronts them with a
    proxy): `own_broker(port=None, advertised=None)`. Whatever is still running at the end is stopped."""
    started: list[OwnBroker] = []

    def start(port: int | None = None, advertised: tuple[str, int] | None = None) -> OwnBroker:
        started.append(own_broker_of(broker_pool, port, advertised))
        return started[-1]

    yield start
    for broker in started:
        broker.stop()


def _tier(item: pytest.Item) -> str | None:
    """The broker tier a test ran on: its `kafka_bootstrap`'s, or its "tier" parameter with the pool."""
    names = getattr(item, "fixturenames", ())
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec else {}
    if "kafka_bootstrap" in names:
        return str(params.get("kafka_bootstrap", "default"))
    if "broker_pool" in names and "tier" in params:
        return str(params["tier"])
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Counts each test against the broker it ran on; a failed one carries that broker's log tail."""
    report = yield
    tier = _tier(item)
    broker = _POOL.peek(tier) if (_POOL is not None and tier) else None
    if broker is not None:
        if report.when == "call":
            broker.uses[getattr(getattr(item, "module", None), "__name__", "?")] += 1
        if report.failed:
            broker.failures += 1
            report.sections.append((f"broker: {broker.description} at {broker.bootstrap}", broker.log_tail()))
    return report


def _broker_lines() -> list[str]:
    """One line per broker this process started: its version, its tests, and where a failure's files are."""
    if _POOL is None:
        return []
    lines = []
    for broker in _POOL.started():
        modules = len(broker.uses)
        line = (
            f"worker tests on {broker.description} at {broker.bootstrap}: {sum(broker.uses.values())} tests"
        )
        line += f" in {modules} modules"
        if broker.failures and broker.files:
            line += f"; {broker.failures} failed, its files and logs kept in {broker.files}"
        lines.append(line)
    if _POOL.fallback_reason:
        lines.append(f"not on Apache Kafka: {_POOL.fallback_reason}")
    return lines


# Lines the test processes of a parallel run (pytest-xdist) sent back as they ended.
_RELAYED: list[str] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a process of a parallel run: hand this process's broker lines to the one that reports."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["broker_lines"] = _broker_lines()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_testnodedown(node: Any, error: object) -> None:
    _RELAYED.extend(getattr(node, "workeroutput", {}).get("broker_lines", []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _RELAYED + _broker_lines():
        terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def live_worker(  # a worker per test module that asks for it, on its own topics
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> Iterator[LiveWorker]:
    yield from serving(kafka_bootstrap, tiny_llama_dir)


@pytest.fixture(scope="module")
def live_vision_worker(  # the same with a tiny image-text model
    kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveWorker]:
    from models.tiny_vision import write_tiny_vision_model

    yield from serving(kafka_bootstrap, write_tiny_vision_model(tmp_path_factory.mktemp("vision"), seed=1))


def serving(kafka_bootstrap: str, model_dir: Path, **overrides: Any) -> Iterator[LiveWorker]:
    """A worker of `model_dir` on its own topics (and settings `overrides`), run in a thread until the
    generator is closed."""
    names = Names.unique("client")
    settings = fast_settings(kafka_bootstrap, model_dir, names, **overrides)
    asyncio.run(ensure_topics(settings))  # the client needs the results topic before the worker is up
    worker = ScoreWorker(settings, Scorer(model_dir, ScorerConfig(device="cpu")))
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            asyncio.run(worker.run())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve, name="live-worker", daemon=True)
    thread.start()
    try:
        yield LiveWorker(kafka_bootstrap, names, Scorer(model_dir, ScorerConfig(device="cpu")))
    finally:
        worker.stop()
        thread.join(timeout=60)
    assert not thread.is_alive(), "the worker did not stop"
    assert not errors, errors


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Certificates for the TLS tests (a CA, a server and a client certificate, decoys), made once."""
    try:
        return make_test_pki(tmp_path_factory.mktemp("pki"))
    except FileNotFoundError as exc:
        pytest.skip(f"no certificates for the TLS tests: {exc}")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> Scorer:
    """The in-process float32 scorer every worker result is checked against."""
    return Scorer(tiny_llama_dir, ScorerConfig(device="cpu", dtype="float32"))


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Starts worker processes; whatever is still running at the end of the test is killed."""
    started: list[WorkerProcess] = []

    def start(name: str, env: dict[str, str], prefix: Sequence[str] = ()) -> WorkerProcess:
        started.append(WorkerProcess(name, env, tmp_path, prefix))
        return started[-1]

    yield start
    for process in started:
        process.close()

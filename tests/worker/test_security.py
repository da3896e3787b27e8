"""Kafka security end to end: mutual TLS, SASL PLAIN and SCRAM-SHA-256/512, SASL_SSL, with a real worker.

The embedded broker (Tansu 0.6.0) has no usable TLS or SASL, so the proxies of secure_proxy.py play the
secured listener in front of a broker that advertises them: every connection of every client passes through
them, and each test checks what the proxy saw (client certificates, authentications, refusals) besides the
results, so a client that skipped security would fail the test rather than slip through.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from brokers import OwnBroker
from secure_proxy import Pki, ProxyServer, SaslProxy, TlsProxy
from tolerances import assert_scored_alike
from worker_testkit import Names, fast_settings, fast_values, settings_env

from models import Scorer, ScorerConfig
from schemas import ResultStatus, ScoreRequest, ScoreResult
from worker.app import ScoreWorker
from worker.broker import free_port
from worker.cli import main as cli_main
from worker.client import ScoreClient
from worker.config import ENV_PREFIX, KafkaSecurity, WorkerSettings
from worker.lag_exporter import LagExporter
from worker.topics import ensure_topics

pytestmark = pytest.mark.slow

USER = "svc-scorer"
# Random, so that finding it in a log can only mean it leaked.
PASSWORD = f"pw-{secrets.token_urlsafe(18)}"
WRONG_PASSWORD = f"wrong-{secrets.token_urlsafe(18)}"
REQUESTS = [
    ScoreRequest(f"sec-{i}", items=("The answer is 42.", "No idea.")[: 1 + i % 2], query="Is this right?")
    for i in range(6)
]


@pytest.fixture(scope="module")
def scorer(tiny_llama_dir: Path) -> Scorer:
    return Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))


@contextlib.contextmanager
def secured_broker(start: Callable[..., OwnBroker], *proxies: ProxyServer) -> Iterator[str]:
    """Proxies in a chain (the first faces the clients) before a broker of the test's own (`own_broker`) that
    advertises the first.

    Yields the bootstrap address; on leaving, checks that no proxy hit an error of its own.
    """
    with contextlib.ExitStack() as stack:
        for proxy in proxies:
            stack.enter_context(proxy)
        for outer, inner in itertools.pairwise(proxies):
            outer.upstream = ("127.0.0.1", inner.port)
        broker = start(advertised=("127.0.0.1", proxies[0].port))
        stack.callback(broker.stop)
        proxies[-1].upstream = ("127.0.0.1", broker.listen_port)
        yield f"127.0.0.1:{proxies[0].port}"
    assert not [error for proxy in proxies for error in proxy.errors]


def round_trip(settings: WorkerSettings, scorer: Scorer) -> tuple[list[ScoreResult], str]:
    """Create the topics, run a worker, score REQUESTS with ScoreClient: all with the settings' security.

    Returns the results and the worker's metrics exposition.
    """

    async def scenario() -> tuple[list[ScoreResult], str]:
        await ensure_topics(settings)
        worker = ScoreWorker(settings, scorer)
        task = asyncio.create_task(worker.run())
        try:
            async with ScoreClient(
                settings.bootstrap_servers,
                requests_topic=settings.requests_topic,
                results_topic=settings.results_topic,
                kafka_options=settings.kafka_security_kwargs(),
            ) as client:
                results = await client.score(REQUESTS, timeout=60)
        finally:
            worker.stop()
            await asyncio.wait_for(task, 60)
        return results, worker.metrics.exposition().decode()

    return asyncio.run(scenario())


def assert_scored(results: list[ScoreResult], scorer: Scorer) -> None:
    assert [r.request_id for r in results] == [r.request_id for r in REQUESTS]
    for got, want, request in zip(results, scorer.score(REQUESTS), REQUESTS, strict=True):
        assert got.status == ResultStatus.OK, got.error
        assert_scored_alike(got, want, scorer, [request])


def connect_error(bootstrap: str, security: KafkaSecurity) -> str | None:
    """Connect an admin client and list topics: None when that works, else the error as an operator sees it
    (the exception and the Kafka client's warnings, which the command line prints)."""
    captured: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: captured.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("aiokafka").addHandler(handler)

    async def attempt() -> None:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=bootstrap, request_timeout_ms=5000, **security.kafka_security_kwargs()
        )
        try:
            await admin.start()
            await admin.list_topics()
        finally:
            await admin.close()

    try:
        asyncio.run(attempt())
    except (KafkaError, OSError) as exc:
        return "\n".join([f"{type(exc).__name__}: {exc}", *captured])
    finally:
        logging.getLogger("aiokafka").removeHandler(handler)
    return None


# --- TLS ---------------------------------------------------------------------------------------------------


def test_mutual_tls_carries_the_worker_and_its_client(
    own_broker: Callable[..., OwnBroker],
    pki: Pki,
    scorer: Scorer,
    tiny_llama_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    tls = TlsProxy(pki.server_cert, pki.server_key, client_ca=pki.ca)
    with secured_broker(own_broker, tls) as bootstrap:
        settings = fast_settings(bootstrap, tiny_llama_dir, Names.unique("mtls"), **pki.mtls())
        results, exposition = round_trip(settings, scorer)
    assert_scored(results, scorer)
    # Admin, worker consumer and producer, client consumer and producer: every connection showed the cert.
    assert len(tls.client_subjects) >= 5 and set(tls.client_subjects) == {"score-worker client"}
    assert not tls.refused
    assert pki.client_key_password not in caplog.text + exposition


def test_tls_refuses_a_client_without_a_certificate(own_broker: Callable[..., OwnBroker], pki: Pki) -> None:
    tls = TlsProxy(pki.server_cert, pki.server_key, client_ca=pki.ca)
    with secured_broker(own_broker, tls) as bootstrap:
        error = connect_error(bootstrap, KafkaSecurity(security_protocol="SSL", ssl_cafile=pki.ca))
    assert error is not None
    assert not tls.client_subjects
    assert tls.refused and all("CERTIFICATE" in reason.upper() for reason in tls.refused), tls.refused


def test_a_broker_certificate_from_an_untrusted_ca_fails_with_the_reason(
    own_broker: Callable[..., OwnBroker], pki: Pki
) -> None:
    tls = TlsProxy(pki.server_cert, pki.server_key, client_ca=pki.ca)
    with secured_broker(own_broker, tls) as bootstrap:
        error = connect_error(bootstrap, KafkaSecurity(**pki.mtls(ssl_cafile=pki.other_ca)))  # type: ignore[arg-type]
    # The exception only says "Unable to bootstrap"; the reason is in the Kafka client's error line.
    assert error is not None and "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed" in error, error
    assert not tls.client_subjects


def test_the_broker_host_name_is_checked_unless_turned_off(
    own_broker: Callable[..., OwnBroker], pki: Pki
) -> None:
    tls = TlsProxy(pki.wrong_host_cert, pki.wrong_host_key, client_ca=pki.ca)
    with secured_broker(own_broker, tls) as bootstrap:
        checked = connect_error(bootstrap, KafkaSecurity(**pki.mtls()))  # type: ignore[arg-type]
        assert not tls.client_subjects
        unchecked = connect_error(bootstrap, KafkaSecurity(**pki.mtls(ssl_check_hostname=False)))  # type: ignore[arg-type]
    assert checked is not None and "IP address mismatch" in checked, checked
    assert unchecked is None
    assert set(tls.client_subjects) == {"score-worker client"}


# --- SASL --------------------------------------------------------------------------------------------------


def sasl(mechanism: str, password: str = PASSWORD, protocol: str = "SASL_PLAINTEXT") -> dict[str, object]:
    return {
        "security_protocol": protocol,
        "sasl_mechanism": mechanism,
        "sasl_username": USER,
        "sasl_password": password,
    }


@pytest.mark.parametrize("mechanism", SaslProxy.MECHANISMS)
def test_sasl_carries_the_worker_and_its_client(
    own_broker: Callable[..., OwnBroker],
    mechanism: str,
    scorer: Scorer,
    tiny_llama_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Everything at DEBUG but the Kafka client, which the command line holds at WARNING: at DEBUG it logs
    # every request, PLAIN's password included. INFO still shows its "Authenticated as" lines.
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.INFO, logger="aiokafka")
    proxy = SaslProxy({USER: PASSWORD})
    with secured_broker(own_broker, proxy) as bootstrap:
        settings = fast_settings(bootstrap, tiny_llama_dir, Names.unique("sasl"), **sasl(mechanism))
        results, exposition = round_trip(settings, scorer)
    assert_scored(results, scorer)
    assert {(user, used) for user, used, _ in proxy.authenticated} == {(USER, mechanism)}
    clients = {client for _, _, client in proxy.authenticated}
    assert clients == {"score-worker", "score-client", "score-client-results"}, clients
    assert not proxy.failures
    assert f"Authenticated as {USER} via {mechanism}" in caplog.text  # the log did see the exchange
    assert PASSWORD not in caplog.text + exposition


@pytest.mark.parametrize("mechanism", SaslProxy.MECHANISMS)
def test_sasl_refuses_a_wrong_password(
    own_broker: Callable[..., OwnBroker], mechanism: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.INFO, logger="aiokafka")
    proxy = SaslProxy({USER: PASSWORD})
    with secured_broker(own_broker, proxy) as bootstrap:
        error = connect_error(bootstrap, KafkaSecurity(**sasl(mechanism, WRONG_PASSWORD)))  # type: ignore[arg-type]
    assert error is not None and "[Error 58] SaslAuthenticationFailed" in error, error
    assert not proxy.authenticated
    assert proxy.failures and f"for {USER} ({mechanism})" in proxy.failures[0], proxy.failures
    assert WRONG_PASSWORD not in error + caplog.text and PASSWORD not in error + caplog.text


def test_the_sasl_proxy_refuses_a_client_that_skips_authentication(
    own_broker: Callable[..., OwnBroker],
) -> None:
    proxy = SaslProxy({USER: PASSWORD})
    with secured_broker(own_broker, proxy) as bootstrap:
        error = connect_error(bootstrap, KafkaSecurity())
    assert error is not None
    assert not proxy.authenticated
    assert proxy.failures and "before authentication" in proxy.failures[0], proxy.failures


# --- SASL_SSL, every command -------------------------------------------------------------------------------


def test_sasl_ssl_worker_and_every_command_keep_their_secrets(
    own_broker: Callable[..., OwnBroker],
    pki: Pki,
    tiny_llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`score-worker run` at DEBUG with its secrets in the environment, then submit, produce-samples and the
    lag exporter with the same environment: all through mutual TLS and SASL PLAIN (the mechanism that sends
    the password itself), none printing a secret."""
    tls = TlsProxy(pki.server_cert, pki.server_key, client_ca=pki.ca)
    proxy = SaslProxy({USER: PASSWORD})
    names = Names.unique("sasl-ssl")
    metrics_port = free_port()
    with secured_broker(own_broker, tls, proxy) as bootstrap:
        security = {**pki.mtls(), **sasl("PLAIN", protocol="SASL_SSL")}
        env = _environment(bootstrap, tiny_llama_dir, names, metrics_port, security)
        for name, value in env.items():
            if name.startswith(ENV_PREFIX):
                monkeypatch.setenv(name, value)
        settings = fast_settings(bootstrap, tiny_llama_dir, names, **security)
        asyncio.run(ensure_topics(settings))
        worker = subprocess.Popen(
            [sys.executable, "-m", "worker", "--log-level", "DEBUG", "run"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            _submit_and_check(tmp_path, names)
            assert _produce_samples(tmp_path, bootstrap, names) == 0
            lag = _lag_exporter_poll(bootstrap, names)
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
        finally:
            worker.send_signal(signal.SIGTERM)
            out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err[-3000:]
    assert " DEBUG " in err  # the worker did log at DEBUG
    printed = out + err + metrics.decode() + lag + "".join(capsys.readouterr())
    for secret in (PASSWORD, pki.client_key_password):
        assert secret not in printed
    clients = {client for _, _, client in proxy.authenticated}
    assert clients == {"score-worker", "score-client", "score-client-results", "score-samples",
                       "score-lag-exporter"}, clients  # fmt: skip
    assert {(user, used) for user, used, _ in proxy.authenticated} == {(USER, "PLAIN")}
    assert len(tls.client_subjects) >= len(proxy.authenticated) and not tls.refused


def _environment(
    bootstrap: str, model_dir: Path, names: Names, metrics_port: int, security: dict[str, object]
) -> dict[str, str]:
    values = fast_values(bootstrap, model_dir, names, metrics_port=metrics_port, metrics_host="127.0.0.1")
    return settings_env({**values, **security})


def _submit_and_check(tmp_path: Path, names: Names) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"request_id": r.request_id, "items": list(r.items)}) + "\n"
                                for r in REQUESTS))  # fmt: skip
    output = tmp_path / "results.jsonl"
    # Bootstrap servers and topics come from the environment, as the security settings do.
    assert cli_main(["submit", "--input", str(requests), "--output", str(output), "--timeout", "120"]) == 0
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["request_id"] for r in results] == [r.request_id for r in REQUESTS]
    assert {r["status"] for r in results} == {"ok"}


def _produce_samples(tmp_path: Path, bootstrap: str, names: Names) -> int:
    return cli_main([
        "produce-samples", "--bootstrap-servers", bootstrap, "--topic", names.requests, "--count", "3",
        "--rate", "50", "--heartbeat-file", str(tmp_path / "alive"),
    ])  # fmt: skip


def _lag_exporter_poll(bootstrap: str, names: Names) -> str:
    """One poll of the lag exporter with the environment's security; returns its metrics."""
    from worker.config import security_from_environment

    async def poll() -> str:
        options = security_from_environment().kafka_security_kwargs()
        exporter = LagExporter(bootstrap, [names.group], [names.requests], 1.0, options)
        try:
            await exporter.start()
            await exporter.poll()
        finally:
            await exporter.stop()
        from prometheus_client import generate_latest

        return generate_latest(exporter.metrics.registry).decode()

    exposition = asyncio.run(poll())
    assert f'group="{names.group}"' in exposition
    return exposition

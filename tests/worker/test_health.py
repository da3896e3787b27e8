"""/healthz and /readyz of a real worker: not ready before its model loads, ready after, not while the
broker is gone; and the metric names and labels follow Prometheus' conventions."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from brokers import OwnBroker
from prometheus_client.parser import text_string_to_metric_families
from worker_testkit import Names, fast_settings

from models import BatchStats, ModelInfo, Scorer, ScorerConfig
from schemas import ScoreResult
from worker.broker import free_port
from worker.metrics import BOUNDED_LABELS, LATENCY_BUCKETS, ResultTally, WorkerMetrics
from worker.publisher import OutRecord
from worker.service import WorkerService

# The model info metric's description labels: one series per process, so their values are not bounded.
DESCRIPTION_LABELS = {
    "architecture",
    "dtype",
    "device",
    "hidden_size",
    "attention",
    "attention_kernel",
    "pooling",
    "compiled",
    "cuda_graphs",
    "quantization",
    "fused_mlp",
}

pytestmark = pytest.mark.slow


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


async def _until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await asyncio.to_thread(check):
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def test_readiness_follows_model_group_and_broker(
    tiny_llama_dir: Path, own_broker: Callable[..., OwnBroker]
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    gate = threading.Event()

    def load() -> Scorer:
        assert gate.wait(60), "the test never released the model load"
        return Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))

    def status(path: str) -> int:
        return _get(base + path)[0]

    def ready_gauge() -> float:
        for family in text_string_to_metric_families(_get(base + "/metrics")[1].decode()):
            if family.name == "score_worker_ready":
                return float(family.samples[0].value)
        raise AssertionError("no score_worker_ready")

    async def scenario(broker: OwnBroker) -> None:
        settings = fast_settings(
            broker.bootstrap_servers, tiny_llama_dir, Names.unique("health"), metrics_port=port,
            metrics_host="127.0.0.1", broker_probe_interval_ms=300, worker_id="health-worker",
        )  # fmt: skip
        service = WorkerService(settings, load)
        task = asyncio.create_task(service.run())
        try:
            await _until(lambda: status("/healthz") == 200, 30, "/healthz")
            code, body = await asyncio.to_thread(_get, base + "/readyz")
            assert code == 503
            assert json.loads(body)["checks"]["model_loaded"] is False
            assert await asyncio.to_thread(ready_gauge) == 0
            gate.set()
            await _until(lambda: status("/readyz") == 200, 60, "ready once the model is loaded")
            assert await asyncio.to_thread(ready_gauge) == 1
            broker.stop()
            await _until(lambda: status("/readyz") == 503, 30, "not ready with the broker gone")
            code, body = await asyncio.to_thread(_get, base + "/readyz")
            assert json.loads(body)["checks"]["broker_reachable"] is False
            assert await asyncio.to_thread(status, "/healthz") == 200  # the process itself is fine
            assert await asyncio.to_thread(ready_gauge) == 0
        finally:
            gate.set()
            service.stop()
            await asyncio.wait_for(task, 60)
        assert await asyncio.to_thread(status, "/healthz") == 0  # the port is closed after a stop

    asyncio.run(scenario(own_broker()))


def test_health_server_answers_only_its_paths(kafka_bootstrap: str, tiny_llama_dir: Path) -> None:
    import http.client

    async def scenario() -> None:
        port = free_port()
        settings = fast_settings(
            kafka_bootstrap,
            tiny_llama_dir,
            Names.unique("paths"),
            metrics_port=port,
            metrics_host="127.0.0.1",
        )
        service = WorkerService(settings, lambda: Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
        task = asyncio.create_task(service.run())

        def ask(method: str, path: str) -> tuple[int, bytes]:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request(method, path)
            response = connection.getresponse()
            return response.status, response.read()

        try:
            await _until(lambda: _get(f"http://127.0.0.1:{port}/healthz")[0] == 200, 30, "/healthz")
            assert (await asyncio.to_thread(ask, "GET", "/nope"))[0] == 404
            assert (await asyncio.to_thread(ask, "POST", "/metrics"))[0] == 405
            assert await asyncio.to_thread(ask, "HEAD", "/healthz") == (200, b"")
            code, body = await asyncio.to_thread(ask, "GET", "/metrics?x=1")
            assert code == 200 and b"score_worker_ready" in body
        finally:
            service.stop()
            await asyncio.wait_for(task, 60)

    asyncio.run(scenario())


def test_metric_names_units_and_labels_follow_the_conventions() -> None:
    metrics = WorkerMetrics("w-1")
    metrics.bind_model(ModelInfo("m", "LlamaForSequenceClassification", "bfloat16", "cuda:0", 64), 8192)
    metrics.model_batch(BatchStats(2, 3, 30, 0.01, 0.001, 1, {"float16": 128}))
    tally = ResultTally()
    result = ScoreResult.failure("request-id-must-not-be-a-label", "INVALID_REQUEST", "bad", model="m")
    tally.add(OutRecord("t", b"request-id-must-not-be-a-label", b"v", [], result), 0)
    metrics.published(tally, 0.002)
    metrics.gc_paused(2, 0.2)
    exposition = metrics.exposition().decode()
    assert "request-id-must-not-be-a-label" not in exposition
    assert 'score_worker_gc_pause_seconds_count{generation="2",model="m",worker="w-1"} 1.0' in exposition
    kinds: Counter[str] = Counter()
    for family in text_string_to_metric_families(exposition):
        if family.name.startswith("process_"):
            continue
        assert family.name.startswith("score_worker_"), family.name
        kinds[family.type] += 1
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}
            if family.name.endswith("_info"):  # the model's description: one series per process
                labels -= DESCRIPTION_LABELS
            assert labels <= BOUNDED_LABELS, (family.name, labels)
            if family.type == "counter" and not sample.name.endswith("_created"):
                assert sample.name.endswith("_total"), sample.name
        if family.type == "histogram" and family.name.endswith("_seconds"):
            bounds = sorted({float(s.labels["le"]) for s in family.samples if "le" in s.labels})
            assert bounds[0] <= 0.001 and bounds[-2] >= 10, family.name  # bounds[-1] is +Inf
    assert kinds["histogram"] >= 11 and kinds["counter"] >= 12 and kinds["gauge"] >= 5
    assert LATENCY_BUCKETS[0] == 0.001 and LATENCY_BUCKETS[-1] >= 30


def test_layer_compilations_while_serving_are_counted() -> None:
    metrics = WorkerMetrics("w-1")
    metrics.bind_model(ModelInfo("m", "LlamaForSequenceClassification", "bfloat16", "cuda:0", 64), 8192)
    sample = 'score_worker_layer_compilations_total{model="m",worker="w-1"}'
    assert f"{sample} 0.0" in metrics.exposition().decode()  # from the start, for the dashboard's panel
    metrics.model_batch(BatchStats(2, 3, 30, 0.01, 0.001, 1, compiled_graphs=3))
    metrics.model_batch(BatchStats(1, 1, 9, 0.01, 0.001, 0))
    assert f"{sample} 3.0" in metrics.exposition().decode()

"""A real Prometheus scrapes a real worker and the lag exporter while requests flow through a real broker.

Then every query of the Grafana dashboard, its variables substituted, must return data (and carry the labels
its legend names), and the metrics must agree with what was sent and what was published.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from worker_testkit import Names, produce, read_topic, request_record

from schemas import HiddenDType, ScoreRequest, decode_result
from worker.broker import free_port
from worker.topics import create_missing_topics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "grafana"))
import dashboard  # noqa: E402

DEVICE = os.environ.get("SCORE_WORKER_TEST_DEVICE", "cpu")
WORKER_ID = "obs-worker"
DTYPES = [None, HiddenDType.FLOAT32, HiddenDType.FLOAT16, HiddenDType.BFLOAT16]
GPU_ONLY = "_gpu_memory_"  # series a worker exports only when its model runs on CUDA


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (apt-get install prometheus); ./dev.sh installs it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def get(url: str | urllib.request.Request, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def wait_for(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@dataclass
class Stack:
    prometheus: str
    worker_port: int
    names: Names
    model: str
    gateway_port: int

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        status, body = get(url)
        assert status == 200, f"Prometheus refused {expr!r}: {status} {body[:300]!r}"
        payload = json.loads(body)
        assert payload["status"] == "success", payload
        return list(payload["data"]["result"])

    def value(self, expr: str) -> float:
        result = self.query(expr)
        return sum(float(r["value"][1]) for r in result)


def _spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _requests(count: int) -> list[ScoreRequest]:
    requests = []
    for i in range(count):
        dtype = DTYPES[i % len(DTYPES)]
        hidden = {} if dtype is None else {"return_pooled_hidden_states": True, "hidden_states_dtype": dtype}
        items: Any = (f"item {i} of the stream", "a second item") if i % 3 == 0 else (f"single item {i}",)
        if i % 10 == 9:
            items = ((5, 6, 1_000_000),)  # token id out of range: an error result, no model run
        requests.append(ScoreRequest(request_id=f"obs-{i:03d}", items=items, **hidden))  # type: ignore[arg-type]
    return requests


@pytest.fixture(scope="module")
def stack(
    kafka_bootstrap: str, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    binary = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("observability")
    names = Names.unique("obs")
    worker_port, exporter_port, prom_port, gateway_port = free_port(), free_port(), free_port(), free_port()
    # The gateway calls topics of its own that no worker reads: its calls end in 503/504 and leave the
    # worker's counts (checked exactly below) alone, while every gateway series gets its samples.
    gateway_names = Names.unique("obs-gateway")
    asyncio.run(
        create_missing_topics(
            {"bootstrap_servers": kafka_bootstrap}, [gateway_names.requests, gateway_names.results], 1, 1
        )
    )
    env = {
        **os.environ,
        "SCORE_WORKER_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "SCORE_WORKER_MODEL_DIR": str(tiny_llama_dir),
        "SCORE_WORKER_REQUESTS_TOPIC": names.requests,
        "SCORE_WORKER_RESULTS_TOPIC": names.results,
        "SCORE_WORKER_DLQ_TOPIC": names.dlq,
        "SCORE_WORKER_GROUP_ID": names.group,
        "SCORE_WORKER_WORKER_ID": WORKER_ID,
        "SCORE_WORKER_DEVICE": DEVICE,
        "SCORE_WORKER_METRICS_PORT": str(worker_port),
        "SCORE_WORKER_METRICS_HOST": "127.0.0.1",
        "SCORE_WORKER_SESSION_TIMEOUT_MS": "1500",
        "SCORE_WORKER_HEARTBEAT_INTERVAL_MS": "300",
        "SCORE_WORKER_COMMIT_INTERVAL_MS": "200",
        "SCORE_WORKER_TOPIC_PARTITIONS": "3",
        "SCORE_WORKER_BROKER_PROBE_INTERVAL_MS": "500",
    }
    config = tmp / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: score-worker\n    static_configs: [{{targets: ['127.0.0.1:{worker_port}']}}]\n"
        f"  - job_name: score-worker-lag\n    static_configs: [{{targets: ['127.0.0.1:{exporter_port}']}}]\n"
        f"  - job_name: score-gateway\n    static_configs: [{{targets: ['127.0.0.1:{gateway_port}']}}]\n"
    )
    processes = [
        _spawn([sys.executable, "-m", "worker", "run"], tmp / "worker.log", env),
        _spawn(
            [sys.executable, "-m", "worker", "lag-exporter", "--bootstrap-servers", kafka_bootstrap,
             "--group", names.group, "--topic", names.requests, "--port", str(exporter_port),
             "--host", "127.0.0.1", "--interval", "0.5"],
            tmp / "exporter.log",
        ),
        _spawn(
            [sys.executable, "-m", "worker", "gateway", "--bootstrap-servers", kafka_bootstrap,
             "--requests-topic", gateway_names.requests, "--results-topic", gateway_names.results,
             "--host", "127.0.0.1", "--port", str(gateway_port), "--probe-interval", "0.5"],
            tmp / "gateway.log",
        ),
        _spawn(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            tmp / "prometheus.log",
        ),
    ]  # fmt: skip
    try:
        prometheus = f"http://127.0.0.1:{prom_port}"
        wait_for(lambda: get(f"{prometheus}/-/ready")[0] == 200, 60, "Prometheus to be ready")
        wait_for(
            lambda: get(f"http://127.0.0.1:{worker_port}/readyz")[0] == 200, 120, "the worker to be ready"
        )
        wait_for(
            lambda: get(f"http://127.0.0.1:{gateway_port}/metrics")[0] == 200, 120, "the gateway to serve"
        )
        yield Stack(prometheus, worker_port, names, tiny_llama_dir.resolve().name, gateway_port)
    finally:
        for process in processes:
            _stop(process)
        for log in ("worker.log", "exporter.log", "gateway.log"):
            print(f"--- {log}\n{(tmp / log).read_text(errors='replace')[-3000:]}")


@dataclass(frozen=True)
class Sent:
    requests: int
    results: int
    statuses: Counter[str]
    hidden_bytes: Counter[str]


@pytest.fixture(scope="module")
def sent(stack: Stack, kafka_bootstrap: str) -> Sent:
    """Produce a mixed stream plus one undecodable record; read every result back."""
    requests = _requests(40)
    records = [request_record(r) for r in requests]
    records.append((b"broken", b"\xc1 not msgpack", [("x-request-id", b"obs-broken")]))
    asyncio.run(produce(kafka_bootstrap, stack.names.requests, records))
    got = asyncio.run(read_topic(kafka_bootstrap, stack.names.results, len(records), timeout_s=120))
    results = [decode_result(r.value) for r in got]
    assert sorted(r.request_id for r in results) == sorted([r.request_id for r in requests] + ["obs-broken"])
    _call_the_gateway(stack.gateway_port)
    hidden: Counter[str] = Counter()
    for result in results:
        for tensor in result.pooled_hidden_states or ():
            hidden[tensor.dtype] += len(tensor.data)
    assert set(hidden) == {"float32", "float16", "bfloat16"}
    return Sent(len(records), len(results), Counter(r.status.value for r in results), hidden)


def _call_the_gateway(port: int) -> None:
    """A few calls through the gateway, which has no worker: each ends in 503 or 504 within its deadline."""
    body = json.dumps({"items": ["through the gateway"]}).encode()
    for _ in range(3):
        call = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/score", data=body, method="POST",
            headers={"Content-Type": "application/json", "X-Request-Timeout": "0.5"},
        )  # fmt: skip
        status, _ = get(call)
        assert status in (503, 504), status


# The counters the dashboards take rate() of, their series made at their first sample.
RATE_COUNTERS = (
    "score_worker_results_total",
    "score_worker_dead_letters_total",
    "score_worker_hidden_state_copied_bytes_total",
    "score_worker_hidden_state_published_bytes_total",
)


def _unsettled(stack: Stack, sent: Sent) -> list[str]:
    """Which of the stream's end states Prometheus does not show yet (empty when all are there)."""
    sel = f'worker="{WORKER_ID}"'
    group = f'group="{stack.names.group}"'
    checks = {
        "results": stack.value(f"sum(score_worker_results_total{{{sel}}})") == sent.results,
        "worker lag 0": stack.value(f"sum(score_worker_consumer_lag{{{sel}}})") == 0,
        "exporter lag 0": stack.value(f"sum(score_worker_group_lag{{{group}}})") == 0,
        "exporter partitions": len(stack.query(f"score_worker_group_lag{{{group}}}")) == 3,
        # rate() needs two samples of each series in its window: a series born in the stream's last
        # scrape (at its final value) has one until the next scrape lands, however long the worker has run
        **{
            f"two samples of {name}": stack.value(f"min(count_over_time({name}{{{sel}}}[10m]))") >= 2
            for name in RATE_COUNTERS
        },
        "two samples of score_gateway_requests_total": stack.value(
            "min(count_over_time(score_gateway_requests_total[10m]))"
        )
        >= 2,
    }
    return [name for name, ok in checks.items() if not ok]


def settle(stack: Stack, sent: Sent) -> None:
    deadline = time.monotonic() + 60
    while missing := _unsettled(stack, sent):
        assert time.monotonic() < deadline, f"metrics never showed: {missing}"
        time.sleep(0.5)


def test_metrics_agree_with_what_was_sent_and_published(stack: Stack, sent: Sent) -> None:
    settle(stack, sent)
    sel = f'worker="{WORKER_ID}"'
    assert stack.value(f"sum(score_worker_requests_total{{{sel}}})") == sent.requests
    for status, count in sent.statuses.items():
        assert stack.value(f'sum(score_worker_results_total{{{sel}, status="{status}"}})') == count
    assert stack.value(f'score_worker_results_total{{{sel}, code="TOKEN_ID_OUT_OF_RANGE"}}') == 4
    assert stack.value(f'score_worker_dead_letters_total{{{sel}, reason="MALFORMED_MESSAGE"}}') == 1
    assert stack.value(f"score_worker_e2e_latency_seconds_count{{{sel}}}") == sent.results
    for dtype, size in sent.hidden_bytes.items():
        published = f'score_worker_hidden_state_published_bytes_total{{{sel}, dtype="{dtype}"}}'
        copied = f'score_worker_hidden_state_copied_bytes_total{{{sel}, dtype="{dtype}"}}'
        assert stack.value(published) == size, dtype
        assert stack.value(copied) == size, dtype  # nothing was too large to publish
    assert stack.value(f"score_worker_inflight_requests{{{sel}}}") == 0
    assert stack.value(f"score_worker_inflight_bytes{{{sel}}}") == 0
    assert stack.value(f"score_worker_ready{{{sel}}}") == 1
    assert stack.value(f"score_worker_assigned_partitions{{{sel}}}") == 3
    assert stack.value(f"score_worker_commits_total{{{sel}}}") >= 1


def _substitute(expr: str, stack: Stack) -> str:
    # Grafana's $__rate_interval is a minute or so; ten here, so that a rate has its two samples however
    # many one-second scrapes a busy host let time out since the traffic (an instant value still needs one).
    return (
        expr.replace("$__rate_interval", "10m")
        .replace("$model", stack.model)
        .replace("$worker", WORKER_ID)
        .replace("$group", stack.names.group)
    )


def test_every_dashboard_query_returns_data(stack: Stack, sent: Sent) -> None:
    settle(stack, sent)
    board = dashboard.build()
    checked, empty = 0, []
    for title, expr in dashboard.targets(board):
        result = stack.query(_substitute(expr, stack))
        if GPU_ONLY in expr and DEVICE == "cpu":
            assert result == [], f"{title}: a CPU worker must not export GPU memory"
            continue
        if not result:
            empty.append(f"{title}: {expr}")
            continue
        checked += 1
        legend_labels = set(re.findall(r"\{\{(\w+)\}\}", _legend(board, expr)))
        for series in result:
            missing = legend_labels - set(series["metric"])
            assert not missing, f"{title}: {expr} returns no label {missing}"
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert checked >= 60


def _legend(board: dict[str, Any], expr: str) -> str:
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            if target["expr"] == expr:
                return str(target.get("legendFormat", ""))
    return ""


def test_dashboard_variables_resolve(stack: Stack, sent: Sent) -> None:
    settle(stack, sent)
    values = {}
    for variable in dashboard.build()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"])
        assert match, variable
        series = stack.query(_substitute(match.group(1), stack))
        values[variable["name"]] = {s["metric"].get(match.group(2)) for s in series}
    assert stack.model in values["model"]
    assert WORKER_ID in values["worker"]
    assert stack.names.group in values["group"]


def test_committed_dashboard_json_is_the_generators_output() -> None:
    committed = (ROOT / "deploy" / "grafana" / "dashboards" / "score-worker.json").read_text()
    assert committed == dashboard.render(), "run: python deploy/grafana/dashboard.py"

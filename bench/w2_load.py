"""W2's load generator, run in its own process: the request stream, a Kafka producer and a results reader.

It runs three phases against a worker that is already consuming: a warm-up, saturation (everything produced
as fast as possible) and latency (produced at a fixed share of the saturation rate), and returns one
timestamped report per phase. Its CPU work (encoding, decoding results) stays out of the worker's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import ResultStatus, SchemaError, ScoreRequest, decode_result, encode_request, request_headers
from worker.topics import topic_partitions


@dataclass(frozen=True)
class LoadConfig:
    """What the load process needs; every time is time.monotonic (one clock for all processes on Linux)."""

    bootstrap: str
    requests_topic: str
    results_topic: str
    vocab_size: int
    requests: int
    seed: int = 2
    min_len: int = 32
    max_len: int = 512
    max_items: int = 4
    warmup_requests: int = 64
    warmup_timeout_s: float = 90.0
    saturation_timeout_s: float = 150.0
    latency_fraction: float = 0.5
    latency_seconds: float = 20.0
    latency_timeout_s: float = 30.0
    sample: int = 24  # saturation results returned whole, for the float32 check
    one_in_flight: int = 200  # requests sent one after another's result, after each restart
    # Worker restarts (names in bench/w2.py's VARIANTS) each followed by the saturation phase again, after
    # the other phases: the same load against other settings of the same worker, in the same run.
    variants: tuple[str, ...] = ()
    # Absolute time.monotonic() by which every phase must be over (results included): bounds the run.
    deadline: float = math.inf
    # The least time left before `deadline` for a one-in-flight, relay or variant phase to start.
    phase_margin_s: float = 30.0
    # The paced phase again after a restart with a short fetch wait (a restart and the phase's seconds).
    short_fetch_latency: bool = True


# The one-request-in-flight phases run on topics of their own. The embedded broker (Tansu 0.6, memory
# storage) reads a partition more slowly the more record batches it holds: about 2 ms more per fetch for
# every 1000 batches (a 100-byte record took 4.8 ms from produce to read on a fresh partition, 14.1 ms
# after 5000 single-record batches; on a fresh topic beside it, 4.0 ms), and the phases before these leave
# thousands of small batches on the request and result topics. Kafka finds an offset through an index.
ONE_IN_FLIGHT_TOPICS = {
    "one_in_flight": ("score.requests.one", "score.results.one"),
    "low_latency": ("score.requests.low", "score.results.low"),
}
# The broker alone, one record in flight: in place of the worker, a relay with the worker's fetch and
# produce settings passes each record on (bench/w2.py's Relay), at the fetch waits of the two phases above.
# What that round trip takes is the broker's share of a request's latency; the rest is the worker's.
RELAY_TOPICS = ("score.requests.relay", "score.results.relay")
RELAYS = {"relay_wait10": 10, "relay_wait2": 2}


def make_workload(config: LoadConfig, count: int | None = None) -> list[ScoreRequest]:
    """W2's requests: 1-4 items of 32-512 token ids (uniform), half asking for pooled hidden states."""
    rng = np.random.default_rng(config.seed)
    n = config.requests if count is None else count
    items_per = rng.integers(1, config.max_items + 1, n)
    hidden = np.zeros(n, dtype=bool)
    hidden[rng.permutation(n)[: n // 2]] = True
    requests = []
    for i in range(n):
        lengths = rng.integers(config.min_len, config.max_len + 1, int(items_per[i]))
        items = tuple(tuple(rng.integers(1, config.vocab_size, int(length)).tolist()) for length in lengths)
        requests.append(
            ScoreRequest(request_id=f"w2-{i}", items=items, return_pooled_hidden_states=bool(hidden[i]))
        )
    return requests


def w2_requests(count: int, vocab_size: int, item_tokens: int | None = None) -> list[ScoreRequest]:
    """`count` of W2's requests (make_workload's), their items cut to `item_tokens` where given (the CPU
    runs of delivery.py and compression.py cut them: a forward's cost grows with them)."""
    topics = {"bootstrap": "", "requests_topic": "", "results_topic": ""}
    requests = make_workload(LoadConfig(**topics, vocab_size=vocab_size, requests=count))
    if item_tokens is None:
        return requests
    return [dataclasses.replace(r, items=tuple(item[:item_tokens] for item in r.items)) for r in requests]


def _items(request: ScoreRequest) -> int:
    return len(request.items)


def _tokens(request: ScoreRequest) -> int:
    return sum(len(item) for item in request.items)


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/max/mean in milliseconds (empty dict when nothing arrived)."""
    if not latencies_s:
        return {}
    ms = np.asarray(latencies_s) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    values = {"p50_ms": p50, "p90_ms": p90, "p99_ms": p99, "max_ms": ms.max(), "mean_ms": ms.mean()}
    return {key: float(value) for key, value in values.items()}


async def assign_whole_topic(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """Assign every partition of `topic` (waiting up to 5 s for it to exist) to a started `consumer`."""
    partitions = await topic_partitions(consumer, topic)
    for _ in range(50):
        if partitions:
            break
        await asyncio.sleep(0.1)
        partitions = await topic_partitions(consumer, topic)
    if not partitions:
        raise RuntimeError(f"topic {topic} does not exist")
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    consumer.assign(tps)
    return tps


class Loader:
    """One producer and one results reader (manual assignment, no group) shared by the phases."""

    def __init__(self, config: LoadConfig, keyed: bool = False) -> None:
        """`keyed`: the records read back are a relay's, not results: matched to requests by their key."""
        self._config = config
        self._keyed = keyed
        self._producer = AIOKafkaProducer(
            bootstrap_servers=config.bootstrap,
            client_id="w2-load",
            acks="all",
            linger_ms=1,
            max_batch_size=256 * 1024,
            enable_idempotence=False,
        )
        # Short fetch waits: the reader's own idle poll must not add to the measured latency.
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=config.bootstrap,
            client_id="w2-results",
            group_id=None,
            enable_auto_commit=False,
            fetch_max_wait_ms=2,
            max_partition_fetch_bytes=4 * 1024 * 1024,
        )
        self._sent: dict[str, float] = {}
        self._wants_hidden: dict[str, bool] = {}
        self._received: dict[str, float] = {}
        # Wall clock at send and at receipt, and the result record's timestamp (the worker's producer sets
        # it when it sends the result): together they split a latency into the worker's side and the return.
        self._sent_wall: dict[str, float] = {}
        self._received_wall: dict[str, float] = {}
        self._result_created: dict[str, float] = {}
        self._bad: list[str] = []
        # Results kept whole, to be checked against float32 by the main process: id -> scores, hidden.
        self.keep: set[str] = set()
        self.kept: dict[str, dict[str, Any]] = {}
        self._arrived = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._consumer.start()
        tps = await assign_whole_topic(self._consumer, self._config.results_topic)
        # A fresh broker: the results topic holds only this run's results, so read it from the start.
        await self._consumer.seek_to_beginning(*tps)
        await self._producer.start()
        self._reader = asyncio.create_task(self._read())

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self._producer.stop()
        await self._consumer.stop()

    async def _read(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            now, wall = time.monotonic(), time.time()
            for records in batches.values():
                for record in records:
                    if self._keyed:
                        rid = self._relayed((record.key or b"").decode(errors="replace"), now)
                    else:
                        rid = self._handle(record.value or b"", now)
                    if rid is not None:
                        self._received_wall[rid] = wall
                        self._result_created[rid] = record.timestamp / 1000
            if batches:
                self._arrived.set()

    def _handle(self, value: bytes, now: float) -> str | None:
        """Records a result's first arrival; returns its id, or None when it is not one to count."""
        try:
            result = decode_result(value)
        except SchemaError as exc:
            self._bad.append(f"undecodable result: {exc.message}")
            return None
        rid = result.request_id
        if rid not in self._sent or rid in self._received:
            return None  # another phase's id, or a redelivered duplicate: only the first arrival counts
        self._received[rid] = now
        hidden = result.pooled_hidden_states is not None
        if rid in self.keep:
            states = result.pooled_hidden_states
            self.kept[rid] = {
                "scores": [list(row) for row in result.scores],
                "hidden": None
                if states is None
                else [t.to_numpy().astype(np.float32).tolist() for t in states],
            }
        if result.status is not ResultStatus.OK or hidden != self._wants_hidden[rid]:
            self._bad.append(f"{rid}: {result.status.value} {result.error} hidden={hidden}")
        return rid

    def _relayed(self, rid: str, now: float) -> str | None:
        """Records a relayed record's first arrival (keyed by the request id); None if not one to count."""
        if rid not in self._sent or rid in self._received:
            return None
        self._received[rid] = now
        return rid

    def _encode(self, requests: Sequence[ScoreRequest], prefix: str) -> list[tuple[str, bytes, bool]]:
        out = []
        for i, request in enumerate(requests):
            renamed = dataclasses.replace(request, request_id=f"{prefix}-{i}")
            out.append((renamed.request_id, encode_request(renamed), request.return_pooled_hidden_states))
        return out

    async def _send(self, rid: str, value: bytes, hidden: bool) -> asyncio.Future[Any]:
        self._wants_hidden[rid] = hidden
        self._sent[rid] = time.monotonic()
        self._sent_wall[rid] = time.time()
        future: asyncio.Future[Any] = await self._producer.send(
            self._config.requests_topic, value, rid.encode(), headers=request_headers(rid)
        )
        return future

    async def wait_results(self, ids: Sequence[str], deadline: float) -> None:
        """Return once every id has its result, or at the deadline."""
        first_missing = 0
        while True:
            self._arrived.clear()  # before the check: an arrival after it then wakes the wait below
            # Results come roughly in order: advancing one cursor keeps each check cheap.
            while first_missing < len(ids) and ids[first_missing] in self._received:
                first_missing += 1
            remaining = deadline - time.monotonic()
            if first_missing == len(ids) or remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), min(remaining, 0.5))

    def _phase_report(
        self, requests: Sequence[ScoreRequest], ids: Sequence[str], **extra: float
    ) -> dict[str, Any]:
        done = [i for i, rid in enumerate(ids) if rid in self._received]
        latencies = [self._received[ids[i]] - self._sent[ids[i]] for i in done]
        last = max((self._received[ids[i]] for i in done), default=float("nan"))
        return {
            "requests": len(ids),
            "completed": len(done),
            "items": sum(_items(r) for r in requests),
            "items_completed": sum(_items(requests[i]) for i in done),
            "tokens": sum(_tokens(r) for r in requests),
            "tokens_completed": sum(_tokens(requests[i]) for i in done),
            "t_first_send": self._sent[ids[0]],
            "t_last_result": last,
            "latency": latency_summary(latencies),
            "latencies_ms": sorted(round(1000.0 * x, 3) for x in latencies),
            "bad_results": len(self._bad),
            "bad_examples": self._bad[:3],
            **extra,
        }

    async def burst(self, requests: Sequence[ScoreRequest], prefix: str, timeout_s: float) -> dict[str, Any]:
        """Produce everything at once (the producer's own pace), then wait for every result."""
        encoded = self._encode(requests, prefix)
        cpu0, start = time.process_time(), time.monotonic()
        acks = [await self._send(rid, value, hidden) for rid, value, hidden in encoded]
        enqueued = time.monotonic()
        deadline = start + timeout_s
        await asyncio.wait_for(asyncio.gather(*acks), max(deadline - time.monotonic(), 0.1))
        acked = time.monotonic()
        ids = [rid for rid, _, _ in encoded]
        await self.wait_results(ids, deadline)
        report = self._phase_report(requests, ids, t_enqueued=enqueued, t_acked=acked)
        report["t_end"] = time.monotonic()
        report["loader_cpu_s"] = time.process_time() - cpu0
        return report

    async def paced(
        self, requests: Sequence[ScoreRequest], prefix: str, items_per_s: float
    ) -> dict[str, Any]:
        """Produce at a fixed item rate (each request at its scheduled time), then wait for the results."""
        encoded = self._encode(requests, prefix)
        cpu0, start = time.process_time(), time.monotonic()
        acks, items_before, late = [], 0, 0
        for request, (rid, value, hidden) in zip(requests, encoded, strict=True):
            delay = start + items_before / items_per_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.005:
                late += 1  # the sender itself fell behind the schedule
            acks.append(await self._send(rid, value, hidden))
            items_before += _items(request)
        last_send = time.monotonic()
        await asyncio.gather(*acks)
        ids = [rid for rid, _, _ in encoded]
        await self.wait_results(
            ids, min(time.monotonic() + self._config.latency_timeout_s, self._config.deadline)
        )
        report = self._phase_report(requests, ids, t_last_send=last_send)
        report.update(
            target_items_per_s=items_per_s,
            offered_items_per_s=items_before / max(last_send - start, 1e-9),
            sends_late=late,
            t_end=time.monotonic(),
            loader_cpu_s=time.process_time() - cpu0,
        )
        return report

    async def one_at_a_time(self, requests: Sequence[ScoreRequest], prefix: str) -> dict[str, Any]:
        """Each request produced only after the previous one's result arrived: the latency floor, split
        into the producer's acknowledgement, the worker's side (send to the result record's timestamp) and
        the return (that timestamp to the result read)."""
        encoded = self._encode(requests, prefix)
        cpu0 = time.process_time()
        acked_ms: list[float] = []
        for rid, value, hidden in encoded:
            ack = await self._send(rid, value, hidden)
            await ack
            acked_ms.append(1000 * (time.monotonic() - self._sent[rid]))
            await self.wait_results([rid], min(time.monotonic() + 10, self._config.deadline))
        ids = [rid for rid, _, _ in encoded]
        report = self._phase_report(requests, ids)
        done = [rid for rid in ids if rid in self._result_created]
        worker_side = [1000 * (self._result_created[r] - self._sent_wall[r]) for r in done]
        returned = [1000 * (self._received_wall[r] - self._result_created[r]) for r in done]
        report.update(
            producer_ack=_summary_ms(acked_ms),
            send_to_result_created=_summary_ms(worker_side),
            result_created_to_read=_summary_ms(returned),
            t_end=time.monotonic(),
            loader_cpu_s=time.process_time() - cpu0,
        )
        return report


def _summary_ms(values: Sequence[float]) -> dict[str, float]:
    """p50/p90 of millisecond values (record timestamps have a resolution of 1 ms)."""
    if not values:
        return {}
    p50, p90 = np.percentile(np.asarray(values, dtype=float), [50, 90])
    return {"p50_ms": round(float(p50), 2), "p90_ms": round(float(p90), 2)}


def _progress(name: str, phase: dict[str, Any]) -> None:
    # The run takes minutes: say where it is, in the log, as each phase ends.
    seconds = phase["t_last_result"] - phase["t_first_send"]
    print(
        f"[load] {name}: {phase['completed']}/{phase['requests']} results in {seconds:.1f} s, latency "
        f"{ {k: round(v) for k, v in phase['latency'].items()} }, bad {phase['bad_results']}",
        flush=True,
    )


def _saturation_rate(report: dict[str, Any]) -> float:
    elapsed = report["t_last_result"] - report["t_first_send"]
    return float(report["items_completed"] / elapsed) if elapsed > 0 else 0.0


async def run_phases(config: LoadConfig, queue: Any, control: Any) -> dict[str, Any]:
    """Warm-up, saturation, latency at `latency_fraction` of the saturation item rate, then (time allowing)
    the same latency phase and one request at a time after the main process restarted the worker with a
    short fetch wait, and one request at a time again after a restart into the low-latency profile."""
    started = time.monotonic()
    requests = make_workload(config)
    report: dict[str, Any] = {"workload_s": time.monotonic() - started}
    loader = Loader(config)
    await loader.start()
    try:
        warm = requests[: config.warmup_requests]
        report["warmup"] = await loader.burst(warm, "warm", config.warmup_timeout_s)
        if report["warmup"]["completed"] < len(warm):
            raise RuntimeError(f"warm-up incomplete: {report['warmup']}")
        _progress("warm-up", report["warmup"])
        # Leave the latency phases their time: produce-to-last-result is bounded by what remains before them.
        reserve = 2 * (config.latency_seconds + config.latency_timeout_s)
        loader.keep = {f"sat-{i}" for i in range(config.sample)}
        sat_timeout = min(config.saturation_timeout_s, config.deadline - time.monotonic() - reserve)
        sat = await loader.burst(requests, "sat", max(sat_timeout, 10.0))
        report["saturation"] = sat
        report["sample"] = [
            {"items": [list(item) for item in requests[i].items], **loader.kept[f"sat-{i}"]}
            for i in range(config.sample)
            if f"sat-{i}" in loader.kept
        ]
        _progress("saturation", sat)
        if sat["completed"] < sat["requests"]:
            # The backlog would distort the latency phase: wait for it (bounded), else skip that phase.
            drain_until = min(time.monotonic() + 30, config.deadline)
            await loader.wait_results([f"sat-{i}" for i in range(len(requests))], drain_until)
            report["latency_skipped"] = "saturation did not complete in time"
            return report
        rate = config.latency_fraction * _saturation_rate(sat)
        budget, count = rate * config.latency_seconds, 0
        while count < len(requests) and budget > 0:
            budget -= _items(requests[count])
            count += 1
        report["latency"] = await loader.paced(requests[:count], "lat", rate)
        _progress("latency", report["latency"])
        if not config.short_fetch_latency:
            report["latency_short_fetch_skipped"] = "not asked for"
        elif config.deadline - time.monotonic() < config.latency_seconds + config.latency_timeout_s:
            report["latency_short_fetch_skipped"] = "no time left"
            return report
        else:
            queue.put({"restart": "short_fetch"})
            await asyncio.to_thread(control.get, True, 90)
            report["warmup_short_fetch"] = await loader.burst(warm[:16], "warm2", config.warmup_timeout_s)
            report["latency_short_fetch"] = await loader.paced(requests[:count], "lat2", rate)
            _progress("latency, worker fetch_max_wait_ms 10", report["latency_short_fetch"])

        async def one_at_a_time(
            restart: str, topics: tuple[str, str], prefix: str, warm_prefix: str, relayed: bool
        ) -> tuple[dict[str, Any], dict[str, Any]]:
            """After `restart` (a worker's, or the relay in its place): a warm-up, then one request in
            flight at a time, on `topics` of their own; the warm-up's report and the phase's."""
            queue.put({"restart": restart})
            await asyncio.to_thread(control.get, True, 90)
            own_topics = {"requests_topic": topics[0], "results_topic": topics[1]}
            own = Loader(dataclasses.replace(config, **own_topics), keyed=relayed)
            await own.start()
            try:
                warmed = await own.burst(warm[:16], warm_prefix, config.warmup_timeout_s)
                if not relayed:
                    queue.put({"mark": "warm"})  # the worker's own stage figures count from here
                return warmed, await own.one_at_a_time(requests[: config.one_in_flight], prefix)
            finally:
                await own.stop()

        one_phases = (  # worker restart, report key, id prefixes, progress label
            ("one_in_flight", "one_in_flight", "one", "warm3", "worker fetch_max_wait_ms 10"),
            ("low_latency", "one_in_flight_low_latency", "one-low", "warm4", "worker fetch_max_wait_ms 2"),
        )
        for restart, name, prefix, warm_prefix, label in one_phases:
            if config.deadline - time.monotonic() < config.phase_margin_s:
                report[f"{name}_skipped"] = "no time left"
                return report
            topics = ONE_IN_FLIGHT_TOPICS[restart]
            report[f"warmup_{restart}"], report[name] = await one_at_a_time(
                restart, topics, prefix, warm_prefix, relayed=False
            )
            report[name]["topics"] = list(topics)
            _progress(f"one request in flight, {label}", report[name])
        for restart, wait_ms in RELAYS.items():
            if config.deadline - time.monotonic() < config.phase_margin_s:
                report[f"{restart}_skipped"] = "no time left"
                return report
            _, report[restart] = await one_at_a_time(
                restart, RELAY_TOPICS, restart, f"warm-{restart}", relayed=True
            )
            label = f"the broker alone (a relay), one record in flight, fetch_max_wait_ms {wait_ms}"
            _progress(label, report[restart])
        for variant in config.variants:
            needed = 2 * (sat["t_last_result"] - sat["t_first_send"]) + config.phase_margin_s
            if config.deadline - time.monotonic() < needed:
                report[f"saturation_{variant}_skipped"] = "no time left"
                continue
            queue.put({"restart": variant})
            await asyncio.to_thread(control.get, True, 90)
            await loader.burst(warm, f"warm-{variant}", config.warmup_timeout_s)
            timeout = config.deadline - time.monotonic() - 5
            report[f"saturation_{variant}"] = await loader.burst(requests, f"sat-{variant}", timeout)
            _progress(f"saturation, {variant}", report[f"saturation_{variant}"])
    finally:
        await loader.stop()
    return report


def main(config: LoadConfig, queue: Any, control: Any) -> None:
    """Process entry: the report (or {"error": traceback}) goes on `queue`; `control` answers restarts."""
    try:
        queue.put(asyncio.run(run_phases(config, queue, control)))
    except BaseException:
        queue.put({"error": traceback.format_exc()})

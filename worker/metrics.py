"""The worker's Prometheus metrics: one registry, one prefix, bounded labels; every stage records here."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)
from prometheus_client import Counter as PromCounter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.publisher import OutRecord

if TYPE_CHECKING:  # annotations only: the lag exporter and the supervisor import this module without torch
    from models import BatchStats, ModelInfo

PREFIX = "score_worker"
# Stage and end-to-end latencies: single milliseconds at the low end (a small batch on a GPU takes a few),
# tens of seconds at the high end (a backlog after a restart, a long CPU batch).
LATENCY_BUCKETS = (
    0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
)  # fmt: skip
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# Label names a worker metric may carry: each has a small, fixed set of values (never a request id).
BOUNDED_LABELS = frozenset(
    {
        "model",
        "worker",
        "code",
        "status",
        "reason",
        "dtype",
        "topic",
        "partition",
        "generation",
        "cause",
        "gpu",
    }
)
# Garbage-collector pauses: tens of microseconds for the youngest generation, up to seconds for a full scan.
GC_PAUSE_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
OK_CODE = "none"  # the code label of results that succeeded

DeviceMemory = Callable[[], tuple[int, int] | None]


@dataclass
class ResultTally:
    """What a group of published records carried, counted once when they were encoded."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (status, code) -> results
    hidden_bytes: Counter[str] = field(default_factory=Counter)  # dtype -> bytes of hidden-state data
    timestamps_ms: list[int] = field(default_factory=list)  # request record timestamps, one per result
    dead_letters: Counter[str] = field(default_factory=Counter)  # reason code -> records
    request_bytes: int = 0  # size of the request records these answer (leaves the in-flight bytes)

    def merge(self, other: ResultTally) -> None:
        self.outcomes.update(other.outcomes)
        self.hidden_bytes.update(other.hidden_bytes)
        self.timestamps_ms.extend(other.timestamps_ms)
        self.dead_letters.update(other.dead_letters)
        self.request_bytes += other.request_bytes

    def swap(self, sent: OutRecord, instead_of: OutRecord) -> None:
        """`sent` went out in place of `instead_of` (counted by `add`): count what was sent instead."""
        self._count_result(instead_of, -1)
        self._count_result(sent, 1)

    def add(self, record: OutRecord, timestamp_ms: int) -> None:
        """Count one outgoing record: the result it carries (timed from `timestamp_ms`) or a dead letter."""
        if record.dead_letter_reason is not None:
            self.dead_letters[record.dead_letter_reason] += 1
        if self._count_result(record, 1):
            self.timestamps_ms.append(timestamp_ms)

    def _count_result(self, record: OutRecord, sign: int) -> bool:
        """Add (or, with sign -1, take back) the result a record carries; False when it carries none."""
        result = record.result
        if result is None:
            return False
        code = OK_CODE if result.error is None else result.error.code.value
        self.outcomes[(result.status.value, code)] += sign
        states = result.pooled_hidden_states
        if states:  # every vector of a result has one dtype and one length
            self.hidden_bytes[states[0].dtype] += sign * len(states) * len(states[0].data)
        return True


def _labels(names: Iterable[str]) -> tuple[str, ...]:
    return ("model", "worker", *names)


class WorkerMetrics:
    """All metrics of one worker process, in a registry of its own (several workers may share a process).

    Created before the model loads (the ready gauge and process metrics are served from the start); the
    per-model metrics get their `model` label once `bind_model` is called. Methods are called from the
    event loop and the model thread; prometheus-client's values are thread safe, so no lock is added.
    """

    def __init__(self, worker: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.worker = worker
        self._model: str | None = None
        self._max_batch_tokens = 1
        self._device_memory: DeviceMemory | None = None
        ProcessCollector(namespace="", registry=self.registry)
        self._ready = Gauge(
            f"{PREFIX}_ready", "1 while the worker is ready to score (see /readyz)", ["worker"],
            registry=self.registry,
        )  # fmt: skip
        self._ready.labels(worker).set(0)
        self._define(self.registry)
        self.registry.register(_DeviceMemoryCollector(self))
        self.partitions = PartitionMetrics(self)

    def _define(self, r: CollectorRegistry) -> None:
        def hist(name: str, doc: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, _labels(()), buckets=buckets, registry=r)

        def counter(name: str, doc: str, *extra: str) -> PromCounter:
            return PromCounter(f"{PREFIX}_{name}", doc, _labels(extra), registry=r)

        def gauge(name: str, doc: str, *extra: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, _labels(extra), registry=r)

        self.model_info = Info(f"{PREFIX}_model", "the loaded model", ["worker"], registry=r)
        self.e2e = hist("e2e_latency_seconds", "request record timestamp to the broker's ack of its result")
        self.batch_wait = hist("batch_wait_seconds", "per request: from tokenised to its batch's start")
        self.tokenize = hist("tokenize_seconds", "per request: decoding and tokenising")
        self.forward = hist("forward_seconds", "per batch: the model's forward pass, pooling and head")
        self.hidden_copy = hist("hidden_copy_seconds", "per batch: copying asked hidden states to the host")
        self.encode = hist("encode_seconds", "per batch: encoding its result records")
        self.publish = hist("publish_seconds", "per group of records: sending until the broker acked all")
        self.batch_size = hist("batch_requests", "requests per model batch", BATCH_SIZE_BUCKETS)
        self.batch_tokens = hist(
            "batch_tokens",
            "tokens per model batch as its budget counts them (a shared prefix once)",
            BATCH_TOKEN_BUCKETS,
        )
        self.batch_fill = hist("batch_fill_ratio", "batch tokens / max_batch_tokens", RATIO_BUCKETS)
        self.hidden_share = hist(
            "batch_hidden_state_request_ratio", "per batch: share of requests asking for hidden states",
            RATIO_BUCKETS,
        )  # fmt: skip
        self.requests = counter("requests_total", "request records fetched")
        self.items = counter("items_total", "items run through the model")
        self.tokens = counter("tokens_total", "prompt tokens run through the model")
        self.prefix_saved = counter(
            "shared_prefix_tokens_saved_total",
            "prompt tokens not computed: prefixes that prompts of a batch share, computed once",
        )
        self.cache_lookups = counter(
            "prefix_cache_lookups_total", "prompts looked up in the prefix cache (0 without one)"
        )
        self.cache_hits = counter(
            "prefix_cache_hits_total", "prompts that found a prefix of theirs in the prefix cache"
        )
        self.cache_tokens = counter(
            "prefix_cache_tokens_saved_total",
            "prompt tokens not computed: their keys and values came from the prefix cache",
        )
        self.cache_bytes = gauge("prefix_cache_bytes", "bytes the prefix cache holds (keys and values)")
        self.regrouped_requests = counter(
            "regrouped_requests_total",
            "requests moved to another waiting batch, beside requests that share their prompt's prefix",
        )
        self.intake_processed = counter(
            "intake_process_requests_total",
            "request records decoded and tokenised in intake processes (the rest on the worker's own thread)",
        )
        self.intake_restarts = counter(
            "intake_process_restarts_total", "times the intake processes failed and were stopped"
        )
        self.batches = counter("batches_total", "model batches run")
        self.batch_failures = counter("batch_failures_total", "model batches whose forward pass raised")
        self.layer_compilations = counter(
            "layer_compilations_total",
            "graphs torch.compile traced for the compiled layers while serving (a kind of batch the start-up "
            "warm-up did not show them; each holds the model for seconds)",
        )
        self.hidden_requests = counter("hidden_state_requests_total", "requests that asked for hidden states")
        self.copied_bytes = counter("hidden_state_copied_bytes_total", "hidden-state bytes copied", "dtype")
        self.published_bytes = counter(
            "hidden_state_published_bytes_total", "hidden-state bytes in acked results", "dtype"
        )
        self.results = counter("results_total", "results acked by the broker", "status", "code")
        self.dead_letters = counter("dead_letters_total", "dead-letter records acked", "reason")
        self.commits = counter("commits_total", "offset commits the broker accepted")
        self.commit_failures = counter("commit_failures_total", "offset commits that failed")
        self.rebalances = counter("rebalances_total", "partition assignments received")
        self.assigned = gauge("assigned_partitions", "partitions this worker owns")
        self.inflight = gauge("inflight_requests", "request records fetched and not yet fully published")
        self.inflight_bytes = gauge("inflight_bytes", "bytes of those request records")
        self.paused = gauge("paused_partitions", "partitions paused by backpressure")
        self.undecodable_reads = counter(
            "undecodable_reads_total",
            "reads of a partition that stopped at records the worker cannot read (the first, and each retry)",
            "topic", "partition", "cause",
        )  # fmt: skip
        self.held = gauge(
            "held_partitions", "partitions stopped at records the worker cannot read (see /readyz)"
        )
        self.skipped_records = counter(
            "skipped_records_total",
            "offsets skipped after staying unreadable (undecodable_skip_after_ms); each range goes to the "
            "dead-letter topic",
            "topic", "partition", "cause",
        )  # fmt: skip
        self.fetch_failures = counter(
            "fetch_failures_total", "fetches that raised (the worker rewinds to what it handed out, retries)"
        )
        self.lag = gauge(
            "consumer_lag", "records behind: high-water mark minus position", "topic", "partition"
        )
        self.gc_pause = Histogram(
            f"{PREFIX}_gc_pause_seconds", "garbage-collector pauses while the worker runs (all threads wait)",
            _labels(("generation",)), buckets=GC_PAUSE_BUCKETS, registry=r,
        )  # fmt: skip

    # -- set-up -----------------------------------------------------------------------------------------

    def bind_model(
        self, info: ModelInfo, max_batch_tokens: int, device_memory: DeviceMemory | None = None
    ) -> None:
        """Label the per-model metrics with the loaded model and export its description."""
        self._model = info.name
        self._max_batch_tokens = max(1, max_batch_tokens)
        self._device_memory = device_memory
        self.model_info.labels(self.worker).info(
            {
                "model": info.name,
                "architecture": info.architecture,
                "dtype": info.dtype,
                "device": info.device,
                "hidden_size": str(info.hidden_size),
                "attention": info.attention,
                "attention_kernel": info.attention_kernel,
                "pooling": info.pooling,
                "compiled": str(info.compiled).lower(),
                "cuda_graphs": str(info.cuda_graphs).lower(),
                "quantization": info.quantization,
                "fused_mlp": str(info.fused_mlp).lower(),
            }
        )
        # Series without extra labels exist from the start at 0, so rates and panels have data at once.
        for metric in (
            self.e2e, self.batch_wait, self.tokenize, self.forward, self.hidden_copy, self.encode,
            self.publish, self.batch_size, self.batch_tokens, self.batch_fill, self.hidden_share,
            self.requests, self.items, self.tokens, self.prefix_saved, self.regrouped_requests,
            self.cache_lookups, self.cache_hits, self.cache_tokens, self.cache_bytes,
            self.intake_processed, self.intake_restarts, self.batches, self.batch_failures,
            self.layer_compilations, self.hidden_requests, self.commits, self.commit_failures,
            self.rebalances, self.assigned, self.inflight, self.inflight_bytes, self.paused, self.held,
            self.fetch_failures,
        ):  # fmt: skip
            metric.labels(info.name, self.worker)
        for generation in (0, 1, 2):
            self.gc_pause.labels(info.name, self.worker, str(generation))

    def _of(self, metric: Any, *extra: str) -> Any:
        return metric.labels(self._model or "", self.worker, *extra)

    def set_ready(self, ready: bool) -> None:
        self._ready.labels(self.worker).set(1 if ready else 0)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

    # -- hot path: one call per fetch, batch or group of records; no per-item work ---------------------

    def fetched(self, records: int, size_bytes: int) -> None:
        self._of(self.requests).inc(records)
        self._of(self.inflight_bytes).inc(size_bytes)

    def gc_paused(self, generation: int, seconds: float) -> None:
        self._of(self.gc_pause, str(generation)).observe(seconds)

    def tokenized(self, seconds: float) -> None:
        self._of(self.tokenize).observe(seconds)

    def prepared_in_processes(self, records: int) -> None:
        self._of(self.intake_processed).inc(records)

    def regrouped(self, requests: int) -> None:
        self._of(self.regrouped_requests).inc(requests)

    def intake_restarted(self) -> None:
        self._of(self.intake_restarts).inc()

    def batch_started(self, requests: int, tokens: int, waits: Iterable[float]) -> None:
        self._of(self.batch_size).observe(requests)
        self._of(self.batch_tokens).observe(tokens)
        self._of(self.batch_fill).observe(min(1.0, tokens / self._max_batch_tokens))
        wait = self._of(self.batch_wait)
        for seconds in waits:
            wait.observe(seconds)

    def model_batch(self, stats: BatchStats) -> None:
        """One forward batch of the Scorer (models.BatchStats), reported from the model thread."""
        self._of(self.batches).inc()
        if stats.failed:
            self._of(self.batch_failures).inc()
            return
        self._of(self.forward).observe(stats.forward_s)
        if stats.compiled_graphs:
            self._of(self.layer_compilations).inc(stats.compiled_graphs)
        self._of(self.items).inc(stats.items)
        self._of(self.tokens).inc(stats.tokens)
        if stats.packed_tokens:
            shared = stats.tokens - stats.packed_tokens - stats.cached_tokens
            self._of(self.prefix_saved).inc(max(0, shared))
        if stats.cache_bytes is not None:
            self._of(self.cache_lookups).inc(stats.cache_lookups)
            self._of(self.cache_hits).inc(stats.cache_hits)
            self._of(self.cache_tokens).inc(stats.cached_tokens)
            self._of(self.cache_bytes).set(stats.cache_bytes)
        self._of(self.hidden_share).observe(stats.hidden_requests / max(1, stats.requests))
        self._of(self.hidden_requests).inc(stats.hidden_requests)
        if stats.hidden_bytes:
            self._of(self.hidden_copy).observe(stats.copy_s)
            for dtype, size in stats.hidden_bytes.items():
                self._of(self.copied_bytes, dtype).inc(size)

    def encoded(self, seconds: float) -> None:
        self._of(self.encode).observe(seconds)

    def published(self, tally: ResultTally, seconds: float) -> None:
        """Records the broker acknowledged: outcomes, end-to-end latency, hidden-state bytes sent."""
        self._of(self.publish).observe(seconds)
        for (status, code), count in tally.outcomes.items():
            self._of(self.results, status, code).inc(count)
        for reason, count in tally.dead_letters.items():
            self._of(self.dead_letters, reason).inc(count)
        for dtype, size in tally.hidden_bytes.items():
            self._of(self.published_bytes, dtype).inc(size)
        # Clocks of two hosts: a producer clock ahead of ours must not give negative latencies.
        now_ms = time.time() * 1000
        e2e = self._of(self.e2e)
        for stamp in tally.timestamps_ms:
            e2e.observe(max(0.0, now_ms - stamp) / 1000)
        self._of(self.inflight_bytes).dec(tally.request_bytes)

    def committed(self) -> None:
        self._of(self.commits).inc()

    def commit_failed(self) -> None:
        self._of(self.commit_failures).inc()


class PartitionMetrics:
    """The state of the partitions a worker fetches from, sampled by the fetch loop and the holds: owned,
    paused, held and lagging partitions, the records skipped and the fetches that failed. Part of a
    WorkerMetrics (its `partitions`), whose labels and series it records into."""

    def __init__(self, owner: WorkerMetrics) -> None:
        self._owner = owner

    def assigned_partitions(self, count: int) -> None:
        self._owner._of(self._owner.rebalances).inc()
        self._owner._of(self._owner.assigned).set(count)

    def state(self, inflight: int, paused: int) -> None:
        self._owner._of(self._owner.inflight).set(inflight)
        self._owner._of(self._owner.paused).set(paused)

    def set_lag(self, lags: Mapping[tuple[str, int], int]) -> None:
        for (topic, partition), lag in lags.items():
            self._owner._of(self._owner.lag, topic, str(partition)).set(max(0, lag))

    def undecodable(self, topic: str, partition: int, cause: str) -> None:
        self._owner._of(self._owner.undecodable_reads, topic, str(partition), cause).inc()

    def held_partitions(self, count: int) -> None:
        self._owner._of(self._owner.held).set(count)

    def skipped(self, topic: str, partition: int, cause: str, offsets: int) -> None:
        self._owner._of(self._owner.skipped_records, topic, str(partition), cause).inc(offsets)

    def fetch_failed(self) -> None:
        self._owner._of(self._owner.fetch_failures).inc()

    def forget_partitions(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Drop the lag series of partitions this worker no longer owns (another worker reports them)."""
        for topic, partition in partitions:
            with contextlib.suppress(KeyError):
                self._owner.lag.remove(self._owner._model or "", self._owner.worker, topic, str(partition))


class _DeviceMemoryCollector(Collector):
    """GPU memory read at scrape time, so an idle worker's figure is current too (none on the CPU)."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        read = self._metrics._device_memory
        memory = read() if read is not None else None
        if memory is None:
            return
        labels = [self._metrics._model or "", self._metrics.worker]
        for name, value in zip(("allocated", "reserved"), memory, strict=True):
            family = GaugeMetricFamily(
                f"{PREFIX}_gpu_memory_{name}_bytes",
                f"bytes {name} by torch's CUDA caching allocator",
                labels=["model", "worker"],
            )
            family.add_metric(labels, value)
            yield family

"""`score-worker lag-exporter`: consumer-group lag for Prometheus, measured from outside the workers.

The workers export their own lag, but a worker that is down, stuck or not yet started exports nothing, which
is exactly when lag matters. This process asks the brokers instead: the group's committed offsets, and each
partition's high-water mark read from a one-record fetch at the log end (ListOffsets alone is wrong on some
Kafka-protocol brokers, Tansu among them, and a fetch response carries the true high-water mark).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.config import (
    SECURITY_ENV_VARS,
    ClientEnvironment,
    environment_variables,
    read_environment,
    security_from_environment,
)
from worker.health import HealthServer
from worker.metrics import PREFIX
from worker.undecodable import FetchGuard

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED = 0, 1


# The environment variables this command reads (flags override them).
class LagExporterEnvironment(BaseSettings):
    """The exporter's own SCORE_LAG_EXPORTER_* variables (flags override them)."""

    model_config = SettingsConfigDict(env_prefix="SCORE_LAG_EXPORTER_", frozen=True, extra="ignore")

    groups: str = Field("score-worker", description="consumer groups, comma-separated")
    port: int = Field(9465, ge=0, le=65535, description="port of /metrics, /healthz and /readyz")
    interval_s: float = Field(5.0, gt=0, description="seconds between polls")


ENV_VARS = (
    "SCORE_WORKER_BOOTSTRAP_SERVERS",
    "SCORE_WORKER_REQUESTS_TOPIC",
    *environment_variables(LagExporterEnvironment),
    *SECURITY_ENV_VARS,
)


class LagMetrics:
    """The exporter's registry: lag, committed offsets and high-water marks per group and partition."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        partition = ["group", "topic", "partition"]
        self.lag = Gauge(
            f"{PREFIX}_group_lag", "records not yet consumed: high-water mark minus committed offset",
            partition, registry=self.registry,
        )  # fmt: skip
        self.committed = Gauge(
            f"{PREFIX}_group_committed_offset", "the group's committed offset", partition,
            registry=self.registry,
        )  # fmt: skip
        self.highwater = Gauge(
            f"{PREFIX}_topic_high_water_mark", "offset of the next record written", ["topic", "partition"],
            registry=self.registry,
        )  # fmt: skip
        self.polls = Counter(f"{PREFIX}_lag_exporter_polls_total", "polls", registry=self.registry)
        self.failures = Counter(
            f"{PREFIX}_lag_exporter_poll_failures_total", "polls that failed", registry=self.registry
        )
        self.last_success = Gauge(
            f"{PREFIX}_lag_exporter_last_success_timestamp_seconds", "when a poll last succeeded",
            registry=self.registry,
        )  # fmt: skip


class LagExporter:
    """Polls the brokers every `interval_s` and keeps the gauges current."""

    def __init__(
        self,
        bootstrap: str,
        groups: Sequence[str],
        topics: Sequence[str],
        interval_s: float,
        kafka_options: Mapping[str, Any] | None = None,
    ) -> None:
        """`kafka_options` (security_protocol, ssl_context, sasl_*) go to every client it makes."""
        self._groups, self._topics = list(groups), list(topics)
        self._options: dict[str, Any] = {
            "bootstrap_servers": bootstrap, "client_id": "score-lag-exporter", **(kafka_options or {}),
        }  # fmt: skip
        self._interval_s = interval_s
        self.metrics = LagMetrics()
        self.healthy = False
        self._highwater: dict[TopicPartition, int] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._guard: FetchGuard | None = None
        self._admin: AIOKafkaAdminClient | None = None
        # One consumer per group that never subscribes: it reads the group's commits without joining it
        # (the admin client's OffsetFetch is not understood by every Kafka-protocol broker).
        self._group_readers: dict[str, AIOKafkaConsumer] = {}

    async def start(self) -> None:
        """Connect; raises KafkaError while no broker answers (`run` keeps trying)."""
        try:
            admin = AIOKafkaAdminClient(**self._options)
            self._admin = admin
            await admin.start()
            # No group: it only reads positions. Tiny fetches: one record at the log end is all it needs.
            self._consumer = AIOKafkaConsumer(
                **self._options, enable_auto_commit=False, max_partition_fetch_bytes=1, fetch_max_wait_ms=100
            )
            await self._consumer.start()
            # Its fetches only learn the high-water mark: a batch it cannot decode must not fail the poll.
            self._guard = FetchGuard(self._consumer)
            self._guard.attach()
            for group in self._groups:
                reader = AIOKafkaConsumer(**self._options, group_id=group, enable_auto_commit=False)
                self._group_readers[group] = reader
                await reader.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for reader in self._group_readers.values():
            await reader.stop()
        self._group_readers.clear()
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        if self._admin is not None:
            await self._admin.close()
            self._admin = None

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop` is set; brokers that are not up yet, or go away, are failed polls, not exits."""
        while not stop.is_set():
            try:
                async with asyncio.timeout(max(10.0, 2 * self._interval_s)):
                    if self._admin is None:
                        await self.start()
                    await self.poll()
            except (KafkaError, TimeoutError, OSError) as exc:
                self.metrics.failures.inc()
                if self.healthy:
                    log.warning("polling the brokers failed: %r", exc)
                self.healthy = False
            else:
                if not self.healthy:
                    log.info("polling %d groups", len(self._groups))
                self.healthy = True
            self.metrics.polls.inc()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval_s)

    async def poll(self) -> None:
        """One round: high-water marks of the topics' partitions, and every group's committed offsets."""
        partitions = await self._topic_partitions()
        highwater = await self._highwaters(partitions)
        for tp, end in highwater.items():
            self.metrics.highwater.labels(tp.topic, str(tp.partition)).set(end)
        for group, reader in self._group_readers.items():
            for tp, end in highwater.items():
                # Nothing committed yet: a new group starts at the beginning (auto_offset_reset earliest).
                position = await reader.committed(tp) or 0
                labels = (group, tp.topic, str(tp.partition))
                self.metrics.committed.labels(*labels).set(position)
                self.metrics.lag.labels(*labels).set(max(0, end - position))
        self.metrics.last_success.set(time.time())

    async def _topic_partitions(self) -> list[TopicPartition]:
        """Partitions of the watched topics, asked anew each round (a topic may be created or grown)."""
        assert self._admin is not None
        # Only topics that exist: naming a missing one in a metadata request lets a broker that
        # auto-creates topics create it, with its default partition count, before the workers do.
        existing = set(await self._admin.list_topics())
        watched = [topic for topic in self._topics if topic in existing]
        found = []
        for topic in await self._admin.describe_topics(watched) if watched else []:
            if topic["error_code"] == 0:
                found += [TopicPartition(topic["topic"], p["partition"]) for p in topic["partitions"]]
        return sorted(found)

    async def _highwaters(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        """High-water marks from a fetch one record before each partition's known end."""
        consumer = self._consumer
        assert consumer is not None
        if not partitions:
            return {}
        consumer.assign(partitions)
        listed = await consumer.end_offsets(partitions)  # exact on Kafka; a lower bound on Tansu
        for tp in partitions:
            consumer.seek(tp, max(0, max(listed.get(tp, 0), self._highwater.get(tp, 0)) - 1))
        await consumer.getmany(*partitions, timeout_ms=300)
        if self._guard is not None:
            await self._guard.take()  # the records are not needed, readable or not
        for tp in partitions:
            fetched = consumer.highwater(tp)
            self._highwater[tp] = max(self._highwater.get(tp, 0), listed.get(tp, 0), fetched or 0)
        return {tp: self._highwater[tp] for tp in partitions}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    client = read_environment(ClientEnvironment, "lag-exporter")
    own = read_environment(LagExporterEnvironment, "lag-exporter")
    parser.add_argument(
        "--bootstrap-servers", default=client.bootstrap_servers,
        help="Kafka bootstrap servers (env SCORE_WORKER_BOOTSTRAP_SERVERS)",
    )  # fmt: skip
    groups = [g for g in own.groups.split(",") if g]
    parser.add_argument(
        "--group", action="append", default=None,
        help=f"consumer group, repeatable (env SCORE_LAG_EXPORTER_GROUPS, default {','.join(groups)})",
    )  # fmt: skip
    parser.set_defaults(default_groups=groups, default_topic=client.requests_topic)
    parser.add_argument(
        "--topic", action="append", default=None,
        help="topic whose partitions are reported even before a commit (env SCORE_WORKER_REQUESTS_TOPIC, "
        "default score.requests)",
    )  # fmt: skip
    parser.add_argument(
        "--port", type=int, default=own.port,
        help="port of /metrics, /healthz and /readyz (env SCORE_LAG_EXPORTER_PORT, default 9465)",
    )  # fmt: skip
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument(
        "--interval", type=float, default=own.interval_s,
        help="seconds between polls (env SCORE_LAG_EXPORTER_INTERVAL_S, default 5)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if not args.bootstrap_servers:
        print("lag-exporter: pass --bootstrap-servers or set SCORE_WORKER_BOOTSTRAP_SERVERS", file=sys.stderr)
        return 2
    topics = args.topic or [args.default_topic]
    try:
        security = security_from_environment().kafka_security_kwargs()
    except ValueError as error:
        print(f"lag-exporter: {error}", file=sys.stderr)
        return 2
    groups = args.group or args.default_groups
    exporter = LagExporter(args.bootstrap_servers, groups, topics, args.interval, security)
    try:
        asyncio.run(_serve(exporter, args.host, args.port))
    except (KafkaError, OSError) as exc:
        log.error("lag-exporter failed: %r", exc)
        return EXIT_FAILED
    return EXIT_OK


async def _serve(exporter: LagExporter, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = HealthServer(
        host, port, lambda: generate_latest(exporter.metrics.registry), lambda: {"polling": exporter.healthy}
    )
    await server.start()
    try:
        await exporter.run(stop)
    finally:
        await exporter.stop()
        await server.stop()

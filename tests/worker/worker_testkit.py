"""Helpers for the worker tests: unique topic names, producing, reading topics back, committed offsets."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, TopicPartition

from models import EngineWrapper, Scorer
from schemas import ScoreRequest, encode_request, request_headers
from worker.app import ScoreWorker
from worker.config import ENV_PREFIX, KafkaSecurity, WorkerSettings
from worker.topics import topic_partitions

Record = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]  # key, value, headers


class WrappedScorer(EngineWrapper):
    """A real Scorer behind the worker's engine interface; tests subclass it to observe, slow or fail one
    member (most often `launch`, where a batch reaches the model)."""

    def __init__(self, scorer: Scorer) -> None:
        super().__init__(scorer)
        self.scorer = scorer


@dataclass(frozen=True)
class Names:
    """Topic and group names unique to one test, so tests sharing a broker never see each other's data."""

    requests: str
    results: str
    dlq: str
    group: str

    @classmethod
    def unique(cls, prefix: str) -> Names:
        tag = f"{prefix}-{uuid.uuid4().hex[:10]}"
        return cls(f"{tag}.requests", f"{tag}.results", f"{tag}.dlq", f"{tag}-group")


TEST_PREFIX = "SCORE_WORKER_TEST_"


def own_cluster_security(bootstrap: str) -> dict[str, Any]:
    """The security settings of a broker of one's own (the one $SCORE_WORKER_TEST_BOOTSTRAP names), from
    SCORE_WORKER_TEST_<SETTING> variables: SCORE_WORKER_TEST_SECURITY_PROTOCOL, ..._SASL_MECHANISM,
    ..._SASL_USERNAME, ..._SASL_PASSWORD, ..._SSL_CAFILE, ..._SSL_CERTFILE, ..._SSL_KEYFILE,
    ..._SSL_KEY_PASSWORD, ..._SSL_CHECK_HOSTNAME. Empty for every broker the tests start themselves."""
    if not bootstrap or bootstrap != os.environ.get(f"{TEST_PREFIX}BOOTSTRAP"):
        return {}
    found = {name: os.environ.get(f"{TEST_PREFIX}{name.upper()}") for name in KafkaSecurity.model_fields}
    return {name: value for name, value in found.items() if value is not None}


def client_kwargs(bootstrap: str) -> dict[str, Any]:
    """Connection arguments of a test's own aiokafka clients: the address, and the security of one's own
    cluster where the tests run against one."""
    security = KafkaSecurity(**own_cluster_security(bootstrap)).kafka_security_kwargs()
    return {"bootstrap_servers": bootstrap, **security}


def fast_settings(bootstrap: str, model_dir: Path, names: Names, **overrides: Any) -> WorkerSettings:
    """Settings with short group timeouts: Tansu makes a joining member wait half the session timeout."""
    return WorkerSettings(**fast_values(bootstrap, model_dir, names, **overrides))


def settings_env(values: dict[str, Any]) -> dict[str, str]:
    """This process's environment without its SCORE_WORKER_* variables, plus `values` as those variables
    (how a worker process started by a test gets its settings)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(ENV_PREFIX)}
    for name, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        env[f"{ENV_PREFIX}{name.upper()}"] = text
    return env


def fast_values(bootstrap: str, model_dir: Path, names: Names, **overrides: Any) -> dict[str, Any]:
    """The field values of `fast_settings`."""
    values: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "model_dir": model_dir,
        "requests_topic": names.requests,
        "results_topic": names.results,
        "dlq_topic": names.dlq,
        "group_id": names.group,
        "device": "cpu",
        "session_timeout_ms": 1500,
        "heartbeat_interval_ms": 300,
        "max_wait_ms": 5,
        "commit_interval_ms": 200,
        "topic_partitions": 3,
    }
    values.update(own_cluster_security(bootstrap))
    values.update(overrides)
    return values


def request_record(request: ScoreRequest, key: bytes | None = None) -> Record:
    """A request as a producer following the contract writes it: keyed by its id, with the usual headers."""
    key = request.request_id.encode() if key is None else key
    return key, encode_request(request), request_headers(request.request_id)


async def produce(bootstrap: str, topic: str, records: Sequence[Record]) -> None:
    """Send records and wait until the broker acknowledged all of them."""
    producer = AIOKafkaProducer(**client_kwargs(bootstrap), acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [await producer.send(topic, value=v, key=k, headers=h) for k, v, h in records]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def read_topic(
    bootstrap: str,
    topic: str,
    expected: int,
    timeout_s: float = 60.0,
    settle_s: float = 1.0,
    isolation_level: str = "read_uncommitted",
) -> list[ConsumerRecord[bytes, bytes]]:
    """All records of a topic: waits until `expected` arrived, then `settle_s` more to catch extras."""
    consumer = AIOKafkaConsumer(
        **client_kwargs(bootstrap), enable_auto_commit=False, isolation_level=isolation_level
    )
    await consumer.start()
    try:
        partitions = await partitions_of(consumer, topic)
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        records: list[ConsumerRecord[bytes, bytes]] = []
        deadline = time.monotonic() + timeout_s
        settle_until: float | None = None
        while time.monotonic() < (settle_until or deadline):
            fetched = await consumer.getmany(timeout_ms=100)
            records += [r for batch in fetched.values() for r in batch]
            if settle_until is None and len(records) >= expected:
                settle_until = time.monotonic() + settle_s
        return records
    finally:
        await consumer.stop()


async def partitions_of(consumer: AIOKafkaConsumer, topic: str, attempts: int = 100) -> list[TopicPartition]:
    """The partitions of `topic`, asked for every 50 ms until the topic exists (`attempts` times)."""
    for _ in range(attempts):
        found = await topic_partitions(consumer, topic)
        if found:
            return [TopicPartition(topic, p) for p in sorted(found)]
        await asyncio.sleep(0.05)
    raise AssertionError(f"topic {topic} has no partitions")


def log_ends(records: Sequence[ConsumerRecord[bytes, bytes]]) -> dict[int, int]:
    """One past the last offset of each partition, counted from the records themselves.

    Tansu answers ListOffsets "latest" wrongly, so end_offsets() is not used.
    """
    ends: dict[int, int] = {}
    for record in records:
        ends[record.partition] = max(ends.get(record.partition, 0), record.offset + 1)
    return ends


async def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offset per partition (partitions without a commit are left out)."""
    consumer = AIOKafkaConsumer(**client_kwargs(bootstrap), group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = await partitions_of(consumer, topic)
        result = {}
        for tp in partitions:
            offset = await consumer.committed(tp)
            if offset is not None:
                result[tp.partition] = offset
        return result
    finally:
        await consumer.stop()


def header(record: ConsumerRecord[bytes, bytes], name: str) -> bytes | None:
    return next((value for key, value in record.headers if key == name), None)


@dataclass(frozen=True)
class Outcome:
    """What a run left behind: the results, the request records, the group's committed offsets."""

    results: list[ConsumerRecord[bytes, bytes]]
    sources: list[ConsumerRecord[bytes, bytes]]
    committed: dict[int, int]


async def finish(
    settings: WorkerSettings,
    workers: Sequence[tuple[ScoreWorker, asyncio.Task[None]]],
    results: int,
    requests: int,
) -> Outcome:
    """Wait for `results` results, stop the workers (they drain and commit), read back what they left."""
    bootstrap = settings.bootstrap_servers
    got = await read_topic(bootstrap, settings.results_topic, results, timeout_s=180, settle_s=1.0)
    for worker, _ in workers:
        worker.stop()
    await asyncio.wait_for(asyncio.gather(*(task for _, task in workers)), timeout=60)
    sources = await read_topic(bootstrap, settings.requests_topic, requests, settle_s=0.2)
    committed = await committed_offsets(bootstrap, settings.group_id, settings.requests_topic)
    return Outcome(got, sources, committed)


@dataclass(frozen=True)
class LiveWorker:
    """A ScoreWorker serving `names` on its own thread, and a Scorer on the same model for expected values."""

    bootstrap: str
    names: Names
    scorer: Scorer


# The engine's libraries: a command that scores nothing (the gateway, the lag exporter, a host's supervisor)
# must start without them (its install may have no torch, and importing it costs seconds of CPU).
MODEL_LIBRARIES = ("torch", "transformers", "tokenizers", "models.engine")


def model_libraries_loaded_by(*modules: str) -> list[str]:
    """Which of MODEL_LIBRARIES a fresh interpreter holds after importing `modules`."""
    imports = ", ".join(("json", "sys", *modules))
    code = f"import {imports}; print(json.dumps([m for m in {MODEL_LIBRARIES!r} if m in sys.modules]))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return sorted(json.loads(loaded.stdout))

"""Records the worker cannot read, against a real broker and real workers: the partition that holds them stops
at the first such offset, is reported and retried, commits nothing past it, and every other partition flows;
with undecodable_skip_after_ms, the range goes to the dead-letter topic and every later request is answered.

Three ways to be unreadable: a codec library the worker lacks (a worker process with cramjam hidden), batches
damaged by hand and written with a raw produce request, and bytes changed where the client library receives
them (an unknown codec id, a batch cut short); and a fetch that raises."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import raw_batches
from aiokafka import AIOKafkaProducer
from aiokafka.client import AIOKafkaClient
from aiokafka.consumer.fetcher import Fetcher
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import ConsumerRecord, TopicPartition
from brokers import BrokerPool
from fault_kit.accounting import Accounting, spot_check
from fault_kit.traffic import (
    ResultWatcher,
    create_topics,
    make_requests,
    metric_samples,
    samples_in,
    wait_until,
)
from fault_kit.workers import Spawn, worker_env
from worker_testkit import (
    Names,
    client_kwargs,
    committed_offsets,
    fast_settings,
    header,
    read_topic,
    request_record,
)

from models import Scorer, ScorerConfig
from schemas import ErrorCode, ScoreRequest, ScoreResult, decode_request
from worker.app import ScoreWorker
from worker.broker import free_port
from worker.config import ENV_PREFIX

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PARTITIONS = 4
SKIP_AFTER_MS = 1000


# ---------------------------------------------------------------------------------------------- helpers


def ids(requests: Sequence[ScoreRequest]) -> set[str]:
    return {request.request_id for request in requests}


async def produce_to(
    bootstrap: str, tp: TopicPartition, requests: Sequence[ScoreRequest], compression: str | None = None
) -> list[int]:
    """The requests as one batch on one partition (one linger, sent together); their offsets."""
    producer = AIOKafkaProducer(
        **client_kwargs(bootstrap), acks="all", linger_ms=50, max_batch_size=1 << 20,
        compression_type=compression,
    )  # fmt: skip
    await producer.start()
    try:
        acks = [
            await producer.send(tp.topic, value=value, key=key, headers=headers, partition=tp.partition)
            for key, value, headers in (request_record(r) for r in requests)
        ]
        offsets = [(await ack).offset for ack in acks]
    finally:
        await producer.stop()
    assert offsets == list(range(offsets[0], offsets[0] + len(offsets))), "the requests were split up"
    return offsets


def get(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read()
    return status, json.loads(body) if path == "/readyz" else body


def reads(samples: list[tuple[dict[str, str], float]], partition: int, cause: str) -> float:
    return sum(
        v for labels, v in samples if labels["partition"] == str(partition) and labels["cause"] == cause
    )


def exposed(worker: ScoreWorker, name: str) -> list[tuple[dict[str, str], float]]:
    """What an in-process worker's /metrics would show of one metric."""
    return samples_in(worker.metrics.exposition().decode(), name)


async def wait_committed(
    bootstrap: str, names: Names, expected: dict[int, int], timeout_s: float = 30
) -> None:
    """Until the group's commits are exactly `expected` (a commit past a held offset never matches)."""
    deadline = time.monotonic() + timeout_s
    while (got := await committed_offsets(bootstrap, names.group, names.requests)) != expected:
        assert time.monotonic() < deadline, f"committed {got}, expected {expected}"
        await asyncio.sleep(0.2)


def check_held(readiness: dict[str, Any], names: Names, expected: dict[int, tuple[int, str]]) -> None:
    """/readyz: not ready, partitions_readable failing, exactly `expected` held (partition: offset, cause)."""
    assert readiness["ready"] is False and readiness["checks"]["partitions_readable"] is False, readiness
    held = {name: (info["offset"], info["cause"]) for name, info in readiness["held_partitions"].items()}
    assert held == {f"{names.requests}[{p}]": where for p, where in expected.items()}, readiness


def dead_letter_ranges(records: Sequence[ConsumerRecord[bytes, bytes]]) -> dict[int, tuple[int, int, str]]:
    """The skipped ranges on the dead-letter topic: partition -> (first, last, cause)."""
    ranges = {}
    for record in records:
        assert header(record, "x-error-code") == ErrorCode.UNDECODABLE_RECORDS.value.encode(), record.headers
        partition = int(header(record, "x-source-partition") or b"-1")
        first = int(header(record, "x-source-offset") or b"-1")
        last = int(header(record, "x-source-last-offset") or b"-1")
        ranges[partition] = (first, last, (header(record, "x-undecodable-cause") or b"").decode())
    return ranges


def requests_in_batch(data: bytes) -> list[str]:
    """The request ids in a dead-letter record's value: the batch as the broker stored it."""
    records = MemoryRecords(data)
    found = []
    while records.has_next():
        batch = records.next_batch()
        assert batch is not None
        found += [decode_request(bytes(r.value)).request_id for r in batch]
    return found


def check_answered_once(
    watcher: ResultWatcher, expected: Sequence[ScoreRequest], never: set[str], reference: Scorer
) -> None:
    """Every expected request answered exactly once and right; nothing for the `never` ids."""
    by_id: dict[str, list[ScoreResult]] = {}
    for seen in watcher.seen:
        by_id.setdefault(seen.request_id, []).append(seen.result)
    acc = Accounting(Counter({rid: len(got) for rid, got in by_id.items()}), Counter(ids(expected)), by_id)
    assert not acc.missing, f"unanswered: {sorted(acc.missing)[:5]}"
    assert not set(acc.counts) & never, f"answered although skipped: {sorted(set(acc.counts) & never)}"
    assert acc.duplicates == 0, {rid: n for rid, n in acc.counts.items() if n > 1}
    spot_check(reference, expected, acc, size=len(expected))


def without_cramjam(env: dict[str, str], shim: Path) -> dict[str, str]:
    """The worker's environment with cramjam (snappy, lz4, zstd for aiokafka) made unimportable."""
    shim.mkdir(exist_ok=True)
    (shim / "cramjam.py").write_text("raise ImportError('cramjam hidden by the test')\n")
    return {**env, "PYTHONPATH": f"{shim}:{env.get('PYTHONPATH', '')}".rstrip(":")}


# ---------------------------------------------------------------------------------------------- tests


def test_a_codec_library_the_worker_lacks_holds_that_partition_alone_until_skipped(
    kafka_bootstrap: str, tiny_llama_dir: Path, spawn: Spawn, tmp_path: Path, reference: Scorer
) -> None:
    """lz4 batches stop a worker without cramjam at their partition's first one; the skip setting in a
    successor sends the batch's range to the dead-letter topic and answers everything after it."""

    async def scenario() -> None:
        names = Names.unique("nocodec")
        await create_topics(kafka_bootstrap, names, PARTITIONS)
        tps = [TopicPartition(names.requests, p) for p in range(PARTITIONS)]
        before, compressed, after = (make_requests(f"{names.group}-{part}", n) for part, n in
                                     (("before", 4), ("lz4", 5), ("after", 4)))  # fmt: skip
        others = make_requests(f"{names.group}-others", 12, seed=1)
        ends = {0: 0}
        await produce_to(kafka_bootstrap, tps[0], before)
        held_at = (await produce_to(kafka_bootstrap, tps[0], compressed, "lz4"))[0]
        ends[0] = (await produce_to(kafka_bootstrap, tps[0], after))[-1] + 1
        for p in range(1, PARTITIONS):
            ends[p] = (await produce_to(kafka_bootstrap, tps[p], others[p - 1 :: 3]))[-1] + 1
        watcher = await ResultWatcher(kafka_bootstrap, names.results).start()
        port = free_port()
        # Without cramjam the worker can still write its results with gzip.
        values = {"metrics_port": port, "results_compression": "gzip"}
        env = without_cramjam(worker_env(kafka_bootstrap, tiny_llama_dir, names, **values), tmp_path / "shim")
        try:
            worker = spawn("without-cramjam", env)
            pid = worker.pid
            readable = ids(before + others)
            await wait_until(lambda: readable <= watcher.first.keys(), 90, "the readable requests' results")
            # A retry read the partition again and stopped at the same offset.
            await wait_until(
                lambda: reads(metric_samples(port, "score_worker_undecodable_reads"), 0, "codec_unavailable")
                >= 2,
                30, "a retry of the held partition",
            )  # fmt: skip
            assert not ids(compressed + after) & watcher.first.keys()
            status, readiness = get(port, "/readyz")
            assert status == 503
            check_held(readiness, names, {0: (held_at, "codec_unavailable")})
            assert "lz4" in readiness["held_partitions"][f"{names.requests}[0]"]["message"]
            assert get(port, "/healthz")[0] == 200
            assert metric_samples(port, "score_worker_held_partitions")[0][1] == 1
            await wait_committed(kafka_bootstrap, names, {**ends, 0: held_at})
            assert worker.find(rf"{names.requests}\[0\] stops at offset {held_at}.*codec_unavailable")
            assert worker.find("cannot decompress snappy, lz4, zstd")
            assert worker.running() and worker.pid == pid
            code, _ = await worker.terminate()
            assert code == 0, worker.tail()
            await wait_committed(kafka_bootstrap, names, {**ends, 0: held_at})

            successor = spawn(
                "skipping", {**env, f"{ENV_PREFIX}UNDECODABLE_SKIP_AFTER_MS": str(SKIP_AFTER_MS)}
            )
            await wait_until(lambda: ids(after) <= watcher.first.keys(), 90, "the requests after the batch")
            (dead,) = await read_topic(kafka_bootstrap, names.dlq, 1, settle_s=0.5)
            last = held_at + len(compressed) - 1
            assert dead_letter_ranges([dead]) == {0: (held_at, last, "codec_unavailable")}
            assert requests_in_batch(dead.value) == [r.request_id for r in compressed]
            assert header(dead, "x-source-topic") == names.requests.encode()
            await wait_committed(kafka_bootstrap, names, ends)
            skipped = metric_samples(port, "score_worker_skipped_records")
            assert reads(skipped, 0, "codec_unavailable") == len(compressed)
            check_answered_once(watcher, before + others + after, ids(compressed), reference)
            assert successor.running()
        finally:
            await watcher.stop()

    asyncio.run(scenario())


def test_batches_damaged_on_the_wire_hold_their_partitions_at_the_first_unreadable_offset(
    broker_pool: BrokerPool, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    """A CRC mismatch, a gzip payload cut short and a record that overruns its batch, each written with a
    raw produce request between readable requests: each partition holds where reading fails (the damaged
    record's own offset inside a batch), the fourth flows; a successor that skips answers the rest.

    On the embedded broker, which stores batches as given: Apache Kafka refuses these at produce time
    (tests/worker/test_apache_kafka.py), so on Kafka they come only from damage at rest."""
    kafka_bootstrap = broker_pool.embedded().bootstrap

    damage = {0: raw_batches.crc_damaged, 1: raw_batches.payload_cut, 2: raw_batches.record_damaged}
    causes = {0: "crc_mismatch", 1: "unparseable", 2: "unparseable"}

    async def scenario() -> None:
        names = Names.unique("damaged")
        await create_topics(kafka_bootstrap, names, PARTITIONS)
        tps = [TopicPartition(names.requests, p) for p in range(PARTITIONS)]
        readable: list[ScoreRequest] = []
        after: list[ScoreRequest] = []
        lost: set[str] = set()
        held: dict[int, tuple[int, str]] = {}
        ends: dict[int, int] = {}
        for p, tp in enumerate(tps):
            first = make_requests(f"{names.group}-p{p}-before", 3, seed=p)
            await produce_to(kafka_bootstrap, tp, first)
            readable += first
            if p in damage:
                inside = make_requests(f"{names.group}-p{p}-damaged", 3, seed=10 + p)
                base = await raw_batches.produce_raw(
                    kafka_bootstrap, tp, damage[p]([request_record(r) for r in inside])
                )
                # A record that overruns its batch is read up to it: the first request there is answered.
                unread = 1 if p == 2 else 0
                readable += inside[:unread]
                lost |= ids(inside[unread:])
                held[p] = (base + unread, causes[p])
            later = make_requests(f"{names.group}-p{p}-after", 3, seed=20 + p)
            ends[p] = (await produce_to(kafka_bootstrap, tp, later))[-1] + 1
            (after if p in damage else readable).extend(later)
        watcher = await ResultWatcher(kafka_bootstrap, names.results).start()
        port = free_port()
        env = worker_env(kafka_bootstrap, tiny_llama_dir, names, metrics_port=port)
        try:
            worker = spawn("holding", env)
            await wait_until(lambda: ids(readable) <= watcher.first.keys(), 90, "the readable requests")
            await wait_until(lambda: get(port, "/readyz")[1]["held_partitions"].keys() >= {
                f"{names.requests}[{p}]" for p in held}, 30, "three held partitions")  # fmt: skip
            status, readiness = get(port, "/readyz")
            assert status == 503
            check_held(readiness, names, held)
            assert not (ids(after) | lost) & watcher.first.keys()
            assert get(port, "/healthz")[0] == 200
            samples = metric_samples(port, "score_worker_undecodable_reads")
            for p, (_, cause) in held.items():
                assert reads(samples, p, cause) >= 1, samples
            await wait_committed(kafka_bootstrap, names, {**ends, **{p: at for p, (at, _) in held.items()}})
            assert worker.running()
            code, _ = await worker.terminate()
            assert code == 0, worker.tail()

            spawn("skipping", {**env, f"{ENV_PREFIX}UNDECODABLE_SKIP_AFTER_MS": str(SKIP_AFTER_MS)})
            await wait_until(lambda: ids(after) <= watcher.first.keys(), 90, "the requests after the damage")
            dead = await read_topic(kafka_bootstrap, names.dlq, len(held), settle_s=0.5)
            expected = {p: (at, at + (2 if p != 2 else 1), cause) for p, (at, cause) in held.items()}
            assert dead_letter_ranges(dead) == expected
            await wait_committed(kafka_bootstrap, names, ends)
            check_answered_once(watcher, readable + after, lost, reference)
        finally:
            await watcher.stop()

    asyncio.run(scenario())


class ReceivedBytes:
    """Changes what the client library receives in fetch responses for some partitions of one topic: the
    batch at a chosen base offset relabelled with an unknown codec, or cut short (and nothing after it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, topic: str) -> None:
        self.topic = topic
        self.unknown_codec: dict[int, int] = {}  # partition -> base offset of the batch to relabel
        self.cut_short: dict[int, int] = {}
        original = AIOKafkaClient.send

        async def send(client: AIOKafkaClient, node_id: int, request: Any, **kwargs: Any) -> Any:
            response = await original(client, node_id, request, **kwargs)
            if isinstance(request, FetchRequest):
                response.__dict__["topics"] = [
                    (topic, [self._changed(topic, partition) for partition in partitions])
                    for topic, partitions in response.topics
                ]
            return response

        monkeypatch.setattr(AIOKafkaClient, "send", send)

    def _changed(self, topic: str, partition: tuple[Any, ...]) -> tuple[Any, ...]:
        number, *rest = partition
        if topic != self.topic or not isinstance(rest[-1], bytes):
            return partition
        data: bytes = rest[-1]
        if number in self.unknown_codec:
            at = self.unknown_codec[number]
            data = raw_batches.rewrite_batches(
                data, lambda base, batch: raw_batches.with_codec(batch, 5) if base == at else batch
            )
        if number in self.cut_short:
            data = _cut_short(data, self.cut_short[number])
        return (number, *rest[:-1], data)


def _cut_short(data: bytes, base_offset: int) -> bytes:
    """The fetched batches up to the one at `base_offset`, which loses its last bytes; nothing after it."""
    kept: list[bytes] = []

    def keep(base: int, batch: bytes) -> bytes:
        if not kept or int.from_bytes(kept[-1][:8], "big") != base_offset:
            kept.append(batch[:-6] if base == base_offset else batch)
        return batch

    raw_batches.rewrite_batches(data, keep)
    return b"".join(kept)


def test_bytes_changed_at_the_client_library_boundary_are_held_and_skipped(
    kafka_bootstrap: str, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, reference: Scorer
) -> None:
    """Fetched bytes changed where aiokafka receives them: a batch naming codec 5 (Kafka defines 0-4) and a
    batch cut short (aiokafka would silently step one offset past it). Both hold their partition in an
    in-process worker that keeps running; with skipping, their ranges go to the dead-letter topic."""

    async def scenario() -> None:
        names = Names.unique("boundary")
        await create_topics(kafka_bootstrap, names, PARTITIONS)
        tps = [TopicPartition(names.requests, p) for p in range(PARTITIONS)]
        received = ReceivedBytes(monkeypatch, names.requests)
        readable, after, lost = [], [], set()
        ends = {}
        batches = {}
        for p, tp in enumerate(tps):
            first = make_requests(f"{names.group}-p{p}-before", 3, seed=p)
            await produce_to(kafka_bootstrap, tp, first)
            readable += first
            if p < 2:
                inside = make_requests(f"{names.group}-p{p}-changed", 4, seed=10 + p)
                batches[p] = await produce_to(kafka_bootstrap, tp, inside)
                lost |= ids(inside)
            later = make_requests(f"{names.group}-p{p}-after", 3, seed=20 + p)
            ends[p] = (await produce_to(kafka_bootstrap, tp, later))[-1] + 1
            (after if p < 2 else readable).extend(later)
        received.unknown_codec[0] = batches[0][0]
        received.cut_short[1] = batches[1][0]
        watcher = await ResultWatcher(kafka_bootstrap, names.results).start()
        settings = fast_settings(
            kafka_bootstrap, tiny_llama_dir, names, create_topics=False, self_check=False
        )
        try:
            worker = ScoreWorker(settings, Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
            task = asyncio.create_task(worker.run())
            await wait_until(lambda: ids(readable) <= watcher.first.keys(), 90, "the readable requests")
            await wait_until(lambda: len(worker.readiness.held_partitions) == 2, 30, "two held partitions")
            held = {0: (batches[0][0], "unknown_codec"), 1: (batches[1][0], "truncated")}
            check_held({"ready": worker.readiness.ready, "checks": worker.readiness.checks(),
                        **worker.readiness.details()}, names, held)  # fmt: skip
            await wait_committed(kafka_bootstrap, names, {**ends, 0: batches[0][0], 1: batches[1][0]})
            # A second read of each stopped at the same offset: the library did not step past the cut one.
            await wait_until(
                lambda: all(reads(exposed(worker, "score_worker_undecodable_reads"), p, c) >= 2
                            for p, (_, c) in held.items()), 30, "retries of both",
            )  # fmt: skip
            assert not (ids(after) | lost) & watcher.first.keys()
            assert not task.done()
            worker.stop()
            await asyncio.wait_for(task, 60)

            skipping = settings.model_copy(update={"undecodable_skip_after_ms": SKIP_AFTER_MS})
            successor = ScoreWorker(skipping, Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
            task = asyncio.create_task(successor.run())
            await wait_until(lambda: ids(after) <= watcher.first.keys(), 90, "the requests after the batches")
            dead = await read_topic(kafka_bootstrap, names.dlq, 2, settle_s=0.5)
            assert dead_letter_ranges(dead) == {
                p: (offsets[0], offsets[-1], held[p][1]) for p, offsets in batches.items()
            }
            await wait_committed(kafka_bootstrap, names, ends)
            assert successor.readiness.ready and not successor.readiness.held_partitions
            check_answered_once(watcher, readable + after, lost, reference)
            successor.stop()
            await asyncio.wait_for(task, 60)
        finally:
            await watcher.stop()

    asyncio.run(scenario())


def test_a_fetch_that_raises_is_retried_without_losing_or_repeating_a_request(
    kafka_bootstrap: str, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, reference: Scorer
) -> None:
    """getmany raising (whatever the library's reason) neither stops the worker nor skips a record: it
    reports not ready while fetches fail, counts them, rewinds to what it handed out and goes on."""
    failing = asyncio.Event()
    original = Fetcher.fetched_records

    async def fetched_records(fetcher: Fetcher, *args: Any, **kwargs: Any) -> Any:
        records = await original(fetcher, *args, **kwargs)
        if failing.is_set() and fetcher is worker_fetcher[0]:
            raise RuntimeError("injected: the fetch itself failed")
        return records

    worker_fetcher: list[Fetcher] = []
    monkeypatch.setattr(Fetcher, "fetched_records", fetched_records)

    async def scenario() -> None:
        names = Names.unique("raising")
        await create_topics(kafka_bootstrap, names, PARTITIONS)
        requests = make_requests(names.group, 40)
        watcher = await ResultWatcher(kafka_bootstrap, names.results).start()
        settings = fast_settings(
            kafka_bootstrap, tiny_llama_dir, names, create_topics=False, self_check=False
        )
        worker = ScoreWorker(settings, Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
        task = asyncio.create_task(worker.run())
        try:
            # The first requests reach two partitions: the other two hand out nothing before fetching fails,
            # so their rewind goes back to where their reading began.
            first, second = requests[:20], requests[20:]
            for i, request in enumerate(first):
                await produce_to(kafka_bootstrap, TopicPartition(names.requests, i % 2), [request])
            await wait_until(lambda: ids(first) <= watcher.first.keys(), 90, "the first requests")
            worker_fetcher.append(worker._source.consumer._fetcher)  # type: ignore[union-attr]
            failing.set()
            # Fetched while fetching fails: the records the library returned with each failure are dropped
            # and read again once fetching works.
            for i, request in enumerate(second):
                await produce_to(kafka_bootstrap, TopicPartition(names.requests, i % PARTITIONS), [request])
            await wait_until(lambda: not worker.readiness.checks()["fetching"], 10, "fetching to fail")
            await asyncio.sleep(1.0)
            assert not task.done() and not ids(second) & watcher.first.keys()
            failing.clear()
            await wait_until(lambda: ids(second) <= watcher.first.keys(), 60, "the requests sent meanwhile")
            assert worker.readiness.checks()["fetching"]
            failures = sum(v for _, v in exposed(worker, "score_worker_fetch_failures"))
            assert failures >= 2
            await asyncio.sleep(1.0)  # a duplicate would have come by now
            check_answered_once(watcher, requests, set(), reference)
            worker.stop()
            await asyncio.wait_for(task, 60)
        finally:
            await watcher.stop()

    asyncio.run(scenario())


def test_a_cause_that_passes_clears_by_itself(
    kafka_bootstrap: str, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, reference: Scorer
) -> None:
    """Bytes damaged in transit once (a broker serving a bad copy, then a good one): the held partition's
    next retry reads them, everything is answered once, and the worker is ready again, with nothing skipped
    and no setting changed."""

    async def scenario() -> None:
        names = Names.unique("transient")
        await create_topics(kafka_bootstrap, names, PARTITIONS)
        tp = TopicPartition(names.requests, 0)
        received = ReceivedBytes(monkeypatch, names.requests)
        before = make_requests(f"{names.group}-before", 3)
        await produce_to(kafka_bootstrap, tp, before)
        inside = make_requests(f"{names.group}-inside", 3, seed=1)
        base = (await produce_to(kafka_bootstrap, tp, inside))[0]
        received.unknown_codec[0] = base
        watcher = await ResultWatcher(kafka_bootstrap, names.results).start()
        settings = fast_settings(
            kafka_bootstrap, tiny_llama_dir, names, create_topics=False, self_check=False
        )
        worker = ScoreWorker(settings, Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
        task = asyncio.create_task(worker.run())
        try:
            await wait_until(lambda: ids(before) <= watcher.first.keys(), 90, "the requests before")
            await wait_until(lambda: bool(worker.readiness.held_partitions), 30, "the held partition")
            assert not worker.readiness.ready
            received.unknown_codec.clear()  # the next read gets the batch as it was written
            await wait_until(lambda: ids(inside) <= watcher.first.keys(), 60, "the requests in the batch")
            assert worker.readiness.ready and not worker.readiness.held_partitions
            assert not exposed(worker, "score_worker_skipped_records")
            await asyncio.sleep(0.5)  # a duplicate would have come by now
            check_answered_once(watcher, before + inside, set(), reference)
            worker.stop()
            await asyncio.wait_for(task, 60)
        finally:
            await watcher.stop()

    asyncio.run(scenario())

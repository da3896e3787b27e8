"""Fault-injection kit: worker processes, steady traffic, a proxy that cuts one client, and the accounting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import ConsumerRecord
from prometheus_client.parser import text_string_to_metric_families
from tolerances import assert_scored_alike
from worker_testkit import (
    Names,
    Record,
    client_kwargs,
    fast_values,
    header,
    partitions_of,
    read_topic,
    request_record,
    settings_env,
)

from models import Scorer
from schemas import (
    ErrorCode,
    ResultStatus,
    SchemaError,
    ScoreRequest,
    ScoreResult,
    decode_result,
    encode_request,
    request_headers,
)

WORKER_BIN = Path(sys.executable).with_name("score-worker")
PARTITIONS = 4
_WORD_TEXT = (
    "the quick brown fox jumps over lazy dog reward model reads prompt and response then returns single "
    "number good answers are helpful honest harmless streaming workers batch tokens publish results"
)
WORDS = _WORD_TEXT.split()


def figures(name: str, **values: Any) -> None:
    """One line of measured figures, for `pytest -s` readers."""
    shown = ", ".join(
        f"{key} {value:.2f}" if isinstance(value, float) else f"{key} {value}"
        for key, value in values.items()
    )
    print(f"\nFIGURES {name}: {shown}")


# ---------------------------------------------------------------------------------------------- traffic


def make_requests(tag: str, count: int, seed: int = 0) -> list[ScoreRequest]:
    """Unique-id requests of three shapes (query + items, items alone, token ids), some asking for states."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        rid = f"{tag}-{i:05d}"
        shape = i % 3
        if shape == 2:
            ids = tuple(rng.randrange(4, 500) for _ in range(rng.randrange(3, 12)))
            items: tuple[Any, ...] = (ids, tuple(rng.randrange(4, 500) for _ in range(5)))
            requests.append(ScoreRequest(request_id=rid, items=items, query=(5, 6, 7)))
            continue
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 15)))
        query = f"question {i}: {text}? " if shape == 0 else None
        items = tuple(f"answer {j} {rng.choice(WORDS)} {rng.choice(WORDS)}" for j in range(1 + shape))
        requests.append(
            ScoreRequest(request_id=rid, items=items, query=query, return_pooled_hidden_states=i % 4 == 0)
        )
    return requests


async def create_topics(
    bootstrap: str, names: Names, partitions: int = PARTITIONS, replication: int = 1
) -> None:
    """The requests, results and dead-letter topics, before any worker starts."""
    admin = AIOKafkaAdminClient(**client_kwargs(bootstrap))
    await admin.start()
    try:
        topics = [NewTopic(n, partitions, replication) for n in (names.requests, names.results, names.dlq)]
        response = await admin.create_topics(topics)
        errors = [e for e in response.topic_errors if e[1] != 0]
        assert not errors, errors
    finally:
        await admin.close()


class SteadyProducer:
    """Sends records at a steady rate from a background task, remembering when and where each one landed."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        records: Sequence[Record],
        rate_per_s: float,
        idempotent: bool = False,
    ) -> None:
        """`idempotent`: no second copy of a record from the producer's own retry (a broker failure makes
        it retry; without it a request can land twice, and is then rightly answered twice)."""
        self.topic, self.records, self.rate = topic, list(records), rate_per_s
        self.acked_at: list[float | None] = [None] * len(records)
        self.placed: list[tuple[int, int] | None] = [None] * len(records)  # (partition, offset)
        self.errors: list[BaseException] = []
        self.finished_at: float | None = None
        # Large enough for the oversized poison records; the broker decides what it accepts.
        self._producer = AIOKafkaProducer(
            **client_kwargs(bootstrap), acks="all", linger_ms=2, max_request_size=4 << 20,
            enable_idempotence=idempotent,
        )  # fmt: skip
        self._task: asyncio.Task[None] | None = None
        self._started = False

    @property
    def acked(self) -> int:
        return sum(at is not None for at in self.acked_at)

    async def start(self) -> SteadyProducer:
        await self._producer.start()
        self._started = True
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for index, (key, value, headers) in enumerate(self.records):
            delay = started + index / self.rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            ack = await self._producer.send(self.topic, value=value, key=key, headers=headers)
            ack.add_done_callback(lambda done, i=index: self._on_ack(i, done))
        await self._producer.flush()
        self.finished_at = time.time()

    def _on_ack(self, index: int, done: asyncio.Future[Any]) -> None:
        if done.exception() is not None:
            self.errors.append(done.exception())  # type: ignore[arg-type]
            return
        meta = done.result()
        self.acked_at[index] = time.time()
        self.placed[index] = (meta.partition, meta.offset)

    def acked_before(self, moment: float) -> list[int]:
        return [i for i, at in enumerate(self.acked_at) if at is not None and at < moment]

    async def wait_done(self, timeout_s: float) -> None:
        assert self._task is not None
        await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        assert not self.errors, self.errors[:3]
        assert self.acked == len(self.records)

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._started:
            await self._producer.stop()


@dataclass(frozen=True)
class Seen:
    """One result record as the watcher saw it."""

    request_id: str
    timestamp_s: float  # the record's timestamp: when the worker published it
    result: ScoreResult


class ResultWatcher:
    """Reads the results topic from its start in the background, for live progress and timings."""

    def __init__(self, bootstrap: str, topic: str, isolation_level: str = "read_uncommitted") -> None:
        self.topic = topic
        self.seen: list[Seen] = []
        self.first: dict[str, float] = {}
        self._consumer = AIOKafkaConsumer(
            **client_kwargs(bootstrap), enable_auto_commit=False, isolation_level=isolation_level
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> ResultWatcher:
        await self._consumer.start()
        partitions = await partitions_of(self._consumer, self.topic, attempts=200)
        self._consumer.assign(partitions)
        await self._consumer.seek_to_beginning(*partitions)
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            fetched = await self._consumer.getmany(timeout_ms=100)
            for record in (r for batch in fetched.values() for r in batch):
                try:
                    result = decode_result(record.value or b"")
                except SchemaError:
                    continue  # the final accounting reports it
                seen = Seen(result.request_id, record.timestamp / 1000, result)
                self.seen.append(seen)
                self.first.setdefault(seen.request_id, seen.timestamp_s)

    def answered_before(self, moment: float) -> set[str]:
        return {rid for rid, at in self.first.items() if at < moment}

    def first_after(self, moment: float, ids: set[str] | None = None) -> float | None:
        """Timestamp of the first result published after `moment` (for one of `ids` when given)."""
        times = [
            s.timestamp_s
            for s in self.seen
            if s.timestamp_s > moment and (ids is None or s.request_id in ids)
        ]
        return min(times, default=None)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._consumer.stop()


def metric_samples(metrics_port: int, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one metric family a worker exposes on 127.0.0.1 (none while it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as response:
            return samples_in(response.read().decode(), name)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return []


def samples_in(exposition: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one metric family in Prometheus' text format, with their labels. Counters are named
    without their _total suffix, as the parser names families."""
    return [
        (dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(exposition)
        if family.name == name
        for sample in family.samples
        if sample.name in (name, f"{name}_total")
    ]


def gauge_total(metrics_port: int, name: str) -> float:
    """The sum over its labels of one gauge a worker exposes on 127.0.0.1 (0 while unreachable)."""
    return sum(value for _, value in metric_samples(metrics_port, name))


async def wait_holding(
    metrics_port: int, timeout_s: float, busy_s: float = 2.0, poll_s: float = 0.02
) -> None:
    """Until a worker holds fetched requests it has not answered, judged from its in-flight gauge:
    the gauge rose from zero (the worker had answered everything, so the requests it fetched since found
    the model idle and wait max_wait_ms for company), or it stayed above zero for `busy_s` (the worker runs
    behind the stream). A gauge merely above zero may be a batch being published that very moment."""
    deadline = time.monotonic() + timeout_s
    was_zero, busy_since = False, None
    while time.monotonic() < deadline:
        # Off the loop: a scrape the busy worker answers slowly must not stall this process's producer.
        holding = await asyncio.to_thread(gauge_total, metrics_port, "score_worker_inflight_bytes") > 0
        now = time.monotonic()
        if holding and (was_zero or (busy_since is not None and now - busy_since >= busy_s)):
            return
        was_zero = not holding
        busy_since = (busy_since or now) if holding else None
        await asyncio.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for the worker to hold requests")


async def wait_until(check: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(poll_s)


@dataclass
class Stream:
    """One test's traffic: its topics, the requests, the steady producer and the live result watcher."""

    bootstrap: str
    names: Names
    requests: list[ScoreRequest]
    producer: SteadyProducer
    watcher: ResultWatcher
    isolation_level: str = "read_uncommitted"  # how the watcher and the final read see results

    @classmethod
    async def open(
        cls,
        bootstrap: str,
        prefix: str,
        count: int,
        rate: float,
        mix: Callable[[list[ScoreRequest]], list[Record]] | None = None,
        replication: int = 1,
        idempotent: bool = False,
        isolation_level: str = "read_uncommitted",
    ) -> Stream:
        """Topics created (`replication` copies of each partition), the watcher reading; the producer waits
        for `produce()`. `mix` turns the requests into the records to send (other records mixed in); by
        default each request is one record."""
        names = Names.unique(prefix)
        await create_topics(bootstrap, names, replication=replication)
        requests = make_requests(names.group, count)
        records = mix(requests) if mix is not None else [request_record(r) for r in requests]
        producer = SteadyProducer(bootstrap, names.requests, records, rate, idempotent)
        watcher = await ResultWatcher(bootstrap, names.results, isolation_level).start()
        return cls(bootstrap, names, requests, producer, watcher, isolation_level)

    async def produce(self) -> None:
        await self.producer.start()

    def expected(self) -> Counter[str]:
        return Counter(r.request_id for r in self.requests)

    def caught_up(self, slack: int) -> bool:
        """The workers have answered all but `slack` of what the broker has acknowledged so far."""
        return len(self.watcher.first) >= self.producer.acked - slack

    async def finish(
        self, expected: Counter[str], live: Sequence[WorkerProcess], timeout_s: float = 60.0
    ) -> Accounting:
        """Wait for the whole stream and its answers, then read the results topic back completely.

        Fails at once, with its log, when one of the `live` workers exits meanwhile."""

        def done() -> bool:
            for worker in live:
                assert worker.running(), (
                    f"{worker.name} exited with {worker.popen.returncode}\n{worker.tail()}"
                )
            return set(expected) <= self.watcher.first.keys()

        await self.producer.wait_done(timeout_s)
        with contextlib.suppress(TimeoutError):
            await wait_until(done, timeout_s, "every answer")  # the accounting below names what is missing
        records = await read_topic(
            self.bootstrap,
            self.names.results,
            sum(expected.values()),
            timeout_s=10,
            settle_s=1.0,
            isolation_level=self.isolation_level,
        )
        return account(records, expected)

    async def close(self) -> None:
        await self.producer.stop()
        await self.watcher.stop()


# ---------------------------------------------------------------------------------------------- workers


def worker_env(bootstrap: str, model_dir: Path, names: Names, **settings: Any) -> dict[str, str]:
    """The environment of a worker process: SCORE_WORKER_* settings with short group timeouts."""
    values = fast_values(
        bootstrap,
        model_dir,
        names,
        metrics_port=0,
        # Tansu makes a joining member wait about half the session timeout.
        session_timeout_ms=3000,
        heartbeat_interval_ms=500,
        commit_interval_ms=100,
        create_topics=False,
        self_check=False,
        log_format="json",
    )
    return settings_env({**values, **settings})


@dataclass(frozen=True)
class LogLine:
    """One line of a worker's JSON log."""

    at: float  # seconds since the epoch
    level: str
    message: str


def _parse_line(line: str) -> LogLine | None:
    try:
        entry = json.loads(line)
        when = datetime.strptime(entry["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
    except (ValueError, KeyError, TypeError):
        return None
    at = (when - datetime(1970, 1, 1)).total_seconds()
    return LogLine(
        at, entry["level"], entry["message"] + ("\n" + entry["exception"] if "exception" in entry else "")
    )


class WorkerProcess:
    """One `score-worker run` process, its JSON log file, and the faults a test can inflict on it."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.started_at = time.time()
        with open(self.log_path, "wb") as out:
            self.popen = subprocess.Popen(
                [str(WORKER_BIN), "run"], env=env, stdout=out, stderr=subprocess.STDOUT
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        shown = [line[:400] for line in self.text().splitlines()[-lines:]]
        return f"--- {self.name} (pid {self.pid}) log tail:\n" + "\n".join(shown)

    def lines(self) -> list[LogLine]:
        return [line for raw in self.text().splitlines() if (line := _parse_line(raw)) is not None]

    def find(self, pattern: str, after: float = 0.0) -> LogLine | None:
        return next((ln for ln in self.lines() if ln.at >= after and re.search(pattern, ln.message)), None)

    async def wait_for(self, pattern: str, timeout_s: float = 60.0, after: float = 0.0) -> LogLine:
        deadline = time.monotonic() + timeout_s
        while (found := self.find(pattern, after)) is None:
            assert self.running(), f"{self.name} exited with {self.popen.returncode}\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.name} never logged {pattern!r}\n{self.tail()}"
            await asyncio.sleep(0.05)
        return found

    async def wait_assigned(self, timeout_s: float = 60.0, after: float = 0.0) -> LogLine:
        """The next assignment with at least one partition."""
        return await self.wait_for(r"assigned partitions: \[", timeout_s, after)

    def assigned(self) -> set[int]:
        """Partitions of the last assignment it logged."""
        last = [ln for ln in self.lines() if ln.message.startswith("assigned partitions")]
        return {int(p) for p in re.findall(r"\[(\d+)\]", last[-1].message)} if last else set()

    def kill(self) -> float:
        """SIGKILL; returns when it was sent (epoch seconds) once the process is gone."""
        at = time.time()
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)
        return at

    async def terminate(self, timeout_s: float = 60.0) -> tuple[int, float]:
        """SIGTERM; the exit code and the seconds from the signal to the exit."""
        started = time.monotonic()
        self.popen.send_signal(signal.SIGTERM)
        while self.popen.poll() is None:
            assert time.monotonic() - started < timeout_s, f"{self.name} ignored SIGTERM\n{self.tail()}"
            await asyncio.sleep(0.01)
        return self.popen.returncode, time.monotonic() - started

    def rss_kib(self) -> int | None:
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        return int(found.group(1)) if found else None

    def problems(self, start: float, end: float) -> list[LogLine]:
        """WARNING and ERROR lines logged between two moments."""
        return [ln for ln in self.lines() if start <= ln.at <= end and ln.level in ("WARNING", "ERROR")]

    def close(self) -> None:
        if self.running():
            self.popen.kill()
            self.popen.wait(timeout=10)


class RssSampler:
    """Samples a process's resident memory in the background."""

    def __init__(self, process: WorkerProcess, every_s: float = 0.05) -> None:
        self.process, self.every_s = process, every_s
        self.samples: list[int] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> RssSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while (rss := self.process.rss_kib()) is not None:
            self.samples.append(rss)
            await asyncio.sleep(self.every_s)

    def stop(self) -> int:
        """The peak (KiB)."""
        if self._task is not None:
            self._task.cancel()
        return max(self.samples)


Spawn = Callable[[str, dict[str, str]], WorkerProcess]


# ---------------------------------------------------------------------------------------------- proxy


def kafka_client_id(frame: bytes) -> str:
    """The client id of a Kafka request (header v1 and v2 both carry it as a nullable int16 string)."""
    (length,) = struct.unpack_from(">h", frame, 8)
    return "" if length < 0 else frame[10 : 10 + length].decode("utf-8", "replace")


@dataclass(eq=False)
class _Link:
    client_id: str
    sides: tuple[asyncio.StreamWriter, asyncio.StreamWriter]

    def sever(self) -> None:
        for writer in self.sides:
            writer.transport.abort()


class ClientCutProxy:
    """A TCP proxy in front of a broker that can cut the connections of chosen Kafka clients.

    A broker advertising this proxy sends every client through it, so the clients are told apart by the
    client id in the first request of each connection: the worker's can be cut while the test's producer
    and readers keep going. While cut, chosen clients' new connections are closed after their first request.
    Runs on its own thread and loop, so that nothing the test does can stall the traffic it carries.
    """

    def __init__(self, cut_prefix: str) -> None:
        self.cut_prefix = cut_prefix
        self.upstream_port: int | None = None
        self.port = 0
        self.severed = 0  # open connections closed by cut()
        self.refused = 0  # connections closed while cut
        self._cutting = False
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cut-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    def _call(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)  # type: ignore[arg-type]

    def start(self) -> ClientCutProxy:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def cut(self) -> None:
        async def cut() -> None:
            self._cutting = True
            for link in [k for k in self._links if k.client_id.startswith(self.cut_prefix)]:
                link.sever()
                self.severed += 1

        self._call(cut())

    def restore(self) -> None:
        async def restore() -> None:
            self._cutting = False

        self._call(restore())

    def stop(self) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for link in list(self._links):
                link.sever()

        self._call(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readexactly(4)
            frame = await reader.readexactly(struct.unpack(">i", head)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.transport.abort()
            return
        client_id = kafka_client_id(frame)
        if self._cutting and client_id.startswith(self.cut_prefix):
            self.refused += 1
            writer.transport.abort()
            return
        assert self.upstream_port is not None
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        up_writer.write(head + frame)
        link = _Link(client_id, (writer, up_writer))
        self._links.add(link)
        try:
            pumps = [
                asyncio.create_task(_pump(reader, up_writer)),
                asyncio.create_task(_pump(up_reader, writer)),
            ]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
        finally:
            link.sever()
            self._links.discard(link)


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while chunk := await source.read(1 << 16):
            sink.write(chunk)
            await sink.drain()
    except (ConnectionError, OSError):
        return


# ---------------------------------------------------------------------------------------------- accounting


@dataclass
class Accounting:
    """What came back on the results topic, measured against the ids that were sent."""

    counts: Counter[str]
    expected: Counter[str]
    by_id: dict[str, list[ScoreResult]] = field(default_factory=dict)

    @property
    def missing(self) -> set[str]:
        return set(self.expected) - set(self.counts)

    @property
    def unexpected(self) -> set[str]:
        return set(self.counts) - set(self.expected)

    @property
    def duplicates(self) -> int:
        """Results beyond the number of records sent with that id."""
        return sum(max(0, n - self.expected[rid]) for rid, n in self.counts.items())

    def not_ok(self, ids: set[str]) -> dict[str, str]:
        bad = {}
        for rid in ids:
            for result in self.by_id.get(rid, []):
                if result.status != ResultStatus.OK:
                    bad[rid] = f"{result.error.code}: {result.error.message}" if result.error else "?"
        return bad


def account(records: Sequence[ConsumerRecord[bytes, bytes]], expected: Counter[str]) -> Accounting:
    by_id: dict[str, list[ScoreResult]] = {}
    for record in records:
        try:
            result = decode_result(record.value or b"")
        except SchemaError as error:
            raise AssertionError(f"an unreadable result at offset {record.offset}: {error}") from error
        by_id.setdefault(result.request_id, []).append(result)
    counts = Counter({rid: len(results) for rid, results in by_id.items()})
    return Accounting(counts, expected, by_id)


def check_complete(acc: Accounting, stream: Stream, reference: Scorer) -> float:
    """Every request answered OK, nothing else answered; a sample scored as the reference scores it."""
    assert not acc.missing, f"{len(acc.missing)} requests lost, e.g. {sorted(acc.missing)[:5]}"
    assert not acc.unexpected, f"results for unknown ids: {sorted(acc.unexpected)[:5]}"
    failed = acc.not_ok(set(stream.expected()))
    assert not failed, f"{len(failed)} good requests failed, e.g. {list(failed.items())[:3]}"
    return spot_check(reference, stream.requests, acc)


def spot_check(
    scorer: Scorer, requests: Sequence[ScoreRequest], accounting: Accounting, size: int = 50
) -> float:
    """Scores (and pooled states) of a sample, every copy of each, against an in-process float32 Scorer:
    the worker scored them in other batches, so each within assert_scored_alike's bounds.

    Returns the largest absolute difference seen.
    """
    sample = random.Random(1).sample(list(requests), min(size, len(requests)))
    largest = 0.0
    for request, reference in zip(sample, scorer.score(sample), strict=True):
        assert reference.status == ResultStatus.OK, reference.error
        for got in accounting.by_id[request.request_id]:
            assert got.status == ResultStatus.OK, (request.request_id, got.error)
            difference = _difference(got, reference)
            assert not math.isinf(difference), f"{request.request_id}: a NaN in the worker's result"
            assert_scored_alike(got, reference, scorer, [request])
            largest = max(largest, difference)
    return largest


def _difference(got: ScoreResult, reference: ScoreResult) -> float:
    assert len(got.scores) == len(reference.scores)
    diffs = [
        abs(a - b)
        for gs, rs in zip(got.scores, reference.scores, strict=True)
        for a, b in zip(gs, rs, strict=True)
    ]
    if reference.pooled_hidden_states is not None:
        assert got.pooled_hidden_states is not None and len(got.pooled_hidden_states) == len(got.scores)
        for g, r in zip(got.pooled_hidden_states, reference.pooled_hidden_states, strict=True):
            diffs.append(float(np.max(np.abs(g.to_numpy() - r.to_numpy()))))
    # A NaN compares false with every bound: count it as the largest difference there is.
    return math.inf if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)


# ---------------------------------------------------------------------------------------------- poison


@dataclass(frozen=True)
class Poison:
    """A record that breaks (or only stretches) the wire contract, and what the contract says it gets."""

    label: str
    record: Record
    result_id: str | None  # the id its result must carry; None: no id is readable, the dead letter is all
    ok: bool = False  # a valid request in odd clothes: an OK result and no dead letter
    code: ErrorCode | None = None  # the error code the contract fixes, where it fixes one
    dead_letter: bool = True
    echo: Any = None  # the metadata its error result must echo (the map was readable); None: not checked


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _raw_map(fields: Sequence[tuple[str, bytes]]) -> bytes:
    """A msgpack map from already-encoded values (for what msgpack itself refuses to write)."""
    assert len(fields) < 16
    return bytes([0x80 | len(fields)]) + b"".join(_pack(k) + v for k, v in fields)


class PoisonCorpus:
    """Builds the bad records, each with a fresh id where one can be carried."""

    def __init__(self, tag: str, seed: int = 7) -> None:
        self.tag = tag
        self.rng = random.Random(seed)
        self.items: list[Poison] = []
        self._next = 0

    def new_id(self) -> str:
        self._next += 1
        return f"{self.tag}-bad-{self._next:03d}"

    def noise(self, size: int) -> bytes:
        return self.rng.randbytes(size)

    def refused(self, label: str, fields: dict[str, Any], code: ErrorCode) -> None:
        """A map the decoder refuses: an error result to its id and a dead-letter copy."""
        rid = self.new_id()
        echo = None if "metadata" in fields else {"poison": label, "n": [1, 2.5, None]}
        value = _pack({"version": 1, "request_id": rid, "items": ["x"], "metadata": echo, **fields})
        record = (rid.encode(), value, request_headers(rid))
        self.items.append(Poison(label, record, rid, code=code, echo=echo))

    def unreadable(
        self,
        label: str,
        value: bytes | None,
        with_header: bool,
        code: ErrorCode | None,
        key: bytes | None = None,
    ) -> None:
        """No id in the value: the header's id (when sent) gets the error result; always a dead letter."""
        rid = self.new_id() if with_header else None
        headers = request_headers(rid) if rid else []
        if value is None:
            key = b"no-value"  # Kafka clients refuse a record with neither
        self.items.append(Poison(label, (key, value, headers), rid, code=code if rid else None))

    def unscorable(self, label: str, fields: dict[str, Any], code: ErrorCode | None) -> None:
        """Well-formed but unscorable: an error result only."""
        rid = self.new_id()
        value = _pack({"version": 1, "request_id": rid, **fields})
        self.items.append(
            Poison(label, (rid.encode(), value, request_headers(rid)), rid, code=code, dead_letter=False)
        )

    def odd_but_valid(
        self, label: str, fields: dict[str, Any], key: bytes | None, headers: list[Any]
    ) -> None:
        rid = self.new_id()
        value = _pack({"version": 1, "request_id": rid, "items": ["an odd but valid request"], **fields})
        self.items.append(
            Poison(label, (key, value, [*request_headers(rid), *headers]), rid, ok=True, dead_letter=False)
        )


def poison_corpus(tag: str, keyless_oversized: bool = False) -> list[Poison]:
    """Every kind of bad record the worker must answer without losing it or falling over.

    `keyless_oversized` adds dead-letter candidates above max_record_bytes that have no key: a copy that
    must drop its value then has neither key nor value, which Kafka clients refuse to send.
    """
    c = PoisonCorpus(tag)
    _garbage(c)
    _wrong_types(c)
    _huge(c)
    _nesting_and_specials(c)
    _versions(c)
    _odd_but_valid(c)
    if keyless_oversized:
        c.unreadable("random 300 KB, no key", c.noise(300_000), with_header=False, code=None)
        rid = c.new_id()
        value = _pack({"version": 1, "request_id": "i" * 100_000, "items": ["x"]})
        record = (None, value, request_headers(rid))
        c.items.append(Poison("100,000-character id, no key", record, rid, code=ErrorCode.INVALID_REQUEST))
    return c.items


def _garbage(c: PoisonCorpus) -> None:
    for size in (1, 64, 4096):
        c.unreadable(f"random {size} bytes", c.noise(size), with_header=False, code=None)
    # Far above the worker's max_record_bytes: the dead-letter copy must drop the value to fit.
    c.unreadable("random 300 KB, keyed", c.noise(300_000), with_header=False, code=None, key=b"oversized")
    c.unreadable("random bytes, id header", c.noise(512), with_header=True, code=None)
    whole = encode_request(ScoreRequest(request_id="cut-short", items=("a complete request",)))
    for with_header in (True, False):
        c.unreadable("truncated msgpack", whole[: len(whole) // 2], with_header, ErrorCode.MALFORMED_MESSAGE)
    for value in (None, b""):
        for with_header in (True, False):
            c.unreadable(f"value {value!r}", value, with_header, ErrorCode.MALFORMED_MESSAGE)
    c.unreadable("top-level array", _pack([1, "request"]), True, ErrorCode.MALFORMED_MESSAGE)
    c.unreadable("integer map key", _pack({"version": 1, 7: "x"}), True, ErrorCode.MALFORMED_MESSAGE)
    extension = _pack({"version": 1, "metadata": msgpack.ExtType(5, b"x")})
    c.unreadable("extension type", extension, True, ErrorCode.MALFORMED_MESSAGE)
    bad_utf8 = _raw_map([("version", _pack(1)), ("items", b"\x91\xa2\xff\xfe")])
    c.unreadable("invalid UTF-8", bad_utf8, True, ErrorCode.MALFORMED_MESSAGE)
    # The header's id cannot address a result (not UTF-8; too long): only the dead letter is left.
    for bad_id in (b"\xff\xfe\xfd", b"x" * 300):
        c.items.append(Poison("unusable id header", (None, c.noise(40), [("x-request-id", bad_id)]), None))


def _wrong_types(c: PoisonCorpus) -> None:
    invalid = ErrorCode.INVALID_REQUEST
    wrong: dict[str, list[Any]] = {
        "version": ["1", True, 1.0],
        "items": ["text", 5, [1, 2], [["a"]], None],
        "query": [5, {"a": 1}, [1, "a"]],
        "item_first": [1, "true"],
        "apply_softmax": ["true", 0],
        "return_pooled_hidden_states": [0, None, []],
        "hidden_states_dtype": [32, "FLOAT32", "float64"],
        "metadata": [_deep(100)],
        "label_token_ids": ["abc", [1, 1], [], [-1]],
        "messages": ["hi", [{"role": "user", "content": 5}], [{"role": "user", "content": "x", "extra": 1}]],
        "truncate": [3, "middle"],
        "requires": ["items", [1], ["pooling"]],
    }
    for name, values in wrong.items():
        for value in values:
            if value is None and name == "return_pooled_hidden_states":
                continue  # nil means the default: valid
            c.refused(f"{name}={value!r:.40}", {name: value}, invalid)
    for bad in (12345, "", None):  # the map's id is unusable: the header's addresses the result
        rid = c.new_id()
        value = _pack({"version": 1, "request_id": bad, "items": ["x"]})
        c.items.append(Poison(f"request_id={bad!r}", (None, value, request_headers(rid)), rid, code=invalid))


def _huge(c: PoisonCorpus) -> None:
    words = " ".join(c.rng.choice(WORDS) for _ in range(40_000))  # about 200 KB of text
    # An error whichever limit comes first (the worker's item count, or the result's size).
    c.unscorable("10,000 items", {"items": ["w"] * 10_000}, None)
    states = {"items": ["w"] * 1_000, "return_pooled_hidden_states": True}
    c.unscorable("1,000 hidden states", states, ErrorCode.RESULT_TOO_LARGE)
    c.unscorable(
        "300,000 query token ids", {"query": [5] * 300_000, "items": [[6]]}, ErrorCode.INPUT_TOO_LONG
    )
    c.unscorable("200 KB query text", {"query": words, "items": ["x"]}, ErrorCode.INPUT_TOO_LONG)
    c.unscorable("200 KB metadata", {"items": ["x"], "metadata": words}, ErrorCode.RESULT_TOO_LARGE)
    c.unscorable("token id beyond the vocabulary", {"items": [[5, 100_000]]}, ErrorCode.TOKEN_ID_OUT_OF_RANGE)
    c.unscorable("empty token prompt", {"items": [[]]}, ErrorCode.EMPTY_INPUT)
    labels = {"items": ["x"], "label_token_ids": [5, 6]}
    c.unscorable("labels for a classifier", labels, ErrorCode.LABEL_IDS_NOT_SUPPORTED)
    c.refused("50,000 label ids", {"label_token_ids": list(range(50_000))}, ErrorCode.INVALID_REQUEST)
    c.refused("5,000 requires names", {"requires": ["items"] * 5_000}, ErrorCode.INVALID_REQUEST)
    rid = c.new_id()
    value = _pack({"version": 1, "request_id": "i" * 100_000, "items": ["x"]})
    record = (b"huge-id", value, request_headers(rid))
    c.items.append(Poison("100,000-character id", record, rid, code=ErrorCode.INVALID_REQUEST))


def _deep(depth: int) -> Any:
    value: Any = None
    for _ in range(depth):
        value = [value]
    return value


def _nesting_and_specials(c: PoisonCorpus) -> None:
    nested = b"\x91" * 10_000 + b"\xc0"  # 10,000 nested one-element arrays: msgpack will not write it
    for name in ("metadata", "items", "query"):
        value = _raw_map([("version", _pack(1)), ("request_id", _pack("nested")), (name, nested)])
        c.unreadable(f"{name} nested 10,000 deep", value, True, ErrorCode.MALFORMED_MESSAGE)
    invalid = ErrorCode.INVALID_REQUEST
    for special in (math.nan, math.inf, -math.inf):
        c.refused(f"version={special}", {"version": special}, invalid)
        c.refused(f"query token {special}", {"query": [1, special]}, invalid)
        c.refused(f"item token {special}", {"items": [[special]]}, invalid)
        c.refused(f"label id {special}", {"label_token_ids": [special]}, invalid)
        c.refused(f"item_first={special}", {"item_first": special}, invalid)


def _versions(c: PoisonCorpus) -> None:
    for version in (2, 0, -1, 2**40, 2**64 - 1):
        c.refused(f"version {version}", {"version": version}, ErrorCode.UNSUPPORTED_SCHEMA_VERSION)
    rid = c.new_id()
    value = _pack({"request_id": rid, "items": ["x"]})
    c.items.append(
        Poison("no version", (None, value, request_headers(rid)), rid, code=ErrorCode.INVALID_REQUEST)
    )


def _odd_but_valid(c: PoisonCorpus) -> None:
    c.odd_but_valid("null key", {}, None, [])
    c.odd_but_valid(
        "binary headers", {}, b"\x00\xff", [("x-bin", bytes(range(256))), ("X-Empty", b""), ("x-null", None)]
    )
    specials = {"metadata": {"n": math.nan, "i": [math.inf, -math.inf]}}
    c.odd_but_valid("NaN and infinities in metadata", specials, None, [])
    c.odd_but_valid("300 KB unknown key", {"x-producer-blob": c.noise(300_000)}, None, [])


def check_poison(acc: Accounting, dead: list[Any], placed: dict[tuple[int, int], Poison]) -> None:
    """Each bad record got what the contract promises: its error result, its dead letter, nothing more."""
    letters: dict[tuple[int, int], Any] = {}
    for letter in dead:
        source = (
            int(header(letter, "x-source-partition") or -1),
            int(header(letter, "x-source-offset") or -1),
        )
        assert source not in letters, f"two dead letters for {source}"
        letters[source] = letter
    assert set(letters) <= set(placed), "a good request was dead-lettered"
    wrong = [
        f"{p.label}: {why}" for at, p in placed.items() if (why := _poison_fault(acc, letters.get(at), p))
    ]
    assert not wrong, "\n".join(wrong)


def _poison_fault(acc: Accounting, letter: Any, poison: Poison) -> str | None:
    """What is wrong with the answer to one bad record, or None."""
    if poison.dead_letter != (letter is not None):
        return f"dead letter expected: {poison.dead_letter}, found: {letter is not None}"
    if letter is not None and poison.code and header(letter, "x-error-code") != str(poison.code).encode():
        return f"dead letter code {header(letter, 'x-error-code')!r}, expected {poison.code}"
    if poison.result_id is None:
        return None
    results = acc.by_id.get(poison.result_id, [])
    if len(results) != 1:
        return f"{len(results)} results for {poison.result_id}"
    error = results[0].error
    if poison.ok:
        return None if error is None else f"expected an OK result, got {error.code}: {error.message[:200]}"
    if error is None:
        return "expected an error result, got OK"
    if poison.code and error.code != poison.code:
        return f"code {error.code}, expected {poison.code}: {error.message[:200]}"
    if poison.echo is not None and results[0].metadata != poison.echo:
        return f"metadata {results[0].metadata!r} instead of the request's {poison.echo!r}"
    return None

"""Traffic for fault tests: generated requests, a steady producer, a results watcher, metric reads, waits."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families
from worker_testkit import (
    Names,
    Record,
    client_kwargs,
    partitions_of,
    read_topic,
    request_record,
)

from fault_kit.accounting import Accounting, account
from fault_kit.common import PARTITIONS, WORDS
from fault_kit.workers import WorkerProcess
from schemas import (
    SchemaError,
    ScoreRequest,
    ScoreResult,
    decode_result,
)


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
        # Results carry the time the broker appended them (the worker's clock would stamp when it made them,
        # which on a busy host or through a cut connection can be long before they reached the broker).
        appended = {"message.timestamp.type": "LogAppendTime"}
        topics = [
            NewTopic(names.requests, partitions, replication),
            NewTopic(names.results, partitions, replication, topic_configs=appended),
            NewTopic(names.dlq, partitions, replication),
        ]
        response = await admin.create_topics(topics)
        errors = [e for e in response.topic_errors if e[1] != 0]
        assert not errors, errors
    finally:
        await admin.close()


class SteadyProducer:
    """Sends records at a steady rate from a background task, remembering when and where each one landed.

    It sends every record, or, once `end(after_s)` is called, stops that much later: a stream that must
    still run when a fault comes runs until the test has made it, on a busy host as on an idle one, with
    its records only as the cap."""

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
        # One entry per record sent, in order: when the broker acknowledged it, (partition, offset).
        self.acked_at: list[float | None] = []
        self.placed: list[tuple[int, int] | None] = []
        self.errors: list[BaseException] = []
        self.finished_at: float | None = None
        # Large enough for the oversized poison records; the broker decides what it accepts.
        self._producer = AIOKafkaProducer(
            **client_kwargs(bootstrap), acks="all", linger_ms=2, max_request_size=4 << 20,
            enable_idempotence=idempotent,
        )  # fmt: skip
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._end_at: float | None = None  # on the loop's clock

    @property
    def sent(self) -> int:
        return len(self.acked_at)

    @property
    def acked(self) -> int:
        return sum(at is not None for at in self.acked_at)

    async def start(self) -> SteadyProducer:
        await self._producer.start()
        self._started = True
        self._task = asyncio.create_task(self._run())
        return self

    def end(self, after_s: float) -> None:
        """Send no record later than `after_s` from now (the first call counts)."""
        if self._end_at is None:
            self._end_at = asyncio.get_running_loop().time() + after_s

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for index, (key, value, headers) in enumerate(self.records):
            due = started + index / self.rate
            if self._end_at is not None and due > self._end_at:
                break
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            self.acked_at.append(None)
            self.placed.append(None)
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
        assert self.acked == self.sent

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._started:
            await self._producer.stop()


@dataclass(frozen=True)
class Seen:
    """One result record as the watcher saw it."""

    request_id: str
    timestamp_s: float  # the record's timestamp: when the broker appended it (LogAppendTime)
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
    """One test's traffic: its topics, the requests, the steady producer and the live result watcher.

    An open-ended stream (`open(..., open_ended=True)`) runs until `finish`, and `end_s` past it: a fault
    that a busy host makes late still meets a running stream. Its `count` is only a cap; `requests` are
    those sent so far."""

    bootstrap: str
    names: Names
    planned: list[ScoreRequest]
    producer: SteadyProducer
    watcher: ResultWatcher
    isolation_level: str = "read_uncommitted"  # how the watcher and the final read see results
    open_ended: bool = False

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
        open_ended: bool = False,
    ) -> Stream:
        """Topics created (`replication` copies of each partition), the watcher reading; the producer waits
        for `produce()`. `mix` turns the requests into the records to send (other records mixed in); by
        default each request is one record."""
        assert not (open_ended and mix), "an open-ended stream sends one record per request"
        names = Names.unique(prefix)
        await create_topics(bootstrap, names, replication=replication)
        requests = make_requests(names.group, count)
        records = mix(requests) if mix is not None else [request_record(r) for r in requests]
        producer = SteadyProducer(bootstrap, names.requests, records, rate, idempotent)
        watcher = await ResultWatcher(bootstrap, names.results, isolation_level).start()
        return cls(bootstrap, names, requests, producer, watcher, isolation_level, open_ended)

    @property
    def requests(self) -> list[ScoreRequest]:
        """The requests of the stream: all of them, or, open-ended, those sent so far (in order, one record
        each: index i is the producer's record i)."""
        return self.planned[: self.producer.sent] if self.open_ended else self.planned

    async def produce(self) -> None:
        await self.producer.start()

    def running(self) -> bool:
        """The producer is still sending (an open-ended stream has not reached its cap)."""
        return self.producer.finished_at is None

    def expected(self) -> Counter[str]:
        return Counter(r.request_id for r in self.requests)

    def caught_up(self, slack: int) -> bool:
        """The workers have answered all but `slack` of what the broker has acknowledged so far."""
        return len(self.watcher.first) >= self.producer.acked - slack

    def answer_rate(self, window_s: float = 2.0, read_delay_s: float = 0.5) -> float:
        """First answers a second, by the broker's append times, over `window_s` ending `read_delay_s` ago
        (what the watcher may not have read yet)."""
        end = time.time() - read_delay_s
        start = end - window_s
        return sum(1 for at in self.watcher.first.values() if start <= at < end) / window_s

    def keeps_pace(self, slack: int, factor: float) -> bool:
        """The workers answer at no more than `factor` times the stream's rate and are answering: caught up
        (within `slack`), or, on a host too busy for that, behind by a steady amount rather than draining a
        backlog (which they would answer faster than the stream sends)."""
        if self.caught_up(slack):
            return True
        rate = self.answer_rate()
        return 0 < rate <= factor * self.producer.rate

    async def finish(
        self,
        live: Sequence[WorkerProcess],
        timeout_s: float = 60.0,
        end_s: float = 2.0,
        extra: Counter[str] | None = None,
    ) -> Accounting:
        """End an open-ended stream `end_s` from now; wait for the whole stream and its answers (every
        request, and the `extra` results expected besides), then read the results topic back completely.

        Fails at once, with its log, when one of the `live` workers exits meanwhile."""
        if self.open_ended:
            self.producer.end(end_s)
        await self.producer.wait_done(timeout_s)
        expected = self.expected() + (extra or Counter())

        def done() -> bool:
            for worker in live:
                assert worker.running(), (
                    f"{worker.name} exited with {worker.popen.returncode}\n{worker.tail()}"
                )
            return set(expected) <= self.watcher.first.keys()

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

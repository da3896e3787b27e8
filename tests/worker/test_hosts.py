"""Many hosts, on one machine: each "host" is a network namespace on a bridge (tests/worker/netns.py), an
Apache Kafka node on the first, a worker process on each of the others. One steady stream runs through the
group while a host is added, a host's worker is killed with -9, and a host is cut off the network for 15 s
(its link down: no reset, its connections just go quiet) and comes back. Nothing is lost; each request is
answered once, or twice where a fault made a worker repeat what it had not committed; and the longest any
request waited for its answer around each change is measured (docs/reliability.md keeps the figures).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import netns
import pytest
from brokers import insisted, java_or_not_here
from fault_kit.accounting import check_complete
from fault_kit.common import figures
from fault_kit.traffic import Stream, wait_until
from fault_kit.workers import Spawn, WorkerProcess, worker_env
from netns import Hosts

from models import Scorer
from worker.apache_kafka import ApacheKafka, pom_versions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RATE = 40.0
MAX_INFLIGHT = 32
SESSION_MS = 6000
COMMIT_INTERVAL_S = 0.1  # worker_env's commit_interval_ms
POLL_S = 0.2  # the longest the fetch loop waits between two looks at its commit timer
CUT_S = 15.0
STREAM_CAP_S = 240.0


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    reason = netns.available()
    if reason is not None:
        if insisted():
            pytest.fail(f"the many-hosts test runs in CI as root with iproute2: {reason}")
        pytest.skip(reason)
    with Hosts(4) as made:
        yield made


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, hosts: Hosts) -> Iterator[ApacheKafka]:
    """One Kafka node on host 0; workers on hosts 1 to 3 reach it across the bridge."""
    java_or_not_here()
    with ApacheKafka(
        nodes=1,
        version=pom_versions()["newest"],
        work_dir=tmp_path_factory.mktemp("kafka-hosts"),
        hosts=[hosts.addresses[0]],
        wrappers=[hosts.wrappers[0]],
    ) as made:
        yield made


def longest_wait(stream: Stream, start: float, end: float) -> float:
    """The longest time from the broker's acknowledgement of a request to its first answer, among the
    requests acknowledged between `start` and `end` (epoch seconds)."""
    waits = [
        answered - at
        for index, at in enumerate(stream.producer.acked_at)
        if at is not None and start <= at <= end
        if (answered := stream.watcher.first.get(stream.requests[index].request_id)) is not None
    ]
    return max(waits)


def steady_wait(stream: Stream, start: float, end: float) -> float:
    """The median wait of the requests acknowledged in a quiet window."""
    return statistics.median(
        answered - at
        for index, at in enumerate(stream.producer.acked_at)
        if at is not None and start <= at <= end
        if (answered := stream.watcher.first.get(stream.requests[index].request_id)) is not None
    )


async def _reassigned(workers: list[WorkerProcess], after: float, timeout_s: float) -> float:
    """When one of `workers` next logged an assignment with partitions after `after`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [w.find(r"assigned partitions: \[", after) for w in workers]
        times = [line.at for line in found if line is not None]
        if times:
            return min(times)
        assert time.monotonic() < deadline, "no worker took partitions after the change"
        await asyncio.sleep(0.1)


def test_hosts_added_killed_and_cut_off_lose_nothing(
    broker: ApacheKafka, hosts: Hosts, tiny_llama_dir: Path, spawn: Spawn, reference: Scorer
) -> None:
    bootstrap = broker.bootstrap_servers

    async def scenario() -> tuple[Stream, dict[str, float], dict[str, float]]:
        stream = await Stream.open(bootstrap, "hosts", int(STREAM_CAP_S * RATE), RATE, open_ended=True)
        env = worker_env(
            bootstrap, tiny_llama_dir, stream.names, max_inflight_requests=MAX_INFLIGHT,
            session_timeout_ms=SESSION_MS, heartbeat_interval_ms=1000, publish_timeout_ms=120_000,
        )  # fmt: skip
        at: dict[str, float] = {}
        after: dict[str, float] = {}
        try:
            first = spawn("host-1", env, hosts.wrappers[1])
            second = spawn("host-2", env, hosts.wrappers[2])
            await first.wait_assigned(120)
            await second.wait_assigned(120)
            await stream.produce()
            await wait_until(lambda: len(stream.watcher.first) >= 200, 90, "200 answers")
            at["steady"] = time.time()

            at["add"] = time.time()  # a third host joins
            third = spawn("host-3", env, hosts.wrappers[3])
            await third.wait_assigned(120)
            after["add"] = time.time()
            await wait_until(lambda: stream.keeps_pace(MAX_INFLIGHT, 1.25), 60, "the group to keep pace")

            at["kill"] = first.kill()  # host 1's worker dies
            after["kill"] = await _reassigned([second, third], at["kill"], 60)
            await wait_until(lambda: stream.keeps_pace(MAX_INFLIGHT, 1.25), 60, "the group to keep pace")

            at["cut"] = time.time()  # host 2 loses its network for CUT_S
            hosts.cut(2)
            try:
                after["cut"] = await _reassigned([third], at["cut"], 60)
                await asyncio.sleep(max(0.0, at["cut"] + CUT_S - time.time()))
            finally:
                hosts.heal(2)
            at["heal"] = time.time()
            await wait_until(lambda: stream.keeps_pace(MAX_INFLIGHT, 1.25), 90, "the group to keep pace")
            assert stream.running(), "the stream reached its cap before the last change"
            acc = await stream.finish([second, third], timeout_s=120)
            at["end"] = time.time()
            check_complete(acc, stream, reference)
            # Each change that is not a graceful leave (the kill, the cut, the cut host's return) can repeat
            # what one worker held uncommitted: its in-flight requests, and what it answered since its last
            # commit (one commit interval and one fetch-loop wait, 0.1 s round trip, at the stream's rate).
            bound = 3 * (MAX_INFLIGHT + math.ceil(RATE * (COMMIT_INTERVAL_S + POLL_S + 0.1)))
            assert acc.duplicates <= bound, (acc.duplicates, bound)
            figures("many hosts", requests=len(stream.requests), duplicates=acc.duplicates, bound=bound)
            return stream, at, after
        finally:
            await stream.close()

    stream, at, after = asyncio.run(scenario())
    steady = steady_wait(stream, at["steady"] - 5, at["add"])
    # Each change's window: the requests acknowledged from a second before it to a second before the next.
    waits = {
        "added": longest_wait(stream, at["add"] - 1, at["kill"] - 1),
        "killed": longest_wait(stream, at["kill"] - 1, at["cut"] - 1),
        "cut_off": longest_wait(stream, at["cut"] - 1, at["end"]),
    }
    figures(
        "many hosts, longest wait for an answer around each change (s)",
        steady_median=f"{steady:.3f}",
        **{name: f"{value:.2f}" for name, value in waits.items()},
        kill_to_reassigned=f"{after['kill'] - at['kill']:.1f}",
        cut_to_reassigned=f"{after['cut'] - at['cut']:.1f}",
        join_to_assigned=f"{after['add'] - at['add']:.1f}",
    )
    # A kill or a cut leaves the lost worker's partitions unanswered until its session times out, then the
    # others take them: a request waits about the session timeout, never the whole stream.
    assert waits["killed"] < SESSION_MS / 1000 + 20
    assert waits["cut_off"] < SESSION_MS / 1000 + CUT_S + 20

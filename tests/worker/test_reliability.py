"""Failure isolation, limits, deadlines, the watchdog and the drain bound, against a real broker and model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tolerances import assert_scored_alike
from worker_testkit import (
    Names,
    WrappedScorer,
    client_kwargs,
    committed_offsets,
    fast_settings,
    finish,
    log_ends,
    produce,
    read_topic,
    request_record,
)

from models import BatchObserver, PendingScores, PreparedRequest, Scorer, ScorerConfig
from models.errors import DeviceLostError
from schemas import ErrorCode, HiddenDType, ResultStatus, ScoreRequest, ScoreResult, decode_result
from worker.app import ScoreWorker
from worker.errors import ModelStuckError, PublishError
from worker.topics import ensure_topics

pytestmark = pytest.mark.slow


class MarkedScorer(Scorer):
    """The real Scorer, whose forward pass fails (or hangs) whenever its batch holds a marked request.

    The marker is in the request id, so the same content scores normally under another id.
    """

    hang = threading.Event()  # set to release hanging forwards

    def _launch_batch(self, batch: list[PreparedRequest]) -> Any:
        ids = [p.request.request_id for p in batch]
        if any(i.startswith("poison") for i in ids):
            raise RuntimeError("simulated kernel failure on a poisonous input")
        if any(i.startswith("lost") for i in ids):
            raise DeviceLostError("simulated: the device is gone")
        return super()._launch_batch(batch)

    def _collect(self, launched: Any) -> Any:
        # A hung kernel: the host waits for a device that never finishes the batch.
        if any(p.request.request_id.startswith("hang") for p in launched.batch):
            self.hang.wait(60)
        return super()._collect(launched)


class CountingScorer(WrappedScorer):
    """Remembers every request id that reached the model."""

    def __init__(self, scorer: Scorer) -> None:
        super().__init__(scorer)
        self.scored: list[str] = []

    def launch(self, prepared: Sequence[Any], on_batch: BatchObserver | None = None) -> PendingScores:
        self.scored += [p.request.request_id for p in prepared]
        return self.engine.launch(prepared, on_batch)


def _by_id(records: Sequence[Any]) -> dict[str, ScoreResult]:
    return {decode_result(r.value).request_id: decode_result(r.value) for r in records}


def _code(result: ScoreResult) -> ErrorCode | None:
    return None if result.error is None else result.error.code


def test_a_poisonous_request_fails_alone_and_its_batch_neighbours_score(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    names = Names.unique("isolate")
    # One batch of everything: the poisonous request shares its forward pass with 23 innocent ones.
    settings = fast_settings(kafka_bootstrap, tiny_llama_dir, names, max_wait_ms=500, max_batch_requests=64)
    scorer = MarkedScorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    requests = [ScoreRequest(f"ok-{i:02d}", items=(f"text {i}", "more")) for i in range(24)]
    requests.insert(11, ScoreRequest("poison-1", items=("text 1", "more")))
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    reference = plain.score(requests)

    async def scenario() -> dict[str, ScoreResult]:
        await ensure_topics(settings)
        await produce(kafka_bootstrap, names.requests, [request_record(r) for r in requests])
        worker = ScoreWorker(settings, scorer)
        outcome = await finish(settings, [(worker, asyncio.create_task(worker.run()))], 25, 25)
        assert outcome.committed == log_ends(outcome.sources)
        return _by_id(outcome.results)

    got = asyncio.run(scenario())
    assert len(got) == 25
    assert _code(got["poison-1"]) is ErrorCode.MODEL_ERROR
    assert "on its own" in got["poison-1"].error.message  # type: ignore[union-attr]
    for request, expected in zip(requests, reference, strict=True):
        if expected.request_id != "poison-1":
            result = got[expected.request_id]
            assert result.status is ResultStatus.OK
            assert_scored_alike(result, expected, plain, [request])


def _limits_requests() -> list[ScoreRequest]:
    return [
        ScoreRequest("fine", items=("short",) * 4),
        ScoreRequest("many-items", items=("x",) * 33),
        ScoreRequest("long-request", items=("one two three four five six seven eight",) * 30),
        ScoreRequest("long-item", items=("word " * 200,)),
        ScoreRequest(
            "big-result",
            items=("x",) * 30,
            return_pooled_hidden_states=True,
            hidden_states_dtype=HiddenDType.FLOAT32,
        ),
        ScoreRequest("past-deadline", items=("x",), deadline_ms=int(time.time() * 1000) - 1),
        ScoreRequest("short-ttl", items=("x",), ttl_ms=1),
        ScoreRequest("own-ttl", items=("x",), ttl_ms=3_600_000),
    ]


def test_limits_and_deadlines_answer_before_any_model_work(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    names = Names.unique("limits2")
    settings = fast_settings(
        kafka_bootstrap,
        tiny_llama_dir,
        names,
        max_request_items=32,
        max_request_tokens=200,
        max_item_tokens=100,
        max_record_bytes=8192,  # 30 float32 hidden states of 64 values: 7.7 KB of data, over with the rest
        default_ttl_ms=20_000,
    )
    base = Scorer(
        tiny_llama_dir,
        ScorerConfig(device="cpu", max_request_items=32, max_request_tokens=200, max_item_tokens=100),
    )
    scorer = CountingScorer(base)
    requests = _limits_requests()
    old = ScoreRequest("old-default-ttl", items=("x",))  # no deadline: the worker's default applies

    async def scenario() -> dict[str, ScoreResult]:
        await ensure_topics(settings)
        await produce(kafka_bootstrap, names.requests, [request_record(r) for r in requests])
        await _produce_at(kafka_bootstrap, names.requests, old, int(time.time() * 1000) - 60_000)
        worker = ScoreWorker(settings, scorer)
        outcome = await finish(settings, [(worker, asyncio.create_task(worker.run()))], 9, 9)
        return _by_id(outcome.results)

    got = asyncio.run(scenario())
    assert {rid: _code(r) for rid, r in got.items()} == {
        "fine": None,
        "many-items": ErrorCode.TOO_MANY_ITEMS,
        "long-request": ErrorCode.REQUEST_TOO_LONG,
        "long-item": ErrorCode.INPUT_TOO_LONG,
        "big-result": ErrorCode.RESULT_TOO_LARGE,
        "past-deadline": ErrorCode.EXPIRED,
        "short-ttl": ErrorCode.EXPIRED,
        "own-ttl": None,
        "old-default-ttl": ErrorCode.EXPIRED,
    }
    assert "max_request_items" in got["many-items"].error.message  # type: ignore[union-attr]
    assert "max_request_tokens" in got["long-request"].error.message  # type: ignore[union-attr]
    assert sorted(scorer.scored) == ["fine", "own-ttl"]  # nothing else cost model time


async def _produce_at(bootstrap: str, topic: str, request: ScoreRequest, timestamp_ms: int) -> None:
    from aiokafka import AIOKafkaProducer

    key, value, headers = request_record(request)
    producer = AIOKafkaProducer(**client_kwargs(bootstrap), acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key, timestamp_ms=timestamp_ms, headers=headers)
    finally:
        await producer.stop()


class PacedScorer(CountingScorer):
    """Each forward batch takes at least `delay_s` (a larger model's pace), and its size is recorded."""

    def __init__(self, scorer: Scorer, delay_s: float) -> None:
        super().__init__(scorer)
        self.delay_s = delay_s
        self.batch_tokens: list[int] = []

    def launch(self, prepared: Sequence[Any], on_batch: BatchObserver | None = None) -> PendingScores:
        self.batch_tokens.append(sum(p.num_tokens for p in prepared))
        time.sleep(self.delay_s)
        return super().launch(prepared, on_batch)


def test_a_request_that_expires_while_queued_costs_no_model_time(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    names = Names.unique("expire")
    # One partition: the last request is fetched behind the eight (Kafka serves partitions in turn).
    settings = fast_settings(
        kafka_bootstrap, tiny_llama_dir, names, max_batch_requests=1, max_wait_ms=0, topic_partitions=1
    )
    scorer = PacedScorer(Scorer(tiny_llama_dir, ScorerConfig(device="cpu")), delay_s=0.4)
    # Eight batches of 0.4 s before the last: its 1 s time-to-live runs out in the queue.
    requests = [ScoreRequest(f"slow-{i}", items=("x",)) for i in range(8)]
    requests.append(ScoreRequest("queued", items=("x",), ttl_ms=1_000))

    async def scenario() -> dict[str, ScoreResult]:
        await ensure_topics(settings)
        await produce(kafka_bootstrap, names.requests, [request_record(r) for r in requests])
        worker = ScoreWorker(settings, scorer)
        outcome = await finish(settings, [(worker, asyncio.create_task(worker.run()))], 9, 9)
        return _by_id(outcome.results)

    got = asyncio.run(scenario())
    assert _code(got["queued"]) is ErrorCode.EXPIRED
    assert "queued" not in scorer.scored
    assert all(got[f"slow-{i}"].status is ResultStatus.OK for i in range(8))


def _run_until_fatal(settings: Any, scorer: Any, requests: list[ScoreRequest]) -> tuple[Any, float, Any]:
    async def scenario() -> tuple[BaseException | None, float, ScoreWorker]:
        await ensure_topics(settings)
        await produce(
            settings.bootstrap_servers, settings.requests_topic, [request_record(r) for r in requests]
        )
        worker = ScoreWorker(settings, scorer)
        started = time.monotonic()
        try:
            await asyncio.wait_for(worker.run(), 60)
        except (ModelStuckError, DeviceLostError, PublishError) as error:
            return error, time.monotonic() - started, worker
        return None, time.monotonic() - started, worker

    return asyncio.run(scenario())


def test_the_watchdog_stops_a_worker_whose_model_call_hangs_without_committing_it(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    names = Names.unique("watchdog")
    settings = fast_settings(
        kafka_bootstrap, tiny_llama_dir, names, max_batch_requests=1, watchdog_ms=1500, topic_partitions=1
    )
    MarkedScorer.hang.clear()
    scorer = MarkedScorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    requests = [ScoreRequest(f"before-{i}", items=("x",)) for i in range(5)]
    requests += [ScoreRequest("hang-1", items=("x",)), ScoreRequest("after", items=("x",))]
    try:
        error, took_s, worker = _run_until_fatal(settings, scorer, requests)
        assert isinstance(error, ModelStuckError), error
        assert took_s < 30
        assert worker.readiness.checks()["model_responsive"] is False
        assert worker.model_call_stuck
        results = _by_id(asyncio.run(read_topic(kafka_bootstrap, names.results, 5, settle_s=0.5)))
        assert sorted(results) == [f"before-{i}" for i in range(5)]
        committed = asyncio.run(committed_offsets(kafka_bootstrap, names.group, names.requests))
        assert committed == {0: 5}  # up to the stuck request, not past it: it is delivered again
    finally:
        MarkedScorer.hang.set()


def test_a_lost_device_stops_the_worker_without_committing_its_batch(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    names = Names.unique("lostdev")
    settings = fast_settings(kafka_bootstrap, tiny_llama_dir, names, max_batch_requests=1, topic_partitions=1)
    scorer = MarkedScorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    requests = [ScoreRequest(f"before-{i}", items=("x",)) for i in range(3)]
    requests += [ScoreRequest("lost-1", items=("x",)), ScoreRequest("after", items=("x",))]
    error, _, _ = _run_until_fatal(settings, scorer, requests)
    assert isinstance(error, DeviceLostError), error
    committed = asyncio.run(committed_offsets(kafka_bootstrap, names.group, names.requests))
    assert committed == {0: 3}
    results = _by_id(asyncio.run(read_topic(kafka_bootstrap, names.results, 3, settle_s=0.5)))
    assert "lost-1" not in results


def test_a_stop_waits_at_most_the_drain_bound(kafka_bootstrap: str, tiny_llama_dir: Path) -> None:
    names = Names.unique("drain")
    settings = fast_settings(
        kafka_bootstrap,
        tiny_llama_dir,
        names,
        max_batch_requests=1,
        drain_timeout_ms=1000,
        topic_partitions=1,
    )
    MarkedScorer.hang.clear()
    scorer = MarkedScorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    requests = [ScoreRequest("first", items=("x",)), ScoreRequest("hang-2", items=("x",))]

    async def scenario() -> tuple[float, ScoreWorker]:
        await ensure_topics(settings)
        await produce(kafka_bootstrap, names.requests, [request_record(r) for r in requests])
        worker = ScoreWorker(settings, scorer)
        task = asyncio.create_task(worker.run())
        await read_topic(kafka_bootstrap, names.results, 1, settle_s=0.5)  # "first" is out, "hang-2" runs
        started = time.monotonic()
        worker.stop()
        await asyncio.wait_for(task, 30)
        return time.monotonic() - started, worker

    try:
        took_s, worker = asyncio.run(scenario())
        assert took_s < 1.0 + 2.0  # the bound, plus a commit and leaving the group
        assert worker.model_call_stuck
        committed = asyncio.run(committed_offsets(kafka_bootstrap, names.group, names.requests))
        assert committed == {0: 1}
    finally:
        MarkedScorer.hang.set()


def _large(request_id: str, items: int) -> ScoreRequest:
    return ScoreRequest(
        request_id,
        query="a shared question that every item of this large request is scored against",
        items=tuple(f"candidate {i} " + "word " * (i % 7) for i in range(items)),
        return_pooled_hidden_states=True,
        hidden_states_dtype=HiddenDType.FLOAT32,
    )


def test_small_requests_behind_large_ones_wait_about_one_batch(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    names = Names.unique("hol")
    budget = 1024
    settings = fast_settings(
        kafka_bootstrap, tiny_llama_dir, names, max_batch_tokens=budget, max_record_bytes=4_000_000
    )
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    paced = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", max_batch_tokens=budget))
    scorer = PacedScorer(paced, delay_s=0.08)
    large = [_large("large-1", 600), _large("large-2", 600)]  # about 14k tokens each: 14 batches each
    small = [ScoreRequest(f"small-{i:03d}", items=(f"short {i}",)) for i in range(60)]

    async def scenario() -> tuple[dict[str, ScoreResult], dict[str, float]]:
        await ensure_topics(settings)
        worker = ScoreWorker(settings, scorer)
        task = asyncio.create_task(worker.run())
        await produce(kafka_bootstrap, names.requests, [request_record(small[0])])
        await read_topic(kafka_bootstrap, names.results, 1, settle_s=0)  # joined and warm
        await produce(kafka_bootstrap, names.requests, [request_record(r) for r in large])
        for request in small[1:]:  # a steady trickle behind the large requests
            await produce(kafka_bootstrap, names.requests, [request_record(request)])
            await asyncio.sleep(0.05)
        outcome = await finish(settings, [(worker, task)], 62, 62)
        sent = {decode_result(r.value).request_id: r.timestamp for r in outcome.results}
        requested = {r.key.decode(): r.timestamp for r in outcome.sources if r.key}
        waits = {rid: (sent[rid] - requested[rid]) / 1000 for rid in sent}
        return _by_id(outcome.results), waits

    got, waits = asyncio.run(scenario())
    assert len(got) == 62
    large_s = max(waits["large-1"], waits["large-2"])
    small_waits = sorted(waits[r.request_id] for r in small[1:])
    print(f"large requests answered after {waits['large-1']:.2f} and {waits['large-2']:.2f} s; "
          f"small requests p50 {small_waits[29]:.3f} s, max {small_waits[-1]:.3f} s")  # fmt: skip
    assert max(scorer.batch_tokens) <= budget  # the large requests ran in batch-sized parts
    assert large_s > 2.0  # 28 paced batches at least: a small request stuck behind them would show it
    # About one part of a large request, a batch of its own, the batch wait and the broker's fetch wait
    # (0.4 s here); queued behind the large requests instead, they waited 2.7 to 6.3 s.
    assert small_waits[-1] < min(1.5, large_s / 3), small_waits
    # The parts joined into one result per large request, equal to scoring it whole.
    for request, expected in zip(large, plain.score(large), strict=True):
        result = got[request.request_id]
        assert result.status is ResultStatus.OK and len(result.scores) == 600
        assert result.prompt_tokens == expected.prompt_tokens
        assert result.pooled_hidden_states is not None
        assert_scored_alike(result, expected, plain, [request])


def test_the_command_exits_non_zero_when_the_watchdog_fires(
    kafka_bootstrap: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A 1 ms watchdog fires on the first batch: the process exits 1, uncommitted, and /readyz says why."""
    import subprocess
    import sys

    names = Names.unique("watchdog-cli")
    settings = fast_settings(kafka_bootstrap, tiny_llama_dir, names, topic_partitions=1)
    asyncio.run(ensure_topics(settings))
    request = ScoreRequest("slow", items=tuple(f"text number {i}" for i in range(200)))
    asyncio.run(produce(kafka_bootstrap, names.requests, [request_record(request)]))
    command = [
        sys.executable, "-m", "worker", "run", "--model", str(tiny_llama_dir),
        "--bootstrap-servers", kafka_bootstrap, "--requests-topic", names.requests,
        "--results-topic", names.results, "--dlq-topic", names.dlq, "--group-id", names.group,
        "--device", "cpu", "--session-timeout-ms", "1500", "--heartbeat-interval-ms", "300",
        "--metrics-port", "0", "--no-self-check", "--watchdog-ms", "1", "--watchdog-multiple", "1",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "past its limit" in done.stderr and "watchdog_ms" in done.stderr
    committed = asyncio.run(committed_offsets(kafka_bootstrap, names.group, names.requests))
    assert committed.get(0, 0) == 0  # the request is delivered again


class _LaunchOrder(PacedScorer):
    """A paced scorer that records each batch's request ids, in the order the model thread ran them."""

    def __init__(self, scorer: Scorer, delay_s: float) -> None:
        super().__init__(scorer, delay_s)
        self.batches: list[list[str]] = []

    def launch(self, prepared: Sequence[Any], on_batch: BatchObserver | None = None) -> PendingScores:
        self.batches.append([p.request.request_id for p in prepared])
        return super().launch(prepared, on_batch)


def test_a_request_behind_items_over_the_budget_waits_for_one_of_them(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    """Six requests each holding one item longer than the token budget (which nothing can cut), then a
    small request: the model runs the small one after the first long item, not after all six."""
    names = Names.unique("long-items")
    budget = 128
    settings = fast_settings(
        kafka_bootstrap, tiny_llama_dir, names, max_batch_tokens=budget, topic_partitions=1
    )
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    scorer = _LaunchOrder(Scorer(tiny_llama_dir, ScorerConfig(device="cpu", max_batch_tokens=budget)), 0.2)
    long = [ScoreRequest(f"long-{i}", items=(f"passage {i} " + "word " * 250,)) for i in range(6)]
    small = ScoreRequest("small", items=("a short answer",))
    assert all(plain.prepare(r).num_tokens > budget for r in long)  # type: ignore[union-attr]

    async def scenario() -> dict[str, ScoreResult]:
        await ensure_topics(settings)
        worker = ScoreWorker(settings, scorer)
        task = asyncio.create_task(worker.run())
        await produce(kafka_bootstrap, names.requests, [request_record(ScoreRequest("warm", items=("x",)))])
        await read_topic(kafka_bootstrap, names.results, 1, settle_s=0)  # joined and warm
        await produce(kafka_bootstrap, names.requests, [request_record(r) for r in [*long, small]])
        outcome = await finish(settings, [(worker, task)], 8, 8)
        return _by_id(outcome.results)

    got = asyncio.run(scenario())
    assert len(got) == 8 and all(r.status is ResultStatus.OK for r in got.values())
    ran = [ids for ids in scorer.batches if ids != ["warm"]]
    assert sorted(ran) == sorted([[r.request_id] for r in long] + [["small"]])  # each long item alone
    # In arrival order the small request would run seventh; taking turns, it runs at most second.
    assert ran.index(["small"]) <= 1, ran
    for request, expected in zip([*long, small], plain.score([*long, small]), strict=True):
        assert_scored_alike(got[request.request_id], expected, plain, [request])

"""Reply topics: a request may name the topic its result goes to (kafka_replyTopic), within the worker's
allow-list; everything else is answered on the results topic, and nothing is written where it was not
allowed. The correlation header comes back on the result."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from worker_testkit import (
    Names,
    client_kwargs,
    fast_settings,
    finish,
    header,
    produce,
    read_topic,
    request_record,
)

from models import Scorer, ScorerConfig
from schemas import HEADER_CORRELATION_ID, HEADER_REPLY_TOPIC, ErrorCode, ScoreRequest, decode_result
from worker.app import ScoreWorker
from worker.config import WorkerSettings
from worker.replies import DEFAULT_ROUTE, ReplyPolicy
from worker.topics import ensure_topics


def _settings(pattern: str = r"score\.results\..+") -> WorkerSettings:
    return WorkerSettings(
        bootstrap_servers="127.0.0.1:9092",
        model_dir=Path("/tmp"),
        requests_topic="in",
        results_topic="score.results",
        dlq_topic="score.results.dlq",
        reply_topic_pattern=pattern,
    )


def test_a_route_follows_the_headers_within_the_allow_list() -> None:
    policy = ReplyPolicy(_settings())
    assert policy.route([]) is DEFAULT_ROUTE and policy.route(None) is DEFAULT_ROUTE
    mine = policy.route([("KAFKA_REPLYTOPIC", b"score.results.client-7")])  # any case, as Kafka clients vary
    assert mine.topic == "score.results.client-7" and mine.refusal is None
    assert policy.route([(HEADER_REPLY_TOPIC, b"score.results")]).topic is None  # the default, named
    for refused in (b"private.payments", b"score.results.", b"sc\xc3\xb6re.results.x", b"a b", b"x" * 300):
        route = policy.route([(HEADER_REPLY_TOPIC, refused)])
        assert route.topic is None and route.refusal is not None, refused
    # The worker's own requests and dead-letter topics, even where the pattern would allow them.
    loose = ReplyPolicy(_settings(".*"))
    assert loose.route([(HEADER_REPLY_TOPIC, b"in")]).refusal is not None
    assert loose.route([(HEADER_REPLY_TOPIC, b"score.results.dlq")]).refusal is not None
    assert loose.route([(HEADER_REPLY_TOPIC, b"anything")]).topic == "anything"
    closed = ReplyPolicy(_settings(""))
    assert "allows none" in (closed.route([(HEADER_REPLY_TOPIC, b"score.results.x")]).refusal or "")
    correlated = policy.route([(HEADER_CORRELATION_ID, b"\x00\x01corr")])
    assert correlated.headers == [(HEADER_CORRELATION_ID, b"\x00\x01corr")] and correlated.topic is None
    assert policy.route([(HEADER_CORRELATION_ID, b"c" * 2000)]).headers == []  # not a payload carrier


def _request(rid: str, reply: str | None = None, correlation: bytes | None = None) -> Any:
    key, value, headers = request_record(
        ScoreRequest(request_id=rid, items=((5, 6, 7),), metadata={"n": rid})
    )
    if reply is not None:
        headers = [*headers, (HEADER_REPLY_TOPIC, reply.encode())]
    if correlation is not None:
        headers = [*headers, (HEADER_CORRELATION_ID, correlation)]
    return key, value, headers


async def _topics(bootstrap: str) -> set[str]:
    admin = AIOKafkaAdminClient(**client_kwargs(bootstrap))
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


def test_each_client_reads_exactly_its_own_results(kafka_bootstrap: str, tiny_llama_dir: Path) -> None:
    names = Names.unique("replies")
    pattern = rf"{names.results.replace('.', chr(92) + '.')}\..+"
    settings = fast_settings(kafka_bootstrap, tiny_llama_dir, names, reply_topic_pattern=pattern)
    mine_a, mine_b = f"{names.results}.client-a", f"{names.results}.client-b"
    missing, private = f"{names.results}.never-created", f"{names.requests}-private"
    # Interleaved: two clients with reply topics of their own, one reading the results topic.
    plan = [(f"a-{i}", mine_a) for i in range(6)] + [(f"b-{i}", mine_b) for i in range(6)]
    plan += [(f"c-{i}", None) for i in range(6)]
    plan = [plan[i] for i in sorted(range(len(plan)), key=lambda i: (i % 6, i))]
    refused = [("refused-private", private), ("refused-missing", missing)]

    async def scenario() -> Any:
        await ensure_topics(settings)
        admin = AIOKafkaAdminClient(**client_kwargs(kafka_bootstrap))
        await admin.start()
        try:
            await admin.create_topics([NewTopic(t, 2, 1) for t in (mine_a, mine_b)])
        finally:
            await admin.close()
        worker = ScoreWorker(settings, Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
        task = asyncio.create_task(worker.run())
        records = [_request(rid, reply, correlation=rid.encode()) for rid, reply in [*plan, *refused]]
        await produce(kafka_bootstrap, names.requests, records)
        default = 6 + len(refused)
        outcome = await finish(settings, [(worker, task)], default, len(records))
        got_a = await read_topic(kafka_bootstrap, mine_a, 6)
        got_b = await read_topic(kafka_bootstrap, mine_b, 6)
        return outcome, got_a, got_b, await _topics(kafka_bootstrap)

    outcome, got_a, got_b, topics = asyncio.run(scenario())
    for records, prefix in ((got_a, "a-"), (got_b, "b-")):
        results = [decode_result(r.value or b"") for r in records]
        assert sorted(r.request_id for r in results) == [f"{prefix}{i}" for i in range(6)]
        assert all(r.ok and r.metadata == {"n": r.request_id} for r in results)
        assert all(
            header(r, HEADER_CORRELATION_ID) == decode_result(r.value or b"").request_id.encode()
            for r in records
        )
    default = {
        decode_result(r.value or b"").request_id: (r, decode_result(r.value or b"")) for r in outcome.results
    }
    assert sorted(default) == sorted([f"c-{i}" for i in range(6)] + [rid for rid, _ in refused])
    for rid, _ in refused:
        record, result = default[rid]
        assert result.error is not None and result.error.code is ErrorCode.REPLY_TOPIC_NOT_ALLOWED, (
            result.error
        )
        assert result.metadata == {"n": rid} and header(record, HEADER_CORRELATION_ID) == rid.encode()
    assert "does not exist" in (default["refused-missing"][1].error.message or "")  # type: ignore[union-attr]
    # Nothing was written where it was not allowed, and no topic was created for it.
    assert private not in topics and missing not in topics
    assert all(default[f"c-{i}"][1].ok for i in range(6))
    # Every request was committed: the reply topic changes where results go, not the offset rules.
    assert sum(outcome.committed.values()) == len(plan) + len(refused)


def test_clients_with_reply_topics_see_only_their_own_results(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    """ScoreClient with a reply topic of its own: created when missing, positioned before the first send,
    and it reads nothing but its own results while other clients score at the same time."""
    from worker.client import ScoreClient

    names = Names.unique("reply-clients")
    pattern = rf"{names.results.replace('.', chr(92) + '.')}\..+"
    settings = fast_settings(kafka_bootstrap, tiny_llama_dir, names, reply_topic_pattern=pattern)

    async def scenario() -> Any:
        await ensure_topics(settings)
        worker = ScoreWorker(settings, Scorer(tiny_llama_dir, ScorerConfig(device="cpu")))
        task = asyncio.create_task(worker.run())
        topics = {"a": f"{names.results}.a", "b": f"{names.results}.b", "shared": None}
        clients = {
            name: ScoreClient(
                kafka_bootstrap, requests_topic=names.requests, results_topic=names.results, reply_topic=topic
            )
            for name, topic in topics.items()
        }
        try:
            for client in clients.values():
                await client.start()
            batches = {
                name: [ScoreRequest(f"{name}-{i}", items=((5, 6, 7 + i),)) for i in range(8)]
                for name in clients
            }
            results = await asyncio.gather(*(clients[n].score(batches[n], timeout=120) for n in clients))
            stats = {name: client.stats for name, client in clients.items()}
        finally:
            for client in clients.values():
                await client.stop()
            worker.stop()
            await asyncio.wait_for(task, 60)
        return dict(zip(clients, results, strict=True)), stats

    results, stats = asyncio.run(scenario())
    for name, got in results.items():
        assert [r.request_id for r in got] == [f"{name}-{i}" for i in range(8)]
        assert all(r.ok for r in got)
        # Nothing of the others' arrived: each reply topic holds one client's results only, and the shared
        # topic only those of the client without one.
        assert stats[name].unknown == 0 and stats[name].received == 8, (name, stats[name])

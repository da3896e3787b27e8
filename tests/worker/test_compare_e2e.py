"""Comparisons end to end: a pairwise and a rank request through a real broker and a real worker, asked by
ScoreClient and by `score-worker submit`, and a compare request the contract refuses, answered once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgpack
import numpy as np
import pytest
from brokers import broker_tiers
from tolerances import assert_within, forward_atol
from worker_testkit import LiveWorker, produce, read_topic

from models.prepare import PreparedRequest
from schemas import Compare, ErrorCode, ScoreRequest, ScoreResult, decode_result
from worker.cli import main as cli_main
from worker.client import ScoreClient

pytestmark = pytest.mark.slow

kafka_bootstrap = broker_tiers("default")

QUERY = "Question: which of these answers about the opening hours of the town library is the most helpful? "
ITEMS = ("It opens at nine.", "The library is closed on Sundays.", "Nine, except on Sundays.", "No idea.")


def _client(live: LiveWorker) -> ScoreClient:
    names = live.names
    return ScoreClient(
        live.bootstrap, requests_topic=names.requests, results_topic=names.results, start_timeout=20
    )


def _assert_compared(got: ScoreResult, live: LiveWorker, compare: Compare) -> None:
    """The worker's comparison against the same request scored in process: the rewards within two float32
    forwards of each other (packed in other batches), the answer within what that moves (sigmoid is
    1/4-Lipschitz: a reward difference off by 2 atol moves P by atol / 2; a Plackett-Luce probability p by
    at most p (e^(2 atol) - 1)), the ranking the same where the rewards lie further apart than that."""
    assert got.ok, got.error
    request = ScoreRequest("ref", items=got_items(got), query=QUERY, compare=compare)
    (want,) = live.scorer.score([request])
    prepared = live.scorer.prepare(request)
    assert isinstance(prepared, PreparedRequest)
    assert got.rewards is not None and want.rewards is not None
    expected = np.asarray(want.rewards)
    atol = forward_atol(
        Path(live.scorer.hf_model.name_or_path), expected, longest=max(map(len, prepared.prompts))
    )
    assert_within(got.rewards, expected, atol, "rewards")
    if compare is Compare.PAIRWISE:
        assert got.preference is not None and want.preference is not None and got.ranking is None
        assert_within(got.preference, want.preference, atol / 2, "preference")
        return
    assert np.abs(np.diff(np.sort(expected))).min() > 2 * atol, "items too close to order; choose others"
    assert got.ranking == want.ranking and got.preference is None
    assert got.best_probability is not None and want.best_probability is not None
    best = np.asarray(want.best_probability)
    assert_within(got.best_probability, best, best * np.expm1(2 * atol), "best_probability")


def got_items(result: ScoreResult) -> tuple[str, ...]:
    return ITEMS[: len(result.scores)]


def test_client_asks_pairwise_and_rank(live_worker: LiveWorker) -> None:
    async def scenario() -> tuple[ScoreResult, ScoreResult]:
        async with _client(live_worker) as client:
            pair = await client.compare(ITEMS[:2], QUERY, timeout=60)
            ranked = await client.compare(ITEMS, QUERY, timeout=60)
            return pair, ranked

    pair, ranked = asyncio.run(scenario())
    _assert_compared(pair, live_worker, Compare.PAIRWISE)
    _assert_compared(ranked, live_worker, Compare.RANK)


def test_submit_compares_every_line(live_worker: LiveWorker, tmp_path: Path) -> None:
    source = tmp_path / "requests.jsonl"
    lines = [{"request_id": "cli-rank", "query": QUERY, "items": list(ITEMS)}]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    target = tmp_path / "results.jsonl"
    names = live_worker.names
    args = [
        "submit", "--bootstrap-servers", live_worker.bootstrap, "--requests-topic", names.requests,
        "--results-topic", names.results, "--timeout", "60", "--input", str(source), "--output", str(target),
        "--compare", "rank",
    ]  # fmt: skip
    assert cli_main(args) == 0
    (row,) = [json.loads(line) for line in target.read_text().splitlines()]
    got = ScoreResult(
        row["request_id"], row["status"], scores=tuple(map(tuple, row["scores"])), rewards=row["rewards"],
        ranking=row["ranking"], best_probability=row["best_probability"],
    )  # fmt: skip
    _assert_compared(got, live_worker, Compare.RANK)


def test_a_refused_compare_is_answered_once_and_dead_lettered(live_worker: LiveWorker) -> None:
    names = live_worker.names
    body = {
        "version": 1,
        "request_id": "bad-pair",
        "query": QUERY,
        "items": list(ITEMS[:3]),
        "compare": "pairwise",
    }
    value = msgpack.packb(body)

    async def scenario() -> tuple[list[ScoreResult], list[bytes]]:
        await produce(live_worker.bootstrap, names.requests, [(b"bad-pair", value, [])])
        dead = await read_topic(live_worker.bootstrap, names.dlq, 1, settle_s=0.2)
        for _ in range(60):  # the result is written before the dead letter, but other tests' results too
            records = await read_topic(live_worker.bootstrap, names.results, 1, settle_s=0.5)
            ours = [
                r
                for r in map(decode_result, (record.value for record in records))
                if r.request_id == "bad-pair"
            ]
            if ours:
                return ours, [record.value for record in dead]
        return [], [record.value for record in dead]

    results, dead = asyncio.run(scenario())
    (result,) = results  # exactly one
    assert result.error is not None and result.error.code is ErrorCode.COMPARE_INVALID
    assert "exactly two items" in result.error.message
    assert dead == [value]

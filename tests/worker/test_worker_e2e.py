"""End to end through a real broker: 500 mixed requests plus malformed records, a real tiny model."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest
from brokers import broker_tiers
from tolerances import assert_scored_alike
from worker_testkit import (
    Names,
    Outcome,
    Record,
    fast_settings,
    finish,
    header,
    log_ends,
    produce,
    read_topic,
    request_record,
)

from models import Scorer, ScorerConfig
from schemas import (
    ErrorCode,
    HiddenDType,
    ResultStatus,
    ScoreRequest,
    ScoreResult,
    decode_result,
)
from worker.app import ScoreWorker
from worker.topics import ensure_topics

pytestmark = pytest.mark.slow

# The wire contract on every broker the project meets: Apache Kafka (the newest 4.x and the version
# docker-compose.yml runs) and the embedded broker the demo uses.
kafka_bootstrap = broker_tiers("default", "embedded", "kafka-compose")

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards"]
DTYPES = [HiddenDType.FLOAT32, HiddenDType.FLOAT16, HiddenDType.BFLOAT16]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))


def _ids(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(5, 500) for _ in range(rng.randint(1, 8)))


def make_requests(count: int, seed: int = 7) -> list[ScoreRequest]:
    """Texts and token ids, single and multi-item, with and without hidden states in every dtype."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        kind = i % 4
        as_ids = kind in (1, 3)
        make = _ids if as_ids else _text
        items = tuple(make(rng) for _ in range(1 if kind == 0 else rng.randint(2, 3)))
        requests.append(
            ScoreRequest(
                request_id=f"req-{i:04d}",
                items=items,
                query=make(rng) if kind >= 2 else None,
                item_first=kind == 3,
                apply_softmax=i % 7 == 0,
                return_pooled_hidden_states=i % 3 != 0,
                hidden_states_dtype=DTYPES[i % 3],
                metadata={"n": i} if i % 5 == 0 else None,
            )
        )
    return requests


def malformed_records() -> dict[str, Record]:
    """Records that break the wire contract or cannot be scored, by what the worker must do with them."""
    invalid = msgpack.packb({"request_id": "bad-invalid", "items": [[1, -5]], "version": 1})
    out_of_range = ScoreRequest(request_id="bad-token-id", items=((3, 100_000),))
    return {
        "bytes-no-id": (b"k1", bytes(random.Random(1).randrange(256) for _ in range(64)), []),
        "bytes-with-id": (b"k2", b"\xc1\xc1 not msgpack", [("x-request-id", b"bad-bytes-with-id")]),
        "invalid-with-id": (b"k3", invalid, [("trace", b"abc")]),
        "unscorable": request_record(out_of_range),
        # An id in the header that no result could carry (over 256 characters): dead letter only.
        "bytes-unusable-id": (b"k5", b"\xc1 junk", [("x-request-id", b"x" * 300)]),
    }


def _assert_same_result(got: ScoreResult, want: ScoreResult, scorer: Scorer, request: ScoreRequest) -> None:
    assert got.status == want.status == ResultStatus.OK, (got.error, want.error)
    assert got.prompt_tokens == want.prompt_tokens
    assert got.metadata == want.metadata
    # Packing differs between the worker's batches and the direct run.
    assert_scored_alike(got, want, scorer, [request])


def test_mixed_stream_is_scored_once_each_and_committed(kafka_bootstrap: str, tiny_llama_dir: Path) -> None:
    names = Names.unique("e2e")
    settings = fast_settings(
        kafka_bootstrap, tiny_llama_dir, names, max_batch_requests=32, max_batch_tokens=1024
    )
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    requests = make_requests(500)
    bad = malformed_records()
    records = [request_record(r) for r in requests]
    for position, record in zip((40, 260, 261, 420, 421), bad.values(), strict=True):
        records.insert(position, record)
    expected_results = len(requests) + 3  # every bad record with a usable id gets a result

    async def scenario() -> tuple[Outcome, list[Any]]:
        await ensure_topics(settings)
        # Half before the worker starts (a new group must start from the earliest offset), half while it runs.
        await produce(kafka_bootstrap, names.requests, records[:250])
        worker = ScoreWorker(settings, scorer)
        task = asyncio.create_task(worker.run())
        await produce(kafka_bootstrap, names.requests, records[250:])
        # finish() waits a second after the last result: periodic commits pass before the final one at stop.
        outcome = await finish(settings, [(worker, task)], expected_results, len(records))
        return outcome, await read_topic(kafka_bootstrap, names.dlq, 4, settle_s=0.2)

    outcome, dlq = asyncio.run(scenario())
    results, sources, committed = outcome.results, outcome.sources, outcome.committed

    decoded = {}
    counts = Counter()
    for record in results:
        result = decode_result(record.value)
        counts[result.request_id] += 1
        decoded[result.request_id] = result
        assert header(record, "x-request-id") == result.request_id.encode()
        assert record.key is not None
    assert not [rid for rid, n in counts.items() if n != 1], "duplicated results"
    assert len(decoded) == expected_results

    direct = scorer.score(requests)
    for request, want in zip(requests, direct, strict=True):
        _assert_same_result(decoded[want.request_id], want, scorer, request)

    for rid, code in [
        ("bad-bytes-with-id", ErrorCode.MALFORMED_MESSAGE),
        ("bad-invalid", ErrorCode.INVALID_REQUEST),
        ("bad-token-id", ErrorCode.TOKEN_ID_OUT_OF_RANGE),
    ]:
        result = decoded[rid]
        assert result.status == ResultStatus.ERROR and result.error is not None
        assert result.error.code == code and result.error.message

    _check_dead_letters(dlq, sources, bad, names)
    assert committed == log_ends(sources)
    assert sum(committed.values()) == len(records)


def _check_dead_letters(dlq: list, sources: list, bad: dict[str, Record], names: Names) -> None:
    """Exactly the four contract-breaking records, copied whole, with reason and source in headers."""
    assert len(dlq) == 4
    by_value = {record.value: record for record in sources}
    copied = {record.value for record in dlq}
    assert copied == {
        bad[name][1] for name in ("bytes-no-id", "bytes-with-id", "invalid-with-id", "bytes-unusable-id")
    }
    for record in dlq:
        source = by_value[record.value]
        assert record.key == source.key
        assert [h for h in record.headers if not h[0].startswith("x-") or h[0] == "x-request-id"] == [
            h for h in source.headers
        ]
        code = header(record, "x-error-code")
        expected_code = b"INVALID_REQUEST" if source.key == b"k3" else b"MALFORMED_MESSAGE"
        assert code == expected_code
        assert header(record, "x-error-message")
        assert header(record, "x-source-topic") == names.requests.encode()
        assert header(record, "x-source-partition") == str(source.partition).encode()
        assert header(record, "x-source-offset") == str(source.offset).encode()

"""Worker limits and failure paths against a real broker: backpressure, oversized results, a failing batch."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from worker_testkit import (
    Names,
    Outcome,
    Record,
    WrappedScorer,
    fast_settings,
    finish,
    header,
    log_ends,
    produce,
    read_topic,
    request_record,
)

from models import BatchObserver, PendingScores, Scorer, ScorerConfig
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

MAX_INFLIGHT = 6


class ObservedScorer(WrappedScorer):
    """The real Scorer, plus: records the worker's in-flight count at each batch, fails batches on demand."""

    def __init__(self, scorer: Scorer, fail_request_id: str) -> None:
        super().__init__(scorer)
        self._fail = fail_request_id
        self.worker: ScoreWorker | None = None
        self.in_flight_seen: list[int] = []
        self.batch_sizes: list[int] = []
        self.thread_names: set[str] = set()
        self.launched: set[str] = set()

    def launch(self, prepared: Sequence[Any], on_batch: BatchObserver | None = None) -> PendingScores:
        assert self.worker is not None
        self.in_flight_seen.append(self.worker.in_flight)
        self.batch_sizes.append(len(prepared))
        self.thread_names.add(threading.current_thread().name)
        self.launched |= {p.request.request_id for p in prepared}
        time.sleep(0.02)  # slower than fetching, so the worker runs into its in-flight limit
        if any(p.request.request_id == self._fail for p in prepared):
            raise RuntimeError("simulated kernel failure")
        return self.engine.launch(prepared, on_batch)


def _requests() -> list[ScoreRequest]:
    requests = [ScoreRequest(request_id=f"lim-{i:03d}", items=(f"short text {i}",)) for i in range(40)]
    # 24 items x 64 float32 values = 6 KiB of hidden states: above the 4 KiB record limit below.
    requests.insert(
        10,
        ScoreRequest(
            request_id="too-large",
            items=tuple(f"item {j}" for j in range(24)),
            return_pooled_hidden_states=True,
            hidden_states_dtype=HiddenDType.FLOAT32,
        ),
    )
    requests.insert(25, ScoreRequest(request_id="explode", items=("this batch fails",)))
    # Token outputs count in the bound too: 40 positions x 64 float32 values = 10 KiB; 2 positions fit.
    words = " ".join(f"w{j}" for j in range(40))
    requests.insert(
        15,
        ScoreRequest(
            request_id="tokens-too-large",
            items=(words,),
            token_outputs="tokens",
            return_token_hidden_states=True,
        ),
    )
    requests.insert(
        16,
        ScoreRequest(
            request_id="tokens-fit",
            items=(words,),
            token_outputs="tokens",
            token_range=(-2, None),
            return_token_hidden_states=True,
            hidden_states_dtype=HiddenDType.BFLOAT16,
        ),
    )
    return requests


def _echo_breakers() -> dict[str, Record]:
    """Records whose result or dead-letter copy is too large because of what is echoed from the request:
    the worker must still answer them, or it would stop at them on every restart."""
    big_metadata = ScoreRequest(request_id="big-metadata", items=("short",), metadata={"note": "m" * 6000})
    return {
        "big-metadata": request_record(big_metadata),
        "big-key": request_record(ScoreRequest(request_id="big-key", items=("short",)), key=b"k" * 6000),
        "big-header": (b"k", b"\xc1 junk", [("x-request-id", b"big-header"), ("trace", b"t" * 6000)]),
    }


def test_backpressure_oversized_results_and_failing_batches(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    names = Names.unique("limits")
    settings = fast_settings(
        kafka_bootstrap,
        tiny_llama_dir,
        names,
        max_inflight_requests=MAX_INFLIGHT,
        max_batch_requests=4,
        max_record_bytes=4096,
    )
    scorer = ObservedScorer(Scorer(tiny_llama_dir, ScorerConfig(device="cpu")), fail_request_id="explode")
    requests = _requests()
    breakers = _echo_breakers()
    records = [request_record(r) for r in requests]
    for position, record in zip((5, 20, 30), breakers.values(), strict=True):
        records.insert(position, record)

    async def scenario() -> tuple[Outcome, list[Any]]:
        await ensure_topics(settings)
        # All requests wait in the topic before the worker starts: only backpressure limits its fetching.
        await produce(kafka_bootstrap, names.requests, records)
        worker = ScoreWorker(settings, scorer)
        scorer.worker = worker
        outcome = await finish(
            settings, [(worker, asyncio.create_task(worker.run()))], len(records), len(records)
        )
        return outcome, await read_topic(kafka_bootstrap, names.dlq, 1, settle_s=0.2)

    outcome, dlq = asyncio.run(scenario())
    results = outcome.results

    by_id = {decode_result(r.value).request_id: decode_result(r.value) for r in results}
    assert len(results) == len(by_id) == len(records)
    assert max(scorer.in_flight_seen) == MAX_INFLIGHT  # reached, never exceeded
    assert max(scorer.batch_sizes) <= 4
    assert len(scorer.thread_names) == 1 and next(iter(scorer.thread_names)).startswith("score-model")

    too_large = by_id["too-large"]
    assert too_large.status == ResultStatus.ERROR and too_large.error is not None
    assert (
        too_large.error.code == ErrorCode.RESULT_TOO_LARGE and "max_record_bytes" in too_large.error.message
    )
    tokens = by_id["tokens-too-large"]
    assert tokens.error is not None and tokens.error.code == ErrorCode.RESULT_TOO_LARGE, tokens.error
    assert "token positions" in tokens.error.message
    assert {"too-large", "tokens-too-large"}.isdisjoint(scorer.launched)  # refused before any model work
    fit = by_id["tokens-fit"]
    if fit.ok:  # (unless the failing batch took it down with it)
        assert fit.token_positions is not None and len(fit.token_positions[0]) == 2
        assert fit.token_hidden_states is not None and fit.token_hidden_states[0].shape == (2, 64)
    failed = [r for r in by_id.values() if r.error is not None and r.error.code == ErrorCode.INTERNAL_ERROR]
    assert "explode" in {r.request_id for r in failed}
    assert 1 <= len(failed) <= 4  # only the failing batch
    special = {*breakers, "too-large", "tokens-too-large"} | {r.request_id for r in failed}
    assert all(r.status == ResultStatus.OK for r in by_id.values() if r.request_id not in special)
    _check_echo_breakers(by_id, results, dlq)
    assert outcome.committed == log_ends(outcome.sources)


def _check_echo_breakers(by_id: dict[str, ScoreResult], results: list[Any], dlq: list[Any]) -> None:
    for request_id in ("big-metadata", "big-key"):
        result = by_id[request_id]
        assert result.error is not None and result.error.code == ErrorCode.RESULT_TOO_LARGE, result.error
        assert result.metadata is None
    keys = {decode_result(r.value).request_id: r.key for r in results}
    assert keys["big-metadata"] == b"big-metadata"
    assert keys["big-key"] is None  # the key alone breaks the limit: the result goes out without it
    malformed = by_id["big-header"].error
    assert malformed is not None and malformed.code == ErrorCode.MALFORMED_MESSAGE
    # The dead-letter copy keeps the reason, the source and the key; the oversized headers are left out.
    (copy,) = dlq
    assert copy.key == b"k" and copy.value == b""  # too large: the reason and source stay, the value goes
    assert header(copy, "x-error-code") == b"MALFORMED_MESSAGE"
    assert header(copy, "x-source-offset") is not None
    assert header(copy, "trace") is None and header(copy, "x-headers-omitted-bytes") is not None

"""Accounting of a fault test: every request answered once, and a sample checked against the model."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from aiokafka.structs import ConsumerRecord
from tolerances import assert_scored_alike

from models import Scorer
from schemas import (
    ResultStatus,
    SchemaError,
    ScoreRequest,
    ScoreResult,
    decode_result,
)

if TYPE_CHECKING:
    from fault_kit.traffic import Stream


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

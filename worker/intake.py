"""Records in, records out: decode and tokenise fetched requests, encode results, count what they carry."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.structs import ConsumerRecord, TopicPartition

from models import BatchPlan, PendingScores, ScoringEngine
from models.errors import DeviceLostError
from schemas import (
    ErrorCode,
    SchemaError,
    ScoreRequest,
    ScoreResult,
    decode_request,
    header_request_id,
    result_headers,
    result_size_bound,
)
from worker.config import WorkerSettings
from worker.intake_processes import Ready
from worker.metrics import ResultTally, WorkerMetrics
from worker.publisher import OutRecord, dead_letter_record, result_record
from worker.publisher import record_size as out_record_size
from worker.replies import DEFAULT_ROUTE, ReplyPolicy, Route

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Accepted:
    """A decoded, tokenised request waiting for (or in) a model batch."""

    tp: TopicPartition
    offset: int
    key: bytes | None
    request: ScoreRequest
    prepared: Any
    timestamp_ms: int  # the request record's timestamp: where its end-to-end latency starts
    size: int  # bytes of the request record
    ready_at: float  # monotonic time it was tokenised: where its wait for a batch starts
    expires_at_ms: int | None = None  # Unix milliseconds after which it gets EXPIRED instead of a score
    route: Route = DEFAULT_ROUTE  # where its result goes (a reply topic it named), and echoed headers


@dataclass(eq=False)
class Rejected:
    """A record answered without a model run, with the records that answer it (result and/or DLQ copy)."""

    tp: TopicPartition
    offset: int
    messages: list[OutRecord]
    tally: ResultTally


Source = tuple[TopicPartition, int]


@dataclass(frozen=True)
class Outgoing:
    """Records to publish for a group of requests, and what they carry (counted once the broker acks)."""

    records: list[OutRecord]
    tally: ResultTally
    sources: list[Source]  # the request each record answers (partition and offset), one per record

    def __post_init__(self) -> None:
        if len(self.sources) != len(self.records):
            raise ValueError(f"{len(self.records)} records but {len(self.sources)} sources")

    def answered(self) -> list[Source]:
        """The requests these records answer, each once, in order."""
        return list(dict.fromkeys(self.sources))


@dataclass(eq=False)
class Launch:
    """A batch handed to the scorer: its pending device work, or its results when they are known already."""

    prepared: Sequence[Any]
    pending: PendingScores | None  # what the engine's launch returned
    results: list[ScoreResult] | None = None


def record_size(record: ConsumerRecord[bytes, bytes]) -> int:
    return len(record.value or b"") + len(record.key or b"")


class Intake:
    """Turns fetched records into accepted requests or rejections, and results into records to publish."""

    def __init__(self, settings: WorkerSettings, engine: ScoringEngine, metrics: WorkerMetrics) -> None:
        self._settings = settings
        self._engine = engine
        self._metrics = metrics
        self._replies = ReplyPolicy(settings)

    @property
    def plan(self) -> BatchPlan:
        """The engine's token-budget rule: what the worker's batches and a large request's parts count."""
        return self._engine.plan

    def prepare_all(
        self, records: Sequence[ConsumerRecord[bytes, bytes]], ready: Sequence[Ready | None] | None = None
    ) -> list[Accepted | Rejected]:
        """Runs on the tokeniser thread. `ready`: what intake processes already prepared of each record
        (None where they did not: that record is decoded and tokenised here)."""
        if ready is None:
            return [self._prepare_one(record) for record in records]
        return [self._prepare_one(record, done) for record, done in zip(records, ready, strict=True)]

    def _prepare_one(
        self, record: ConsumerRecord[bytes, bytes], ready: Ready | None = None
    ) -> Accepted | Rejected:
        started = time.perf_counter()
        tp = TopicPartition(record.topic, record.partition)
        route = self._replies.route(record.headers)
        if ready is not None:
            request = ready[0].request
        else:
            try:
                request = decode_request(record.value if record.value is not None else b"")
            except SchemaError as error:
                return self._reject_record(
                    record, error.code, error.message, error.request_id, error.metadata, route
                )
            except Exception as exc:  # decode_request promises SchemaError only; never lose a record to a bug
                log.exception("decoding offset %d of %s failed unexpectedly", record.offset, tp)
                message = f"decoding failed: {exc!r}"
                return self._reject_record(record, ErrorCode.INTERNAL_ERROR, message, None, None, route)
        expires_at_ms = request.expires_at_ms(record.timestamp, self._settings.default_ttl_ms)
        answer: ScoreResult | None = None
        prepared: Any = None
        if route.refusal is not None:  # before any model work: the result could not go where it was asked
            answer = self.failure(request, ErrorCode.REPLY_TOPIC_NOT_ALLOWED, route.refusal)
        elif expires_at_ms is not None and time.time() * 1000 >= expires_at_ms:
            answer = self.expired(request, expires_at_ms)  # before tokenizing: it costs nothing more
        elif ready is not None:
            prepared = ready[0]
            answer = self._too_large(request, record.key, prepared)
        else:
            answer, prepared = self._prepare(request, record.key)
        self._metrics.tokenized(time.perf_counter() - started + (0.0 if ready is None else ready[1]))
        if answer is not None:
            # Well-formed but unscorable (empty input, too long, expired...): the result says why.
            return self._answered(record, [result_record(self._settings, record.key, answer, route)])
        return Accepted(
            tp, record.offset, record.key, request, prepared, record.timestamp, record_size(record),
            time.monotonic(), expires_at_ms, route,
        )  # fmt: skip

    def _prepare(self, request: ScoreRequest, key: bytes | None) -> tuple[ScoreResult | None, Any]:
        """(error result, None) or (None, the prepared request)."""
        try:
            prepared = self._engine.prepare(request)
        except Exception as exc:
            log.exception("preparing request %s failed unexpectedly", request.request_id)
            message = f"preparing the request failed: {exc!r}"
            return self.failure(request, ErrorCode.INTERNAL_ERROR, message), None
        if isinstance(prepared, ScoreResult):
            return prepared, None
        return self._too_large(request, key, prepared), prepared

    def _too_large(self, request: ScoreRequest, key: bytes | None, prepared: Any) -> ScoreResult | None:
        """RESULT_TOO_LARGE before any model time, when the result's size bound breaks the record limit
        (token outputs counted at every position the request reads)."""
        floats = self._engine.num_labels
        if request.label_token_ids is not None:
            floats = len(request.label_token_ids)
        hidden = self._engine.hidden_size
        items = len(prepared.prompts)
        positions = prepared.num_positions
        bound = result_size_bound(
            request, self._engine.model_name, items, floats, hidden, positions, prepared.head_floats
        )
        size = out_record_size(key, None, result_headers(request.request_id)) + bound
        limit = self._settings.max_record_bytes
        if size <= limit:
            return None
        message = (
            f"the result of {items} items ({positions} token positions) would be up to {size} bytes, above "
            f"the record limit of {limit} bytes (max_record_bytes); send fewer items or less metadata per "
            "request, a shorter token_range, ask for float16/bfloat16 hidden states, or raise the limit"
        )
        return self.failure(request, ErrorCode.RESULT_TOO_LARGE, message)

    def expired(self, request: ScoreRequest, expires_at_ms: int) -> ScoreResult:
        late_ms = int(time.time() * 1000) - expires_at_ms
        message = (
            f"the request's deadline passed {late_ms} ms before it could be scored; send it again with a "
            "later deadline_ms or ttl_ms, or add workers if requests often wait this long"
        )
        return self.failure(request, ErrorCode.EXPIRED, message)

    def _reject_record(
        self,
        record: ConsumerRecord[bytes, bytes],
        code: ErrorCode,
        message: str,
        request_id: str | None,
        metadata: object = None,
        route: Route = DEFAULT_ROUTE,
    ) -> Rejected:
        """A record that breaks the wire contract: always a DLQ copy, and an error result addressed by the
        map's request id or else the x-request-id header's, whichever is a usable id (none: no result, the
        dead-letter copy is the trace). The result echoes the metadata when the map's was readable."""
        tp = TopicPartition(record.topic, record.partition)
        request_id = request_id or header_request_id(record.headers)
        log.warning(
            "rejected offset %d of %s[%d] (request id %s): %s %s",
            record.offset, tp.topic, tp.partition, request_id or "unknown", code, message,
        )  # fmt: skip
        messages = [dead_letter_record(self._settings, record, code, message)]
        if request_id is None:
            log.warning("offset %d of %s: no usable request id in the map or the headers", record.offset, tp)
            return self._answered(record, messages)
        model = self._engine.model_name
        failure = ScoreResult.failure(request_id, code, message, model=model, metadata=metadata)
        answer = result_record(self._settings, record.key, failure, route)
        sent = answer.result.error if answer.result is not None else None
        if sent is not None and sent.code is not code:
            # The echoed metadata alone would break the record limit: the error itself matters more.
            bare = ScoreResult.failure(request_id, code, message, model=model)
            answer = result_record(self._settings, record.key, bare, route)
        messages.insert(0, answer)
        return self._answered(record, messages)

    @staticmethod
    def _answered(record: ConsumerRecord[bytes, bytes], messages: list[OutRecord]) -> Rejected:
        tally = ResultTally(request_bytes=record_size(record))
        for message in messages:
            tally.add(message, record.timestamp)
        tp = TopicPartition(record.topic, record.partition)
        return Rejected(tp, record.offset, messages, tally)

    def failure(self, request: ScoreRequest, code: ErrorCode, message: str) -> ScoreResult:
        return ScoreResult.failure(
            request.request_id, code, message, model=self._engine.model_name, metadata=request.metadata
        )

    def launch(self, prepared: Sequence[Any]) -> Launch:
        """Runs on the model thread: the batch's forward passes queued on the device; `finish` waits for
        them (one result per prepared request or part of one, in order)."""
        try:
            pending = self._engine.launch(prepared, on_batch=self._metrics.model_batch)
        except DeviceLostError:
            raise  # nothing more can run here: the worker stops, uncommitted
        except Exception as exc:  # the engine reports model failures itself; this is a last resort
            return Launch(prepared, None, self._last_resort(prepared, exc))
        return Launch(prepared, pending)

    def finish(self, launch: Launch) -> list[ScoreResult]:
        """Runs on the model thread, in launch order: the launched batch's results."""
        if launch.results is not None:
            return launch.results
        assert launch.pending is not None, "a launch holds its pending work or its results"
        try:
            return self._checked(launch.prepared, self._engine.finish(launch.pending))
        except DeviceLostError:
            raise
        except Exception as exc:
            return self._last_resort(launch.prepared, exc)

    @staticmethod
    def _checked(prepared: Sequence[Any], results: list[ScoreResult]) -> list[ScoreResult]:
        if len(results) != len(prepared):
            raise RuntimeError(f"scorer returned {len(results)} results for {len(prepared)} requests")
        return results

    def _last_resort(self, prepared: Sequence[Any], exc: Exception) -> list[ScoreResult]:
        log.exception("scoring a batch of %d requests failed", len(prepared), exc_info=exc)
        return [
            self.failure(p.request, ErrorCode.INTERNAL_ERROR, f"scoring failed: {exc!r}") for p in prepared
        ]

    def encode(self, answers: Sequence[tuple[Accepted, ScoreResult]]) -> Outgoing:
        """Results as records to publish (encoding large hidden states is not free: model thread)."""
        started = time.perf_counter()
        tally = ResultTally()
        records = []
        sources = []
        for item, result in answers:
            record = result_record(self._settings, item.key, result, item.route)
            tally.add(record, item.timestamp_ms)
            tally.request_bytes += item.size
            records.append(record)
            sources.append((item.tp, item.offset))
        self._metrics.encoded(time.perf_counter() - started)
        return Outgoing(records, tally, sources)

"""Record building: whatever a request carries, its result and dead-letter copy fit the record limit."""

from __future__ import annotations

from pathlib import Path

from aiokafka.structs import ConsumerRecord

from schemas import ErrorCode, ScoreResult, decode_result
from worker.config import WorkerSettings
from worker.publisher import dead_letter_record, record_size, result_record

FLOOR = WorkerSettings.model_fields["max_record_bytes"].metadata[0].ge
# Error messages may quote what the request sent; four-byte characters make the most bytes of a length.
HOSTILE_MESSAGE = "\N{GRINNING FACE}" * 5000


def _settings(tmp_path: Path) -> WorkerSettings:
    return WorkerSettings(
        bootstrap_servers="127.0.0.1:9092",
        model_dir=tmp_path,
        dlq_topic="d" * 249,
        max_record_bytes=FLOOR,
    )


def test_an_error_result_fits_the_smallest_limit_whatever_was_echoed(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    failure = ScoreResult.failure(
        "r" * 256, ErrorCode.INVALID_REQUEST, HOSTILE_MESSAGE, model="some-model", metadata="m" * 10_000
    )
    record = result_record(settings, b"k" * 10_000, failure)
    assert record_size(record.key, record.value, record.headers) <= FLOOR
    assert record.value is not None
    result = decode_result(record.value)
    assert result.request_id == "r" * 256
    assert result.error is not None and result.error.code == ErrorCode.RESULT_TOO_LARGE


def test_a_dead_letter_copy_fits_the_smallest_limit_whatever_the_record_carries(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    source = ConsumerRecord(
        topic="s" * 249,
        partition=7,
        offset=123_456_789,
        timestamp=0,
        timestamp_type=0,
        key=b"k" * 10_000,
        value=b"v" * 10_000,
        checksum=None,
        serialized_key_size=10_000,
        serialized_value_size=10_000,
        headers=[("trace", b"t" * 10_000)],
    )
    record = dead_letter_record(settings, source, ErrorCode.MALFORMED_MESSAGE, HOSTILE_MESSAGE)
    assert record_size(record.key, record.value, record.headers) <= FLOOR
    headers = dict(record.headers)
    assert headers["x-error-code"] == b"MALFORMED_MESSAGE"
    assert headers["x-source-offset"] == b"123456789"
    message = headers["x-error-message"].decode("utf-8")  # shortened on a character boundary
    assert 0 < len(message.encode()) <= 1000 and HOSTILE_MESSAGE.startswith(message)


def test_a_small_copy_stays_whole(tmp_path: Path) -> None:
    source = ConsumerRecord("src", 0, 5, 0, 0, b"key", b"\xc1 junk", None, 3, 6, [("trace", b"abc")])
    record = dead_letter_record(_settings(tmp_path), source, ErrorCode.MALFORMED_MESSAGE, "not msgpack")
    assert (record.key, record.value) == (b"key", b"\xc1 junk")
    assert record.headers[0] == ("trace", b"abc")
    assert dict(record.headers)["x-source-topic"] == b"src"

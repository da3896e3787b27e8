"""Naming what could not be read from the batch's own bytes: header fields, CRCs, codecs, short batches."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import raw_batches
from aiokafka import codec
from aiokafka.errors import CorruptRecordException, RecordTooLargeError, UnsupportedCodecError
from aiokafka.record.legacy_records import LegacyRecordBatchBuilder
from aiokafka.structs import TopicPartition
from pydantic import ValidationError
from worker_testkit import Names, fast_settings

from worker.codecs import missing_codecs
from worker.holds import FIRST_RETRY_S, MAX_RETRY_S, retry_delay
from worker.undecodable import CAUSES, Unreadable, classify, describe, parse_batch

RECORDS = [(b"k%d" % i, b"value %d " % i * 8, [("h", b"x")]) for i in range(3)]
TP = TopicPartition("requests", 0)


def at(base: int, batch: bytes) -> bytes:
    """The batch as a broker serves it: with its base offset set."""
    return base.to_bytes(8, "big") + batch[8:]


def decoding(error: BaseException, offset: int = 0) -> Unreadable:
    return Unreadable(TP, offset, error, decoding=True)


def test_the_batch_holding_an_offset_is_found_with_its_range_codec_and_crc() -> None:
    data = at(10, bytes(raw_batches.build(RECORDS))) + at(
        13, bytes(raw_batches.build(RECORDS, raw_batches.LZ4))
    )
    first = parse_batch(data, 11)
    assert first is not None and (first.base_offset, first.last_offset) == (10, 12)
    assert first.codec_name == "none" and first.crc_ok and first.complete and first.magic == 2
    second = parse_batch(data, 13)
    assert second is not None and (second.base_offset, second.last_offset, second.codec_name) == (
        13,
        15,
        "lz4",
    )
    assert second.data == data[len(data) - len(second.data) :]
    assert parse_batch(data, 16) is None
    assert parse_batch(b"", 0) is None


def test_each_cause_is_named_from_the_bytes() -> None:
    error = CorruptRecordException("whatever the library said")
    good = parse_batch(bytes(raw_batches.build(RECORDS)), 0)
    assert good is not None
    # The bytes read fine here: what failed was not in them.
    assert classify(decoding(error), good) == "fetch_error"
    damaged = parse_batch(raw_batches.crc_damaged(RECORDS), 0)
    assert damaged is not None and not damaged.crc_ok and classify(decoding(error), damaged) == "crc_mismatch"
    relabelled = parse_batch(raw_batches.with_codec(bytes(raw_batches.build(RECORDS)), 6), 0)
    assert relabelled is not None and relabelled.crc_ok
    assert classify(decoding(error), relabelled) == "unknown_codec"
    assert "codec 6" in describe("unknown_codec", relabelled, error)
    cut = parse_batch(raw_batches.payload_cut(RECORDS), 0)
    assert cut is not None and cut.crc_ok and classify(decoding(error), cut) == "unparseable"
    short = parse_batch(bytes(raw_batches.build(RECORDS))[:-5], 0)
    assert short is not None and not short.complete and (short.base_offset, short.last_offset) == (0, 2)
    assert classify(decoding(RecordTooLargeError("cut", TP, 0, 100)), short) == "truncated"
    header_only = parse_batch(bytes(raw_batches.build(RECORDS))[:30], 0)
    assert header_only is not None and not header_only.complete
    assert classify(decoding(error), header_only) == "truncated"


def test_a_missing_codec_library_is_named_and_the_worker_refuses_to_write_with_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    lz4 = parse_batch(bytes(raw_batches.build(RECORDS, raw_batches.LZ4)), 0)
    assert lz4 is not None
    error = UnsupportedCodecError("Libraries for lz4 compression codec not found")
    assert missing_codecs() == []
    monkeypatch.setattr(codec, "cramjam", None)
    assert missing_codecs() == ["snappy", "lz4", "zstd"]
    assert classify(decoding(error), lz4) == "codec_unavailable"
    assert "compressed with lz4" in describe("codec_unavailable", lz4, error)
    settings = fast_settings("127.0.0.1:9092", tmp_path, Names.unique("codec"), results_compression="gzip")
    assert settings.results_compression == "gzip"
    with pytest.raises(ValidationError, match="zstd needs the cramjam package"):
        fast_settings("127.0.0.1:9092", tmp_path, Names.unique("codec"), results_compression="zstd")


def test_without_the_bytes_the_library_error_names_the_cause() -> None:
    assert (
        classify(decoding(UnsupportedCodecError("Unknown compression codec 0x05")), None) == "unknown_codec"
    )
    lacking = UnsupportedCodecError("Libraries for zstd compression codec not found")
    assert classify(decoding(lacking), None) == "codec_unavailable"
    assert classify(decoding(CorruptRecordException("Invalid CRC - tp")), None) == "crc_mismatch"
    assert classify(decoding(ValueError("bad varint")), None) == "unparseable"
    assert classify(Unreadable(TP, 0, RecordTooLargeError("cut"), decoding=False), None) == "truncated"
    # A fetch that failed for the partition says nothing about bytes, whatever the batch holds.
    denied = Unreadable(TP, 0, RuntimeError("TopicAuthorizationFailed"), decoding=False)
    assert classify(denied, parse_batch(raw_batches.crc_damaged(RECORDS), 0)) == "fetch_error"


def test_legacy_messages_are_read_by_their_own_header() -> None:
    builder = LegacyRecordBatchBuilder(magic=1, compression_type=0, batch_size=1 << 20)
    for offset, (key, value, _) in enumerate(RECORDS):
        builder.append(offset, timestamp=0, key=key, value=value)
    data = bytes(builder.build())
    found = parse_batch(data, 1)
    assert found is not None and found.magic == 1 and found.crc_ok and found.complete
    assert (found.base_offset, found.last_offset) == (1, 1)
    damaged = bytearray(data)
    damaged[-1] ^= 0xFF
    broken = parse_batch(bytes(damaged), 2)
    assert broken is not None and not broken.crc_ok


def test_retries_back_off_from_half_a_second_to_a_bound() -> None:
    assert retry_delay(1) == FIRST_RETRY_S
    assert [retry_delay(n) for n in (2, 3, 4)] == [2 * FIRST_RETRY_S, 4 * FIRST_RETRY_S, 8 * FIRST_RETRY_S]
    assert retry_delay(50) == MAX_RETRY_S


def test_the_contract_lists_every_cause_the_worker_names() -> None:
    readme = (Path(__file__).resolve().parents[2] / "schemas" / "README.md").read_text(encoding="utf-8")
    (row,) = [line for line in readme.splitlines() if line.startswith("| `x-undecodable-cause`")]
    assert re.findall(r"`([a-z_]+)`", row.split("|")[3]) == list(CAUSES)

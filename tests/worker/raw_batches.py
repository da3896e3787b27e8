"""Record batches built and damaged by hand, and written to the broker's wire in a raw produce request."""

from __future__ import annotations

import asyncio
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence

from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.util import calc_crc32c
from aiokafka.structs import TopicPartition
from worker_testkit import Record, client_kwargs

from worker.codecs import CODECS
from worker.undecodable import parse_batch

GZIP, LZ4 = 1, 3
# Offsets in a v2 batch header (see worker/undecodable.py): length, CRC, attributes, record count, and
# where the records begin.
_LENGTH_AT, _CRC_AT, _ATTRIBUTES_AT, _COUNT_AT, _RECORDS_AT = 8, 17, 21, 57, 61


def build(records: Sequence[Record], codec: int = 0) -> bytearray:
    """A v2 record batch of `records`, as a producer writes it (base offset 0: the broker assigns its own)."""
    builder = DefaultRecordBatchBuilder(
        magic=2, compression_type=codec, is_transactional=0, producer_id=-1, producer_epoch=-1,
        base_sequence=-1, batch_size=64 << 20,
    )  # fmt: skip
    now_ms = int(time.time() * 1000)
    for delta, (key, value, headers) in enumerate(records):
        assert builder.append(delta, timestamp=now_ms, key=key, value=value, headers=headers) is not None
    return bytearray(builder.build())


def seal(batch: bytearray) -> bytes:
    """The batch with its length field and CRC made to match its bytes (so the damage passes the CRC)."""
    struct.pack_into(">i", batch, _LENGTH_AT, len(batch) - 12)
    struct.pack_into(">I", batch, _CRC_AT, calc_crc32c(bytes(batch[_ATTRIBUTES_AT:])))
    return bytes(batch)


def crc_damaged(records: Sequence[Record]) -> bytes:
    """A byte of the last record flipped after the CRC was written: a copy damaged on its way."""
    batch = build(records)
    batch[-1] ^= 0xFF
    return bytes(batch)


def payload_cut(records: Sequence[Record]) -> bytes:
    """A gzip batch whose compressed payload lost its last bytes before its producer sealed it: the CRC
    holds, decompressing fails."""
    return seal(build(records, GZIP)[:-6])


def record_missing(records: Sequence[Record]) -> bytes:
    """An uncompressed batch that announces one record more than it holds (CRC sealed): the library parses
    the records it holds and fails on the one it does not."""
    batch = build(records)
    struct.pack_into(">i", batch, _COUNT_AT, len(records) + 1)
    return seal(batch)


def record_damaged(records: Sequence[Record]) -> bytes:
    """An uncompressed batch whose second record announces two bytes more than it holds (CRC sealed): the
    library reads the first record and fails at the second's offset."""
    assert len(records) >= 2
    batch = build(records)
    first_length, pos = _varint(batch, _RECORDS_AT)
    second = pos + first_length
    length, end = _varint(batch, second)
    longer = _zigzag(length + 2)
    assert len(longer) == end - second, "pick records whose length's varint keeps its size"
    batch[second:end] = longer
    return seal(batch)


def _varint(data: bytes | bytearray, pos: int) -> tuple[int, int]:
    """A zigzag varint (Kafka's record fields) at `pos`: its value and the position after it."""
    shift = raw = 0
    while True:
        byte = data[pos]
        pos += 1
        raw |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return (raw >> 1) ^ -(raw & 1), pos


def _zigzag(value: int) -> bytes:
    raw = (value << 1) ^ (value >> 63)
    out = bytearray()
    while True:
        if raw < 0x80:
            return bytes(out + bytes([raw]))
        out.append((raw & 0x7F) | 0x80)
        raw >>= 7


def with_codec(batch: bytes, codec: int) -> bytes:
    """The batch relabelled as compressed with `codec` (CRC sealed)."""
    relabelled = bytearray(batch)
    (attributes,) = struct.unpack_from(">h", relabelled, _ATTRIBUTES_AT)
    struct.pack_into(">h", relabelled, _ATTRIBUTES_AT, (attributes & ~0x07) | codec)
    return seal(relabelled)


def rewrite_batches(data: bytes, change: Callable[[int, bytes], bytes]) -> bytes:
    """Fetched bytes with every complete v2 batch passed through `change(base_offset, batch)`."""
    out, pos = bytearray(), 0
    while pos + 12 <= len(data):
        base, length = struct.unpack_from(">qi", data, pos)
        end = pos + 12 + length
        if end > len(data):
            break
        out += change(base, data[pos:end])
        pos = end
    return bytes(out + data[pos:])


async def produce_raw(bootstrap: str, tp: TopicPartition, batch: bytes) -> int:
    """Write one batch to the partition's leader exactly as given; returns the base offset it got."""
    error_code, base_offset = await produce_raw_answer(bootstrap, tp, batch)
    assert error_code == 0, f"the broker refused the batch: error {error_code}"
    return base_offset


# A partition's leadership settling (a topic just created, a leader just moved): any producer retries these
# after a metadata refresh, and so does this one; every other answer is returned as the broker gave it.
_LEADERSHIP_SETTLING = {3, 5, 6}  # UNKNOWN_TOPIC_OR_PARTITION, LEADER_NOT_AVAILABLE, NOT_LEADER_OR_FOLLOWER


async def produce_raw_answer(bootstrap: str, tp: TopicPartition, batch: bytes) -> tuple[int, int]:
    """Write one batch as given; the broker's answer: (error code, base offset)."""
    client = AIOKafkaClient(**client_kwargs(bootstrap))
    await client.bootstrap()
    try:
        for _ in range(50):
            cluster = await client.fetch_all_metadata()
            leader = cluster.leader_for_partition(tp)
            if leader is None or leader < 0:
                error_code, base_offset = 5, -1
            else:
                response = await client.send(
                    leader, ProduceRequest(None, -1, 10_000, [(tp.topic, [(tp.partition, batch)])])
                )
                ((_, partitions),) = response.topics
                ((_, error_code, base_offset, *_),) = partitions
            if error_code not in _LEADERSHIP_SETTLING:
                break
            await asyncio.sleep(0.1)
        return int(error_code), int(base_offset)
    finally:
        await client.close()


def stored_codecs(bootstrap: str, topic: str, partitions: int) -> Counter[str]:
    """The codec of every batch the broker stores on a topic, read raw (fetched, never decompressed)."""

    async def read() -> Counter[str]:
        client = AIOKafkaClient(**client_kwargs(bootstrap))
        await client.bootstrap()
        seen: Counter[str] = Counter()
        try:
            cluster = await client.fetch_all_metadata()
            for partition in range(partitions):
                node = cluster.leader_for_partition(TopicPartition(topic, partition))
                offset = 0
                while True:
                    request = FetchRequest(100, 1, 8 << 20, 0, [(topic, [(partition, offset, 8 << 20)])])
                    response = await client.send(node, request)
                    data = bytes(response.topics[0][1][0][-1])
                    batch = parse_batch(data, offset)
                    if batch is None:
                        break
                    while batch is not None and batch.complete:
                        seen[CODECS[batch.codec]] += 1
                        offset = batch.last_offset + 1
                        data = data[len(batch.data) :]
                        batch = parse_batch(data, offset)
        finally:
            await client.close()
        return seen

    return asyncio.run(read())

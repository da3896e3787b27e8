"""Records a consumer cannot read, caught where aiokafka turns fetched bytes into records: the partition
stops at the first offset it cannot read, and nothing raises out of getmany.

aiokafka raises a batch it cannot decode (a codec library missing, a CRC mismatch, a record it cannot
parse) out of `getmany()` for every partition at once, and loses the records of the same fetch that came
before the bad batch: each retry fetches them again and drops them again. A batch cut short makes it skip
one offset silently. `FetchGuard` attaches to one started consumer and changes only what happens at such a
failure: the records before it are returned, the partition is paused at the first offset it could not
read, and the failure is handed to the owner (`take`), who decides to retry, report or skip. It leans on
aiokafka's fetch buffer (`Fetcher._records`, `FetchResult`, `PartitionRecords`, `FetchError`);
`check_supported` verifies those are as expected, and the pin to aiokafka 0.14 keeps them so.

`read_raw_batch` reads the batch at an offset from the broker without decoding it, so that a failure can be
named by what the bytes are (`classify`) and skipped by the range their header gives.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer
from aiokafka.consumer import fetcher as aiokafka_fetcher
from aiokafka.errors import (
    CorruptRecordException,
    KafkaError,
    RecordTooLargeError,
    UnsupportedCodecError,
)
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.record.util import calc_crc32c
from aiokafka.structs import TopicPartition

from worker.codecs import CODECS, available

log = logging.getLogger(__name__)

Cause = Literal[
    "codec_unavailable", "unknown_codec", "crc_mismatch", "truncated", "unparseable", "fetch_error"
]
# Stable label values (metrics, logs, dead-letter headers); schemas/README.md lists them.
CAUSES: tuple[Cause, ...] = (
    "codec_unavailable", "unknown_codec", "crc_mismatch", "truncated", "unparseable", "fetch_error",
)  # fmt: skip

# Record batch v2 header: baseOffset int64, batchLength int32, partitionLeaderEpoch int32, magic int8,
# crc uint32 (CRC-32C of everything after it), attributes int16, lastOffsetDelta int32, ... 61 bytes in all.
_V2_HEADER = 61
_V2_CRC_AT, _V2_ATTRIBUTES_AT, _V2_LAST_DELTA_AT = 17, 21, 23
# Legacy message (v0/v1): offset int64, size int32, crc uint32 (CRC-32 from magic on), magic int8, attributes.
_LEGACY_HEADER = 18
_MAGIC_AT = 16
# What one inspection asks the broker for: a batch larger than this still comes whole (Fetch v3+ always
# returns the first batch complete), so this only bounds what comes after it.
_INSPECT_BYTES = 8 << 20
# The held batch is there, so a broker answers at once; some (Tansu) answer a fetch that may not wait at
# all with nothing.
_INSPECT_WAIT_MS = 100


@dataclass(frozen=True)
class Unreadable:
    """A read of `tp` stopped at `offset`, the first offset it could not read, because of `error`.

    `decoding`: the broker's bytes came but could not be turned into records; otherwise the fetch itself
    failed for that partition."""

    tp: TopicPartition
    offset: int
    error: BaseException
    decoding: bool


@dataclass(frozen=True)
class RawBatch:
    """The record batch that holds an offset, as the broker stores it, with what its header says."""

    base_offset: int
    last_offset: int
    magic: int
    codec: int
    crc_ok: bool
    complete: bool  # the broker returned all the bytes its length field announces
    data: bytes

    @property
    def codec_name(self) -> str:
        return CODECS.get(self.codec, f"codec {self.codec}")


def parse_batch(data: bytes, offset: int) -> RawBatch | None:
    """The first batch in fetched `data` whose last offset is at or after `offset`; None when there is none
    (or not even its header came)."""
    pos = 0
    while pos + _MAGIC_AT < len(data):
        base, length = struct.unpack_from(">qi", data, pos)
        end = pos + 12 + length
        magic = data[pos + _MAGIC_AT]
        complete = length >= 0 and end <= len(data)
        batch_bytes = data[pos : end if complete else len(data)]
        if magic >= 2:
            if len(batch_bytes) < _V2_HEADER:
                return RawBatch(base, base, magic, -1, False, False, batch_bytes)
            (crc,) = struct.unpack_from(">I", batch_bytes, _V2_CRC_AT)
            (attributes,) = struct.unpack_from(">h", batch_bytes, _V2_ATTRIBUTES_AT)
            (last_delta,) = struct.unpack_from(">i", batch_bytes, _V2_LAST_DELTA_AT)
            last = base + last_delta
            crc_ok = complete and calc_crc32c(batch_bytes[_V2_ATTRIBUTES_AT:]) == crc
        else:
            if len(batch_bytes) < _LEGACY_HEADER:
                return RawBatch(base, base, magic, -1, False, False, batch_bytes)
            (crc,) = struct.unpack_from(">I", batch_bytes, 12)
            attributes = batch_bytes[_MAGIC_AT + 1]
            last = base  # a compressed wrapper carries the offset of its last inner message
            crc_ok = complete and zlib.crc32(batch_bytes[_MAGIC_AT:]) == crc
        if last >= offset or not complete:
            return RawBatch(base, last, magic, attributes & 0x07, crc_ok, complete, batch_bytes)
        pos = end
    return None


def _decodes(batch: RawBatch) -> bool:
    """Whether aiokafka reads every record of the batch."""
    try:
        records = MemoryRecords(batch.data)
        while records.has_next():
            read = records.next_batch()
            if read is None:
                return False
            for _ in read:
                pass
    except Exception:
        return False
    return True


def classify(unreadable: Unreadable, batch: RawBatch | None) -> Cause:
    """What made the read fail: from the batch's own bytes where they could be read, else from the error."""
    error = unreadable.error
    if not unreadable.decoding and not isinstance(error, RecordTooLargeError):
        return "fetch_error"
    if batch is not None:
        if not batch.complete:
            return "truncated"
        if not batch.crc_ok:
            return "crc_mismatch"
        if batch.codec not in CODECS:
            return "unknown_codec"
        if not available(CODECS[batch.codec]):
            return "codec_unavailable"
        # The bytes are sound and the library reads them now: the failure was not in them.
        return "fetch_error" if _decodes(batch) else "unparseable"
    if isinstance(error, RecordTooLargeError):
        return "truncated"
    if isinstance(error, UnsupportedCodecError):
        return "unknown_codec" if "Unknown" in str(error) else "codec_unavailable"
    if isinstance(error, CorruptRecordException) and "CRC" in str(error):
        return "crc_mismatch"
    return "unparseable"


def describe(cause: Cause, batch: RawBatch | None, error: BaseException) -> str:
    """One sentence for the log, /readyz and the dead-letter record: what is wrong and what to change."""
    where = "" if batch is None else f"batch {batch.base_offset}-{batch.last_offset} "
    if cause == "codec_unavailable":
        codec_name = batch.codec_name if batch is not None else "its codec"
        return (
            f"{where}is compressed with {codec_name}, which this installation cannot decompress "
            f"({error}); install score-worker with its declared dependencies (cramjam)"
        )
    if cause == "unknown_codec":
        named = f" {batch.codec}" if batch is not None else ""
        return f"{where}names compression codec{named}, which Kafka does not define; its producer is broken"
    if cause == "crc_mismatch":
        return f"{where}fails its CRC check: its bytes were damaged after its producer wrote them"
    if cause == "truncated":
        return f"{where}is cut short: the broker returned fewer bytes than the batch announces"
    if cause == "unparseable":
        return f"{where}passes its CRC check, but its records cannot be read: {error}"
    return f"fetching it failed: {error!r}"


async def read_raw_batch(
    consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int, timeout_s: float = 2.0
) -> RawBatch | None:
    """The batch holding `offset` as the partition's leader stores it, read without decoding; None when the
    leader does not answer in time or has no such batch."""
    client = consumer._client
    try:
        async with asyncio.timeout(timeout_s):
            node = client.cluster.leader_for_partition(tp)
            if node is None or node < 0:
                await client.force_metadata_update()
                node = client.cluster.leader_for_partition(tp)
            if node is None or node < 0:
                return None
            topics = [(tp.topic, [(tp.partition, offset, _INSPECT_BYTES)])]
            response = await client.send(node, FetchRequest(_INSPECT_WAIT_MS, 1, _INSPECT_BYTES, 0, topics))
    except (KafkaError, TimeoutError, OSError) as error:
        log.debug("could not read the raw batch at %s offset %d: %r", tp, offset, error)
        return None
    for topic, partitions in response.topics:
        for partition, error_code, _highwater, *part_data in partitions:
            if topic == tp.topic and partition == tp.partition and error_code == 0:
                return parse_batch(bytes(part_data[-1]), offset)
    return None


def check_supported() -> None:
    """Raises RuntimeError when the installed aiokafka keeps fetched records other than `FetchGuard`
    expects (score-worker pins aiokafka 0.14, which does)."""
    needed = ("FetchResult", "FetchError", "PartitionRecords", "Fetcher")
    missing = [name for name in needed if not hasattr(aiokafka_fetcher, name)]
    if missing:
        raise RuntimeError(
            f"this aiokafka has no {', '.join(missing)} in aiokafka.consumer.fetcher: score-worker reads "
            "undecodable records safely with aiokafka 0.14 only; install the version pyproject.toml names"
        )


class _GuardedBuffer(collections.OrderedDict[TopicPartition, Any]):
    """The fetcher's buffer of fetched partitions: what the fetcher stores passes through the guard."""

    def __init__(self, guard: FetchGuard, existing: dict[TopicPartition, Any]) -> None:
        super().__init__()
        self._guard = guard
        for tp, value in existing.items():
            self[tp] = value

    def __setitem__(self, tp: TopicPartition, value: Any) -> None:
        if isinstance(value, aiokafka_fetcher.FetchError):
            # Kept out of the buffer, so that getmany never raises it; the guard holds the partition.
            self._guard.fetch_failed(tp, value._error)
            return
        if isinstance(value, aiokafka_fetcher.FetchResult):
            self._guard.watch(tp, value._partition_records)
        super().__setitem__(tp, value)


class FetchGuard:
    """Attached to one started consumer: a partition whose records cannot be read is paused at the first
    offset it could not read, and the failure waits in `take()` instead of being raised from getmany."""

    def __init__(self, consumer: AIOKafkaConsumer) -> None:
        self._consumer = consumer
        self._found: dict[TopicPartition, Unreadable] = {}
        # Partitions whose failure came from the fetch (not from decoding) and whose position the library
        # may have moved: restored in take().
        self._rewind: set[TopicPartition] = set()

    def attach(self) -> None:
        """Call after `consumer.start()` and before the first getmany."""
        check_supported()
        fetcher = getattr(self._consumer, "_fetcher", None)
        records = getattr(fetcher, "_records", None)
        if not isinstance(records, dict):
            raise RuntimeError("consumer not started, or this aiokafka keeps its fetched records elsewhere")
        fetcher._records = _GuardedBuffer(self, records)  # type: ignore[union-attr]

    def watch(self, tp: TopicPartition, records: Any) -> None:
        """Reads of one fetched partition: a failure ends them where it happened, and is held."""
        records._records_iterator = self._guarded(tp, records, records._records_iterator)

    def _guarded(self, tp: TopicPartition, records: Any, inner: Iterator[Any]) -> Iterator[Any]:
        try:
            yield from inner
        except Exception as error:  # whatever the library raises reading the bytes: held, never raised
            # next_fetch_offset is one past the last record handed out: the first offset not read. The
            # library moves the partition's position there once this iteration ends.
            self._hold(Unreadable(tp, records.next_fetch_offset, error, decoding=True))

    def fetch_failed(self, tp: TopicPartition, error: BaseException) -> None:
        """A fetch error the library would raise from getmany for one partition."""
        offset = -1
        if isinstance(error, RecordTooLargeError) and len(error.args) >= 3 and isinstance(error.args[2], int):
            # The library has already stepped past one offset for this error: remember where it was.
            offset = error.args[2]
        self._rewind.add(tp)
        self._hold(Unreadable(tp, offset, error, decoding=False))

    def _hold(self, unreadable: Unreadable) -> None:
        self._found.setdefault(unreadable.tp, unreadable)
        # At once, so that the fetcher does not fetch the same bytes again in a tight loop.
        self._consumer.pause(unreadable.tp)

    async def take(self) -> list[Unreadable]:
        """What could not be read since the last call, one entry per partition, each partition paused and
        positioned at the offset it could not read (partitions no longer assigned are left out)."""
        found, self._found = self._found, {}
        rewind, self._rewind = self._rewind, set()
        assigned = self._consumer.assignment()
        taken = []
        for tp, unreadable in found.items():
            if tp not in assigned:
                continue
            if unreadable.offset < 0:
                unreadable = Unreadable(tp, await self._consumer.position(tp), unreadable.error, False)
            elif tp in rewind:
                self._consumer.seek(tp, unreadable.offset)
            taken.append(unreadable)
        return taken

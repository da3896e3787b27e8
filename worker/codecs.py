"""Kafka's compression codecs: which this installation can decompress, and the producer argument for each."""

from __future__ import annotations

from typing import Literal

from aiokafka import codec

Compression = Literal["none", "gzip", "snappy", "lz4", "zstd"]
# By their id in a record batch's attributes (the low three bits).
CODECS: dict[int, Compression] = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}
CODEC_NAMES: tuple[Compression, ...] = tuple(CODECS.values())
# What the project's producers write unless told otherwise (the results, ScoreClient, submit, the sample
# producer). On W2's results zstd stored 31% fewer bytes with bfloat16 hidden states and 13% with float32
# ones, for 14-30 microseconds more per result; lz4 saved 11% and 5% for more time, gzip as much as zstd
# for 4-7 times the uncompressed time (docs/benchmarks.md, "Result compression").
DEFAULT_COMPRESSION: Compression = "zstd"
_AVAILABLE = {
    "none": lambda: True,
    "gzip": codec.has_gzip,
    "snappy": codec.has_snappy,
    "lz4": codec.has_lz4,
    "zstd": codec.has_zstd,
}


def available(name: str) -> bool:
    """Whether aiokafka can read and write batches compressed with the codec called `name` here."""
    return bool(_AVAILABLE[name]())


def missing_codecs() -> list[str]:
    """The codecs this installation cannot decompress (none with score-worker's declared dependencies)."""
    return [name for name in CODEC_NAMES if not available(name)]


def producer_compression(name: Compression) -> str | None:
    """aiokafka's compression_type for a codec name ("none" is None there)."""
    return None if name == "none" else name

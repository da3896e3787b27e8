"""Poison records: what standard producers can write that the worker must contain and report."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from worker_testkit import (
    Record,
    header,
)

from fault_kit.accounting import Accounting
from fault_kit.common import WORDS
from schemas import (
    ErrorCode,
    ScoreRequest,
    encode_request,
    request_headers,
)


@dataclass(frozen=True)
class Poison:
    """A record that breaks (or only stretches) the wire contract, and what the contract says it gets."""

    label: str
    record: Record
    result_id: str | None  # the id its result must carry; None: no id is readable, the dead letter is all
    ok: bool = False  # a valid request in odd clothes: an OK result and no dead letter
    code: ErrorCode | None = None  # the error code the contract fixes, where it fixes one
    dead_letter: bool = True
    echo: Any = None  # the metadata its error result must echo (the map was readable); None: not checked


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _raw_map(fields: Sequence[tuple[str, bytes]]) -> bytes:
    """A msgpack map from already-encoded values (for what msgpack itself refuses to write)."""
    assert len(fields) < 16
    return bytes([0x80 | len(fields)]) + b"".join(_pack(k) + v for k, v in fields)


class PoisonCorpus:
    """Builds the bad records, each with a fresh id where one can be carried."""

    def __init__(self, tag: str, seed: int = 7) -> None:
        self.tag = tag
        self.rng = random.Random(seed)
        self.items: list[Poison] = []
        self._next = 0

    def new_id(self) -> str:
        self._next += 1
        return f"{self.tag}-bad-{self._next:03d}"

    def noise(self, size: int) -> bytes:
        return self.rng.randbytes(size)

    def refused(self, label: str, fields: dict[str, Any], code: ErrorCode) -> None:
        """A map the decoder refuses: an error result to its id and a dead-letter copy."""
        rid = self.new_id()
        echo = None if "metadata" in fields else {"poison": label, "n": [1, 2.5, None]}
        value = _pack({"version": 1, "request_id": rid, "items": ["x"], "metadata": echo, **fields})
        record = (rid.encode(), value, request_headers(rid))
        self.items.append(Poison(label, record, rid, code=code, echo=echo))

    def unreadable(
        self,
        label: str,
        value: bytes | None,
        with_header: bool,
        code: ErrorCode | None,
        key: bytes | None = None,
    ) -> None:
        """No id in the value: the header's id (when sent) gets the error result; always a dead letter."""
        rid = self.new_id() if with_header else None
        headers = request_headers(rid) if rid else []
        if value is None:
            key = b"no-value"  # Kafka clients refuse a record with neither
        self.items.append(Poison(label, (key, value, headers), rid, code=code if rid else None))

    def unscorable(self, label: str, fields: dict[str, Any], code: ErrorCode | None) -> None:
        """Well-formed but unscorable: an error result only."""
        rid = self.new_id()
        value = _pack({"version": 1, "request_id": rid, **fields})
        self.items.append(
            Poison(label, (rid.encode(), value, request_headers(rid)), rid, code=code, dead_letter=False)
        )

    def odd_but_valid(
        self, label: str, fields: dict[str, Any], key: bytes | None, headers: list[Any]
    ) -> None:
        rid = self.new_id()
        value = _pack({"version": 1, "request_id": rid, "items": ["an odd but valid request"], **fields})
        self.items.append(
            Poison(label, (key, value, [*request_headers(rid), *headers]), rid, ok=True, dead_letter=False)
        )


def poison_corpus(tag: str, keyless_oversized: bool = False) -> list[Poison]:
    """Every kind of bad record the worker must answer without losing it or falling over.

    `keyless_oversized` adds dead-letter candidates above max_record_bytes that have no key: a copy that
    must drop its value then has neither key nor value, which Kafka clients refuse to send.
    """
    c = PoisonCorpus(tag)
    _garbage(c)
    _wrong_types(c)
    _huge(c)
    _nesting_and_specials(c)
    _versions(c)
    _odd_but_valid(c)
    if keyless_oversized:
        c.unreadable("random 300 KB, no key", c.noise(300_000), with_header=False, code=None)
        rid = c.new_id()
        value = _pack({"version": 1, "request_id": "i" * 100_000, "items": ["x"]})
        record = (None, value, request_headers(rid))
        c.items.append(Poison("100,000-character id, no key", record, rid, code=ErrorCode.INVALID_REQUEST))
    return c.items


def _garbage(c: PoisonCorpus) -> None:
    for size in (1, 64, 4096):
        c.unreadable(f"random {size} bytes", c.noise(size), with_header=False, code=None)
    # Far above the worker's max_record_bytes: the dead-letter copy must drop the value to fit.
    c.unreadable("random 300 KB, keyed", c.noise(300_000), with_header=False, code=None, key=b"oversized")
    c.unreadable("random bytes, id header", c.noise(512), with_header=True, code=None)
    whole = encode_request(ScoreRequest(request_id="cut-short", items=("a complete request",)))
    for with_header in (True, False):
        c.unreadable("truncated msgpack", whole[: len(whole) // 2], with_header, ErrorCode.MALFORMED_MESSAGE)
    for value in (None, b""):
        for with_header in (True, False):
            c.unreadable(f"value {value!r}", value, with_header, ErrorCode.MALFORMED_MESSAGE)
    c.unreadable("top-level array", _pack([1, "request"]), True, ErrorCode.MALFORMED_MESSAGE)
    c.unreadable("integer map key", _pack({"version": 1, 7: "x"}), True, ErrorCode.MALFORMED_MESSAGE)
    extension = _pack({"version": 1, "metadata": msgpack.ExtType(5, b"x")})
    c.unreadable("extension type", extension, True, ErrorCode.MALFORMED_MESSAGE)
    bad_utf8 = _raw_map([("version", _pack(1)), ("items", b"\x91\xa2\xff\xfe")])
    c.unreadable("invalid UTF-8", bad_utf8, True, ErrorCode.MALFORMED_MESSAGE)
    # The header's id cannot address a result (not UTF-8; too long): only the dead letter is left.
    for bad_id in (b"\xff\xfe\xfd", b"x" * 300):
        c.items.append(Poison("unusable id header", (None, c.noise(40), [("x-request-id", bad_id)]), None))


def _wrong_types(c: PoisonCorpus) -> None:
    invalid = ErrorCode.INVALID_REQUEST
    wrong: dict[str, list[Any]] = {
        "version": ["1", True, 1.0],
        "items": ["text", 5, [1, 2], [["a"]], None],
        "query": [5, {"a": 1}, [1, "a"]],
        "item_first": [1, "true"],
        "apply_softmax": ["true", 0],
        "return_pooled_hidden_states": [0, None, []],
        "hidden_states_dtype": [32, "FLOAT32", "float64"],
        "metadata": [_deep(100)],
        "label_token_ids": ["abc", [1, 1], [], [-1]],
        "messages": ["hi", [{"role": "user", "content": 5}], [{"role": "user", "content": "x", "extra": 1}]],
        "truncate": [3, "middle"],
        "requires": ["items", [1], ["pooling"]],
    }
    for name, values in wrong.items():
        for value in values:
            if value is None and name == "return_pooled_hidden_states":
                continue  # nil means the default: valid
            c.refused(f"{name}={value!r:.40}", {name: value}, invalid)
    for bad in (12345, "", None):  # the map's id is unusable: the header's addresses the result
        rid = c.new_id()
        value = _pack({"version": 1, "request_id": bad, "items": ["x"]})
        c.items.append(Poison(f"request_id={bad!r}", (None, value, request_headers(rid)), rid, code=invalid))


def _huge(c: PoisonCorpus) -> None:
    words = " ".join(c.rng.choice(WORDS) for _ in range(40_000))  # about 200 KB of text
    # An error whichever limit comes first (the worker's item count, or the result's size).
    c.unscorable("10,000 items", {"items": ["w"] * 10_000}, None)
    states = {"items": ["w"] * 1_000, "return_pooled_hidden_states": True}
    c.unscorable("1,000 hidden states", states, ErrorCode.RESULT_TOO_LARGE)
    c.unscorable(
        "300,000 query token ids", {"query": [5] * 300_000, "items": [[6]]}, ErrorCode.INPUT_TOO_LONG
    )
    c.unscorable("200 KB query text", {"query": words, "items": ["x"]}, ErrorCode.INPUT_TOO_LONG)
    c.unscorable("200 KB metadata", {"items": ["x"], "metadata": words}, ErrorCode.RESULT_TOO_LARGE)
    c.unscorable("token id beyond the vocabulary", {"items": [[5, 100_000]]}, ErrorCode.TOKEN_ID_OUT_OF_RANGE)
    c.unscorable("empty token prompt", {"items": [[]]}, ErrorCode.EMPTY_INPUT)
    labels = {"items": ["x"], "label_token_ids": [5, 6]}
    c.unscorable("labels for a classifier", labels, ErrorCode.LABEL_IDS_NOT_SUPPORTED)
    c.refused("50,000 label ids", {"label_token_ids": list(range(50_000))}, ErrorCode.INVALID_REQUEST)
    c.refused("5,000 requires names", {"requires": ["items"] * 5_000}, ErrorCode.INVALID_REQUEST)
    rid = c.new_id()
    value = _pack({"version": 1, "request_id": "i" * 100_000, "items": ["x"]})
    record = (b"huge-id", value, request_headers(rid))
    c.items.append(Poison("100,000-character id", record, rid, code=ErrorCode.INVALID_REQUEST))


def _deep(depth: int) -> Any:
    value: Any = None
    for _ in range(depth):
        value = [value]
    return value


def _nesting_and_specials(c: PoisonCorpus) -> None:
    nested = b"\x91" * 10_000 + b"\xc0"  # 10,000 nested one-element arrays: msgpack will not write it
    for name in ("metadata", "items", "query"):
        value = _raw_map([("version", _pack(1)), ("request_id", _pack("nested")), (name, nested)])
        c.unreadable(f"{name} nested 10,000 deep", value, True, ErrorCode.MALFORMED_MESSAGE)
    invalid = ErrorCode.INVALID_REQUEST
    for special in (math.nan, math.inf, -math.inf):
        c.refused(f"version={special}", {"version": special}, invalid)
        c.refused(f"query token {special}", {"query": [1, special]}, invalid)
        c.refused(f"item token {special}", {"items": [[special]]}, invalid)
        c.refused(f"label id {special}", {"label_token_ids": [special]}, invalid)
        c.refused(f"item_first={special}", {"item_first": special}, invalid)


def _versions(c: PoisonCorpus) -> None:
    for version in (2, 0, -1, 2**40, 2**64 - 1):
        c.refused(f"version {version}", {"version": version}, ErrorCode.UNSUPPORTED_SCHEMA_VERSION)
    rid = c.new_id()
    value = _pack({"request_id": rid, "items": ["x"]})
    c.items.append(
        Poison("no version", (None, value, request_headers(rid)), rid, code=ErrorCode.INVALID_REQUEST)
    )


def _odd_but_valid(c: PoisonCorpus) -> None:
    c.odd_but_valid("null key", {}, None, [])
    c.odd_but_valid(
        "binary headers", {}, b"\x00\xff", [("x-bin", bytes(range(256))), ("X-Empty", b""), ("x-null", None)]
    )
    specials = {"metadata": {"n": math.nan, "i": [math.inf, -math.inf]}}
    c.odd_but_valid("NaN and infinities in metadata", specials, None, [])
    c.odd_but_valid("300 KB unknown key", {"x-producer-blob": c.noise(300_000)}, None, [])


def check_poison(acc: Accounting, dead: list[Any], placed: dict[tuple[int, int], Poison]) -> None:
    """Each bad record got what the contract promises: its error result, its dead letter, nothing more."""
    letters: dict[tuple[int, int], Any] = {}
    for letter in dead:
        source = (
            int(header(letter, "x-source-partition") or -1),
            int(header(letter, "x-source-offset") or -1),
        )
        assert source not in letters, f"two dead letters for {source}"
        letters[source] = letter
    assert set(letters) <= set(placed), "a good request was dead-lettered"
    wrong = [
        f"{p.label}: {why}" for at, p in placed.items() if (why := _poison_fault(acc, letters.get(at), p))
    ]
    assert not wrong, "\n".join(wrong)


def _poison_fault(acc: Accounting, letter: Any, poison: Poison) -> str | None:
    """What is wrong with the answer to one bad record, or None."""
    if poison.dead_letter != (letter is not None):
        return f"dead letter expected: {poison.dead_letter}, found: {letter is not None}"
    if letter is not None and poison.code and header(letter, "x-error-code") != str(poison.code).encode():
        return f"dead letter code {header(letter, 'x-error-code')!r}, expected {poison.code}"
    if poison.result_id is None:
        return None
    results = acc.by_id.get(poison.result_id, [])
    if len(results) != 1:
        return f"{len(results)} results for {poison.result_id}"
    error = results[0].error
    if poison.ok:
        return None if error is None else f"expected an OK result, got {error.code}: {error.message[:200]}"
    if error is None:
        return "expected an error result, got OK"
    if poison.code and error.code != poison.code:
        return f"code {error.code}, expected {poison.code}: {error.message[:200]}"
    if poison.echo is not None and results[0].metadata != poison.echo:
        return f"metadata {results[0].metadata!r} instead of the request's {poison.echo!r}"
    return None

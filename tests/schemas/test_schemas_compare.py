"""The comparison fields of the wire contract: compare and reward_column on requests, rewards, preference,
ranking and best_probability on results; their round trips, their refusals, and old messages unchanged."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from schemas import (
    Compare,
    ErrorCode,
    ResultStatus,
    SchemaError,
    ScoreRequest,
    ScoreResult,
    TokenOutputs,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
    result_size_bound,
)

PAIR = ("It opens at nine.", "I do not know.")


def test_compare_requests_round_trip() -> None:
    for compare, items, column in ((Compare.PAIRWISE, PAIR, None), (Compare.RANK, (*PAIR, "Nine."), 1)):
        request = ScoreRequest("c", items=items, query="q", compare=compare, reward_column=column)
        decoded = decode_request(encode_request(request))
        assert decoded == request and decoded.compare is compare
        wire = msgpack.unpackb(encode_request(request))
        assert (wire["compare"], wire["reward_column"]) == (compare.value, column)
    spelled = decode_request(
        msgpack.packb({"version": 1, "request_id": "s", "items": PAIR, "compare": "pairwise"})
    )
    assert spelled.compare is Compare.PAIRWISE and spelled.reward_column is None
    assert "compare" in ScoreRequest("r", items=PAIR, requires=("compare", "reward_column")).requires  # type: ignore[operator]


@pytest.mark.parametrize(
    ("fields", "code", "says"),
    [
        ({"compare": "pairwise", "items": ("a",)}, ErrorCode.COMPARE_INVALID, "exactly two items"),
        ({"compare": "pairwise", "items": ("a", "b", "c")}, ErrorCode.COMPARE_INVALID, "has 3 items"),
        ({"compare": "rank", "items": ("a",)}, ErrorCode.COMPARE_INVALID, "two or more"),
        ({"compare": "rank", "items": ()}, ErrorCode.COMPARE_INVALID, "two or more"),
        ({"reward_column": 0}, ErrorCode.COMPARE_INVALID, "compare is nil"),
        (
            {"compare": "pairwise", "token_outputs": TokenOutputs.TOKENS},
            ErrorCode.COMPARE_INVALID,
            "token_outputs",
        ),
        ({"compare": "best"}, ErrorCode.INVALID_REQUEST, "'best'"),
        ({"compare": "Pairwise"}, ErrorCode.INVALID_REQUEST, '"pairwise"'),
        ({"compare": 1}, ErrorCode.INVALID_REQUEST, "compare is"),
        ({"compare": "pairwise", "reward_column": -1}, ErrorCode.INVALID_REQUEST, ">= 0"),
        ({"compare": "pairwise", "reward_column": 1.0}, ErrorCode.INVALID_REQUEST, "integer"),
        ({"compare": "pairwise", "reward_column": True}, ErrorCode.INVALID_REQUEST, "integer"),
    ],
)
def test_refusals_have_stable_codes_and_reach_the_decoder(
    fields: dict[str, Any], code: ErrorCode, says: str
) -> None:
    body: dict[str, Any] = {"version": 1, "request_id": "bad-1", "items": list(PAIR), **fields}
    if isinstance(body["items"], tuple):
        body["items"] = list(body["items"])
    if "token_outputs" in body:
        body["token_outputs"] = body["token_outputs"].value
    with pytest.raises(SchemaError) as error:
        decode_request(msgpack.packb(body))
    assert error.value.code is code and says in error.value.message
    assert error.value.request_id == "bad-1"  # the worker can answer it


def test_compare_results_round_trip_and_old_results_read_as_nil() -> None:
    pair = ScoreResult(
        "p", ResultStatus.OK, scores=((0.5,), (-0.5,)), rewards=(0.5, -0.5), preference=0.7310585786300049
    )
    assert decode_result(encode_result(pair)) == pair
    ranked = ScoreResult(
        "r", ResultStatus.OK, scores=((1.0,), (3.0,), (2.0,)), rewards=(1.0, 3.0, 2.0), ranking=(1, 2, 0),
        best_probability=(0.09, 0.66, 0.24),
    )  # fmt: skip
    decoded = decode_result(encode_result(ranked))
    assert decoded == ranked and decoded.ranking == (1, 2, 0)
    # A result written before these fields existed: no keys, read as nil.
    old = {"version": 1, "request_id": "o", "status": "ok", "scores": [[1.0]]}
    read = decode_result(msgpack.packb(old))
    assert (read.rewards, read.preference, read.ranking, read.best_probability) == (None, None, None, None)
    wire = msgpack.unpackb(encode_result(read))
    assert {k: wire[k] for k in ("rewards", "preference", "ranking", "best_probability")} == dict.fromkeys(
        ("rewards", "preference", "ranking", "best_probability")
    )


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"rewards": (1.0,)}, "one per item"),
        ({"rewards": (1.0, 2.0, 3.0), "preference": 0.5}, "exactly two"),
        ({"rewards": (1.0, 2.0, 3.0), "ranking": (0, 0, 1)}, "each item index once"),
        ({"rewards": (1.0, 2.0, 3.0), "ranking": (0, 1)}, "each item index once"),
        ({"rewards": (1.0, 2.0, 3.0), "best_probability": (0.5, 0.5)}, "one per item"),
        ({"preference": 0.5}, "without rewards"),
        ({"rewards": (1.0, "x", 3.0)}, "rewards[1]"),
        ({"rewards": (1.0, 2.0, 3.0), "ranking": (0, 1, -2)}, "ranking[2]"),
    ],
)
def test_inconsistent_results_are_refused(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(SchemaError) as error:
        ScoreResult("x", ResultStatus.OK, scores=((1.0,), (2.0,), (3.0,)), **fields)
    assert error.value.code is ErrorCode.INVALID_REQUEST and says in error.value.message


def test_error_results_carry_no_comparison() -> None:
    with pytest.raises(SchemaError, match="comparison"):
        ScoreResult("e", ResultStatus.ERROR, error=None, rewards=(1.0,))
    failure = ScoreResult.failure("e", ErrorCode.REWARD_COLUMN_REQUIRED, "send reward_column.")
    assert decode_result(encode_result(failure)) == failure


def test_size_bound_covers_the_comparison() -> None:
    items = tuple(f"item {i}" for i in range(40))
    request = ScoreRequest("big", items=items, compare="rank", metadata={"k": "v"})
    rewards = tuple(-1.0e-300 * (i + 1) for i in range(40))  # full float64s: 9 bytes each on the wire
    result = ScoreResult(
        "big", ResultStatus.OK, scores=tuple((r,) for r in rewards), rewards=rewards,
        ranking=tuple(range(40)), best_probability=rewards, model="m",
        timings={"tokenize_s": 0.0, "forward_s": 0.0, "copy_s": 0.0}, metadata={"k": "v"},
    )  # fmt: skip
    assert len(encode_result(result)) <= result_size_bound(request, "m", 40, 1, 16)
    plain = ScoreRequest("big", items=items, metadata={"k": "v"})
    assert result_size_bound(plain, "m", 40, 1, 16) < len(encode_result(result))  # the comparison counted

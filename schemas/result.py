"""The scoring result: one per request, either scores (and hidden states) or an error."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from schemas._checks import (
    PLAIN_FLOAT_TYPES,
    PLAIN_INT_TYPES,
    check_float,
    check_int,
    check_metadata,
    check_request_id,
    check_str,
    describe,
    invalid,
    quoted,
)
from schemas.compare import check_floats, check_outcome, check_ranking
from schemas.errors import ErrorCode, SchemaError
from schemas.request import check_version
from schemas.tensor import Tensor
from schemas.version import SCHEMA_VERSION

_STR_TYPES = frozenset({str})


class ResultStatus(StrEnum):
    """Whether a request was scored."""

    OK = "ok"
    ERROR = "error"


def check_error_code(value: object, field: str) -> ErrorCode:
    """A known error code (the decoder maps codes from newer workers before calling this)."""
    if isinstance(value, ErrorCode):
        return value
    if isinstance(value, str) and value in ErrorCode.__members__:
        return ErrorCode(value)
    raise invalid(
        f"{field} is {describe(value)} {quoted(value)}; send one of the error codes of schema version 1."
    )


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """Why a request failed: a stable code and a sentence saying what to change."""

    code: ErrorCode
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "code", check_error_code(self.code, "error.code"))
        check_str(self.message, "error.message")


def _check_scores(value: object) -> tuple[tuple[float, ...], ...]:
    if not isinstance(value, list | tuple):
        raise invalid(f"scores must be an array of arrays of floats, not {describe(value)}.")
    rows: list[tuple[float, ...]] = []
    for index, row in enumerate(value):
        if not isinstance(row, list | tuple):
            raise invalid(f"scores[{index}] must be an array of floats, not {describe(row)}.")
        if set(map(type, row)) <= PLAIN_FLOAT_TYPES:
            rows.append(tuple(row))
        else:
            rows.append(tuple(check_float(score, f"scores[{index}][{j}]") for j, score in enumerate(row)))
    return tuple(rows)


def _check_pooled(value: object) -> tuple[Tensor, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(t, Tensor) for t in value):
        raise invalid(f"pooled_hidden_states must be nil or an array of tensors, not {describe(value)}.")
    return tuple(value)


def _check_positions(value: object) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise invalid(
            f"token_positions must be nil or an array of arrays of integers, not {describe(value)}."
        )
    rows: list[tuple[int, ...]] = []
    for index, row in enumerate(value):
        if isinstance(row, tuple) and set(map(type, row)) <= PLAIN_INT_TYPES and min(row, default=0) >= 0:
            rows.append(row)  # what the engine builds
            continue
        if not isinstance(row, list | tuple):
            raise invalid(f"token_positions[{index}] must be an array of integers, not {describe(row)}.")
        rows.append(tuple(check_int(p, f"token_positions[{index}][{j}]", 0) for j, p in enumerate(row)))
    return tuple(rows)


def _check_tensors(value: object, field: str) -> tuple[Tensor, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(t, Tensor) for t in value):
        raise invalid(f"{field} must be nil or an array of tensors, not {describe(value)}.")
    return tuple(value)


def _check_head_scores(value: object) -> dict[str, tuple[tuple[float, ...], ...]] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise invalid(
            f"head_scores must be nil or a map of head name to score arrays, not {describe(value)}."
        )
    return {check_str(name, "a head_scores key"): _check_scores(rows) for name, rows in value.items()}


def _check_truncated(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, tuple) and set(map(type, value)) <= PLAIN_INT_TYPES and min(value, default=0) >= 0:
        return value  # what the engine builds: checked in C, field by field only when one is wrong
    if not isinstance(value, list | tuple):
        raise invalid(
            f"truncated_tokens must be nil or an array of integers, not {describe(value)}; send nil, or one "
            f"count (>= 0) per item."
        )
    return tuple(check_int(count, f"truncated_tokens[{index}]", 0) for index, count in enumerate(value))


def _check_timings(value: object) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise invalid(f"timings must be a map of stage name to seconds, not {describe(value)}.")
    if set(map(type, value)) <= _STR_TYPES and set(map(type, value.values())) <= PLAIN_FLOAT_TYPES:
        return dict(value)
    return {check_str(k, "a timings key"): check_float(v, f"timings[{quoted(k)}]") for k, v in value.items()}


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """The outcome of one request; on error, scores is () and pooled_hidden_states, truncated_tokens None."""

    request_id: str
    status: ResultStatus
    scores: tuple[tuple[float, ...], ...] = ()
    pooled_hidden_states: tuple[Tensor, ...] | None = None
    prompt_tokens: int = 0
    model: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    error: ErrorInfo | None = None
    metadata: object = None
    truncated_tokens: tuple[int, ...] | None = None
    # With the request's token_outputs: per item, the positions read (in its prompt, in order), their
    # scores [P, L] (float32) and hidden states [P, H] (the request's dtype), where asked.
    token_positions: tuple[tuple[int, ...], ...] | None = None
    token_scores: tuple[Tensor, ...] | None = None
    token_hidden_states: tuple[Tensor, ...] | None = None
    # With the request's heads: per head name, one score array per item.
    head_scores: dict[str, tuple[tuple[float, ...], ...]] | None = None
    # With the request's compare (schemas/compare.py): each item's reward; P(A beats B) for "pairwise";
    # item indices best first and each item's probability of being the best for "rank".
    rewards: tuple[float, ...] | None = None
    preference: float | None = None
    ranking: tuple[int, ...] | None = None
    best_probability: tuple[float, ...] | None = None
    version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        request_id = check_request_id(self.request_id)
        try:
            self._validate()
        except SchemaError as error:
            raise error.with_request_id(request_id) from None

    def _validate(self) -> None:
        check_version(self.version)
        if not isinstance(self.status, str) or self.status not in ("ok", "error"):
            raise invalid(f'status is {describe(self.status)} {quoted(self.status)}; send "ok" or "error".')
        if not isinstance(self.status, ResultStatus):
            object.__setattr__(self, "status", ResultStatus(self.status))
        object.__setattr__(self, "scores", _check_scores(self.scores))
        object.__setattr__(self, "pooled_hidden_states", _check_pooled(self.pooled_hidden_states))
        check_int(self.prompt_tokens, "prompt_tokens", 0)
        object.__setattr__(self, "prompt_tokens", int(self.prompt_tokens))
        check_str(self.model, "model")
        object.__setattr__(self, "timings", _check_timings(self.timings))
        if self.error is not None and not isinstance(self.error, ErrorInfo):
            raise invalid(f"error must be nil or a map {{code, message}}, not {describe(self.error)}.")
        check_metadata(self.metadata)
        object.__setattr__(self, "truncated_tokens", _check_truncated(self.truncated_tokens))
        object.__setattr__(self, "token_positions", _check_positions(self.token_positions))
        object.__setattr__(self, "token_scores", _check_tensors(self.token_scores, "token_scores"))
        hidden = _check_tensors(self.token_hidden_states, "token_hidden_states")
        object.__setattr__(self, "token_hidden_states", hidden)
        object.__setattr__(self, "head_scores", _check_head_scores(self.head_scores))
        self._check_comparison()
        self._check_consistency()

    def _check_comparison(self) -> None:
        object.__setattr__(self, "rewards", check_floats(self.rewards, "rewards"))
        if self.preference is not None:
            object.__setattr__(self, "preference", check_float(self.preference, "preference"))
        object.__setattr__(self, "ranking", check_ranking(self.ranking))
        best = check_floats(self.best_probability, "best_probability")
        object.__setattr__(self, "best_probability", best)
        if self.status is ResultStatus.OK:
            check_outcome(len(self.scores), self.rewards, self.preference, self.ranking, best)
        elif (self.rewards, self.preference, self.ranking, best) != (None, None, None, None):
            raise invalid(
                'An "error" result carries a comparison; send rewards, preference, ranking and '
                "best_probability nil."
            )

    def _check_consistency(self) -> None:
        if self.status is ResultStatus.OK:
            if self.error is not None:
                raise invalid('An "ok" result carries an error; send status "error", or error nil.')
            pooled = self.pooled_hidden_states
            if pooled is not None and len(pooled) != len(self.scores):
                raise invalid(
                    f"pooled_hidden_states has {len(pooled)} tensors for {len(self.scores)} items; "
                    f"send one tensor per item."
                )
            truncated = self.truncated_tokens
            if truncated is not None and len(truncated) != len(self.scores):
                raise invalid(
                    f"truncated_tokens has {len(truncated)} counts for {len(self.scores)} items; send one "
                    f"count per item, or nil."
                )
            self._check_token_outputs()
            for name, rows in (self.head_scores or {}).items():
                if len(rows) != len(self.scores):
                    raise invalid(
                        f"head_scores[{quoted(name)}] has {len(rows)} arrays for {len(self.scores)} items; "
                        "send one per item."
                    )
            return
        if self.error is None:
            raise invalid('An "error" result has no error; send error as a map {code, message}.')
        if self.scores or self.pooled_hidden_states is not None:
            raise invalid('An "error" result carries scores or hidden states; send scores [] and nil states.')
        if self.truncated_tokens is not None:
            raise invalid('An "error" result carries truncated_tokens; send truncated_tokens nil.')
        if self.head_scores is not None:
            raise invalid('An "error" result carries head_scores; send head_scores nil.')
        if (self.token_positions, self.token_scores, self.token_hidden_states) != (None, None, None):
            raise invalid(
                'An "error" result carries token outputs; send token_positions and its tensors nil.'
            )

    def _check_token_outputs(self) -> None:
        """Token outputs come with their positions: one entry per item, one row per position."""
        positions = self.token_positions
        tensors = {"token_scores": self.token_scores, "token_hidden_states": self.token_hidden_states}
        if positions is None:
            for name, value in tensors.items():
                if value is not None:
                    raise invalid(
                        f"{name} is set without token_positions; send the positions it was read at."
                    )
            return
        if len(positions) != len(self.scores):
            raise invalid(
                f"token_positions has {len(positions)} entries for {len(self.scores)} items; send one per "
                "item."
            )
        for name, value in tensors.items():
            if value is None:
                continue
            if len(value) != len(positions):
                raise invalid(
                    f"{name} has {len(value)} tensors for {len(positions)} items; send one per item."
                )
            for index, (tensor, at) in enumerate(zip(value, positions, strict=True)):
                if len(tensor.shape) != 2 or tensor.shape[0] != len(at):
                    raise invalid(
                        f"{name}[{index}] has shape {list(tensor.shape)} for {len(at)} positions; send "
                        f"[positions, width]."
                    )

    @property
    def ok(self) -> bool:
        """Whether the request was scored."""
        return self.status is ResultStatus.OK

    @classmethod
    def failure(
        cls,
        request_id: str,
        code: ErrorCode,
        message: str,
        *,
        model: str = "",
        metadata: object = None,
        timings: Mapping[str, float] | None = None,
    ) -> ScoreResult:
        """An error result for a request: no scores, no hidden states, prompt_tokens 0."""
        return cls(
            request_id=request_id,
            status=ResultStatus.ERROR,
            error=ErrorInfo(code, message),
            model=model,
            metadata=metadata,
            timings=dict(timings or {}),
        )

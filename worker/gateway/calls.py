"""One HTTP call on its way to Kafka: reading its fields, making its score requests (with the call's
deadline), and turning error results into HTTP errors. Shared by every route shape."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from schemas import ErrorCode, ResultStatus, SchemaError, ScoreRequest, ScoreResult
from worker.client import new_request_id
from worker.gateway.bridge import KafkaBridge
from worker.gateway.errors import GatewayError, invalid, status_of

Body = dict[str, Any]


class Call:
    """What a route needs from the gateway for one call: limits, the deadline, the Kafka side."""

    def __init__(self, bridge: KafkaBridge, timeout_s: float, max_items: int, labels: Sequence[str]) -> None:
        self.bridge = bridge
        self.timeout_s = timeout_s
        self._started = time.monotonic()
        # The same instant as Unix milliseconds: the workers answer EXPIRED instead of scoring after it.
        self.deadline_ms = int((time.time() + timeout_s) * 1000)
        self.max_items = max_items
        self.labels = labels
        self.prompt_tokens = 0

    @property
    def model(self) -> str:
        return self.bridge.model

    def request(self, **fields: Any) -> ScoreRequest:
        """A score request of this call; a field the contract refuses is a 400 with its code."""
        try:
            return ScoreRequest(request_id=new_request_id(), deadline_ms=self.deadline_ms, **fields)
        except SchemaError as error:
            raise GatewayError(400, error.code.value, error.message) from None

    def check_count(self, count: int, field: str) -> None:
        if count > self.max_items:
            raise GatewayError(
                413, ErrorCode.TOO_MANY_ITEMS.value,
                f"{field} has {count} entries; send at most {self.max_items} in one call", param=field,
            )  # fmt: skip

    async def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """The results, in order, all of them scored; the first error result fails the call."""
        remaining = self.timeout_s - (time.monotonic() - self._started)
        results = await self.bridge.score(requests, max(remaining, 0.0))
        for result in results:
            if result.status is not ResultStatus.OK:
                assert result.error is not None
                code = result.error.code
                raise GatewayError(status_of(code), code.value, result.error.message)
            self.prompt_tokens += result.prompt_tokens
        return results

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage block as vLLM and SGLang fill it for pooling calls: prompt tokens only."""
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens,
                "completion_tokens": 0, "prompt_tokens_details": None}  # fmt: skip


def _token_ids(values: list[Any]) -> bool:
    """Whether every value is an integer; type() is int leaves out booleans (a subclass of int), and the
    JSON and msgpack decoders make no other subclass. It is the cheapest test per token."""
    return all(type(v) is int for v in values)


def text_or_ids(value: object, field: str) -> str | list[int]:
    """A text, or an array of token ids."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and _token_ids(value):
        return value
    raise invalid(f"{field} must be a string or an array of token ids", field)


def inputs(value: object, field: str) -> list[str | list[int]]:
    """One input or an array of them: a text, token ids, an array of texts or of token-id arrays."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and _token_ids(value):
        return [value]
    if isinstance(value, list):
        return [text_or_ids(item, f"{field}[{index}]") for index, item in enumerate(value)]
    raise invalid(f"{field} is required: a string, token ids, or an array of them", field)


def flag(body: Body, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false", name)
    return value


def optional_int(body: Body, name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise invalid(f"{name} must be an integer >= {minimum}", name)
    return value


def activated(row: Sequence[float], use_activation: bool) -> list[float]:
    """vLLM's classification activation: a sigmoid for one label, a softmax over several; raw logits off."""
    if not use_activation:
        return list(row)
    if len(row) == 1:
        return [_sigmoid(row[0])]
    top = max(row)
    exps = [math.exp(value - top) for value in row]  # shifted by the maximum: no overflow
    total = math.fsum(exps)
    return [value / total for value in exps]


def _sigmoid(value: float) -> float:
    if value >= 0:
        return 1.0 / (1.0 + math.exp(-value))
    shrunk = math.exp(value)  # the other form for negatives: exp(-value) would overflow
    return shrunk / (1.0 + shrunk)

"""Requests larger than one model batch: cut into runs of items that fit a batch, and their results joined."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from models.prepare import PreparedRequest
from schemas import ResultStatus, ScoreResult, Tensor


def token_runs(sizes: Sequence[int], max_tokens: int) -> Iterator[range]:
    """Consecutive index ranges whose sizes add up to at most `max_tokens`; a size above it stands alone.

    The one rule for cutting a sequence into token-budget batches: the worker's batcher, the engine's split
    and the cutting of a large request all follow it.
    """
    start, tokens = 0, 0
    for index, size in enumerate(sizes):
        if index > start and tokens + size > max_tokens:
            yield range(start, index)
            start, tokens = index, 0
        tokens += size
    if start < len(sizes):
        yield range(start, len(sizes))


def split_request(prepared: PreparedRequest, max_tokens: int) -> list[PreparedRequest]:
    """The request as parts of consecutive items, each within `max_tokens` (an item above it alone).

    A request that fits is returned whole. Tokenizing time is charged to the first part.
    """
    if prepared.num_tokens <= max_tokens:
        return [prepared]
    parts = []
    for number, run in enumerate(token_runs([len(p) for p in prepared.prompts], max_tokens)):
        cut = slice(run.start, run.stop)
        parts.append(
            dataclasses.replace(
                prepared,
                prompts=prepared.prompts[cut],
                token_types=None if prepared.token_types is None else prepared.token_types[cut],
                truncated=None if prepared.truncated is None else prepared.truncated[cut],
                tokenize_s=prepared.tokenize_s if number == 0 else 0.0,
            )
        )
    return parts


def join_results(parts: Sequence[ScoreResult]) -> ScoreResult:
    """One result from the results of a request's parts, in item order; the first failed part's error
    result stands for the whole request (a result never carries some items' scores and not others)."""
    if len(parts) == 1:
        return parts[0]
    for part in parts:
        if part.status is ResultStatus.ERROR:
            return part
    first = parts[0]
    hidden: tuple[Tensor, ...] | None = None
    if first.pooled_hidden_states is not None:
        hidden = tuple(t for part in parts for t in part.pooled_hidden_states or ())
    truncated = None
    if first.truncated_tokens is not None:
        truncated = tuple(n for part in parts for n in part.truncated_tokens or ())
    timings: dict[str, float] = {}
    for part in parts:
        for name, seconds in part.timings.items():
            timings[name] = timings.get(name, 0.0) + seconds
    return dataclasses.replace(
        first,
        scores=tuple(row for part in parts for row in part.scores),
        pooled_hidden_states=hidden,
        prompt_tokens=sum(part.prompt_tokens for part in parts),
        timings=timings,
        truncated_tokens=truncated,
    )

"""`POST /v1/compare`: a prompt's responses compared by a reward model, pairwise (Bradley-Terry) or ranked."""

from __future__ import annotations

from typing import Any

from schemas import Compare
from worker.gateway.calls import Body, Call, flag, inputs, optional_int, text_or_ids
from worker.gateway.errors import invalid

_MODES = {"pairwise": Compare.PAIRWISE, "rank": Compare.RANK}


def _mode(body: Body, count: int) -> Compare:
    """The body's `compare`, or by the count: two items pairwise, more ranked (as ScoreClient.compare)."""
    value = body.get("compare")
    if value is None:
        return Compare.PAIRWISE if count == 2 else Compare.RANK
    if value not in _MODES:
        raise invalid('compare must be "pairwise" (two items) or "rank" (two or more)', "compare")
    return _MODES[value]


async def compare(body: Body, call: Call) -> dict[str, Any]:
    """The items (responses to `query`, the prompt) scored in one request, the prompt computed once; the
    worker's rewards, preference (P(items[0] preferred to items[1]) = sigma(r_0 - r_1)), ranking (best first)
    and each item's probability of being the best. The worker checks the counts and the reward column."""
    if body.get("items") is None:
        raise invalid("items is required: the responses to compare, strings or token-id arrays", "items")
    items = inputs(body["items"], "items")
    call.check_count(len(items), "items")
    mode = _mode(body, len(items))
    column = optional_int(body, "reward_column", 0)
    query = body.get("query")
    request = call.request(
        query=None if query is None else text_or_ids(query, "query"),
        items=items,
        label_token_ids=body.get("label_token_ids"),
        item_first=flag(body, "item_first", False),
        compare=mode,
        reward_column=column,
        # A worker older than comparisons refuses the request instead of answering with scores alone.
        requires=("compare",) if column is None else ("compare", "reward_column"),
    )
    (result,) = await call.score([request])
    return {
        "object": "comparison",
        "model": call.model,
        "compare": mode.value,
        "rewards": None if result.rewards is None else list(result.rewards),
        "preference": result.preference,
        "ranking": None if result.ranking is None else list(result.ranking),
        "best_probability": None if result.best_probability is None else list(result.best_probability),
        "scores": [list(row) for row in result.scores],
        "usage": call.usage(),
    }

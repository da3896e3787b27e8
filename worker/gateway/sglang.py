"""SGLang's `POST /v1/score`: a query and items in, scores per item (and pooled hidden states) out."""

from __future__ import annotations

from typing import Any

from worker.gateway.bodies import encoding_format, vector
from worker.gateway.calls import Body, Call, flag, inputs, text_or_ids
from worker.gateway.errors import invalid


async def score(body: Body, call: Call) -> dict[str, Any]:
    """SGLang's ScoringRequest in, its ScoringResponse out (usage filled with the prompt tokens)."""
    if body.get("items") is None:
        raise invalid(
            "items is required: a string, an array of strings, or an array of token-id arrays", "items"
        )
    items = inputs(body["items"], "items")
    call.check_count(len(items), "items")
    query = body.get("query")
    labels = body.get("label_token_ids")
    hidden = flag(body, "return_pooled_hidden_states", False)
    encoding = encoding_format(body)
    request = call.request(
        query=None if query is None else text_or_ids(query, "query"),
        items=items,
        label_token_ids=labels,
        apply_softmax=flag(body, "apply_softmax", False),
        item_first=flag(body, "item_first", False),
        return_pooled_hidden_states=hidden,
    )
    (result,) = await call.score([request])
    pooled = None
    if result.pooled_hidden_states is not None:
        pooled = [vector(tensor, encoding) for tensor in result.pooled_hidden_states]
    usage = {**call.usage(), "reasoning_tokens": 0}
    return {"scores": [list(row) for row in result.scores], "pooled_hidden_states": pooled,
            "model": call.model, "usage": usage, "object": "scoring"}  # fmt: skip

"""vLLM's pooling routes: `POST /classify`, `POST /pooling`, `POST /score`, answered in vLLM's shapes."""

from __future__ import annotations

from typing import Any

from worker.gateway.bodies import encoding_format, vector
from worker.gateway.calls import Body, Call, activated, flag, inputs
from worker.gateway.errors import invalid
from worker.gateway.shapes import call_id, created, single_scores

# Accepted by vLLM, not by this gateway: a request that relies on them is refused, never scored without them.
_REFUSED = {
    "messages": "send the rendered text (or token ids) as input; chat requests are not served here yet",
    "truncate_prompt_tokens": "truncation is the workers' own rule (the request field truncate)",
    "dimensions": "hidden states come whole (Matryoshka dimensions are not cut)",
}


def _refuse_unsupported(body: Body) -> None:
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise invalid(f"{name} is not supported by this gateway: {why}", name)


def _label(index: int, labels: list[str] | tuple[str, ...]) -> str:
    return labels[index] if index < len(labels) else f"LABEL_{index}"


async def classify(body: Body, call: Call) -> dict[str, Any]:
    """Each input's class probabilities (sigmoid for one label, softmax for several) and its top label."""
    _refuse_unsupported(body)
    items = inputs(body.get("input"), "input")
    call.check_count(len(items), "input")
    use_activation = flag(body, "use_activation", True)
    (result,) = await call.score([call.request(items=items)])
    data = []
    for index, row in enumerate(result.scores):
        probs = activated(row, use_activation)
        top = max(range(len(probs)), key=probs.__getitem__) if probs else 0
        data.append({"index": index, "label": _label(top, tuple(call.labels)), "probs": probs,
                     "num_classes": len(probs)})  # fmt: skip
    return {"id": call_id("classify"), "object": "list", "created": created(), "model": call.model,
            "data": data, "usage": call.usage()}  # fmt: skip


async def pooling(body: Body, call: Call) -> dict[str, Any]:
    """Each input's pooled hidden state (the model's last hidden state at its pooled token, before the
    head), as floats or base64."""
    _refuse_unsupported(body)
    task = body.get("task")
    if task not in (None, "embed"):
        raise invalid(
            f'task {task!r} is not served by /pooling here; send "embed" or none (for scores: /classify)'
        )
    encoding = encoding_format(body)
    items = inputs(body.get("input"), "input")
    call.check_count(len(items), "input")
    (result,) = await call.score([call.request(items=items, return_pooled_hidden_states=True)])
    assert result.pooled_hidden_states is not None
    data = [{"index": index, "object": "pooling", "data": vector(tensor, encoding)}
            for index, tensor in enumerate(result.pooled_hidden_states)]  # fmt: skip
    return {"id": call_id("pool"), "object": "list", "created": created(), "model": call.model,
            "data": data, "usage": call.usage()}  # fmt: skip


_PAIR_NAMES = (("data_1", "data_2"), ("text_1", "text_2"), ("queries", "documents"), ("queries", "items"))


def _pairs(body: Body) -> tuple[list[str | list[int]], list[str | list[int]], str]:
    for first, second in _PAIR_NAMES:
        if body.get(first) is not None and body.get(second) is not None:
            return inputs(body[first], first), inputs(body[second], second), second
    raise invalid(
        "send the two sides as text_1 and text_2 (or data_1/data_2, queries/documents, queries/items)"
    )


async def score(body: Body, call: Call) -> dict[str, Any]:
    """One score per pair: one first text against each second one (1 to N), or pairs in order (N to N)."""
    _refuse_unsupported(body)
    firsts, seconds, field = _pairs(body)
    call.check_count(len(seconds), field)
    use_activation = flag(body, "use_activation", True)
    if len(firsts) == 1:
        requests = [call.request(query=firsts[0], items=seconds)]
    elif len(firsts) == len(seconds):
        requests = [
            call.request(query=first, items=[second]) for first, second in zip(firsts, seconds, strict=True)
        ]
    else:
        raise invalid(
            f"the first side has {len(firsts)} entries and {field} {len(seconds)}: send one, or as many"
        )
    rows = [row for result in await call.score(requests) for row in single_scores(result.scores, "score")]
    data = [{"index": index, "object": "score", "score": activated(row, use_activation)[0]}
            for index, row in enumerate(rows)]  # fmt: skip
    return {"id": call_id("score"), "object": "list", "created": created(), "model": call.model,
            "data": data, "usage": call.usage()}  # fmt: skip

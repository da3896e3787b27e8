"""OpenRLHF's remote reward model, `POST /get_reward`: one reward per full text (prompt and response)."""

from __future__ import annotations

from typing import Any

from worker.gateway.calls import Body, Call
from worker.gateway.errors import invalid
from worker.gateway.shapes import single_scores


async def get_reward(body: Body, call: Call) -> dict[str, Any]:
    """`query`: the texts as the trainer sends them, each already its prompt and response in the chat
    template; `prompts` and `labels` are accepted and not used (a reward model reads the text alone)."""
    queries = body.get("query")
    if not isinstance(queries, list) or not all(isinstance(text, str) for text in queries):
        raise invalid("query must be an array of strings (each prompt and response together)", "query")
    for name in ("prompts", "labels"):
        if body.get(name) is not None and not isinstance(body[name], list):
            raise invalid(f"{name} must be an array when sent", name)
    call.check_count(len(queries), "query")
    (result,) = await call.score([call.request(items=queries)])
    rewards = [row[0] for row in single_scores(result.scores, "get_reward")]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}

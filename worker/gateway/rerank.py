"""`POST /v1/rerank` and `/v2/rerank`: the Cohere/Jina shape as vLLM serves it, documents ranked by score."""

from __future__ import annotations

from typing import Any

from worker.gateway.calls import Body, Call, activated, flag, optional_int
from worker.gateway.errors import invalid
from worker.gateway.shapes import call_id, single_scores


def _documents(value: object) -> list[str]:
    """Documents as strings, or objects whose "text" is one."""
    if not isinstance(value, list):
        raise invalid("documents must be an array of strings or of objects with a text", "documents")
    texts = []
    for index, document in enumerate(value):
        text = document.get("text") if isinstance(document, dict) else document
        if not isinstance(text, str):
            raise invalid(f"documents[{index}] must be a string or an object with a text string", "documents")
        texts.append(text)
    return texts


async def rerank(body: Body, call: Call) -> dict[str, Any]:
    """Each document scored after the query; results by score, highest first, the first top_n of them."""
    query = body.get("query")
    if not isinstance(query, str):
        raise invalid("query must be a string", "query")
    documents = _documents(body.get("documents"))
    call.check_count(len(documents), "documents")
    top_n = optional_int(body, "top_n", 0) or len(documents)
    use_activation = flag(body, "use_activation", True)
    keep_documents = flag(body, "return_documents", True)
    (result,) = await call.score([call.request(query=query, items=documents)])
    scores = [activated(row, use_activation)[0] for row in single_scores(result.scores, "rerank")]
    ranked = sorted(range(len(documents)), key=lambda index: -scores[index])[:top_n]
    results = []
    for index in ranked:
        entry: dict[str, Any] = {"index": index}
        if keep_documents:
            entry["document"] = {"text": documents[index]}
        entry["relevance_score"] = scores[index]
        results.append(entry)
    usage = {"prompt_tokens": call.prompt_tokens, "total_tokens": call.prompt_tokens}
    return {"id": call_id("rerank"), "model": call.model, "usage": usage, "results": results}

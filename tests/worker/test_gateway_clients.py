"""Clients this project did not write, against a real gateway, worker and broker: the Cohere SDK's rerank on
a cross-encoder and a decoder reranker, OpenRLHF's own remote reward client, and the request bodies of vLLM's
and SGLang's own documentation, each answer checked against the same request sent over Kafka."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cohere
import httpx
import numpy as np
import pytest
from conftest import serving
from gateway_kit import (
    KEYS,
    REPLY_PATTERN,
    RunningGateway,
    answering_client,
    assert_alike,
    assert_sigmoid_alike,
    gateway_settings,
    one,
    serving_gateway,
    sigmoid_atol,
)
from worker_testkit import LiveWorker

from models import write_tiny_model

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "The capital of Brazil is Brasilia.",
    "The capital of France is Paris.",
    "Horses and cows are both animals",
]
# SGLang's documented example asks for the label tokens 9454 and 2753 (Qwen2.5's "Yes" and "No"): the judge
# written for it has a vocabulary that holds them.
JUDGE_VOCABULARY = 10_000


@dataclass(frozen=True)
class Served:
    """A worker of one tiny model, its gateway, and an HTTP client of that gateway."""

    worker: LiveWorker
    gateway: RunningGateway
    http: httpx.Client


def _serve(kafka_bootstrap: str, model_dir: Path) -> Iterator[Served]:
    with ExitStack() as stack:
        worker = stack.enter_context(
            contextmanager(serving)(kafka_bootstrap, model_dir, reply_topic_pattern=REPLY_PATTERN)
        )
        gateway = stack.enter_context(serving_gateway(gateway_settings(worker.bootstrap, worker.names)))
        http = stack.enter_context(answering_client(gateway))
        yield Served(worker, gateway, http)


@pytest.fixture(scope="module")
def decoder(kafka_bootstrap: str, tiny_llama_dir: Path) -> Iterator[Served]:
    """A decoder reranker: a one-label LlamaForSequenceClassification reading the query then the item."""
    yield from _serve(kafka_bootstrap, tiny_llama_dir)


@pytest.fixture(scope="module")
def cross_encoder(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A one-label BertForSequenceClassification: query and item as a sentence pair."""
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-bert"), "bert", seed=2, num_labels=1)
    yield from _serve(kafka_bootstrap, model_dir)


@pytest.fixture(scope="module")
def judge(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A causal LM judge, scored on label tokens, for SGLang's /v1/score example."""
    model_dir = write_tiny_model(
        tmp_path_factory.mktemp("tiny-judge"), "llama", seed=3, judge=True,
        overrides={"vocab_size": JUDGE_VOCABULARY},
    )  # fmt: skip
    yield from _serve(kafka_bootstrap, model_dir)


@pytest.fixture(params=["decoder", "cross_encoder"])
def reranker(request: pytest.FixtureRequest) -> Served:
    served: Served = request.getfixturevalue(request.param)
    return served


def assert_ranked_alike(
    served: Served, query: str, documents: Sequence[str], ranked: Sequence[tuple[int, float]]
) -> None:
    """A ranking (index, relevance) against the direct logits of the same query and documents: every
    document once; each relevance the logistic of its direct logit within the bound of two forward passes
    (sigmoid_atol, ε); and the order the direct one wherever two documents' direct probabilities lie more
    than 2ε apart (r_a ≥ r_b with |r - p| ≤ ε gives p_a ≥ p_b - 2ε; closer ones may come either way)."""
    request, expected = one(served.worker, query=query, items=tuple(documents))
    logits = [row[0] for row in expected.scores]
    indices = [index for index, _ in ranked]
    relevance = [score for _, score in ranked]
    assert sorted(indices) == list(range(len(documents)))
    assert relevance == sorted(relevance, reverse=True)
    assert_sigmoid_alike(served.worker, request, [logits[index] for index in indices], relevance)
    atol = sigmoid_atol(served.worker, request, logits)
    probs = 1 / (1 + np.exp(-np.asarray(logits, dtype=np.float64)))
    for higher, lower in itertools.pairwise(indices):
        assert probs[higher] >= probs[lower] - 2 * atol, (indices, probs)


def test_cohere_v2_rerank_through_the_sdk(reranker: Served) -> None:
    client = cohere.ClientV2(api_key=KEYS[0], base_url=reranker.gateway.url, timeout=60)
    response = client.rerank(model="any", query=QUERY, documents=DOCUMENTS)
    ranked = [(result.index, result.relevance_score) for result in response.results]
    assert all(isinstance(index, int) and isinstance(score, float) for index, score in ranked)
    assert_ranked_alike(reranker, QUERY, DOCUMENTS, ranked)
    top = client.rerank(model="any", query=QUERY, documents=DOCUMENTS, top_n=2)
    assert [result.index for result in top.results] == [index for index, _ in ranked[:2]]


def test_cohere_v1_rerank_through_the_sdk(reranker: Served) -> None:
    client = cohere.Client(api_key=KEYS[1], base_url=reranker.gateway.url, timeout=60)
    response = client.rerank(model="any", query=QUERY, documents=DOCUMENTS, return_documents=True)
    ranked = [(result.index, result.relevance_score) for result in response.results]
    assert_ranked_alike(reranker, QUERY, DOCUMENTS, ranked)
    for result in response.results:
        assert result.document is not None and result.document.text == DOCUMENTS[result.index]


def test_cohere_sdk_with_a_wrong_key_is_refused(decoder: Served) -> None:
    client = cohere.ClientV2(api_key="not-a-key", base_url=decoder.gateway.url, timeout=60)
    with pytest.raises(cohere.UnauthorizedError):
        client.rerank(model="any", query=QUERY, documents=DOCUMENTS)


# Where ./dev.sh installs OpenRLHF: a directory of its own, off the path (its wheel carries a top-level
# `tests` package that would hide this repository's).
OPENRLHF_DIR = Path(sys.prefix) / "openrlhf"


def openrlhf_agent(monkeypatch: pytest.MonkeyPatch) -> Any:
    """OpenRLHF's own openrlhf/utils/agent.py, where its trainer's remote reward call lives. ./dev.sh installs
    the package without its dependencies (DeepSpeed, flash-attn, Ray and vLLM builds), which
    openrlhf/utils/__init__.py imports: so `openrlhf` and `openrlhf.utils` are set up as bare packages of
    that directory and agent.py is imported beneath them (it needs only aiohttp and logging_utils)."""
    source = OPENRLHF_DIR / "openrlhf"
    if not (source / "utils" / "agent.py").is_file():
        pytest.skip(f"OpenRLHF's client is not at {source}: ./dev.sh installs it")
    for name, path in (("openrlhf", source), ("openrlhf.utils", source / "utils")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        monkeypatch.setitem(sys.modules, name, package)
    for name in ("openrlhf.utils.agent", "openrlhf.utils.logging_utils"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module("openrlhf.utils.agent")


def test_openrlhf_remote_reward_client(decoder: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenRLHF's SingleTurnAgentExecutor with two reward servers on its command line
    (`--reward.remote_url A,B`), both this gateway (keys off: OpenRLHF sends none): its own HTTP client
    shards the queries over the servers, posts {"query", "prompts", "labels"} and reads each answer, from
    which its rollout takes "scores" (else "rewards") and "extra_logs"."""
    agent = openrlhf_agent(monkeypatch)
    prompts = [
        "<s>user: 2+2?\nassistant:",
        "<s>user: capital of France?\nassistant:",
        "<s>user: hi\nassistant:",
    ]
    responses = [" 4</s>", " Paris</s>", " Hello, how can I help?</s>"]
    queries = [prompt + response for prompt, response in zip(prompts, responses, strict=True)]
    settings = gateway_settings(decoder.worker.bootstrap, decoder.worker.names, gateway_api_keys="")
    with serving_gateway(settings) as open_gateway, answering_client(open_gateway):
        urls = f"{open_gateway.url}/get_reward,{open_gateway.url}/get_reward".split(",")  # as its CLI splits
        executor = agent.SingleTurnAgentExecutor(remote_rm_url=urls)
        shards = asyncio.run(executor._fetch_rewards_via_http(queries, prompts, ["", "", ""]))
    assert len(shards) == 2  # ceil(3 / 2) = 2 queries to the first server, 1 to the second
    rewards: list[float] = []
    for shard in shards:
        scores = shard.get("scores")  # what its rollout reads first
        assert scores == shard["rewards"] and isinstance(shard.get("extra_logs"), dict)
        rewards += scores
    assert len(rewards) == 3 and all(isinstance(reward, float) for reward in rewards)
    request, expected = one(decoder.worker, items=tuple(queries))
    assert_alike(decoder.worker, request, expected, [[reward] for reward in rewards])


# The request bodies below are those of vLLM's documentation (docs/serving/openai_compatible_server.md and
# examples/online_serving/openai_pooling_client.py) and SGLang's (its native API page), word for word.
CLASSIFY_BATCH = {
    "model": "jason9693/Qwen2.5-1.5B-apeach",
    "input": ["Loved the new café—coffee was great.", "This update broke everything. Frustrating."],
}
CLASSIFY_ONE = {"model": "jason9693/Qwen2.5-1.5B-apeach", "input": "Loved the new café—coffee was great."}
POOLING = {"model": "internlm/internlm2-1_8b-reward", "input": "vLLM is great!"}
SCORE_ONE = {
    "model": "BAAI/bge-reranker-v2-m3",
    "encoding_format": "float",
    "text_1": "What is the capital of France?",
    "text_2": "The capital of France is Paris.",
}
SCORE_BATCH = {
    "model": "BAAI/bge-reranker-v2-m3",
    "text_1": "What is the capital of France?",
    "text_2": ["The capital of Brazil is Brasilia.", "The capital of France is Paris."],
}
SCORE_PAIRS = {
    "model": "BAAI/bge-reranker-v2-m3",
    "encoding_format": "float",
    "text_1": ["What is the capital of Brazil?", "What is the capital of France?"],
    "text_2": ["The capital of Brazil is Brasilia.", "The capital of France is Paris."],
}
RERANK = {"model": "BAAI/bge-reranker-base", "query": QUERY, "documents": DOCUMENTS}
SGLANG_SCORE = {
    "model": "qwen/qwen2.5-0.5b-instruct",
    "query": "The capital of France is",
    "items": ["Paris", "London", "Berlin"],
    "label_token_ids": [9454, 2753],
    "apply_softmax": True,
}
VLLM_USAGE = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"]


def _texts(value: str | list[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@pytest.mark.parametrize("body", [CLASSIFY_BATCH, CLASSIFY_ONE], ids=["batch", "one"])
def test_vllm_documented_classify(decoder: Served, body: dict[str, Any]) -> None:
    got = decoder.http.post("/classify", json=body).json()
    assert list(got) == ["id", "object", "created", "model", "data", "usage"]
    assert isinstance(got["id"], str) and got["object"] == "list" and isinstance(got["created"], int)
    assert list(got["usage"]) == VLLM_USAGE
    request, expected = one(decoder.worker, items=_texts(body["input"]))
    for index, entry in enumerate(got["data"]):
        assert list(entry) == ["index", "label", "probs", "num_classes"]
        assert entry["index"] == index and isinstance(entry["label"], str) and entry["num_classes"] == 1
        assert all(isinstance(prob, float) for prob in entry["probs"])
    logits = [row[0] for row in expected.scores]
    assert_sigmoid_alike(decoder.worker, request, logits, [entry["probs"][0] for entry in got["data"]])


def test_vllm_documented_pooling(decoder: Served) -> None:
    got = decoder.http.post("/pooling", json=POOLING).json()
    assert list(got) == ["id", "object", "created", "model", "data", "usage"]
    (entry,) = got["data"]
    assert list(entry) == ["index", "object", "data"] and entry["object"] == "pooling"
    request, expected = one(decoder.worker, items=(POOLING["input"],), return_pooled_hidden_states=True)
    assert_alike(decoder.worker, request, expected, expected.scores, [entry["data"]])


@pytest.mark.parametrize("body", [SCORE_ONE, SCORE_BATCH, SCORE_PAIRS], ids=["one", "batch", "pairs"])
def test_vllm_documented_score(cross_encoder: Served, body: dict[str, Any]) -> None:
    got = cross_encoder.http.post("/score", json=body).json()
    assert list(got) == ["id", "object", "created", "model", "data", "usage"]
    firsts, seconds = _texts(body["text_1"]), _texts(body["text_2"])
    pairs = (
        [(firsts[0], second) for second in seconds]
        if len(firsts) == 1
        else list(zip(firsts, seconds, strict=True))
    )
    assert [entry["index"] for entry in got["data"]] == list(range(len(pairs)))
    for entry, (first, second) in zip(got["data"], pairs, strict=True):
        assert list(entry) == ["index", "object", "score"] and entry["object"] == "score"
        assert isinstance(entry["score"], float)
        request, expected = one(cross_encoder.worker, query=first, items=(second,))
        assert_sigmoid_alike(cross_encoder.worker, request, [expected.scores[0][0]], [entry["score"]])


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_vllm_documented_rerank(cross_encoder: Served, path: str) -> None:
    got = cross_encoder.http.post(path, json=RERANK).json()
    assert list(got) == ["id", "model", "usage", "results"]
    assert isinstance(got["usage"]["total_tokens"], int)
    for result in got["results"]:
        assert list(result) == ["index", "document", "relevance_score"]
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    ranked = [(result["index"], result["relevance_score"]) for result in got["results"]]
    assert_ranked_alike(cross_encoder, QUERY, DOCUMENTS, ranked)


def test_sglang_documented_score(judge: Served) -> None:
    got = judge.http.post("/v1/score", json=SGLANG_SCORE).json()
    assert list(got) == ["scores", "pooled_hidden_states", "model", "usage", "object"]
    assert got["object"] == "scoring" and len(got["scores"]) == 3 and got["pooled_hidden_states"] is None
    assert all(isinstance(score, float) for row in got["scores"] for score in row)
    request, expected = one(
        judge.worker, query=SGLANG_SCORE["query"], items=tuple(SGLANG_SCORE["items"]),
        label_token_ids=(9454, 2753), apply_softmax=True,
    )  # fmt: skip
    assert_alike(judge.worker, request, expected, got["scores"])
    for row in got["scores"]:  # softmax over the two labels: they sum to one within float32 rounding
        assert len(row) == 2 and abs(sum(row) - 1) < 1e-6

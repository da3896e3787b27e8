"""`score-worker gateway` against a real broker and a real worker with a tiny model: every route's answer
against the same request sent over Kafka through ScoreClient, in each reference's field names and order;
and what a caller sees when the body, the key, the deadline or the workers fail."""

from __future__ import annotations

import asyncio
import base64
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
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
    auth,
    direct,
    free_port,
    gateway_settings,
    one,
    serving_gateway,
    sigmoid_atol,
)
from worker_testkit import LiveWorker, Names, client_kwargs, own_cluster_security, settings_env

from schemas import ScoreRequest
from worker.client import new_request_id
from worker.topics import create_missing_topics

QUERY = "Is this answer helpful? "
ITEMS = ["Yes, it explains the steps.", "No.", "It depends on the question asked."]


@pytest.fixture(scope="module")
def worker(kafka_bootstrap: str, tiny_llama_dir: Path) -> Iterator[LiveWorker]:
    yield from serving(kafka_bootstrap, tiny_llama_dir, reply_topic_pattern=REPLY_PATTERN)


@pytest.fixture(scope="module")
def gateway(worker: LiveWorker) -> Iterator[RunningGateway]:
    settings = gateway_settings(
        worker.bootstrap, worker.names, gateway_max_items=16, gateway_max_body_bytes=65536
    )
    with serving_gateway(settings) as running:
        yield running


@pytest.fixture(scope="module")
def http(gateway: RunningGateway) -> Iterator[httpx.Client]:
    with answering_client(gateway) as client:
        yield client


def test_sglang_score_matches_the_client_scores_and_hidden_states(
    worker: LiveWorker, http: httpx.Client
) -> None:
    body = {"query": QUERY, "items": ITEMS, "return_pooled_hidden_states": True, "model": "any"}
    answer = http.post("/v1/score", json=body)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert list(got) == ["scores", "pooled_hidden_states", "model", "usage", "object"]
    request, expected = one(worker, query=QUERY, items=tuple(ITEMS), return_pooled_hidden_states=True)
    assert_alike(worker, request, expected, got["scores"], got["pooled_hidden_states"])
    assert got["object"] == "scoring" and got["model"] == expected.model
    assert got["usage"]["prompt_tokens"] == expected.prompt_tokens == got["usage"]["total_tokens"]
    encoded = http.post("/v1/score", json={**body, "encoding_format": "base64"}).json()
    states = [np.frombuffer(base64.b64decode(text), dtype="<f4") for text in encoded["pooled_hidden_states"]]
    assert_alike(worker, request, expected, encoded["scores"], states)
    plain = http.post("/v1/score", json={"items": [[5, 6, 7], [8, 9]], "query": [1, 2, 3]}).json()
    assert_alike(worker, *one(worker, query=(1, 2, 3), items=((5, 6, 7), (8, 9))), plain["scores"])
    assert plain["pooled_hidden_states"] is None


def test_concurrent_calls_each_get_their_own_results(worker: LiveWorker, gateway: RunningGateway) -> None:
    """Calls in flight together share one reply topic: each answer is its own request's, by id."""
    texts = [f"answer number {index} " * (1 + index % 3) for index in range(40)]

    async def calls() -> list[Any]:
        async with httpx.AsyncClient(base_url=gateway.url, headers=auth(), timeout=60) as client:
            answers = await asyncio.gather(*(client.post("/get_reward", json={"query": [t]}) for t in texts))
        return [answer.json()["rewards"][0] for answer in answers]

    requests = [ScoreRequest(request_id=new_request_id(), items=(text,)) for text in texts]
    for request, expected, reward in zip(
        requests, direct(worker, requests), asyncio.run(calls()), strict=True
    ):
        assert_alike(worker, request, expected, [[reward]])


def test_msgpack_bodies_both_ways(worker: LiveWorker, http: httpx.Client) -> None:
    body = {"query": QUERY, "items": ITEMS, "return_pooled_hidden_states": True}
    packed = http.post(
        "/v1/score", content=msgpack.packb(body),
        headers={"content-type": "application/msgpack", "accept": "application/x-msgpack"},
    )  # fmt: skip
    assert packed.headers["content-type"] == "application/msgpack"
    got = msgpack.unpackb(packed.content)
    assert list(got) == ["scores", "pooled_hidden_states", "model", "usage", "object"]
    request, expected = one(worker, query=QUERY, items=tuple(ITEMS), return_pooled_hidden_states=True)
    assert_alike(worker, request, expected, got["scores"], got["pooled_hidden_states"])


def test_vllm_classify_and_pooling(worker: LiveWorker, http: httpx.Client) -> None:
    request, expected = one(worker, items=tuple(ITEMS))
    got = http.post("/classify", json={"model": "m", "input": ITEMS}).json()
    assert list(got) == ["id", "object", "created", "model", "data", "usage"]
    assert got["id"].startswith("classify-") and got["usage"]["prompt_tokens"] == expected.prompt_tokens
    for index, entry in enumerate(got["data"]):
        assert list(entry) == ["index", "label", "probs", "num_classes"]
        assert entry["index"] == index and entry["label"] == "LABEL_0" and entry["num_classes"] == 1
    logits = [row[0] for row in expected.scores]
    assert_sigmoid_alike(worker, request, logits, [entry["probs"][0] for entry in got["data"]])
    raw = http.post("/classify", json={"input": ITEMS, "use_activation": False}).json()
    assert_alike(worker, request, expected, [entry["probs"] for entry in raw["data"]])
    pooled = http.post("/pooling", json={"input": ITEMS}).json()
    assert pooled["id"].startswith("pool-") and [d["object"] for d in pooled["data"]] == ["pooling"] * 3
    hidden, with_states = one(worker, items=tuple(ITEMS), return_pooled_hidden_states=True)
    assert_alike(worker, hidden, with_states, with_states.scores, [d["data"] for d in pooled["data"]])
    tokens = with_states.prompt_tokens
    usage = {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    assert pooled["usage"] == usage


def test_vllm_score_one_to_many_and_pairs(worker: LiveWorker, http: httpx.Client) -> None:
    fan = http.post("/score", json={"text_1": QUERY, "text_2": ITEMS}).json()
    request, expected = one(worker, query=QUERY, items=tuple(ITEMS))
    assert [d["index"] for d in fan["data"]] == [0, 1, 2] and fan["data"][0]["object"] == "score"
    logits = [row[0] for row in expected.scores]
    assert_sigmoid_alike(worker, request, logits, [entry["score"] for entry in fan["data"]])
    firsts = ["a question ", "another one "]
    pairs = http.post("/score", json={"queries": firsts, "documents": ITEMS[:2]}).json()
    for entry, first, second in zip(pairs["data"], firsts, ITEMS[:2], strict=True):
        pair, result = one(worker, query=first, items=(second,))
        assert_sigmoid_alike(worker, pair, [result.scores[0][0]], [entry["score"]])
    mismatched = http.post("/score", json={"text_1": firsts, "text_2": ITEMS})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["code"] == "INVALID_REQUEST"


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_ranks_documents_by_score(worker: LiveWorker, http: httpx.Client, path: str) -> None:
    documents: list[Any] = [ITEMS[0], {"text": ITEMS[1]}, ITEMS[2]]
    got = http.post(path, json={"query": QUERY, "documents": documents, "top_n": 2}).json()
    assert list(got) == ["id", "model", "usage", "results"]
    results = got["results"]
    assert len(results) == 2 and len({r["index"] for r in results}) == 2
    relevance = [r["relevance_score"] for r in results]
    assert relevance == sorted(relevance, reverse=True)
    request, expected = one(worker, query=QUERY, items=tuple(ITEMS))
    logits = [row[0] for row in expected.scores]
    left_out = ({0, 1, 2} - {r["index"] for r in results}).pop()
    assert_sigmoid_alike(worker, request, [logits[r["index"]] for r in results], relevance)
    # The document left out ranks below those kept, up to the bound of two forward passes.
    assert 1 / (1 + np.exp(-logits[left_out])) <= min(relevance) + sigmoid_atol(worker, request, logits)
    for result in results:
        assert list(result) == ["index", "document", "relevance_score"]
        assert result["document"] == {"text": ITEMS[result["index"]]}
    bare = http.post(path, json={"query": QUERY, "documents": ITEMS, "return_documents": False}).json()
    assert len(bare["results"]) == 3 and all("document" not in r for r in bare["results"])


def test_openrlhf_get_reward(worker: LiveWorker, http: httpx.Client) -> None:
    texts = [QUERY + item for item in ITEMS]
    got = http.post(
        "/get_reward", json={"query": texts, "prompts": [QUERY] * 3, "labels": ["", "", ""]}
    ).json()
    assert list(got) == ["rewards", "scores", "extra_logs"]
    assert got["scores"] == got["rewards"] and got["extra_logs"] == {}
    request, expected = one(worker, items=tuple(texts))
    assert_alike(worker, request, expected, [[reward] for reward in got["rewards"]])


def test_compare_pairwise_and_rank_match_the_client(worker: LiveWorker, http: httpx.Client) -> None:
    """/v1/compare against the same comparison sent over Kafka: the rewards within the forward bound, the
    preference within a quarter of it (the logistic function's slope is at most 1/4), the ranking and the
    best-item probabilities as the worker computed them from those rewards."""
    pair = http.post("/v1/compare", json={"query": QUERY, "items": ITEMS[:2]}).json()
    assert list(pair) == [
        "object", "model", "compare", "rewards", "preference", "ranking", "best_probability", "scores",
        "usage",
    ]  # fmt: skip
    assert pair["compare"] == "pairwise" and pair["ranking"] is None
    request, expected = one(worker, query=QUERY, items=tuple(ITEMS[:2]), compare="pairwise")
    assert_alike(worker, request, expected, [[reward] for reward in pair["rewards"]])
    assert expected.preference is not None and expected.rewards is not None
    atol = sigmoid_atol(worker, request, expected.rewards)
    assert abs(pair["preference"] - expected.preference) <= atol
    rewards = np.asarray(pair["rewards"], dtype=np.float64)  # the gateway's own answer holds together
    assert pair["preference"] == pytest.approx(1 / (1 + np.exp(rewards[1] - rewards[0])), abs=1e-12)

    ranked = http.post("/v1/compare", json={"query": QUERY, "items": ITEMS}).json()
    assert ranked["compare"] == "rank" and ranked["preference"] is None
    assert sorted(ranked["ranking"]) == [0, 1, 2]
    order = [ranked["rewards"][index] for index in ranked["ranking"]]
    assert order == sorted(order, reverse=True)
    assert sum(ranked["best_probability"]) == pytest.approx(1.0, abs=1e-12)
    _error(http.post("/v1/compare", json={"items": ITEMS, "compare": "pairwise"}), 400, "COMPARE_INVALID")
    _error(http.post("/v1/compare", json={"items": ITEMS, "compare": "best"}), 400, "INVALID_REQUEST")


def test_models_health_and_metrics(worker: LiveWorker, gateway: RunningGateway, http: httpx.Client) -> None:
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == one(worker, items=("x",))[1].model
    assert http.get("/health").status_code == 200
    text = httpx.get(f"{gateway.url}/metrics").text  # open to scrapers: no key
    assert 'score_gateway_requests_total{route="sglang_score",status="200"}' in text
    assert "score_gateway_request_seconds_bucket" in text and "score_gateway_kafka_waiting" in text


def _error(answer: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    error: dict[str, Any] = answer.json()["error"]
    assert error["code"] == code, error
    return error


def test_bodies_keys_and_limits_are_refused_with_stable_codes(
    gateway: RunningGateway, http: httpx.Client
) -> None:
    _error(http.post("/v1/score", content=b"{not json"), 400, "MALFORMED_MESSAGE")
    _error(http.post("/v1/score", json=[1, 2]), 400, "INVALID_REQUEST")
    not_msgpack = http.post("/v1/score", content=b"\xc1", headers={"content-type": "application/msgpack"})
    assert "FormatError" in _error(not_msgpack, 400, "MALFORMED_MESSAGE")["message"]
    _error(http.post("/v1/score", json={"query": QUERY}), 400, "INVALID_REQUEST")
    _error(http.post("/v1/score", json={"items": ["a", [1, 2]]}), 400, "INVALID_REQUEST")
    _error(http.post("/v1/score", content=b" " * 70_000), 413, "BODY_TOO_LARGE")
    _error(http.post("/v1/score", json={"items": ["a"] * 17}), 413, "TOO_MANY_ITEMS")
    # The worker's own refusal comes back with its code: a classifier scores with its head, not label ids.
    _error(
        http.post("/v1/score", json={"items": ["a"], "label_token_ids": [1]}), 400, "LABEL_IDS_NOT_SUPPORTED"
    )
    with httpx.Client(base_url=gateway.url) as anonymous:
        for headers in ({}, auth("wrong"), {"Authorization": KEYS[0]}):
            refused = anonymous.post("/v1/score", json={"items": ["a"]}, headers=headers)
            error = _error(refused, 401, "UNAUTHORIZED")
            assert refused.headers["www-authenticate"] == "Bearer" and "wrong" not in str(error)
        assert anonymous.post("/v1/score", json={"items": ["a"]}, headers=auth(KEYS[0])).status_code == 200
    _error(http.get("/v2/nothing"), 404, "NOT_FOUND")


def test_a_call_past_its_deadline_is_over_and_says_why(http: httpx.Client) -> None:
    answer = http.post("/v1/score", json={"items": ITEMS}, headers={"x-request-timeout": "0.001"})
    # A millisecond may lapse at any step: while the gateway reads the body (408 READ_TIMEOUT, the body
    # must arrive within the call's deadline), while the request waits for a worker (the worker answers
    # EXPIRED for a request fetched after its deadline: 504), or while the gateway waits for the result
    # (504 DEADLINE_EXCEEDED). Whichever it was, the call is over, with the status of that step.
    outcomes = {(408, "READ_TIMEOUT"), (504, "EXPIRED"), (504, "DEADLINE_EXCEEDED")}
    assert (answer.status_code, answer.json()["error"]["code"]) in outcomes, answer.text
    _error(
        http.post("/v1/score", json={"items": ITEMS}, headers={"x-request-timeout": "soon"}),
        400,
        "INVALID_REQUEST",
    )


def test_too_many_calls_in_flight_get_429(gateway: RunningGateway, http: httpx.Client) -> None:
    gateway.gateway.in_flight += gateway.settings.gateway_max_calls  # as if that many calls were in flight
    try:
        answer = http.post("/v1/score", json={"items": ["a"]})
    finally:
        gateway.gateway.in_flight -= gateway.settings.gateway_max_calls
    _error(answer, 429, "TOO_MANY_CALLS")
    assert answer.headers["retry-after"] == "1"


def test_without_a_worker_health_and_calls_are_503(kafka_bootstrap: str) -> None:
    names = Names.unique("gateway-idle")
    kwargs = client_kwargs(kafka_bootstrap)
    asyncio.run(create_missing_topics(kwargs, [names.requests, names.results], 1, 1))
    settings = gateway_settings(kafka_bootstrap, names, gateway_probe_interval_s=0.3)
    with serving_gateway(settings) as running, httpx.Client(base_url=running.url, headers=auth()) as http:
        assert http.get("/health").status_code == 503
        for _ in range(100):  # the first probe goes unanswered after one interval
            if running.gateway.bridge.answering is False:
                break
            asyncio.run(asyncio.sleep(0.05))
        answer = http.post("/v1/score", json={"items": ["a"]})
        _error(answer, 503, "NO_WORKER")
        assert answer.headers["retry-after"] == "1"
        _error(http.get("/health"), 503, "NO_WORKER")


def test_after_shutdown_begins_calls_in_flight_are_answered_and_new_ones_refused(
    kafka_bootstrap: str,
) -> None:
    """What SIGTERM does (uvicorn's handler sets should_exit): listening stops at once, a call already in
    flight still gets its answer (here its deadline, no worker being there), then the gateway stops."""
    names = Names.unique("gateway-drain")
    asyncio.run(create_missing_topics(client_kwargs(kafka_bootstrap), [names.requests, names.results], 1, 1))
    settings = gateway_settings(kafka_bootstrap, names, gateway_probe_interval_s=30.0)
    answers: list[httpx.Response] = []
    with serving_gateway(settings) as running:

        def call() -> None:
            timeout = {"x-request-timeout": "2"}
            answers.append(
                httpx.post(f"{running.url}/v1/score", json={"items": ["a"]}, headers={**auth(), **timeout})
            )

        caller = threading.Thread(target=call)
        caller.start()
        while running.gateway.bridge.waiting == 0:  # the call is on Kafka
            time.sleep(0.01)
        running.server.should_exit = True
        time.sleep(0.5)  # uvicorn looks at should_exit every 0.1 s, then closes its listening socket
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"{running.url}/v1/score", json={"items": ["a"]}, headers=auth())
        caller.join(timeout=30)
    (answer,) = answers
    _error(answer, 504, "DEADLINE_EXCEEDED")


def test_the_command_serves_until_sigterm(worker: LiveWorker, tmp_path: Path) -> None:
    """`score-worker gateway` as its own process, set from the environment: it answers, and SIGTERM ends it
    as uvicorn ends (the calls in flight answered, then the signal's own exit), without the key in its
    logs."""
    port = free_port()
    values = {
        "bootstrap_servers": worker.bootstrap, "requests_topic": worker.names.requests,
        "results_topic": worker.names.results, "gateway_api_keys": KEYS[0], "gateway_port": port,
        "gateway_host": "127.0.0.1", **own_cluster_security(worker.bootstrap),
    }  # fmt: skip
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "worker", "gateway"], env=settings_env(values), stderr=out
        )
    try:
        url = f"http://127.0.0.1:{port}"
        answer = None
        for _ in range(300):
            try:
                answer = httpx.post(f"{url}/v1/score", json={"items": ITEMS}, headers=auth(KEYS[0]))
                break
            except httpx.ConnectError:
                time.sleep(0.1)
        assert answer is not None and answer.status_code == 200, answer
        assert_alike(worker, *one(worker, items=tuple(ITEMS)), answer.json()["scores"])
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == -signal.SIGTERM
    finally:
        process.kill()
        process.wait()
    logged = log.read_text()
    assert "Finished server process" in logged and KEYS[0] not in logged, logged

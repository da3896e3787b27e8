"""Shared prefixes in the worker: its batches are cut by what they compute, a shared query counted once, so
a multi-item request that holds more than the token budget but computes less is scored whole, in one batch
with the requests that share its prompt, and its results are those of the engine alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tolerances import assert_scored_alike
from worker_testkit import Names, fast_settings, finish, produce, request_record

from models import Scorer, ScorerConfig
from models.packing import packed_length
from schemas import ScoreRequest, decode_result
from worker.app import ScoreWorker

QUERY = tuple(range(40, 90))  # 50 tokens
ITEMS = tuple((5 + i, 6 + i, 7 + i) for i in range(8))
MIN_TOKENS = 8


def _requests() -> list[ScoreRequest]:
    return [
        ScoreRequest("multi", query=QUERY, items=ITEMS, return_pooled_hidden_states=True),
        *(ScoreRequest(f"best-of-{i}", items=((*QUERY, 200 + i),)) for i in range(3)),
    ]


def _check_results(
    outcome: Any, requests: list[ScoreRequest], model_dir: Path, worker_id: str
) -> dict[str, str]:
    """Every request has its one result, equal to the engine's alone; returns the worker's metric labels."""
    results = {r.request_id: r for r in (decode_result(rec.value or b"") for rec in outcome.results)}
    assert sorted(results) == sorted(r.request_id for r in requests)
    alone = Scorer(model_dir, ScorerConfig(device="cpu"))
    for request, expected in zip(requests, alone.score(requests), strict=True):
        got = results[request.request_id]
        assert got.ok, got.error
        # The worker computes the shared query once; the engine alone here computes every prompt whole.
        assert_scored_alike(got, expected, alone, [request])
    return {"model": alone.model_name, "worker": worker_id}


def _serve(
    settings: Any, scorer: Scorer, requests: list[ScoreRequest], key: bytes | None = None
) -> tuple[Any, Any]:
    """One worker on `scorer` serving `requests` produced to its topic (with `key`, all in one partition, in
    order) until every result is in: what it published, and its metrics."""

    async def scenario() -> tuple[Any, Any]:
        worker = ScoreWorker(settings, scorer)
        task = asyncio.create_task(worker.run())
        records = [request_record(r, key=key) for r in requests]
        await produce(settings.bootstrap_servers, settings.requests_topic, records)
        outcome = await finish(settings, [(worker, task)], len(requests), len(requests))
        return outcome, worker.metrics

    return asyncio.run(scenario())


def test_a_batch_counts_a_shared_query_once(kafka_bootstrap: str, tiny_llama_dir: Path) -> None:
    prompts = [QUERY + item for item in ITEMS] + [(*QUERY, 200 + i) for i in range(3)]
    held, computed = sum(map(len, prompts)), packed_length(prompts, MIN_TOKENS)
    budget = computed + 8
    assert held > 4 * budget  # by what they hold, the multi-item request alone would be cut in parts
    names = Names.unique("shared-batches")
    # A long wait: every request joins the batch the first one opened.
    settings = fast_settings(
        kafka_bootstrap, tiny_llama_dir, names, max_batch_tokens=budget, max_wait_ms=1000
    )
    config = ScorerConfig(device="cpu", max_batch_tokens=budget, share_prefix_min_tokens=MIN_TOKENS)
    requests = _requests()

    outcome, metrics = _serve(settings, Scorer(tiny_llama_dir, config), requests)
    labels = _check_results(outcome, requests, tiny_llama_dir, settings.worker_id)
    assert metrics.registry.get_sample_value("score_worker_batches_total", labels) == 1
    assert metrics.registry.get_sample_value("score_worker_batch_tokens_sum", labels) == computed
    assert metrics.registry.get_sample_value("score_worker_tokens_total", labels) == held
    saved = metrics.registry.get_sample_value("score_worker_shared_prefix_tokens_saved_total", labels)
    assert saved == held - computed


def test_a_batch_closing_between_requests_sharing_a_prompt_leaves_them_together(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    """Best-of-N requests sent one after another (an RL trainer's order): the budget would close the first
    batch after the second prompt's second request; the worker moves those two to the next batch with the
    third instead, so each prompt is computed once, in two batches of 29 tokens rather than 55 and 23."""
    prompts = (tuple(range(40, 60)), tuple(range(60, 80)))
    requests = [
        ScoreRequest(f"p{p}-r{r}", items=(prompts[p] + (100 + r, 101 + r, 102 + r),))
        for p in range(2)
        for r in range(3)
    ]
    names = Names.unique("shared-cut")
    # One partition (one key) keeps the order they were sent in; the long wait lets the budget close batches.
    settings = fast_settings(
        kafka_bootstrap, tiny_llama_dir, names, max_batch_tokens=56, max_wait_ms=1000, topic_partitions=1
    )
    config = ScorerConfig(device="cpu", max_batch_tokens=56, share_prefix_min_tokens=MIN_TOKENS)

    outcome, metrics = _serve(settings, Scorer(tiny_llama_dir, config), requests, key=b"trainer")
    labels = _check_results(outcome, requests, tiny_llama_dir, settings.worker_id)
    assert metrics.registry.get_sample_value("score_worker_batches_total", labels) == 2
    assert metrics.registry.get_sample_value("score_worker_batch_tokens_sum", labels) == 2 * 29


def test_a_prompt_kept_in_the_prefix_cache_serves_the_later_batches(
    kafka_bootstrap: str, tiny_llama_dir: Path
) -> None:
    """One request a batch: the first keeps its prompt's blocks in the prefix cache (at the first sight),
    the next two take them; every result equals the engine's alone, and the worker's metrics count it."""
    prompt = tuple(range(40, 80))  # 40 tokens: five blocks of 8
    requests = [
        ScoreRequest(f"a{r}", items=((*prompt, 100 + r, 101 + r),), return_pooled_hidden_states=True)
        for r in range(3)
    ]
    names = Names.unique("prefix-cache")
    settings = fast_settings(kafka_bootstrap, tiny_llama_dir, names, max_batch_requests=1, topic_partitions=1)
    config = ScorerConfig(
        device="cpu", prefix_cache_mib=4, prefix_cache_block_tokens=8, prefix_cache_admit="first"
    )

    outcome, metrics = _serve(settings, Scorer(tiny_llama_dir, config), requests, key=b"one")
    labels = _check_results(outcome, requests, tiny_llama_dir, settings.worker_id)
    value = metrics.registry.get_sample_value
    assert value("score_worker_batches_total", labels) == 3
    assert value("score_worker_prefix_cache_lookups_total", labels) == 3
    assert value("score_worker_prefix_cache_hits_total", labels) == 2
    assert value("score_worker_prefix_cache_tokens_saved_total", labels) == 2 * 40
    assert (value("score_worker_prefix_cache_bytes", labels) or 0) > 0

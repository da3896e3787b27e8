"""The start-up warm-up (models/warmup.py): after it, no batch of any kind makes the compiled layers compile.

On the CPU the layers compile with inductor as on the GPU (`compile="on"`: `auto` compiles on CUDA only),
the Triton attention kernel runs in Triton's interpreter behind the same length switch (lowered here so that
short prompts cross it), flash is an exact stand-in, and CUDA graphs a stand-in recorder: the variants
torch.compile traces are the GPU's. The GPU's own run of the same check is in tests/gpu/test_fast_path.py.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch._dynamo.utils
from scoring_testkit import assert_scored_alike
from test_triton_attention import FlashStandIn

pytest.importorskip("triton")

from models import BatchStats, Scorer, ScorerConfig, triton_attention, write_tiny_model
from models.attention import triton_or_flash
from models.errors import ModelLoadError
from models.graphs import small_batch_keys
from models.prepare import PreparedRequest
from models.warmup import WarmUpReport, describe, warm_up
from schemas import ScoreRequest

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available() or not triton_attention.interpreting(),
        reason="drives the Triton kernel in its interpreter; tests/gpu runs the same check compiled",
    ),
    pytest.mark.slow,  # each warm-up compiles the layers' graphs: tens of seconds on two cores
]

SWITCH = 24  # the kernel's length switch in these tests (256 on the GPU)
# Graphs up to 128 tokens (the worker's default is its token budget): the small batches' graphs recorded
# ahead run through the interpreted Triton kernel, whose time grows with the square of their length. The
# traffic below has batches on both sides of it, so graphed and ungraphed batches are both checked.
GRAPH_MAX_TOKENS = 128

# Batches as traffic brings them: each a list of requests, each (query length, item lengths). Every kind of
# batch that compiles a graph of its own is here: both sides of the switch in each attention pass, one-token
# batches and items, shared prefixes short and long with suffixes of one token, short and long.
TRAFFIC: list[list[tuple[int, tuple[int, ...]]]] = [
    [(0, (1,))],
    [(0, (1, 1, 1))],
    [(0, (5,)), (0, (5, 2))],
    [(0, (1, 20, 70, 40)), (1, (23, 5, 70, 2))],
    [(60, (40,))],
    [(9, (1, 1))],
    [(9, (1, 4)), (0, (3,))],
    [(30, (2, 25)), (0, (40,))],
    [(9, (3, 30))],
    [(30, (1, 2))],
    [(0, (2, 3)), (12, (1, 1, 7)), (0, (26,))],
]


def _traffic_requests(batch: list[tuple[int, tuple[int, ...]]], salt: int) -> list[ScoreRequest]:
    def ids(count: int, offset: int) -> tuple[int, ...]:
        return tuple(4 + (offset + i) % 400 for i in range(count))

    return [
        ScoreRequest(
            request_id=f"t{salt}-{r}",
            query=ids(query, 1000 + r) if query else None,
            items=tuple(ids(length, 37 * j + 101 * r + salt) for j, length in enumerate(items)),
            return_pooled_hidden_states=True,
        )
        for r, (query, items) in enumerate(batch)
    ]


def _graphs_traced() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _scorer(model_dir: Path, **overrides: object) -> Scorer:
    settings: dict[str, object] = {
        "device": "cpu",
        "attention": "varlen",
        "varlen_kernel": triton_or_flash(FlashStandIn()),
        "share_prefix_min_tokens": 8,
        "graph_recorder": lambda run: run,
        "max_batch_tokens": 2048,
        "graph_max_tokens": GRAPH_MAX_TOKENS,
        **overrides,
    }
    return Scorer(model_dir, ScorerConfig(**settings))


@pytest.mark.parametrize("architecture", ["llama", "gemma3_text"])
def test_after_the_warm_up_no_batch_compiles(
    architecture: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Llama: the switch in both passes, one-token batches, shared prefixes. Gemma 3: sliding windows (flash,
    # and keys gathered where prompts outgrow the window) beside full-attention layers.
    monkeypatch.setattr(triton_attention, "MIN_LENGTH", SWITCH)
    torch._dynamo.reset()  # other tests' graphs would hide what this warm-up compiles
    scorer = _scorer(model_dirs[architecture], compile="on")
    assert scorer.executor.compiled and scorer.executor.graphs is not None and scorer.plan.shares_prefixes
    report = warm_up(scorer)
    assert report.compiled_graphs > 0 and report.cuda_graphs > 0, describe(report)
    # Every variant twice: seen, then recorded (two variants may fall in one graph's shape); then every
    # small batch's graph that no variant recorded.
    recorded_by_variants = report.cuda_graphs - report.ahead_graphs
    assert report.batches % 2 == 0 and 0 < recorded_by_variants <= report.batches // 2
    assert 0 < report.ahead_graphs <= len(small_batch_keys(GRAPH_MAX_TOKENS)) <= report.cuda_graphs
    traced = _graphs_traced()
    reference = Scorer(model_dirs[architecture], ScorerConfig(device="cpu", attention="reference"))
    for salt, batch in enumerate(TRAFFIC):
        requests = _traffic_requests(batch, salt)
        for _ in range(2):  # the second time through a CUDA graph of the shape
            got = scorer.score(requests)
        for result, expected in zip(got, reference.score(requests), strict=True):
            # Two float32 forwards (compiled layers, graphs, Triton or flash, shared prefixes vs the exact
            # path): the model's chain of sums for the batch's longest prompt (forward_atol).
            assert_scored_alike(result, expected, reference, requests)
        assert _graphs_traced() == traced, f"compiled for {batch} after the warm-up"


def test_after_the_warm_up_no_adapter_batch_compiles(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With LoRA adapters served, the warm-up also compiles the adapted variant of each batch kind: traffic
    mixing adapters and the base model compiles nothing after it."""
    from test_adapters import _adapters, _setting

    monkeypatch.setattr(triton_attention, "MIN_LENGTH", SWITCH)
    torch._dynamo.reset()
    adapters = _adapters(tiny_llama_dir, str(tmp_path))
    scorer = _scorer(tiny_llama_dir, compile="on", adapters=_setting(adapters))
    report = warm_up(scorer)
    assert report.compiled_graphs > 0, describe(report)
    traced = _graphs_traced()
    names = [None, *adapters]
    for salt, batch in enumerate(TRAFFIC):
        requests = [
            dataclasses.replace(request, adapter=names[(salt + r) % len(names)])
            for r, request in enumerate(_traffic_requests(batch, salt))
        ]
        assert all(result.ok for result in scorer.score(requests))
        assert _graphs_traced() == traced, f"compiled for {batch} with adapters after the warm-up"


PREFIX_CACHE = {"prefix_cache_mib": 8, "prefix_cache_block_tokens": 8, "prefix_cache_admit": "first"}


@dataclasses.dataclass(frozen=True)
class Warmed:
    """A compiled scorer right after its warm-up: the report, and the graphs traced when it ended."""

    scorer: Scorer
    report: WarmUpReport
    traced: int


def _warmed(model_dir: Path, **overrides: object) -> Warmed:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_attention, "MIN_LENGTH", SWITCH)
        torch._dynamo.reset()  # other tests' graphs would hide what this warm-up compiles
        scorer = _scorer(model_dir, compile="on", **overrides)
        report = warm_up(scorer)
        return Warmed(scorer, report, _graphs_traced())


@pytest.fixture(scope="module")
def prefix_cached_llama(tiny_llama_dir: Path) -> Iterator[Warmed]:
    """One warm-up of the compiled Llama with the prefix cache, for the tests that send it traffic: the
    warm-up (minutes on the CPU) is the same for each, and each checks that nothing compiles after it. A
    test between them that resets dynamo would make the next batch compile, failing the next of them."""
    yield _warmed(tiny_llama_dir, **PREFIX_CACHE)


def test_after_the_warm_up_no_prefix_cache_batch_compiles(
    prefix_cached_llama: Warmed, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches that fill or read the prefix cache run the compiled layers, broken around the cache's
    traffic: the warm-up compiles those pieces too (on a scratch cache, leaving the worker's empty), and
    traffic that fills the cache, then reads it beside prompts it has never seen, compiles nothing."""
    monkeypatch.setattr(triton_attention, "MIN_LENGTH", SWITCH)
    scorer, report, traced = (
        prefix_cached_llama.scorer,
        prefix_cached_llama.report,
        prefix_cached_llama.traced,
    )
    cache = scorer.executor.prefix_cache
    # Right after the warm-up: the fixture's scorer reaches this test before any traffic.
    assert cache is not None and cache.stats.lookups == 0 and len(cache) == 0, describe(report)
    assert _graphs_traced() == traced
    reference = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", attention="reference"))
    for salt, batch in enumerate(TRAFFIC):
        seen = _traffic_requests(batch, salt)
        assert all(result.ok for result in scorer.score(seen))  # fills the cache
        hits = cache.stats.hits
        requests = seen + _traffic_requests(batch, salt + 50)
        for result, expected in zip(scorer.score(requests), reference.score(requests), strict=True):
            assert_scored_alike(result, expected, reference, requests)  # as in the test above
        assert _graphs_traced() == traced, f"compiled for {batch} with the prefix cache after the warm-up"
        if max(q + max(items) for q, items in batch) > 8:  # a whole block before some pooled token
            assert cache.stats.hits > hits, batch


@pytest.mark.parametrize("architecture", ["llama", "gemma3_text"])
def test_prefix_cache_batches_of_any_sequence_count_compile_nothing_after_the_warm_up(
    architecture: str,
    model_dirs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """With a prefix cache (which breaks the layers' graphs around its traffic, so that attention's own
    inputs reach a graph of their own, sizes and all), batches of 1 to 9 sequences reading a cached query
    longer than the windows, as one request's items and as requests of their own, compile nothing after
    the warm-up. Llama's warmed scorer is the one the test above sent its traffic (right above, so that no
    dynamo reset falls between); its cache is emptied first."""
    monkeypatch.setattr(triton_attention, "MIN_LENGTH", SWITCH)
    if architecture == "llama":
        warmed: Warmed = request.getfixturevalue("prefix_cached_llama")
    else:
        warmed = _warmed(model_dirs[architecture], **PREFIX_CACHE)
    scorer, traced = warmed.scorer, warmed.traced
    cache = scorer.executor.prefix_cache
    assert cache is not None
    cache.clear()  # drops the blocks, keeps the counters: the hits below are counted from here
    hits = cache.stats.hits
    assert _graphs_traced() == traced
    query = tuple(range(40, 85))
    for count in range(1, 10):
        items = tuple(tuple(range(100 + 5 * i, 103 + 5 * i)) for i in range(count))
        shared = [ScoreRequest(f"shared-{count}", query=query, items=items)]
        alone = [ScoreRequest(f"alone-{count}-{i}", items=(query + item,)) for i, item in enumerate(items)]
        for requests in (shared, alone):
            assert all(result.ok for result in scorer.score(requests))
            assert _graphs_traced() == traced, f"compiled for {count} sequences ({requests[0].request_id})"
    # Every prompt but the very first finds the query's five blocks in the cache.
    assert cache.stats.hits - hits == 2 * sum(range(1, 10)) - 1


def test_the_traffic_compiles_without_it(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The check above means something only if the traffic meets graphs the first batch does not make.
    monkeypatch.setattr(triton_attention, "MIN_LENGTH", SWITCH)
    torch._dynamo.reset()
    # Each batch that compiles says so in its stats (the worker counts them, logs the batch).
    scorer = _scorer(tiny_llama_dir, compile="on")
    scorer.score(_traffic_requests(TRAFFIC[2], 0))
    first = _graphs_traced()
    stats: list[BatchStats] = []
    for salt, batch in enumerate(TRAFFIC):
        scorer.score_prepared([scorer.prepare(r) for r in _traffic_requests(batch, salt)], stats.append)
    assert _graphs_traced() - first >= 8  # 10 with torch 2.13
    assert sum(s.compiled_graphs for s in stats) == _graphs_traced() - first
    assert any(s.compiled_graphs == 0 for s in stats)


def test_nothing_to_warm_on_the_exact_path(tiny_llama_dir: Path) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    assert not scorer.executor.compiled and scorer.executor.graphs is None
    report = warm_up(scorer)
    assert (report.batches, report.tokens, report.cuda_graphs) == (0, 0, 0)
    assert describe(report).startswith("nothing to warm up")


@pytest.mark.parametrize("architecture", ["judge", "bert", "mistral"])
def test_every_kind_of_model_takes_its_warm_up(architecture: str, tmp_path: Path) -> None:
    # A judge scores label tokens (the warm-up sends them), an encoder shares no prefix, Mistral's windows
    # are shorter than its long prompts: each variant must be a request the model accepts. Graphs without
    # compiled layers, and flash alone (which kernel takes a batch is not what is checked here; the
    # interpreted Triton kernel would take a minute over the long items): every variant runs, cheaply.
    judge = architecture == "judge"
    model_dir = write_tiny_model(tmp_path / architecture, "llama" if judge else architecture, judge=judge)
    scorer = _scorer(model_dir, compile="off", varlen_kernel=FlashStandIn())
    report = warm_up(scorer)
    assert report.batches >= 8 and report.compiled_graphs == 0
    if architecture == "mistral":
        assert scorer.executor.sliding_window is not None and report.batches >= 2 * 9


@pytest.mark.parametrize("max_input_tokens", [1, 6, 40])
def test_a_short_prompt_limit_leaves_out_what_cannot_be_sent(
    max_input_tokens: int, tiny_llama_dir: Path
) -> None:
    # Every synthetic prompt within the limit (a prompt over it would be refused, and the start-up with it).
    # Flash alone, as above.
    scorer = _scorer(
        tiny_llama_dir, compile="off", max_item_tokens=max_input_tokens, varlen_kernel=FlashStandIn()
    )
    report = warm_up(scorer)
    assert report.batches >= 2 and report.tokens <= report.batches * 3 * max_input_tokens


def test_a_variant_that_fails_refuses_to_start(tiny_llama_dir: Path) -> None:
    flash = FlashStandIn()

    def kernel(q: torch.Tensor, *args: object, **kwargs: object) -> object:
        if int(args[4]) > 100:  # max_q: the long item's batch
            raise RuntimeError("no kernel for this length")
        return flash(q, *args, **kwargs)

    scorer = _scorer(tiny_llama_dir, compile="off", varlen_kernel=kernel)
    with pytest.raises(ModelLoadError, match="warm-up: the batch of a long item failed"):
        warm_up(scorer)


def test_the_full_budget_batch_fills_the_budget(tiny_llama_dir: Path) -> None:
    from models.warmup import _full_budget, _template_tokens

    scorer = _scorer(tiny_llama_dir, max_batch_tokens=3000)
    prepared = _full_budget(scorer, _template_tokens(scorer))
    ready = [p for p in prepared if isinstance(p, PreparedRequest)]
    sizes = [p.num_tokens for p in ready]
    assert len(sizes) == len(prepared) > 1
    assert 3000 - max(sizes) < sum(sizes) <= 3000
    assert [len(b) for b in scorer.plan.runs(ready, 3000)] == [len(prepared)]


def test_the_worker_warms_its_scorer_before_serving(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from models import warmup
    from worker.cli import _load_scorer
    from worker.config import WorkerSettings

    calls: list[Scorer] = []

    def recorded(scorer: Scorer) -> warmup.WarmUpReport:
        calls.append(scorer)
        return warmup.WarmUpReport(batches=3, tokens=40, compiled_graphs=2, cuda_graphs=1, seconds=0.5)

    monkeypatch.setattr(warmup, "warm_up", recorded)
    settings = {"bootstrap_servers": "localhost:9092", "model_dir": str(tiny_llama_dir), "self_check": False}
    with caplog.at_level(logging.INFO, logger="worker"):
        scorer = _load_scorer(WorkerSettings(**settings))
    assert calls == [scorer]
    assert "warmed up in 0.50 s: 3 batches of 40 tokens, 2 layer graphs compiled" in caplog.text
    _load_scorer(WorkerSettings(**settings, warm_up=False))
    assert len(calls) == 1


def test_the_warm_up_leaves_the_prefix_cache_alone_and_warms_as_without_it(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up scores each kind of batch twice: with the prefix cache on, the second time would fill
    it and run without a CUDA graph, and no graph would be recorded. It runs without the cache, recording
    what it records without one, and leaves the cache untouched."""
    monkeypatch.setattr(triton_attention, "MIN_LENGTH", SWITCH)
    plain = warm_up(_scorer(tiny_llama_dir, compile="off"))  # graphs alone: the same variants, quicker
    scorer = _scorer(tiny_llama_dir, compile="off", prefix_cache_mib=8)
    cached = warm_up(scorer)
    assert cached.cuda_graphs == plain.cuda_graphs > 0 and cached.batches == plain.batches
    cache = scorer.executor.prefix_cache
    assert cache is not None and cache.stats.lookups == 0 and len(cache) == 0

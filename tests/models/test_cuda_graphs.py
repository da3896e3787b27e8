"""The graphed packed forward (models/graphs.py), driven on the CPU.

A CPU cannot record CUDA graphs, so the tests pass a recorder whose "replay" runs the recorded function
again on the same buffers: everything but the recording itself runs as on the GPU (buckets, padding, empty
sequence slots, the shared output buffer, recording at a shape's second batch, eviction, the fall-back).
The CPU varlen kernel leaves the padding rows NaN, so any leak of them into an item shows. The real
recording runs on the H200 (tests/gpu/).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from scoring_testkit import CpuVarlenKernel, assert_scored_alike, scores_of, token_requests

from models import Scorer, ScorerConfig, triton_attention, write_tiny_model
from models.graphs import (
    MIN_SEQUENCES,
    MIN_TOKENS,
    SMALL_BATCH_TOKENS,
    GraphKey,
    graph_key,
    next_power_of_two,
    small_batch_keys,
    token_bucket,
)
from schemas import ScoreRequest


class CountingRecorder:
    """Stands in for CUDA graph recording: replay runs the recorded function again."""

    def __init__(self, fail: bool = False) -> None:
        self.recordings = 0
        self.fail = fail

    def __call__(self, run: Callable[[], None]) -> Callable[[], None]:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing (simulated)")
        self.recordings += 1
        return run


def _requests(lengths: list[tuple[int, ...]], seed: int = 7) -> list[ScoreRequest]:
    return token_requests(lengths, seed)


def _scorers(model_dir: Path, recorder: CountingRecorder, **config: object) -> tuple[Scorer, Scorer]:
    graphed = Scorer(
        model_dir,
        ScorerConfig(
            device="cpu",
            attention="varlen",
            varlen_kernel=CpuVarlenKernel(),
            graph_recorder=recorder,
            **config,  # type: ignore[arg-type]
        ),
    )
    plain = Scorer(model_dir, ScorerConfig(device="cpu", attention="reference", **config))  # type: ignore[arg-type]
    return graphed, plain


def _assert_same(graphed: Scorer, plain: Scorer, requests: list[ScoreRequest]) -> None:
    for got, expected in zip(graphed.score(requests), plain.score(requests), strict=True):
        assert got.error is None, got.error
        # Both paths run float32 attention per item; padding changes the matmuls' shapes and so their
        # order of summation: two float32 forwards, the model's chain of sums (forward_atol).
        assert_scored_alike(got, expected, plain, requests)


def test_buckets_cover_the_batch_with_bounded_padding() -> None:
    previous = 0
    for tokens in range(1, 20_000):
        bucket = token_bucket(tokens)
        assert bucket >= tokens and bucket >= previous and bucket % 16 == 0
        assert bucket >= MIN_TOKENS
        if tokens > 128:
            assert bucket - tokens < bucket / 8  # 8 steps per doubling
        previous = bucket
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 64, 65)] == [1, 1, 2, 4, 64, 128]
    assert graph_key(100, 1, 100) == GraphKey(112, 4, 112)  # the longest item never beyond the tokens
    assert graph_key(6400, 64, 100) == GraphKey(6656, 64, 128)
    assert graph_key(3, 3, 1) == GraphKey(16, 4, 16)
    assert graph_key(40, 5, 8) == GraphKey(48, 8, 48)


def test_small_batches_key_only_the_side_of_the_attention_switch() -> None:
    switch = triton_attention.MIN_LENGTH
    assert MIN_SEQUENCES * switch < SMALL_BATCH_TOKENS  # both sides occur within small batches
    # Up to SMALL_BATCH_TOKENS: the bucket past the switch, the switch (or the bucket) below it.
    assert graph_key(1000, 3, switch + 44) == GraphKey(1024, 4, 1024)
    assert graph_key(1000, 4, switch - 6) == GraphKey(1024, 4, switch)
    assert graph_key(100, 2, 60) == GraphKey(112, 4, 112)
    # Past it, the next power of two, so that a large batch's attention grid stays near its work.
    assert graph_key(3000, 4, switch + 44) == GraphKey(3072, 4, 2 * switch)


def test_the_small_batch_keys_are_every_key_of_a_request_of_a_few_items() -> None:
    keys = small_batch_keys(SMALL_BATCH_TOKENS)
    assert len(keys) == len(set(keys)) == 56  # 40 token buckets, 16 of them too large for a short side
    met = set()
    for items in range(1, MIN_SEQUENCES + 1):
        for longest in range(1, SMALL_BATCH_TOKENS + 1):
            # The fewest and the most tokens `items` sequences of this longest can hold, and one between.
            for total in {longest + items - 1, (longest * items + longest + items) // 2, longest * items}:
                if total <= SMALL_BATCH_TOKENS:
                    met.add(graph_key(total, items, longest))
    assert met == set(keys)
    assert small_batch_keys(100) == [key for key in keys if key.tokens <= 100]


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "gemma3_text", "phi3", "qwen3_moe"])
def test_graphed_batches_score_like_the_exact_path(architecture: str, model_dirs: dict[str, Path]) -> None:
    recorder = CountingRecorder()
    graphed, plain = _scorers(model_dirs[architecture], recorder)
    graphs = graphed.executor.graphs
    assert graphs is not None
    _assert_same(graphed, plain, _requests([(30,), (3, 41), (17,), (1,)]))
    assert graphs.recorded == 0  # a shape met once takes the ordinary forward
    # The same shape again, with other tokens: run on the buffers and recorded.
    _assert_same(graphed, plain, _requests([(29,), (4, 41), (16,), (2,)], seed=8))
    assert graphs.recorded == 1 and graphs.replays == 0
    # And again: a replay, reading this batch's tokens, with padding rows that held the last batch's.
    _assert_same(graphed, plain, _requests([(28,), (5, 40), (16,), (3,)], seed=9))
    assert graphs.recorded == 1 and graphs.replays == 1 and recorder.recordings == 1
    assert graphed.info.cuda_graphs


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3_text"])
def test_small_batches_recorded_ahead_replay_from_their_first_batch(
    architecture: str, model_dirs: dict[str, Path]
) -> None:
    recorder = CountingRecorder()
    graphed, plain = _scorers(model_dirs[architecture], recorder)
    graphs = graphed.executor.graphs
    assert graphs is not None
    keys = small_batch_keys(SMALL_BATCH_TOKENS)
    assert (
        graphed.executor.record_small_batch_graphs(graphed.config.max_batch_tokens)
        == len(keys)
        == recorder.recordings
        == graphs.graphs
    )
    assert (
        graphed.executor.record_small_batch_graphs(graphed.config.max_batch_tokens) == 0
    )  # all held already
    # One request of one to four items on each side of the switch, and a batch of a few requests: each
    # replays the graph recorded ahead the first time its shape comes, on this batch's tokens.
    batches = [[(30,)], [(3, 41, 200)], [(17, 1, 1, 1)], [(500, 480, 2)], [(9,), (12, 7)]]
    for seed, batch in enumerate(batches):
        _assert_same(graphed, plain, _requests(batch, seed=seed))
    assert graphs.replays == len(batches) and graphs.recorded == len(keys)
    # A spell of batches in other shapes (more sequences) fills and churns the capacity; the graphs recorded
    # ahead stay held for the next quiet spell.
    graphs.capacity = 1
    for count in (5, 9):
        for seed in (1, 2):
            _assert_same(graphed, plain, _requests([(4,)] * count, seed=seed))
    assert graphs.recorded == len(keys) + 2 and graphs.graphs == len(keys) + 1
    _assert_same(graphed, plain, _requests(batches[1], seed=11))
    assert graphs.recorded == len(keys) + 2 and graphs.replays == len(batches) + 1


def test_recording_ahead_stays_within_the_graphs_token_limit(tiny_llama_dir: Path) -> None:
    recorder = CountingRecorder()
    graphed, _ = _scorers(tiny_llama_dir, recorder, graph_max_tokens=100)
    assert (
        graphed.executor.record_small_batch_graphs(graphed.config.max_batch_tokens)
        == len(small_batch_keys(100))
        == recorder.recordings
    )


def test_mean_pooling_reads_only_the_items_rows(tiny_llama_dir: Path) -> None:
    graphed, plain = _scorers(tiny_llama_dir, CountingRecorder(), pooling="mean")
    for seed in (1, 2, 3):  # ordinary, recorded, replayed
        _assert_same(graphed, plain, _requests([(5,), (9, 2)], seed=seed))
    assert graphed.executor.graphs is not None and graphed.executor.graphs.replays == 1


@pytest.mark.parametrize("architecture", ["bert", "xlm-roberta"])
def test_encoders_take_their_token_types_and_positions_through_the_graph(
    architecture: str, tmp_path: Path
) -> None:
    model_dir = write_tiny_model(tmp_path / architecture, architecture, seed=8, num_labels=2)
    graphed, plain = _scorers(model_dir, CountingRecorder())
    requests = [ScoreRequest("pair", query="how are graphs replayed", items=("one answer", "another one"))]
    for _ in range(3):  # ordinary, recorded, replayed
        _assert_same(graphed, plain, requests)
    assert graphed.executor.graphs is not None and graphed.executor.graphs.replays == 1


def test_large_batches_take_the_ordinary_forward(tiny_llama_dir: Path) -> None:
    recorder = CountingRecorder()
    graphed, plain = _scorers(tiny_llama_dir, recorder, graph_max_tokens=40)
    for _ in range(2):
        _assert_same(graphed, plain, _requests([(30,), (20,)]))  # 50 tokens
    assert recorder.recordings == 0
    for _ in range(2):
        _assert_same(graphed, plain, _requests([(30,)]))
    assert recorder.recordings == 1


def test_least_recently_used_graphs_are_dropped(tiny_llama_dir: Path) -> None:
    graphed, plain = _scorers(tiny_llama_dir, CountingRecorder())
    graphs = graphed.executor.graphs
    assert graphs is not None
    graphs.capacity = 2
    # Buckets of 16, 48 and 80 tokens: each recorded at its second batch; 16 replayed before 80 comes.
    for length in (10, 10, 40, 40, 10, 70, 70):
        _assert_same(graphed, plain, _requests([(length,)]))
    assert graphs.graphs == 2 and graphs.recorded == 3 and graphs.replays == 1
    for _ in range(2):  # 48 was dropped when 80 came: met once more, then recorded again
        _assert_same(graphed, plain, _requests([(40,)]))
    assert graphs.recorded == 4


def test_a_failed_recording_turns_graphs_off_and_loses_nothing(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    graphed, plain = _scorers(tiny_llama_dir, CountingRecorder(fail=True))
    with caplog.at_level(logging.WARNING, logger="models.graphs"):
        for _ in range(2):  # the second batch of the shape is recorded
            _assert_same(graphed, plain, _requests([(12,), (5,)]))
    assert graphed.executor.graphs is not None and not graphed.executor.graphs.enabled
    assert "ordinary forward" in caplog.text and not graphed.info.cuda_graphs
    _assert_same(graphed, plain, _requests([(12,), (5,)]))


def test_deterministic_runs_every_item_through_its_own_graph(tiny_llama_dir: Path) -> None:
    graphed, plain = _scorers(tiny_llama_dir, CountingRecorder(), deterministic=True)
    requests = _requests([(12,), (3, 12)])
    _assert_same(graphed, plain, requests)
    alone = graphed.score(requests[1:])
    together = graphed.score(requests)
    # The deterministic setting's promise, whatever shares the batch: the same arithmetic, bit for bit.
    assert np.array_equal(scores_of(alone[0]), scores_of(together[1]))


def test_graphs_follow_the_setting_and_the_device(tiny_llama_dir: Path) -> None:
    assert Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).executor.graphs is None  # auto: CUDA only
    kernel = CpuVarlenKernel()
    recorder = CountingRecorder()
    off = ScorerConfig(
        device="cpu", attention="varlen", varlen_kernel=kernel, graph_recorder=recorder, cuda_graphs="off"
    )
    assert Scorer(tiny_llama_dir, off).executor.graphs is None
    with pytest.raises(ValueError, match="CUDA device"):
        ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel, cuda_graphs="on").resolve_graphs(
            torch.device("cpu"), "varlen"
        )
    exact = ScorerConfig(device="cpu", graph_recorder=CountingRecorder(), cuda_graphs="on")
    assert (
        Scorer(tiny_llama_dir, exact).executor.graphs is None
    )  # the exact path loops on the host: never recorded
    with pytest.raises(ValueError, match="graph_max_tokens"):
        ScorerConfig(graph_max_tokens=0)

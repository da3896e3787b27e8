"""Batching behaviour of the engine: composition invariance, token-budget splits, per-request errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from scoring_testkit import CpuVarlenKernel, assert_forward_close, hidden_of, scores_of

from models import PreparedRequest, Scorer, ScorerConfig
from models.errors import DeviceLostError
from schemas import ErrorCode, HiddenDType, ResultStatus, ScoreRequest, ScoreResult

# The same request computed inside different packs: its attention runs over its own keys either way, but the
# projections' GEMMs see other row counts, and a BLAS may block and order their sums differently for them:
# two float32 forwards, each within the model's chain of sums (scoring_testkit.forward_atol).


def _ids(length: int, seed: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(4, 500, (length,), generator=generator).tolist())


def _request(request_id: str, *lengths: int, seed: int = 0, hidden: bool = True) -> ScoreRequest:
    items = tuple(_ids(length, seed + i) for i, length in enumerate(lengths))
    return ScoreRequest(request_id=request_id, items=items, return_pooled_hidden_states=hidden)


def test_same_request_alone_or_in_any_batch(llama_scorer: Scorer, tiny_llama_dir: Path) -> None:
    target = _request("target", 33, 5, seed=10)
    (alone,) = llama_scorer.score([target])
    neighbours = [_request(f"n{i}", 40 - 9 * i, 3 + i, seed=20 + i) for i in range(4)]
    packs = [[*neighbours[:2], target], [target, *neighbours], [neighbours[3], target, neighbours[0]]]
    for pack in packs:
        results = llama_scorer.score(pack)
        (inside,) = [r for r in results if r.request_id == "target"]
        # Two float32 forwards of the target's 33- and 5-token items.
        assert_forward_close(scores_of(inside), scores_of(alone), tiny_llama_dir, longest=33)
        assert_forward_close(hidden_of(inside), hidden_of(alone), tiny_llama_dir, longest=33)


def test_max_batch_tokens_splits_in_order(tiny_llama_dir: Path, llama_scorer: Scorer) -> None:
    kernel = CpuVarlenKernel()
    scorer = Scorer(
        tiny_llama_dir,
        ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel, max_batch_tokens=30),
    )
    requests = [
        _request("a", 10, seed=1),
        _request("b", 15, seed=2),
        _request("c", 50, seed=3),
        _request("d", 8, 8, seed=4),
        _request("e", 12, seed=5),
    ]
    results = scorer.score(requests)
    layers = 2  # the kernel runs once per layer and forward
    batches = kernel.calls[::layers]
    assert kernel.calls == [cu for cu in batches for _ in range(layers)]
    # a+b fit 30; c (50 tokens) is over the budget and runs alone; d (16) + e (12) fit together.
    assert batches == [[0, 10, 25], [0, 50], [0, 8, 16, 28]]
    assert [r.request_id for r in results] == ["a", "b", "c", "d", "e"]
    assert results[0].timings["forward_s"] == results[1].timings["forward_s"]  # batch-level timings
    for result, expected in zip(results, llama_scorer.score(requests), strict=True):
        # Two float32 forwards (varlen kernel in budgeted batches vs the exact path in one), up to 50 tokens.
        assert_forward_close(scores_of(result), scores_of(expected), tiny_llama_dir, longest=50)


def test_prepare_then_score_prepared(llama_scorer: Scorer) -> None:
    requests = [_request("a", 6), ScoreRequest(request_id="bad", items=((),)), _request("b", 4, 9)]
    prepared = [llama_scorer.prepare(r) for r in requests]
    assert isinstance(prepared[0], PreparedRequest) and prepared[0].num_tokens == 6
    assert isinstance(prepared[1], ScoreResult) and prepared[1].error is not None
    assert isinstance(prepared[2], PreparedRequest) and prepared[2].num_tokens == 13
    results = llama_scorer.score_prepared(prepared)
    assert [r.request_id for r in results] == ["a", "bad", "b"]
    assert [r.status for r in results] == [ResultStatus.OK, ResultStatus.ERROR, ResultStatus.OK]


def _error_requests(vocab: int, limit: int) -> dict[str, tuple[ScoreRequest, ErrorCode]]:
    return {
        "empty": (ScoreRequest(request_id="empty", items=((),)), ErrorCode.EMPTY_INPUT),
        "empty-second": (ScoreRequest(request_id="empty-second", items=((5, 6), ())), ErrorCode.EMPTY_INPUT),
        "vocab": (ScoreRequest(request_id="vocab", items=((5, vocab),)), ErrorCode.TOKEN_ID_OUT_OF_RANGE),
        "query-vocab": (
            ScoreRequest(request_id="query-vocab", query=(vocab + 7,), items=((5,),)),
            ErrorCode.TOKEN_ID_OUT_OF_RANGE,
        ),
        "long": (ScoreRequest(request_id="long", items=(_ids(limit + 1, 0),)), ErrorCode.INPUT_TOO_LONG),
        "long-joined": (
            ScoreRequest(request_id="long-joined", query=_ids(limit, 1), items=((5,),)),
            ErrorCode.INPUT_TOO_LONG,
        ),
    }


def test_bad_requests_get_error_codes_and_spare_the_batch(llama_scorer: Scorer, tiny_llama_dir: Path) -> None:
    vocab, limit = 512, llama_scorer.max_input_tokens
    assert limit == 512  # the tiny model's max_position_embeddings
    errors = _error_requests(vocab, limit)
    good = [_request(f"good{i}", 12 + i, seed=i) for i in range(3)]
    mixed = [good[0], *(request for request, _ in errors.values()), good[1], good[2]]
    results = llama_scorer.score(mixed)
    by_id = {r.request_id: r for r in results}
    for name, (_, code) in errors.items():
        result = by_id[name]
        assert result.status is ResultStatus.ERROR and result.error is not None, name
        assert result.error.code is code, (name, result.error)
        assert result.scores == () and result.pooled_hidden_states is None
        assert result.model == llama_scorer.model_name
    assert "Item 1 " in by_id["empty-second"].error.message  # type: ignore[union-attr]
    for request, alone in zip(good, llama_scorer.score(good), strict=True):
        # Two float32 forwards of prompts of up to 14 tokens, in two batch compositions.
        got = scores_of(by_id[request.request_id])
        assert_forward_close(got, scores_of(alone), tiny_llama_dir, longest=14)


def test_configured_input_limit(tiny_llama_dir: Path) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", max_item_tokens=20))
    assert scorer.max_input_tokens == 20
    ok, too_long = scorer.score(
        [
            ScoreRequest(request_id="ok", items=(_ids(20, 0),)),
            ScoreRequest(request_id="long", items=("word " * 30,)),
        ]
    )
    assert ok.ok
    assert too_long.error is not None and too_long.error.code is ErrorCode.INPUT_TOO_LONG
    assert "limit of 20" in too_long.error.message


def test_empty_items_is_ok_without_scores(llama_scorer: Scorer) -> None:
    asked, plain, other = llama_scorer.score(
        [
            ScoreRequest(request_id="asked", items=(), return_pooled_hidden_states=True),
            ScoreRequest(request_id="plain", items=()),
            _request("other", 7),
        ]
    )
    assert asked.ok and asked.scores == () and asked.pooled_hidden_states == () and asked.prompt_tokens == 0
    assert plain.ok and plain.scores == () and plain.pooled_hidden_states is None
    assert other.ok and len(other.scores) == 1
    (only_empty,) = llama_scorer.score([ScoreRequest(request_id="e", items=())])
    assert only_empty.ok and only_empty.scores == ()


def test_a_failing_batch_is_scored_again_in_halves(tiny_llama_dir: Path) -> None:
    kernel = CpuVarlenKernel()
    scorer = Scorer(
        tiny_llama_dir,
        ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel, max_batch_tokens=20),
    )
    requests = [_request("a", 10, seed=1), _request("b", 10, seed=2), _request("c", 10, seed=3)]
    expected = scorer.score(requests)
    kernel.fail_next = "CUDA out of memory (simulated)"  # once: the halves then fit
    results = scorer.score(requests)
    assert all(r.ok for r in results)
    # Another batch layout: the same scores up to two float32 forwards' rounding (10-token prompts).
    for got, want in zip(results, expected, strict=True):
        assert_forward_close(scores_of(got), scores_of(want), tiny_llama_dir, longest=10)


def test_only_the_request_that_fails_alone_gets_model_error(tiny_llama_dir: Path) -> None:
    kernel = CpuVarlenKernel(fail_on_length=13)
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel))
    requests = [_request(f"r{i}", 13 if i == 5 else 10, seed=i) for i in range(8)]
    results = scorer.score(requests)
    failed = [r.request_id for r in results if not r.ok]
    assert failed == ["r5"]
    error = results[5].error
    assert error is not None and error.code is ErrorCode.MODEL_ERROR and "illegal memory" in error.message
    alone = Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).score(requests[:5] + requests[6:])
    for got, want in zip(results[:5] + results[6:], alone, strict=True):
        # Two float32 forwards (varlen kernel in halves vs the exact path) of 10-token prompts.
        assert_forward_close(scores_of(got), scores_of(want), tiny_llama_dir, longest=10)


def test_a_device_that_no_longer_computes_raises_instead_of_answering(tiny_llama_dir: Path) -> None:
    kernel = CpuVarlenKernel(fail_on_length=13)
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel))
    # The recovery probe runs on CUDA devices only; a CPU build of torch fails it like a lost context does.
    scorer.device = torch.device("cuda")
    with pytest.raises(DeviceLostError, match="must restart"):
        scorer.score([_request("r", 13)])


@pytest.mark.parametrize("text", ["", "hello"])
def test_text_without_tokenizer_is_invalid(text: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((tiny_llama_dir / name).read_bytes())
    scorer = Scorer(bare, ScorerConfig(device="cpu"))
    text_result, ids_result = scorer.score(
        [ScoreRequest(request_id="t", items=(text,)), ScoreRequest(request_id="i", items=((5, 6, 7),))]
    )
    assert text_result.error is not None and text_result.error.code is ErrorCode.INVALID_REQUEST
    assert "token ids" in text_result.error.message
    assert ids_result.ok


def _assert_sentence(message: str) -> None:
    """Error messages are sentences that say what to change: capitalised, with a remedy after ';', ended."""
    assert message[:1].isupper() and message.endswith(".") and "; " in message, message


def test_forward_failure_message_says_what_to_do(tiny_llama_dir: Path) -> None:
    kernel = CpuVarlenKernel(fail_next="CUDA out of memory (simulated)")
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel))
    (result,) = scorer.score([_request("a", 10)])
    assert result.error is not None and result.error.code is ErrorCode.MODEL_ERROR
    _assert_sentence(result.error.message)


class _BrokenTokenizer:
    def __call__(self, *args: object, **kwargs: object) -> object:
        raise ValueError("tokenizer exploded")


class _NoTokenizer:
    """Stands in for the tokenizer where the engine must not touch it (any use fails the test)."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the tokenizer was used ({name}) outside Scorer.prepare")

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise AssertionError("the tokenizer was called outside Scorer.prepare")


def test_tokenizer_failure_is_an_error_result(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    monkeypatch.setattr(
        scorer, "_prompts", dataclasses.replace(scorer._prompts, tokenizer=_BrokenTokenizer())
    )
    result = scorer.prepare(ScoreRequest(request_id="t", items=("hello",)))
    assert isinstance(result, ScoreResult) and result.error is not None
    assert result.error.code is ErrorCode.INTERNAL_ERROR and "tokenizer exploded" in result.error.message
    _assert_sentence(result.error.message)


def test_score_prepared_never_uses_the_tokenizer(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker tokenizes on one thread and runs the model on another; HF fast tokenizers are not safe to
    # use from two threads at once, so score_prepared must not touch the tokenizer at all.
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    requests = [
        ScoreRequest(
            request_id="text", query="Is it good? ", items=("yes", "no"), return_pooled_hidden_states=True
        ),
        _request("ids", 9, 4),
        ScoreRequest(request_id="bad", items=((),)),
    ]
    prepared = [scorer.prepare(request) for request in requests]
    expected = scorer.score_prepared(prepared)
    monkeypatch.setattr(scorer, "_prompts", dataclasses.replace(scorer._prompts, tokenizer=_NoTokenizer()))
    results = scorer.score_prepared(prepared)
    assert [r.status for r in results] == [ResultStatus.OK, ResultStatus.OK, ResultStatus.ERROR]
    # The same prepared batch again through the same code: the same arithmetic, bit for bit.
    assert [r.scores for r in results] == [r.scores for r in expected]


def test_calls_launched_ahead_of_their_finish_score_as_alone(llama_scorer: Scorer) -> None:
    """The worker launches a batch before finishing the one ahead: every call's results, error results
    passed through, hidden states in each asked dtype and softmax included, are those of the call alone."""
    calls = [
        [
            ScoreRequest("hidden16", items=("one", "two"), return_pooled_hidden_states=True,
                         hidden_states_dtype=HiddenDType.FLOAT16),
            ScoreRequest("softmax", items=("three",), apply_softmax=True),
        ],
        [ScoreRequest("empty", items=(), return_pooled_hidden_states=True), _request("tokens", 12, seed=5)],
        [ScoreRequest("bad", items=((10**9,),)), ScoreRequest("hidden32", items=("four",),
                                                             return_pooled_hidden_states=True)],
    ]  # fmt: skip
    prepared = [[llama_scorer.prepare(r) for r in call] for call in calls]
    alone = [llama_scorer.score_prepared(call) for call in prepared]
    launched = [llama_scorer.launch(call) for call in prepared]
    together = [llama_scorer.finish(pending) for pending in launched]
    # Each call is the same batch either way, through the same code: the same arithmetic, bit for bit.
    for want_call, got_call in zip(alone, together, strict=True):
        assert [r.request_id for r in got_call] == [r.request_id for r in want_call]
        for got, want in zip(got_call, want_call, strict=True):
            assert (got.status, got.error, got.scores) == (want.status, want.error, want.scores)
            assert got.pooled_hidden_states == want.pooled_hidden_states


def test_a_failure_that_surfaces_when_a_batch_is_finished_is_scored_again_in_halves(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU a kernel's error surfaces where the host waits for it, in `finish`: the batch is scored
    again in halves there, as a failure at launch is."""
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    requests = [_request("a", 10, seed=1), _request("b", 10, seed=2), _request("c", 10, seed=3)]
    expected = scorer.score(requests)
    collect = scorer._collect
    failures: list[int] = []

    def fails_once(launched: Any) -> Any:
        if not failures:
            failures.append(len(launched.batch))
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return collect(launched)

    monkeypatch.setattr(scorer, "_collect", fails_once)
    results = scorer.finish(scorer.launch([scorer.prepare(r) for r in requests]))
    assert failures == [3] and all(r.ok for r in results)
    for got, want in zip(results, expected, strict=True):
        # Another batch layout (halves): two float32 forwards of 10-token prompts.
        assert_forward_close(scores_of(got), scores_of(want), tiny_llama_dir, longest=10)

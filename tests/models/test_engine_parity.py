"""The packed engine against HuggingFace's own padded float32 forward: scores and pooled hidden states."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from scoring_testkit import assert_forward_close, forward_atol, hf_reference, hidden_of, scores_of, tokenize
from tolerances import (
    assert_within,
    gamma,
    rounded_pair_tolerances,
    softmax_bound,
    sum_bound,
    unit_roundoff,
)
from transformers import AutoModelForSequenceClassification

from models import Scorer, ScorerConfig, transfer
from models.tiny import CAUSAL
from models.transfer import HostRows, RowRequest, start_rows_copy
from schemas import HiddenDType, ScoreRequest

TEXTS = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden fence.",
    "Yes",
    "A reward model reads a prompt and a response, then returns a single number that says how good the "
    "answer is; scores are computed for every item of a request.",
    "Is this response correct? Maybe it needs more detail.",
)
QUERY = "Question: is the following answer helpful and honest? Answer:"


def _ids(count: int, length: int, seed: int) -> list[tuple[int, ...]]:
    # Ids from 4 up: 0..3 are <pad>, <unk>, <s>, </s>; the HF reference finds the last token by the pad id.
    generator = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randint(4, 500, (length + 7 * i,), generator=generator).tolist()) for i in range(count)
    ]


def _assert_close(actual: np.ndarray, expected: np.ndarray, model_dir: Path, longest: int) -> None:
    # The packed engine and HF's padded eager forward, both float32, sum in different orders (SDPA vs
    # explicit matmuls, other GEMM shapes): the model's chain of sums for prompts of up to `longest`
    # tokens, at the values' scale (at least 1): scoring_testkit.forward_atol.
    assert_forward_close(actual, expected, model_dir, longest=longest)


def _longest(prompts: Sequence[Sequence[int]]) -> int:
    return max(len(p) for p in prompts)


@pytest.mark.parametrize("architecture", CAUSAL)
def test_text_requests_match_hf(architecture: str, model_dirs: dict[str, Path]) -> None:
    model_dir = model_dirs[architecture]
    scorer = Scorer(model_dir, ScorerConfig(device="cpu"))
    requests = [
        ScoreRequest(request_id=f"single-{i}", items=(text,), return_pooled_hidden_states=True)
        for i, text in enumerate(TEXTS)
    ]
    requests.append(
        ScoreRequest(request_id="multi", query=QUERY, items=TEXTS, return_pooled_hidden_states=True)
    )
    results = scorer.score(requests)

    prompts = [tokenize(model_dir, text) for text in TEXTS] + [tokenize(model_dir, QUERY + t) for t in TEXTS]
    reference = hf_reference(model_dir, prompts)
    assert max(len(p) for p in prompts) > 16, "prompts must be longer than mistral's sliding window"
    actual_scores = np.concatenate([scores_of(r) for r in results])
    actual_hidden = np.concatenate([hidden_of(r) for r in results])
    _assert_close(actual_scores, reference.logits, model_dir, _longest(prompts))
    _assert_close(actual_hidden, reference.hidden, model_dir, _longest(prompts))
    assert [r.prompt_tokens for r in results[:4]] == [len(p) for p in prompts[:4]]
    assert results[4].prompt_tokens == sum(len(p) for p in prompts[4:])


def test_reference_is_self_consistent(tiny_llama_dir: Path) -> None:
    """Guards the reference itself: HF's hidden_states[-1] is the post-norm state the head reads."""
    reference = hf_reference(tiny_llama_dir, _ids(3, 20, seed=0))
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with torch.inference_mode():
        logits = model.score(torch.from_numpy(reference.hidden)).numpy()
    # One 64-term dot product twice (HF's head over every padded position vs over the pooled rows: other
    # GEMM shapes), each within gamma(64) of its terms' magnitude sum |w_i h_i|.
    magnitude = np.abs(reference.hidden) @ np.abs(model.score.weight.detach().numpy()).T
    assert_within(logits, reference.logits, sum_bound(torch.float32, 64, magnitude, implementations=2))


def test_left_and_right_padding_agree_with_engine(llama_scorer: Scorer, tiny_llama_dir: Path) -> None:
    prompts = _ids(3, 15, seed=1)
    results = llama_scorer.score(
        [
            ScoreRequest(request_id=f"r{i}", items=(p,), return_pooled_hidden_states=True)
            for i, p in enumerate(prompts)
        ]
    )
    for left_pad in (False, True):
        reference = hf_reference(tiny_llama_dir, prompts, left_pad=left_pad)
        longest = _longest(prompts)
        _assert_close(
            np.concatenate([scores_of(r) for r in results]), reference.logits, tiny_llama_dir, longest
        )
        _assert_close(
            np.concatenate([hidden_of(r) for r in results]), reference.hidden, tiny_llama_dir, longest
        )


@pytest.mark.parametrize("item_first", [False, True])
def test_token_ids_are_joined_verbatim(item_first: bool, qwen3_scorer: Scorer, tiny_qwen3_dir: Path) -> None:
    query, *items = _ids(4, 9, seed=2)
    request = ScoreRequest(
        request_id="ids",
        query=query,
        items=tuple(items),
        item_first=item_first,
        return_pooled_hidden_states=True,
    )
    (result,) = qwen3_scorer.score([request])
    prompts = [item + query if item_first else query + item for item in items]
    reference = hf_reference(tiny_qwen3_dir, prompts)
    _assert_close(scores_of(result), reference.logits, tiny_qwen3_dir, _longest(prompts))
    _assert_close(hidden_of(result), reference.hidden, tiny_qwen3_dir, _longest(prompts))
    assert result.prompt_tokens == sum(len(p) for p in prompts)  # no special tokens added to token ids


def test_text_item_first_tokenizes_item_then_query(llama_scorer: Scorer, tiny_llama_dir: Path) -> None:
    request = ScoreRequest(request_id="text", query=" is it good?", items=TEXTS[:2], item_first=True)
    (result,) = llama_scorer.score([request])
    prompts = [tokenize(tiny_llama_dir, t + " is it good?") for t in TEXTS[:2]]
    reference = hf_reference(tiny_llama_dir, prompts)
    _assert_close(scores_of(result), reference.logits, tiny_llama_dir, _longest(prompts))
    assert result.pooled_hidden_states is None


def test_three_labels_and_softmax(three_label_dir: Path) -> None:
    scorer = Scorer(three_label_dir, ScorerConfig(device="cpu"))
    plain, soft = scorer.score(
        [
            ScoreRequest(request_id="plain", items=TEXTS),
            ScoreRequest(request_id="soft", items=TEXTS, apply_softmax=True),
        ]
    )
    prompts = [tokenize(three_label_dir, t) for t in TEXTS]
    reference = hf_reference(three_label_dir, prompts)
    assert scores_of(plain).shape == (len(TEXTS), 3)
    _assert_close(scores_of(plain), reference.logits, three_label_dir, _longest(prompts))
    expected = torch.softmax(torch.from_numpy(reference.logits), dim=-1).numpy()
    # The softmax of 3 logits that two float32 forwards leave forward_atol apart (tolerances.softmax_bound).
    logits_bound = forward_atol(three_label_dir, reference.logits, longest=_longest(prompts))
    atol = softmax_bound(torch.float32, labels=3, logit_error=logits_bound)
    np.testing.assert_allclose(scores_of(soft), expected, atol=atol, rtol=0)
    u = unit_roundoff(torch.float32)
    # Each row sums to 1 up to the normaliser's 3-term sum (gamma(2)), its reciprocal and the products
    # (2u) and numpy's float32 sum of the three (gamma(2)): exp's own errors cancel in the ratio.
    np.testing.assert_allclose(scores_of(soft).sum(axis=1), 1.0, atol=2 * gamma(2) + 2 * u, rtol=0)


def test_softmax_over_one_label_is_one(llama_scorer: Scorer) -> None:
    (result,) = llama_scorer.score([ScoreRequest(request_id="one", items=TEXTS, apply_softmax=True)])
    assert result.scores == ((1.0,),) * len(TEXTS)  # exp(z - z) / exp(z - z) = 1, exactly in float32


def _assert_rounded(
    actual: np.ndarray, reference: np.ndarray, dtype: torch.dtype, model_dir: Path, longest: int
) -> None:
    """actual is the engine's float32 state rounded to `dtype`, expected HF's float32 one rounded alike: the
    float32 states at most forward_atol apart, each then rounded (u = 2^-11 for float16, 2^-8 for
    bfloat16): tolerances.rounded_pair_tolerances."""
    expected = torch.from_numpy(reference).to(dtype).float().numpy()
    atol, rtol = rounded_pair_tolerances(dtype, forward_atol(model_dir, reference, longest=longest))
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_mixed_batch_hidden_state_flags_and_dtypes(
    architecture: str,
    model_dirs: dict[str, Path],
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scorer: Scorer = request.getfixturevalue(f"{architecture}_scorer")
    model_dir = model_dirs[architecture]
    copied: list[RowRequest] = []

    def spy(pooled: torch.Tensor, wanted: Sequence[RowRequest]) -> HostRows:
        copied.extend(wanted)
        return start_rows_copy(pooled, wanted)

    monkeypatch.setattr(transfer, "start_rows_copy", spy)
    asks = [None, HiddenDType.FLOAT32, None, HiddenDType.FLOAT16, HiddenDType.BFLOAT16, None]
    requests = [
        ScoreRequest(
            request_id=f"r{i}",
            items=(TEXTS[i % 4], TEXTS[(i + 1) % 4]),
            metadata={"i": i},
            return_pooled_hidden_states=dtype is not None,
            hidden_states_dtype=dtype or HiddenDType.FLOAT32,
        )
        for i, dtype in enumerate(asks)
    ]
    results = scorer.score(requests)
    # Only the asked rows leave the device, each in the asked dtype: items 2-3, 6-7 and 8-9 of the pack.
    assert [(w.rows, w.dtype) for w in copied] == [
        ((2, 3), HiddenDType.FLOAT32),
        ((6, 7), HiddenDType.FLOAT16),
        ((8, 9), HiddenDType.BFLOAT16),
    ]
    for i, (result, dtype) in enumerate(zip(results, asks, strict=True)):
        prompts = [tokenize(model_dir, t) for t in requests[i].items if isinstance(t, str)]
        reference = hf_reference(model_dir, prompts)
        _assert_close(scores_of(result), reference.logits, model_dir, _longest(prompts))
        assert result.metadata == {"i": i} and result.request_id == f"r{i}"
        if dtype is None:
            assert result.pooled_hidden_states is None
            continue
        assert result.pooled_hidden_states is not None
        assert [t.dtype for t in result.pooled_hidden_states] == [dtype.value] * 2
        assert all(t.shape == (scorer.hidden_size,) for t in result.pooled_hidden_states)
        if dtype is HiddenDType.FLOAT32:
            _assert_close(hidden_of(result), reference.hidden, model_dir, _longest(prompts))
        else:
            torch_dtype = torch.float16 if dtype is HiddenDType.FLOAT16 else torch.bfloat16
            _assert_rounded(hidden_of(result), reference.hidden, torch_dtype, model_dir, _longest(prompts))


def test_result_fields(llama_scorer: Scorer, tiny_llama_dir: Path) -> None:
    (result,) = llama_scorer.score([ScoreRequest(request_id="f", items=("a", "b c"), metadata=[1, "x"])])
    assert result.ok and result.error is None
    assert result.model == tiny_llama_dir.name == llama_scorer.model_name
    assert result.metadata == [1, "x"]
    assert result.prompt_tokens == len(tokenize(tiny_llama_dir, "a")) + len(tokenize(tiny_llama_dir, "b c"))
    assert set(result.timings) == {"tokenize_s", "forward_s", "copy_s"}
    assert all(value >= 0 for value in result.timings.values())
    assert result.timings["forward_s"] > 0


@torch.no_grad()
def _hf_single(model_dir: Path, prompt: Sequence[int]) -> tuple[torch.Tensor, torch.nn.Module, np.ndarray]:
    """HF's own forward of one unpadded prompt: last hidden states [L, H], the head, and HF's logits."""
    model = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), attn_implementation="eager", dtype=torch.float32
    ).eval()
    out = model(input_ids=torch.tensor([list(prompt)]), output_hidden_states=True)
    return out.hidden_states[-1][0], model.score, out.logits[0].numpy()


def test_last_pooling_matches_hf_when_a_prompt_ends_in_the_pad_id(tiny_llama_dir: Path) -> None:
    """Reward models whose pad id is their EOS: HF pools before trailing pad ids; "last" does too by
    default, and "last_token" pools at the true last token when asked."""
    pad = 0  # the tiny models' <pad>
    prompt = (12, 40, 77, 9, pad, pad)
    states, head, hf_logits = _hf_single(tiny_llama_dir, prompt)
    request = ScoreRequest(request_id="r", items=(prompt,), return_pooled_hidden_states=True)
    default = Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).score([request])[0]
    longest = len(prompt)
    _assert_close(scores_of(default), hf_logits[None], tiny_llama_dir, longest)
    # The last token that is not the pad id.
    _assert_close(hidden_of(default), states[3].numpy()[None], tiny_llama_dir, longest)
    true_last = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", pooling="last_token")).score([request])[0]
    _assert_close(hidden_of(true_last), states[-1].numpy()[None], tiny_llama_dir, longest)
    with torch.no_grad():
        _assert_close(scores_of(true_last), head(states[-1:]).numpy(), tiny_llama_dir, longest)
    # The rule matters here: the two poolings differ by more than the two forwards' rounding could.
    apart = float(np.abs(scores_of(true_last) - scores_of(default)).max())
    assert apart > forward_atol(tiny_llama_dir, scores_of(default), longest=longest), apart


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_cls_and_mean_pooling_against_hf_hidden_states(pooling: str, tiny_qwen3_dir: Path) -> None:
    prompts = [tokenize(tiny_qwen3_dir, text) for text in TEXTS[:3]]
    scorer = Scorer(tiny_qwen3_dir, ScorerConfig(device="cpu", pooling=pooling))
    requests = [
        ScoreRequest(request_id=f"r{i}", items=(tuple(p),), return_pooled_hidden_states=True)
        for i, p in enumerate(prompts)
    ]
    for prompt, result in zip(prompts, scorer.score(requests), strict=True):
        states, head, _ = _hf_single(tiny_qwen3_dir, prompt)
        expected = states[0] if pooling == "cls" else states.mean(0)
        # Two float32 forwards, mean pooling one more sum over the prompt's tokens (forward_length).
        mean = pooling == "mean"
        atol = forward_atol(tiny_qwen3_dir, expected.numpy(), longest=len(prompt), mean_pooled=mean)
        np.testing.assert_allclose(hidden_of(result), expected.numpy()[None], atol=atol, rtol=0)
        with torch.no_grad():
            logits = head(expected[None]).numpy()
        atol = forward_atol(tiny_qwen3_dir, logits, longest=len(prompt), mean_pooled=mean)
        np.testing.assert_allclose(scores_of(result), logits, atol=atol, rtol=0)

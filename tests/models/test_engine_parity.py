"""The packed engine against HuggingFace's own padded float32 forward: scores and pooled hidden states."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from scoring_testkit import ATOL, RTOL, hf_reference, hidden_of, scores_of, tokenize
from transformers import AutoModelForSequenceClassification

from models import Scorer, ScorerConfig, engine
from models.packing import HostRows, RowRequest, start_rows_copy
from models.tiny import DECODERS
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


def _assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("architecture", DECODERS)
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
    _assert_close(actual_scores, reference.logits)
    _assert_close(actual_hidden, reference.hidden)
    assert [r.prompt_tokens for r in results[:4]] == [len(p) for p in prompts[:4]]
    assert results[4].prompt_tokens == sum(len(p) for p in prompts[4:])


def test_reference_is_self_consistent(tiny_llama_dir: Path) -> None:
    """Guards the reference itself: HF's hidden_states[-1] is the post-norm state the head reads."""
    reference = hf_reference(tiny_llama_dir, _ids(3, 20, seed=0))
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with torch.inference_mode():
        logits = model.score(torch.from_numpy(reference.hidden)).numpy()
    _assert_close(logits, reference.logits)


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
        _assert_close(np.concatenate([scores_of(r) for r in results]), reference.logits)
        _assert_close(np.concatenate([hidden_of(r) for r in results]), reference.hidden)


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
    _assert_close(scores_of(result), reference.logits)
    _assert_close(hidden_of(result), reference.hidden)
    assert result.prompt_tokens == sum(len(p) for p in prompts)  # no special tokens added to token ids


def test_text_item_first_tokenizes_item_then_query(llama_scorer: Scorer, tiny_llama_dir: Path) -> None:
    request = ScoreRequest(request_id="text", query=" is it good?", items=TEXTS[:2], item_first=True)
    (result,) = llama_scorer.score([request])
    reference = hf_reference(
        tiny_llama_dir, [tokenize(tiny_llama_dir, t + " is it good?") for t in TEXTS[:2]]
    )
    _assert_close(scores_of(result), reference.logits)
    assert result.pooled_hidden_states is None


def test_three_labels_and_softmax(three_label_dir: Path) -> None:
    scorer = Scorer(three_label_dir, ScorerConfig(device="cpu"))
    plain, soft = scorer.score(
        [
            ScoreRequest(request_id="plain", items=TEXTS),
            ScoreRequest(request_id="soft", items=TEXTS, apply_softmax=True),
        ]
    )
    reference = hf_reference(three_label_dir, [tokenize(three_label_dir, t) for t in TEXTS])
    assert scores_of(plain).shape == (len(TEXTS), 3)
    _assert_close(scores_of(plain), reference.logits)
    expected = torch.softmax(torch.from_numpy(reference.logits), dim=-1).numpy()
    _assert_close(scores_of(soft), expected)
    np.testing.assert_allclose(scores_of(soft).sum(axis=1), 1.0, atol=1e-6)


def test_softmax_over_one_label_is_one(llama_scorer: Scorer) -> None:
    (result,) = llama_scorer.score([ScoreRequest(request_id="one", items=TEXTS, apply_softmax=True)])
    assert result.scores == ((1.0,),) * len(TEXTS)


def _assert_rounded(actual: np.ndarray, reference: np.ndarray, dtype: torch.dtype) -> None:
    """actual equals the float32 reference rounded to `dtype`, give or take one unit in the last place."""
    expected = torch.from_numpy(reference).to(dtype).float().numpy()
    relative_ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    np.testing.assert_array_less(np.abs(actual - expected), np.abs(expected) * relative_ulp + 1e-7)


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

    monkeypatch.setattr(engine, "start_rows_copy", spy)
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
        _assert_close(scores_of(result), reference.logits)
        assert result.metadata == {"i": i} and result.request_id == f"r{i}"
        if dtype is None:
            assert result.pooled_hidden_states is None
            continue
        assert result.pooled_hidden_states is not None
        assert [t.dtype for t in result.pooled_hidden_states] == [dtype.value] * 2
        assert all(t.shape == (scorer.hidden_size,) for t in result.pooled_hidden_states)
        if dtype is HiddenDType.FLOAT32:
            _assert_close(hidden_of(result), reference.hidden)
        else:
            torch_dtype = torch.float16 if dtype is HiddenDType.FLOAT16 else torch.bfloat16
            _assert_rounded(hidden_of(result), reference.hidden, torch_dtype)


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
    _assert_close(scores_of(default), hf_logits[None])
    _assert_close(hidden_of(default), states[3].numpy()[None])  # the last token that is not the pad id
    true_last = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", pooling="last_token")).score([request])[0]
    _assert_close(hidden_of(true_last), states[-1].numpy()[None])
    with torch.no_grad():
        _assert_close(scores_of(true_last), head(states[-1:]).numpy())
    assert not np.allclose(scores_of(true_last), scores_of(default), atol=1e-3)  # the rule matters here


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
        _assert_close(hidden_of(result), expected.numpy()[None])
        with torch.no_grad():
            _assert_close(scores_of(result), head(expected[None]).numpy())

"""Judges (label_token_ids), chat conversations (messages) and truncation, each against HF float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scoring_testkit import assert_forward_close, forward_atol, hidden_of, scores_of
from tolerances import softmax_bound
from transformers import AutoModelForCausalLM, AutoTokenizer

from models import Scorer, ScorerConfig, write_tiny_model
from models.tiny import JUDGE_ONLY
from schemas import ErrorCode, ScoreRequest

QUERY = "Is the following answer helpful and honest?"
ITEMS = ("Yes, the library opens at nine o'clock.", "No.")
LABELS = (40, 7, 300)


# Gemma 4's mixture-of-experts blocks beside its MLP (a variant of the tiny model): routing is HF's code.
VARIANTS: dict[str, dict[str, object]] = {
    "experts": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
}


@pytest.fixture(
    scope="module",
    params=[
        "llama",
        "gemma2",
        "smollm3",
        "olmo2",
        "olmo3",
        "glm4",
        "qwen3_moe",
        "qwen3_5_text",
        "qwen3_next",
        *JUDGE_ONLY,
        "gemma4_text+experts",
    ],
)
def judge_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2 caps its output logits as well as its attention logits; the newer families (SmolLM3, OLMo 2
    and 3, GLM-4), Qwen3-MoE's causal LM routing to experts, the hybrids Qwen3.5 and Qwen3-Next (Gated
    DeltaNet layers) and Gemma 4's text model, a judge only, with their quirks (models/tiny.py)."""
    architecture, _, variant = str(request.param).partition("+")
    return write_tiny_model(
        tmp_path_factory.mktemp(f"judge-{architecture}{variant}"), architecture, seed=3, judge=True,
        overrides=VARIANTS.get(variant),
    )  # fmt: skip


def _close(actual: np.ndarray, expected: np.ndarray, model_dir: Path, longest: int) -> None:
    # Two float32 forwards of the same prompts (packed engine vs HF's own, or another batch layout): the
    # model's chain of sums for prompts of up to `longest` tokens, at the values' scale (forward_atol).
    assert_forward_close(actual, expected, model_dir, longest=longest)


@torch.no_grad()
def _hf_last(model_dir: Path, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    out = model(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    return out.logits[0, -1].numpy(), out.hidden_states[-1][0, -1].numpy()


def test_a_judge_scores_label_logits_and_their_softmax(judge_dir: Path) -> None:
    scorer = Scorer(judge_dir, ScorerConfig(device="cpu"))
    tokenizer = AutoTokenizer.from_pretrained(str(judge_dir))
    # Two requests with different labels in one batch: each gets its own columns, in its own order.
    requests = [
        ScoreRequest(
            request_id="a", query=QUERY, items=ITEMS, label_token_ids=LABELS, return_pooled_hidden_states=True
        ),
        ScoreRequest(
            request_id="b", query=QUERY, items=ITEMS[:1], label_token_ids=(300, 41), apply_softmax=True
        ),
    ]
    first, second = scorer.score(requests)
    for row, item in enumerate(ITEMS):
        prompt = tokenizer(QUERY + item)["input_ids"]
        logits, hidden = _hf_last(judge_dir, prompt)
        _close(scores_of(first)[row], logits[list(LABELS)], judge_dir, len(prompt))
        _close(hidden_of(first)[row], hidden, judge_dir, len(prompt))  # the final-norm state before lm_head
    prompt = tokenizer(QUERY + ITEMS[0])["input_ids"]
    logits, _ = _hf_last(judge_dir, prompt)
    # The softmax of 2 label logits that two float32 forwards leave forward_atol apart.
    logit_error = forward_atol(judge_dir, logits[[300, 41]], longest=len(prompt))
    np.testing.assert_allclose(
        scores_of(second)[0],
        torch.softmax(torch.tensor(logits[[300, 41]]), -1).numpy(),
        atol=softmax_bound(torch.float32, labels=2, logit_error=logit_error),
        rtol=0,
    )


def test_judge_label_errors_have_their_own_codes(judge_dir: Path, tiny_llama_dir: Path) -> None:
    judge = Scorer(judge_dir, ScorerConfig(device="cpu"))
    classifier = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    cases = [
        (judge, ScoreRequest(request_id="r", items=ITEMS), ErrorCode.LABEL_IDS_REQUIRED),
        (
            judge,
            ScoreRequest(request_id="r", items=ITEMS, label_token_ids=(5, 10**6)),
            ErrorCode.LABEL_ID_OUT_OF_RANGE,
        ),
        (
            classifier,
            ScoreRequest(request_id="r", items=ITEMS, label_token_ids=(5,)),
            ErrorCode.LABEL_IDS_NOT_SUPPORTED,
        ),
    ]
    for scorer, request, code in cases:
        result = scorer.score([request])[0]
        assert not result.ok and result.error is not None and result.error.code is code, result


def test_messages_are_rendered_whole_by_the_chat_template(tiny_llama_dir: Path) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUERY}]
    request = ScoreRequest(
        request_id="chat", items=ITEMS, messages=messages, return_pooled_hidden_states=True
    )  # type: ignore[arg-type]
    chat = scorer.score([request])[0]
    for row, item in enumerate(ITEMS):
        ids = tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": item}], tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert ids[-1] == tokenizer.eos_token_id  # the reply's end of turn is part of what is scored
        plain = scorer.score(
            [ScoreRequest(request_id="ids", items=(tuple(ids),), return_pooled_hidden_states=True)]
        )[0]
        _close(scores_of(chat)[row], scores_of(plain)[0], tiny_llama_dir, len(ids))
        _close(hidden_of(chat)[row], hidden_of(plain)[0], tiny_llama_dir, len(ids))


def test_messages_need_a_chat_template(tmp_path: Path) -> None:
    encoder = Scorer(write_tiny_model(tmp_path / "bert", "bert", seed=8), ScorerConfig(device="cpu"))
    request = ScoreRequest(request_id="chat", items=ITEMS, messages=[{"role": "user", "content": QUERY}])  # type: ignore[arg-type]
    result = encoder.score([request])[0]
    assert result.error is not None and result.error.code is ErrorCode.CHAT_TEMPLATE_MISSING


@pytest.mark.parametrize(
    ("truncate", "expected"),
    [
        ("query_left", lambda q, i, n: q[n:] + i),
        ("query_right", lambda q, i, n: q[: len(q) - n] + i),
        ("item_left", lambda q, i, n: q + i[n:]),
        ("item_right", lambda q, i, n: q + i[: len(i) - n]),
    ],
)
def test_truncation_cuts_the_named_part_by_just_enough(
    truncate: str, expected: object, tiny_llama_dir: Path
) -> None:
    limit = 20
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", max_item_tokens=limit))
    query, long_item, short_item = tuple(range(10, 22)), tuple(range(30, 45)), (50, 51)
    request = ScoreRequest(
        request_id="t",
        query=query,
        items=(long_item, short_item),
        truncate=truncate,
        return_pooled_hidden_states=True,  # type: ignore[arg-type]
    )
    result = scorer.score([request])[0]
    assert result.ok and result.truncated_tokens == (7, 0)
    cut = expected(query, long_item, 7)  # type: ignore[operator]
    assert len(cut) == limit
    alone = Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).score(
        [ScoreRequest(request_id="a", items=(cut, query + short_item), return_pooled_hidden_states=True)]
    )[0]
    _close(scores_of(result), scores_of(alone), tiny_llama_dir, limit)
    untruncated = scorer.score([ScoreRequest(request_id="n", query=query, items=(long_item,))])[0]
    assert untruncated.error is not None and untruncated.error.code is ErrorCode.INPUT_TOO_LONG
    assert untruncated.truncated_tokens is None


def test_truncation_of_text_and_encoder_pairs_keeps_the_template(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "bert", "bert", seed=8)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    scorer = Scorer(model_dir, ScorerConfig(device="cpu", max_item_tokens=16))
    item = "The quick brown fox jumps over the lazy dog while the farmer watches from the old fence."
    result = scorer.score(
        [ScoreRequest(request_id="t", query="Is it?", items=(item,), truncate="item_right")]
    )[0]  # type: ignore[arg-type]
    assert result.ok and result.truncated_tokens is not None and result.truncated_tokens[0] > 0
    query_ids = tokenizer("Is it?", add_special_tokens=False)["input_ids"]
    item_ids = tokenizer(item, add_special_tokens=False)["input_ids"]
    kept = item_ids[: 16 - 3 - len(query_ids)]  # [CLS] q [SEP] item [SEP]
    expected = Scorer(model_dir, ScorerConfig(device="cpu")).score(
        [ScoreRequest(request_id="e", query=tuple(query_ids), items=(tuple(kept),))]
    )[0]
    _close(scores_of(result), scores_of(expected), model_dir, 16)
    too_short = scorer.score(
        [ScoreRequest(request_id="s", query=item, items=("Yes",), truncate="item_left")]
    )[0]  # type: ignore[arg-type]
    assert too_short.error is not None and too_short.error.code is ErrorCode.INPUT_TOO_LONG


def test_truncation_of_a_decoders_text_cuts_tokens_not_characters(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    query = "The quick brown fox jumps over the lazy dog while the farmer watches from the old fence. "
    item = "Yes."
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", max_item_tokens=12))
    request = ScoreRequest(request_id="t", query=query, items=(item,), truncate="query_left")  # type: ignore[arg-type]
    result = scorer.score([request])[0]
    query_ids = tokenizer(query, add_special_tokens=False)["input_ids"]
    item_ids = tokenizer(item, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id]
    lost = len(bos) + len(query_ids) + len(item_ids) - 12
    assert result.truncated_tokens == (lost,)
    kept = tuple(bos + query_ids[lost:] + item_ids)  # the BOS the tokenizer adds stays in front
    expected = Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).score(
        [ScoreRequest(request_id="e", items=(kept,))]
    )
    _close(scores_of(result), scores_of(expected[0]), tiny_llama_dir, 12)

"""Cross-encoders (BERT, XLM-RoBERTa) in the packed engine against HF's own padded float32 forward."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from scoring_testkit import CpuVarlenKernel, assert_forward_close, hidden_of, scores_of
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from models import ModelLoadError, Scorer, ScorerConfig, write_tiny_model
from models.prepare import PairTemplate
from schemas import ScoreRequest

QUERY = "When does the library open on Sunday?"
ITEMS = (
    "At nine o'clock.",
    "The farmer watches the quick brown fox jump over the lazy dog from the old wooden fence.",
    "It is closed.",
)


@pytest.fixture(scope="module", params=["bert", "roberta", "xlm-roberta", "deberta-v2", "modernbert"])
def encoder_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=8, num_labels=2)


@torch.no_grad()
def _hf(model_dir: Path, first: list[str], second: list[str] | None) -> tuple[np.ndarray, np.ndarray]:
    """HF's logits and the pooled final hidden state (the CLS token's, or the mean where the model's head
    pools the mean, as the tiny ModernBERT's does) for a padded batch of texts or text pairs."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), attn_implementation="eager", dtype=torch.float32
    ).eval()
    encoded = tokenizer(first, second, padding=True, return_tensors="pt")
    out = model(**encoded, output_hidden_states=True)
    states = out.hidden_states[-1]  # [B, L, H]
    if getattr(model.config, "classifier_pooling", "cls") == "mean":
        mask = encoded["attention_mask"].unsqueeze(-1).float()
        return out.logits.numpy(), ((states * mask).sum(1) / mask.sum(1)).numpy()
    return out.logits.numpy(), states[:, 0].numpy()


def _longest(model_dir: Path) -> int:
    """The longest prompt here: the query and an item in the model's pair template."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return max(len(tokenizer(QUERY, item)["input_ids"]) for item in ITEMS)


def _close(actual: np.ndarray, expected: np.ndarray, model_dir: Path, mean_pooled: bool = False) -> None:
    # Two float32 forwards of the same prompts (the packed engine vs HF's padded eager one, or another
    # layout): the encoder's chain of sums for its longest prompt, at the values' scale (forward_atol).
    assert_forward_close(actual, expected, model_dir, longest=_longest(model_dir), mean_pooled=mean_pooled)


def _score(scorer: Scorer, **fields: object) -> tuple[np.ndarray, np.ndarray]:
    result = scorer.score([ScoreRequest(request_id="r", return_pooled_hidden_states=True, **fields)])[0]  # type: ignore[arg-type]
    return scores_of(result), hidden_of(result)


def test_text_pairs_single_texts_and_item_first_match_hf(encoder_dir: Path) -> None:
    scorer = Scorer(encoder_dir, ScorerConfig(device="cpu"))
    assert scorer.info.pooling == ("mean" if encoder_dir.name.startswith("modernbert") else "cls")
    for fields, first, second in [
        ({"query": QUERY, "items": ITEMS}, [QUERY] * 3, list(ITEMS)),
        ({"items": ITEMS}, list(ITEMS), None),
        ({"query": QUERY, "items": ITEMS, "item_first": True}, list(ITEMS), [QUERY] * 3),
    ]:
        scores, hidden = _score(scorer, **fields)
        logits, cls = _hf(encoder_dir, first, second)
        _close(scores, logits, encoder_dir)
        _close(hidden, cls, encoder_dir)  # the pooled state: the CLS token's final state (ModernBERT: mean)


def test_token_ids_get_the_tokenizers_pair_template(encoder_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir))
    query = tuple(tokenizer(QUERY, add_special_tokens=False)["input_ids"])
    items = tuple(tuple(tokenizer(i, add_special_tokens=False)["input_ids"]) for i in ITEMS)
    scorer = Scorer(encoder_dir, ScorerConfig(device="cpu"))
    from_ids = _score(scorer, query=query, items=items)
    from_text = _score(scorer, query=QUERY, items=ITEMS)
    # The same token ids in the same packed row through the same code: the same arithmetic, bit for bit.
    np.testing.assert_array_equal(from_ids[0], from_text[0])
    np.testing.assert_array_equal(from_ids[1], from_text[1])


def test_pair_templates_are_read_off_the_tokenizer(encoder_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir))
    template = PairTemplate.from_tokenizer(tokenizer)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    assert template.single == ((cls,), (sep,))
    if encoder_dir.name.startswith("bert"):
        assert template.pair == ((cls,), (sep,), (sep,)) and template.pair_types == (0, 0, 0, 1, 1)
        assert template.join((7, 8), (9,)) == ((cls, 7, 8, sep, 9, sep), (0, 0, 0, 0, 1, 1))
    elif encoder_dir.name.startswith(("deberta", "modernbert")):
        assert template.pair == ((cls,), (sep,), (sep,)) and template.pair_types is None
    else:
        assert template.pair == ((cls,), (sep, sep), (sep,)) and template.pair_types is None


@pytest.mark.parametrize("architecture", ["bert", "xlm-roberta", "modernbert"])  # DeBERTa: plain path
def test_varlen_wrapper_attends_both_ways_inside_each_item(architecture: str, tmp_path: Path) -> None:
    encoder_dir = write_tiny_model(tmp_path / architecture, architecture, seed=8, num_labels=2)
    kernel = CpuVarlenKernel()
    varlen = Scorer(encoder_dir, ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel))
    reference = Scorer(encoder_dir, ScorerConfig(device="cpu"))
    for got, expected in zip(
        _score(varlen, query=QUERY, items=ITEMS), _score(reference, query=QUERY, items=ITEMS), strict=True
    ):
        _close(got, expected, encoder_dir)  # scores, then the pooled states
    assert kernel.calls


def test_an_encoder_without_its_tokenizer_is_refused(encoder_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(encoder_dir / name, bare / name)
    with pytest.raises(ModelLoadError, match="pair template"):
        Scorer(bare, ScorerConfig(device="cpu"))


def test_deberta_takes_the_plain_padded_path_and_says_so(tmp_path: Path) -> None:
    """Disentangled attention is not pluggable: HF's own padded forward, pooled and headed like the rest."""
    model_dir = write_tiny_model(tmp_path / "deberta", "deberta-v2", seed=8, num_labels=2)
    kernel = CpuVarlenKernel()
    scorer = Scorer(model_dir, ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel))
    assert scorer.info.attention == "plain" and not kernel.calls
    for pooling in ("mean", "last_token"):
        scorer = Scorer(model_dir, ScorerConfig(device="cpu", pooling=pooling))
        _, hidden = _score(scorer, query=QUERY, items=ITEMS)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
        for row, item in enumerate(ITEMS):
            with torch.no_grad():
                states = model(**tokenizer(QUERY, item, return_tensors="pt"), output_hidden_states=True)
            last = states.hidden_states[-1][0]
            expected = last.mean(0) if pooling == "mean" else last[-1]
            _close(hidden[row], expected.numpy(), model_dir, mean_pooled=pooling == "mean")

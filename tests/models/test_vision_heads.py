"""Image-text reward models against HF float32: Qwen3.5's image-text classifier, and TRL value heads on the
Qwen image-text generation models (TRL's tensors in the checkpoint, or Skywork-VL-Reward's
value_head.safetensors beside a sharded one), scored at the last token's final-norm state."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from scoring_testkit import hidden_of, scores_of
from tolerances import forward_atol
from vision_testkit import (
    JUDGE_LABELS,
    encoded,
    judge_alone,
    judge_requests,
    load_judge_reference,
    value_head_of,
)

from models import ModelLoadError, Scorer, ScorerConfig
from models.tiny import write_tiny_model
from models.tiny_vision import add_value_head, write_tiny_qwen_vl_judge
from schemas import ErrorCode, ScoreRequest, ScoreResult

# (architecture, head): Qwen3.5's own classifier; a value head in the checkpoint (TRL) or beside it.
CASES = [
    ("qwen3_5", "classifier"),
    ("qwen2_5_vl", "trl"),
    ("qwen3_vl", "trl"),
    ("qwen3_5", "trl"),
    ("qwen2_5_vl", "beside-sharded"),  # Skywork-VL-Reward's layout
    ("qwen3_5", "beside"),
]


def _shard(model_dir: Path) -> None:
    """Split model.safetensors into two files and an index, as a large checkpoint is saved."""
    weights = load_file(str(model_dir / "model.safetensors"))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({key: weights[key] for key in keys}, str(model_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (model_dir / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


def _write(target: Path, architecture: str, head: str) -> Path:
    if head == "classifier":
        return write_tiny_qwen_vl_judge(target, 7, architecture, num_labels=2)
    model_dir = write_tiny_qwen_vl_judge(target, 7, architecture)
    if head == "beside-sharded":
        _shard(model_dir)
    return add_value_head(model_dir, 3, beside=head.startswith("beside"))


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def model_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    architecture, head = request.param
    return _write(tmp_path_factory.mktemp(f"{architecture}-{head}"), architecture, head)


@pytest.fixture(scope="module")
def scorer(model_dir: Path) -> Scorer:
    return Scorer(model_dir, ScorerConfig(device="cpu"))


def _requests() -> list[ScoreRequest]:
    """The judges' requests as a reward model takes them (no label tokens): images before a query, two
    images of other shapes placed by chat parts, text alone; several items each."""
    return [replace(one, label_token_ids=None, apply_softmax=False) for one in judge_requests()]


def test_mixed_batch_matches_hf_float32(scorer: Scorer, model_dir: Path) -> None:
    """One batch of image and text-only requests (several items each, prompts of 9 to 81 tokens; packed,
    the default for every family here) against HF on each item alone and unpadded: the score and the
    pooled hidden state."""
    assert not scorer.model.judge and scorer.info.pooling in ("last", "last_token")
    reference = load_judge_reference(model_dir)
    head = value_head_of(model_dir)
    assert scorer.model.value_head == (head is not None)
    requests = _requests()
    for request, result in zip(requests, scorer.score(requests), strict=True):
        assert result.ok, result.error
        scores, hidden, longest = judge_alone(reference, request, value_head=head)
        # Float32 on both sides, the same sums in other orders (a packed row against one unpadded row,
        # SDPA against eager): within forward_bound of the vision tower's and the text model's sums in
        # series, whose last is the head (a value head's H terms and its bias, as a classifier's column).
        atol = forward_atol(model_dir, scores, longest=longest)
        np.testing.assert_allclose(scores_of(result), scores, atol=atol, rtol=0)
        if request.return_pooled_hidden_states:
            atol = forward_atol(model_dir, hidden, longest=longest)
            np.testing.assert_allclose(hidden_of(result), hidden, atol=atol, rtol=0)


@pytest.mark.parametrize("packed_images", [True, False])
def test_a_row_scores_as_alone_beside_longer_rows(model_dir: Path, packed_images: bool) -> None:
    """A short text request beside an image request of 81 tokens scores as it does alone: packed, no state
    crosses from one item to the next (Qwen3.5's Gated DeltaNet layers restart at each); padded to the long
    row, the padding after a row (Qwen3.5: through HF's recurrence) never reaches its real tokens."""
    scorer = Scorer(model_dir, ScorerConfig(device="cpu", packed_images=packed_images))
    short, long = _requests()[3], _requests()[2]
    together = scorer.score([long, short])[1]
    alone = scorer.score([short])[0]
    prepared = scorer.prepare(long)
    assert not isinstance(prepared, ScoreResult) and together.ok and alone.ok, (together.error, alone.error)
    # Two float32 runs of the same sums, other batch shapes (forward_bound).
    want = scores_of(alone)
    atol = forward_atol(model_dir, want, longest=max(len(p) for p in prepared.prompts))
    np.testing.assert_allclose(scores_of(together), want, atol=atol, rtol=0)


def test_the_images_change_the_scores(scorer: Scorer, model_dir: Path) -> None:
    requests = [ScoreRequest(f"r{seed}", items=("a cat",), images=(encoded("PNG", seed),)) for seed in (1, 2)]
    first, second = (scores_of(result) for result in scorer.score(requests))
    longest = len(scorer.prepare(requests[0]).prompts[0])  # type: ignore[union-attr]
    assert np.abs(first - second).max() > 10 * forward_atol(model_dir, first, longest=longest)


def test_label_tokens_are_refused(scorer: Scorer) -> None:
    """A reward model's score is its head: a request asking for label tokens is its own error, and the
    request beside it scores."""
    asking = ScoreRequest("labels", items=("a",), images=(encoded("PNG", 1),), label_token_ids=JUDGE_LABELS)
    refused, good = scorer.score([asking, replace(asking, request_id="good", label_token_ids=None)])
    assert refused.error is not None and refused.error.code is ErrorCode.LABEL_IDS_NOT_SUPPORTED, refused
    assert good.ok, good.error


def test_the_start_up_self_check_passes(scorer: Scorer) -> None:
    """The start-up check (text prompts through the engine and through HF's own forward, the value head
    applied to HF's final-norm state) accepts the model within its float32 bound."""
    from models.selfcheck import run_self_check

    report = run_self_check(scorer)
    assert report.items > 0 and report.max_score_diff <= report.score_bound


def _judge_copy(tmp_path: Path, name: str) -> Path:
    return write_tiny_qwen_vl_judge(tmp_path / name, 7, "qwen2_5_vl")


def test_value_head_tensors_it_does_not_know_are_refused(tmp_path: Path) -> None:
    """An MLP value head (v_head.summary.0.weight ...) beside the model would be passed over, and the model
    would load as a judge: refused by name."""
    model_dir = _judge_copy(tmp_path, "mlp")
    hidden = 32
    head = {"v_head.summary.0.weight": torch.ones(8, hidden), "v_head.summary.2.weight": torch.ones(1, 8)}
    save_file(head, str(model_dir / "value_head.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"v_head\.summary\.0\.weight"):
        Scorer(model_dir, ScorerConfig(device="cpu"))


def test_a_pickled_value_head_is_refused(tmp_path: Path) -> None:
    model_dir = _judge_copy(tmp_path, "pickled")
    torch.save({"v_head.summary.weight": torch.ones(1, 32)}, model_dir / "value_head.bin")
    with pytest.raises(ModelLoadError, match=r"value_head\.bin"):
        Scorer(model_dir, ScorerConfig(device="cpu"))


@pytest.mark.parametrize("beside", [False, True])
def test_a_value_head_beside_a_classifier_is_refused(tmp_path: Path, beside: bool) -> None:
    """A classifier scores with its own head: a value head in its tensors or beside them would be passed
    over, and which head the checkpoint meant is unknown."""
    classifier = write_tiny_qwen_vl_judge(tmp_path / "both", 7, "qwen3_5", num_labels=1)
    model_dir = add_value_head(classifier, 3, beside=beside)
    with pytest.raises(ModelLoadError, match="beside Qwen3_5ForSequenceClassification's own head"):
        Scorer(model_dir, ScorerConfig(device="cpu"))


def test_a_value_head_of_the_wrong_width_is_refused(tmp_path: Path) -> None:
    model_dir = _judge_copy(tmp_path, "wide")
    head = {"v_head.summary.weight": torch.ones(2, 32), "v_head.summary.bias": torch.ones(2)}
    save_file(head, str(model_dir / "value_head.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="single-output"):
        Scorer(model_dir, ScorerConfig(device="cpu"))


@pytest.mark.parametrize("architecture", ["qwen3_5_text", "llama"])
def test_text_models_refuse_images_beside_good_requests(tmp_path: Path, architecture: str) -> None:
    """Images sent to a text model (Qwen3.5's text model, a TRL value head on a text decoder): the
    request's IMAGES_NOT_SUPPORTED, the text request beside it scored."""
    model_dir = write_tiny_model(tmp_path / architecture, architecture, seed=2, judge=architecture == "llama")
    if architecture == "llama":
        add_value_head(model_dir, 3)
    scorer = Scorer(model_dir, ScorerConfig(device="cpu"))
    requests = [
        ScoreRequest("images", items=("a",), images=(encoded("PNG", 1),)),
        ScoreRequest("text", items=("a cat", "a dog")),
    ]
    refused, good = scorer.score(requests)
    assert refused.error is not None and refused.error.code is ErrorCode.IMAGES_NOT_SUPPORTED, refused
    assert good.ok and len(good.scores) == 2, good.error


def test_make_tiny_model_writes_the_qwen3_5_classifier(tmp_path: Path, capsys: Any) -> None:
    from worker import cli

    target = tmp_path / "cls"
    command = ["make-tiny-model", str(target), "--architecture", "qwen3_5", "--images", "--num-labels", "3"]
    assert cli.main(command) == 0
    assert "image-text classifier (3 label(s))" in capsys.readouterr().out
    scorer = Scorer(target, ScorerConfig(device="cpu"))
    result = scorer.score([ScoreRequest("r", items=("a",), images=(encoded("PNG", 1),))])[0]
    assert result.ok and len(result.scores[0]) == 3, result.error


@pytest.mark.parametrize(("setting", "value"), [("quantization", "fp8"), ("adapters", "a=/nonexistent")])
def test_qwen3_5_refuses_fp8_and_adapters(tmp_path: Path, setting: str, value: object) -> None:
    """Qwen3.5's image-text model, packed or not, serves neither: its packed image forward takes no
    adapters and its Gated DeltaNet layers no FP8 projections, and HF's own layers of the padded batch were
    never checked against those swaps. Refused at start-up (the text model's packed path serves adapters,
    not FP8)."""
    model_dir = write_tiny_qwen_vl_judge(tmp_path / "refused", 7, "qwen3_5")
    for packed_images in (True, False):
        with pytest.raises(ModelLoadError, match=rf"{setting}.*Gated DeltaNet layers are not served"):
            Scorer(model_dir, ScorerConfig(device="cpu", packed_images=packed_images, **{setting: value}))


def test_hf_gated_deltanet_runs_its_torch_functions_where_the_packed_path_would() -> None:
    """plain_kernels: HF's torch functions for a hybrid in float32 (any device) and on the CPU (where
    transformers 5.17 would call Triton), flash-linear-attention only where resolve_kernel picks it; no
    swap for a model without Gated DeltaNet layers."""
    from transformers import Qwen3_5TextConfig, Qwen3Config

    from models.linear_attention import hf_torch_functions, plain_kernels, resolve_kernel

    hybrid = Qwen3_5TextConfig(num_hidden_layers=4)
    for device, dtype in (("cpu", torch.float32), ("cpu", torch.bfloat16), ("cuda", torch.float32)):
        assert plain_kernels(hybrid, torch.device(device), dtype) is hf_torch_functions
    half_on_cuda = plain_kernels(hybrid, torch.device("cuda"), torch.bfloat16)
    fla = resolve_kernel(torch.device("cuda"), torch.bfloat16) == "fla"
    assert (half_on_cuda is not hf_torch_functions) == fla
    assert plain_kernels(Qwen3Config(), torch.device("cpu"), torch.float32) is not hf_torch_functions

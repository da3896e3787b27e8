"""The Qwen image-text judges on the packed path (models/vision_packed.py) against HF float32, item by item:
images of several sizes across the requests of one packed row, text-only and token-id requests beside them,
one-token items, per-item M-RoPE positions, Qwen3-VL's deep stack, Qwen3.5's Gated DeltaNet layers (no state
carried from one item to the next), and the padded fallback."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scoring_testkit import hidden_of, scores_of
from tolerances import forward_atol
from vision_testkit import (
    judge_alone,
    judge_requests,
    load_judge_reference,
    mixed_judge_requests,
    token_judge_alone,
)

from models import ModelLoadError, Scorer, ScorerConfig
from models.tiny_vision import write_tiny_qwen_vl_judge, write_tiny_vision_model
from models.vision_packed import PackedImages
from schemas import ScoreResult, TokenOutputs


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def judge_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    return write_tiny_qwen_vl_judge(tmp_path_factory.mktemp(f"packed-{request.param}"), 7, request.param)


@pytest.fixture(scope="module")
def packed(judge_dir: Path) -> Scorer:
    return Scorer(judge_dir, ScorerConfig(device="cpu"))


@pytest.fixture(scope="module")
def padded(judge_dir: Path) -> Scorer:
    return Scorer(judge_dir, ScorerConfig(device="cpu", packed_images=False))


@pytest.fixture(scope="module")
def reference(judge_dir: Path) -> tuple[Any, Any]:
    return load_judge_reference(judge_dir)


def assert_close(result: ScoreResult, want: tuple[np.ndarray, np.ndarray, int], judge_dir: Path) -> None:
    scores, hidden, longest = want
    assert result.ok, result.error
    # Two float32 computations of the same sums in other orders (one packed row of every item and the
    # batch's images against one unpadded row and the item's images; the exact path's SDPA against eager):
    # within forward_bound of the vision tower's and the text model's sums in series (tests/tolerances.py).
    # A softmax over the labels is 1-Lipschitz in the max norm, so the logits' bound holds for it.
    np.testing.assert_allclose(
        scores_of(result), scores, atol=forward_atol(judge_dir, scores, longest=longest)
    )
    atol = forward_atol(judge_dir, hidden, longest=longest)
    np.testing.assert_allclose(hidden_of(result), hidden, atol=atol, rtol=0)


def test_the_qwens_run_packed_and_gemma_3_padded(packed: Scorer, padded: Scorer, tmp_path: Path) -> None:
    assert packed.attention == "reference" and packed.executor.packed_images is not None
    assert padded.attention == "plain" and padded.executor.packed_images is None
    # Qwen3.5's hybrid text model: its Gated DeltaNet layers run the packed layer on the packed path only.
    hybrid = packed.hf_model.config.model_type == "qwen3_5"
    assert (packed.executor.linear_layers is not None) == hybrid and padded.executor.linear_layers is None
    # Gemma 3 attends both ways inside each image: it stays on HF's padded forward whatever the setting.
    gemma = Scorer(write_tiny_vision_model(tmp_path / "gemma3", 1), ScorerConfig(device="cpu"))
    assert gemma.attention == "plain" and gemma.executor.packed_images is None


def test_one_packed_batch_of_mixed_requests_matches_hf_float32(
    packed: Scorer, reference: Any, judge_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows: list[int] = []
    forward = PackedImages.pooled

    def counted(self: PackedImages, prompts: Any, *args: Any) -> Any:
        rows.append(len(prompts))
        return forward(self, prompts, *args)

    monkeypatch.setattr(PackedImages, "pooled", counted)
    requests = mixed_judge_requests()
    results = packed.score(requests)
    assert rows == [sum(len(r.items) for r in requests)]  # every item of every request in one packed row
    for request, result in zip(requests, results, strict=True):
        assert_close(result, token_judge_alone(reference, request), judge_dir)


def test_the_varlen_wrapper_runs_the_packed_row(
    reference: Any, judge_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The GPU's path on the CPU: the varlen attention wrapper with an SDPA kernel injected, reading the
    row's bounds on the device, once per full-attention text layer (Qwen3.5's others are Gated DeltaNet)
    over every item of the batch. CUDA graphs asked for (a recorder standing in for the CPU) stay off, and
    the log says why: the image path records none, though its attention is the varlen one graphs take."""
    from scoring_testkit import CpuVarlenKernelGqa

    kernel = CpuVarlenKernelGqa()
    config = ScorerConfig(
        device="cpu",
        attention="varlen",
        varlen_kernel=kernel,
        cuda_graphs="on",
        graph_recorder=lambda run: run,
    )
    with caplog.at_level("INFO", logger="models.execute"):
        scorer = Scorer(judge_dir, config)
    assert scorer.executor.packed_images is not None and scorer.executor.graphs is None
    assert "the image-text packed path does not record them" in caplog.text
    assert "CUDA graphs cannot record" not in caplog.text
    requests = mixed_judge_requests()
    results = scorer.score(requests)
    text = scorer.hf_model.config.text_config
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    layers = kinds.count("full_attention")
    assert len(kernel.calls) == layers and {len(c) for c in kernel.calls} == {
        1 + sum(len(r.items) for r in requests)
    }
    for request, result in zip(requests, results, strict=True):
        assert_close(result, token_judge_alone(reference, request), judge_dir)


def test_the_vision_tower_sees_each_image_of_a_batch_once(packed: Scorer) -> None:
    """A request's items share its images: the tower runs over each image once (its patches, one row each),
    not once per item, and over the images of every request of the batch in that one call."""
    requests = mixed_judge_requests()
    prepared = [packed.prepare(request) for request in requests]
    patches = sum(
        len(p.pixel_values[0].pixel_values)
        for p in prepared
        if not isinstance(p, ScoreResult) and p.pixel_values is not None
    )
    calls: list[int] = []
    tower = packed.hf_model.model.visual
    hook = tower.register_forward_pre_hook(lambda _, args: calls.append(int(args[0].shape[0])))
    try:
        results = packed.score(requests)
    finally:
        hook.remove()
    assert all(r.ok for r in results) and calls == [patches]


def test_each_request_alone_matches_hf_float32(packed: Scorer, reference: Any, judge_dir: Path) -> None:
    for request in (*mixed_judge_requests(), *judge_requests()[2:3]):
        assert_close(packed.score([request])[0], token_judge_alone(reference, request), judge_dir)


def test_packed_and_the_padded_fallback_agree(packed: Scorer, padded: Scorer, judge_dir: Path) -> None:
    requests = mixed_judge_requests()
    for request, one, other in zip(requests, packed.score(requests), padded.score(requests), strict=True):
        prepared = packed.prepare(request)
        assert not isinstance(prepared, ScoreResult) and one.ok and other.ok
        want = scores_of(other)
        # Two float32 computations of the same sums in other orders (forward_bound).
        atol = forward_atol(judge_dir, want, longest=max(len(p) for p in prepared.prompts))
        np.testing.assert_allclose(scores_of(one), want, atol=atol, rtol=0)


def test_token_outputs_at_every_token_agree_with_the_padded_fallback(
    packed: Scorer, padded: Scorer, judge_dir: Path
) -> None:
    """Label logits at every token of every item, image tokens included, read from the packed row where
    the padded forward (HF's whole forward on the padded batch) reads them from its rows."""
    requests = [replace(r, token_outputs=TokenOutputs.TOKENS) for r in mixed_judge_requests()]
    for one, other in zip(packed.score(requests), padded.score(requests), strict=True):
        assert one.ok and other.ok, (one.error, other.error)
        assert one.token_positions == other.token_positions and one.token_scores and other.token_scores
        for mine, theirs, positions in zip(
            one.token_scores, other.token_scores, one.token_positions or (), strict=True
        ):
            want = theirs.to_numpy()
            # Two float32 computations of the same sums in other orders (forward_bound).
            atol = forward_atol(judge_dir, want, longest=len(positions))
            np.testing.assert_allclose(mine.to_numpy(), want, atol=atol, rtol=0)


def test_each_item_has_its_own_3d_positions(packed: Scorer) -> None:
    """Items restart at position 0 on all three axes; an image's tokens span rows and columns (not one
    position a token), and the text after an image goes on past its larger side, as HF's rope index of
    the item alone gives them."""
    request = mixed_judge_requests()[2]  # two images, then text
    prepared = packed.prepare(request)
    assert not isinstance(prepared, ScoreResult) and prepared.pixel_values is not None
    prompt, types = prepared.prompts[0], prepared.token_types[0]
    images = prepared.pixel_values[0]
    assert packed.executor.packed_images is not None
    rope = packed.executor.packed_images.rope_positions([prompt, (9, 10)], [types, (0, 0)], [images, images])
    assert rope.shape == (3, 1, len(prompt) + 2)
    assert rope[:, 0, len(prompt)].tolist() == [0, 0, 0]  # the second item starts afresh
    image = torch.tensor(types, dtype=torch.bool)
    rows, columns = rope[1, 0, : len(prompt)][image], rope[2, 0, : len(prompt)][image]
    assert not torch.equal(rows, columns)  # 2-D positions on the image tokens
    after = rope[:, 0, len(prompt) - 1]
    assert int(after.max()) < len(prompt) - 1  # each image advanced the text by its side, not its tokens
    assert int(rope[0, 0, : len(prompt)].max()) == int(after[0])


def test_qwen3_vl_deep_stack_moves_the_scores(reference: Any, judge_dir: Path) -> None:
    """Qwen3-VL adds the vision tower's intermediate features to its first text layers' outputs at the
    image tokens: without them HF's scores move by far more than the tolerance, so the comparisons above
    would see the deep stack left out of the packed forward."""
    model, _ = reference
    if model.config.model_type != "qwen3_vl":
        pytest.skip("only Qwen3-VL has a deep stack")
    request = mixed_judge_requests()[0]
    want, _, longest = judge_alone(reference, request)
    language = model.model.language_model
    language._deepstack_process = lambda hidden, *_: hidden
    try:
        without, _, _ = judge_alone(reference, request)
    finally:
        del language._deepstack_process
    assert np.abs(without - want).max() > 10 * forward_atol(judge_dir, want, longest=longest)


def test_the_self_check_leaves_the_vision_tower_on_hf_attention(packed: Scorer) -> None:
    """The start-up self-check runs HF's own attention for its reference, then restores each sub-model's:
    the text model's ours, the vision tower's SDPA (ours would need the packed row's bounds)."""
    from models.selfcheck import run_self_check

    request = mixed_judge_requests()[0]
    before = scores_of(packed.score([request])[0])
    report = run_self_check(packed)
    assert report.items > 0 and report.max_score_diff <= report.score_bound
    config = packed.hf_model.config
    assert config.vision_config._attn_implementation == "sdpa"
    assert config.text_config._attn_implementation != "sdpa"
    np.testing.assert_array_equal(scores_of(packed.score([request])[0]), before)


def test_adapters_are_refused_on_the_packed_path(judge_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(judge_dir))
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(str(tmp_path / "a"))
    # Qwen3.5's refusal names its Gated DeltaNet layers, which take no adapters on the padded path either.
    with pytest.raises(ModelLoadError, match="adapters"):
        Scorer(judge_dir, ScorerConfig(device="cpu", adapters=f"a={tmp_path / 'a'}"))


def test_no_state_crosses_from_one_item_to_the_next(
    packed: Scorer, reference: Any, judge_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two items of one request in one packed row: the second's score is its score alone. Qwen3.5's Gated
    DeltaNet layers carry a recurrent state and a convolution window along the row; run over the whole row
    as one sequence (no restart at the second item) the second starts from the first's state, and its score
    moves by far more than the tolerance: the comparison sees a leak."""
    from models.linear_attention import Sequences

    # Two items after the request's image and query: a text of several tokens, then one of a single token.
    first, second = mixed_judge_requests()[0].items[1:]
    both = replace(mixed_judge_requests()[0], items=(first, second))
    scores, hidden, longest = token_judge_alone(reference, replace(both, items=(second,)))
    result = packed.score([both])[0]
    # Float32 sums in other orders against HF's item alone (forward_bound, as assert_close says), over the
    # packed row's longest item: the first's tokens are in the row, though none of them may reach the second.
    prepared = packed.prepare(both)
    assert not isinstance(prepared, ScoreResult)
    longest = max(longest, *(len(prompt) for prompt in prepared.prompts))
    atol = forward_atol(judge_dir, scores, longest=longest)
    np.testing.assert_allclose(scores_of(result)[1:], scores, atol=atol, rtol=0)
    hidden_atol = forward_atol(judge_dir, hidden, longest=longest)
    np.testing.assert_allclose(hidden_of(result)[1:], hidden, atol=hidden_atol, rtol=0)
    if packed.executor.linear_layers is None:
        return  # attention's own bounds keep items apart; only the hybrid carries state along the row
    whole_row = Sequences.of.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        Sequences, "of", classmethod(lambda cls, cu, device: whole_row(cls, cu[[0, -1]], device))
    )
    leaked = scores_of(packed.score([both])[0])[1:]
    # Far outside the bound (ten times it, as the deep-stack check asks): a leak cannot pass for rounding.
    assert np.abs(leaked - scores).max() > 10 * atol

"""Extra heads over one backbone: each named head's scores equal the head applied to HF float32's pooled
hidden state; several heads in one batch equal each head run alone; unknown names and heads that do not fit
the backbone are refused; the result's size bound counts them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from scoring_testkit import hf_reference, scores_of
from tolerances import forward_bound, forward_length

from models import ModelLoadError, Scorer, ScorerConfig
from schemas import ErrorCode, ScoreRequest, ScoreResult, encode_result, result_size_bound

HIDDEN = 64  # the tiny models' hidden size


def _linear_head(directory: Path, seed: int, labels: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, labels)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {"weight": head.weight.data.contiguous(), "bias": head.bias.data.contiguous()},
        str(directory / "head.safetensors"),
    )
    return head


def _mlp_head(directory: Path, seed: int, labels: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    head = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 32), torch.nn.ReLU(), torch.nn.Linear(32, labels))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(directory / "head.safetensors"))
    (directory / "head_config.json").write_text(json.dumps({"type": "mlp", "activation": "relu"}))
    return head


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("heads")
    return {
        "helpful": (root / "helpful", _linear_head(root / "helpful", 1, 1)),
        "safety": (root / "safety", _mlp_head(root / "safety", 2, 3)),
    }


def _ids(seed: int, count: int, length: int) -> list[tuple[int, ...]]:
    generator = np.random.default_rng(seed)
    return [tuple(int(t) for t in generator.integers(4, 500, size=length - i)) for i in range(count)]


def test_named_heads_score_the_pooled_state_and_compose(
    tiny_llama_dir: Path, heads: dict[str, tuple[Path, torch.nn.Module]]
) -> None:
    setting = ",".join(f"{name}={directory}" for name, (directory, _) in heads.items())
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", heads=setting))
    requests = [
        ScoreRequest("both", items=_ids(1, 3, 16), heads=["safety", "helpful"]),
        ScoreRequest("one", items=_ids(2, 2, 12), heads=["safety"], apply_softmax=True),
        ScoreRequest("none", items=_ids(3, 2, 10)),
    ]
    together = scorer.score(requests)
    for request, result in zip(requests, together, strict=True):
        assert result.ok, result.error
        reference = hf_reference(tiny_llama_dir, request.items)
        own = reference.logits
        if request.apply_softmax:
            own = torch.softmax(torch.from_numpy(own), -1).numpy()
        np.testing.assert_allclose(scores_of(result), own, atol=_atol(tiny_llama_dir, 16, 1.0), rtol=0)
        if request.heads is None:
            assert result.head_scores is None
            continue
        assert result.head_scores is not None and list(result.head_scores) == list(request.heads)
        for name in request.heads:
            with torch.inference_mode():
                expected = heads[name][1](torch.from_numpy(reference.hidden)).numpy()
            if request.apply_softmax:
                expected = torch.softmax(torch.from_numpy(expected), -1).numpy()
            got = np.array(result.head_scores[name])
            np.testing.assert_allclose(
                got, expected, atol=_atol(tiny_llama_dir, 16, float(np.abs(expected).max())), rtol=0
            )
    # Several heads in one batch equal each head run alone, on the same items.
    for name in ("safety", "helpful"):
        (alone,) = scorer.score([ScoreRequest("alone", items=requests[0].items, heads=[name])])
        assert together[0].head_scores is not None and alone.head_scores is not None
        np.testing.assert_allclose(
            np.array(alone.head_scores[name]),
            np.array(together[0].head_scores[name]),
            atol=_atol(tiny_llama_dir, 16, 1.0),
            rtol=0,
        )
    bound = result_size_bound(requests[0], together[0].model, 3, scorer.num_labels, scorer.hidden_size, 0, 4)
    assert len(encode_result(together[0])) <= bound


def _atol(model_dir: Path, longest: int, magnitude: float) -> float:
    """The forward's float32 bound on `longest` tokens with two more sums of the hidden size (an MLP head's
    two layers beyond the one head forward_sums counts), at the scale of the values (at least 1)."""
    length = forward_length(model_dir, longest) + 2 * HIDDEN
    return forward_bound(torch.float32, length=length, magnitude=max(1.0, magnitude))


def test_unknown_heads_and_heads_that_do_not_fit_are_refused(
    tiny_llama_dir: Path, heads: dict[str, tuple[Path, torch.nn.Module]], tmp_path: Path
) -> None:
    directory = heads["helpful"][0]
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", heads=f"helpful={directory}"))
    refused = scorer.prepare(ScoreRequest("x", items=["a"], heads=["helpful", "harmless"]))
    assert isinstance(refused, ScoreResult) and refused.error is not None
    assert refused.error.code is ErrorCode.HEAD_NOT_FOUND and "'harmless'" in refused.error.message
    wide = tmp_path / "wide"
    wide.mkdir()
    save_file({"weight": torch.zeros(1, HIDDEN + 1)}, str(wide / "head.safetensors"))
    with pytest.raises(ModelLoadError, match="hidden size"):
        Scorer(tiny_llama_dir, ScorerConfig(device="cpu", heads=f"w={wide}"))


@pytest.mark.slow
def test_named_heads_run_in_a_tensor_parallel_group(
    tiny_llama_dir: Path, heads: dict[str, tuple[Path, torch.nn.Module]]
) -> None:
    """Every rank holds the whole heads and the whole pooled state (the row-parallel sums are complete on
    each): the group's head scores are the head on HF float32's pooled state, as on one device."""
    from models.parallel import start_group

    setting = ",".join(f"{name}={directory}" for name, (directory, _) in heads.items())
    config = ScorerConfig(device="cpu", dtype="float32", tensor_parallel=2, heads=setting)
    leader = start_group(tiny_llama_dir, config)
    try:
        request = ScoreRequest("both", items=_ids(4, 3, 16), heads=["safety", "helpful"])
        (result,) = leader.score_prepared([leader.prepare(request)])
    finally:
        leader.close()
    assert result.ok and result.head_scores is not None, result.error
    hidden = torch.from_numpy(hf_reference(tiny_llama_dir, request.items).hidden)
    for name in request.heads or ():
        with torch.inference_mode():
            expected = heads[name][1](hidden).numpy()
        # The group sums each projection in shares and adds them: another order of the same float32 sums,
        # within the forward's bound as on one device (_atol).
        np.testing.assert_allclose(
            np.array(result.head_scores[name]),
            expected,
            atol=_atol(tiny_llama_dir, 16, float(np.abs(expected).max())),
            rtol=0,
        )

"""Token outputs against HuggingFace float32, per decoder family: process rewards at step separators (both
PRM families: Qwen2.5-Math-PRM's two-class head, Math-Shepherd's causal LM read at a step tag through a
good and a bad token) and outputs at every token or a range; hidden states at those tokens in every dtype;
steps inside a shared prefix; the last layer restricted to the rows read; the refusals."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from scoring_testkit import CpuVarlenKernelGqa, tokenizer
from tolerances import forward_bound, forward_length, rounded_pair_tolerances
from transformers import AutoModel, AutoModelForCausalLM

from models import Scorer, ScorerConfig
from models.tiny import DECODERS, JUDGE_ONLY, PRM_LABELS, PRM_SEPARATORS, write_tiny_model
from schemas import ErrorCode, ScoreRequest, ScoreResult, decode_result, encode_result, result_size_bound

QUERY = "Problem: count the boats on the river."
# Items with no step, one step and many steps (the separator is added per family).
STEPS = ("The answer is nine", "Count them{s} the answer is nine", "First{s} then two{s} then{s} so nine{s}")


@functools.cache
def _prm_dir(root: str, architecture: str, kind: str) -> Path:
    return write_tiny_model(Path(root) / f"{architecture}-{kind}", architecture, seed=3, prm=kind)


@pytest.fixture(scope="module")
def prm_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("prm"))


def _items(kind: str) -> list[str]:
    return [item.format(s=PRM_SEPARATORS[kind]) for item in STEPS]


def _labels(model_dir: Path) -> list[int]:
    return [tokenizer(model_dir).convert_tokens_to_ids(label) for label in PRM_LABELS]


@functools.cache
def _reference(model_dir: Path, kind: str) -> tuple[Any, Any]:
    """HF float32 with eager attention: (the model, its head over hidden states [P, H] -> logits [P, L]).
    "head": the decoder and the PRM's nn.Sequential head built from the checkpoint, as its own code does;
    "lm": the causal LM, its logits at the good and bad tokens."""
    if kind == "lm":
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
        return model, None
    base = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    weights = load_file(str(model_dir / "model.safetensors"))
    hidden = base.config.hidden_size
    head = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    head.load_state_dict(
        {key.removeprefix("score."): value for key, value in weights.items() if "score." in key}
    )
    return base, head.eval()


def _hf_at(model_dir: Path, kind: str, prompt: list[int], at: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """HF float32's (logits [P, L], hidden states [P, H]) of one prompt at positions `at`, run alone."""
    model, head = _reference(model_dir, kind)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0] if kind == "lm" else out.last_hidden_state[0]
        logits = out.logits[0][:, _labels(model_dir)] if kind == "lm" else head(hidden)
    return logits[at].float().numpy(), hidden[at].float().numpy()


def _atol(model_dir: Path, expected: np.ndarray, longest: int) -> float:
    """forward_bound of the model's forward on `longest` tokens plus the head's extra hidden-length sum (the
    PRM head has two linear layers where forward_sums counts one), at the scale of `expected` (>= 1)."""
    hidden = int(json.loads((model_dir / "config.json").read_text())["hidden_size"])
    magnitude = max(1.0, float(np.abs(expected).max(initial=0.0)))
    length = forward_length(model_dir, longest) + hidden
    return forward_bound(torch.float32, length=length, magnitude=magnitude)


def _scorer(model_dir: Path, **settings: Any) -> Scorer:
    return Scorer(model_dir, ScorerConfig(device="cpu", **settings))


def _check_request(
    scorer: Scorer,
    model_dir: Path,
    kind: str,
    request: ScoreRequest,
    result: ScoreResult,
    prompts: list[list[int]],
) -> None:
    assert result.ok, result.error
    assert result.token_positions is not None
    for index, prompt in enumerate(prompts):
        at = list(result.token_positions[index])
        logits, hidden = _hf_at(model_dir, kind, prompt, at)
        if request.return_token_scores:
            assert result.token_scores is not None
            got = result.token_scores[index].to_numpy()
            assert got.shape == (len(at), logits.shape[1] if len(at) else got.shape[1])
            expected = (
                torch.softmax(torch.from_numpy(logits), -1).numpy() if request.apply_softmax else logits
            )
            np.testing.assert_allclose(got, expected, atol=_atol(model_dir, logits, len(prompt)), rtol=0)
        if request.return_token_hidden_states:
            assert result.token_hidden_states is not None
            tensor = result.token_hidden_states[index]
            assert tensor.dtype == request.hidden_states_dtype.value and tensor.shape == (
                len(at),
                hidden.shape[1],
            )
            difference = _atol(model_dir, hidden, len(prompt))
            dtype = getattr(torch, request.hidden_states_dtype.value)
            atol, rtol = (
                rounded_pair_tolerances(dtype, difference) if dtype != torch.float32 else (difference, 0)
            )
            np.testing.assert_allclose(tensor.to_numpy().astype(np.float32), hidden, atol=atol, rtol=rtol)


def _prompts(model_dir: Path, request: ScoreRequest) -> list[list[int]]:
    text = tokenizer(model_dir)
    return [list(text(str(request.query or "") + str(item))["input_ids"]) for item in request.items]


# Every decoder family in both PRM layouts; a judge-only family (Gemma 4's text model) as a causal LM.
@pytest.mark.parametrize(
    ("architecture", "kind"),
    [*((a, k) for a in DECODERS for k in ("head", "lm")), *((a, "lm") for a in JUDGE_ONLY)],
)
def test_process_rewards_at_every_step_match_hf(prm_root: str, architecture: str, kind: str) -> None:
    model_dir = _prm_dir(prm_root, architecture, kind)
    scorer = _scorer(model_dir)
    labels = _labels(model_dir) if kind == "lm" else None
    request = ScoreRequest(
        "steps", items=_items(kind), query=QUERY, token_outputs="steps", apply_softmax=True,
        label_token_ids=labels, return_token_hidden_states=True,
    )  # fmt: skip
    (result,) = scorer.score([request])
    prompts = _prompts(model_dir, request)
    separator = tokenizer(model_dir)(PRM_SEPARATORS[kind], add_special_tokens=False)["input_ids"][0]
    # zero, one and four steps, at the separator tokens, in order
    assert result.token_positions == tuple(
        tuple(i for i, t in enumerate(p) if t == separator) for p in prompts
    )
    assert [len(at) for at in result.token_positions] == [0, 1, 4]
    _check_request(scorer, model_dir, kind, request, result, prompts)
    # An item without a step: empty outputs of the right width, and its item score as ever.
    assert result.token_scores is not None and result.token_scores[0].shape == (0, 2)
    assert len(result.scores[0]) == 2


@pytest.mark.parametrize("architecture", DECODERS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_outputs_at_every_token_and_a_range_match_hf(prm_root: str, architecture: str, dtype: str) -> None:
    model_dir = _prm_dir(prm_root, architecture, "head")
    scorer = _scorer(model_dir)
    requests = [
        ScoreRequest(
            f"tokens-{index}",
            items=_items("head"),
            query=QUERY,
            token_outputs="tokens",
            token_range=span,
            return_token_hidden_states=True,
            hidden_states_dtype=dtype,
        )
        for index, span in enumerate([None, (2, 7), (-3, None)])
    ]
    results = scorer.score(requests)
    for request, result in zip(requests, results, strict=True):
        prompts = _prompts(model_dir, request)
        span = request.token_range or (None, None)
        assert result.token_positions == tuple(tuple(range(len(p))[span[0] : span[1]]) for p in prompts)
        _check_request(scorer, model_dir, "head", request, result, prompts)


def test_steps_inside_a_shared_prefix_and_in_the_suffixes(prm_root: str) -> None:
    """The query holds two steps: they lie in the prefix the items share, computed once; the items' own
    steps lie in their suffixes."""
    model_dir = _prm_dir(prm_root, "llama", "head")
    scorer = _scorer(model_dir, share_prefix_min_tokens=4)
    separator = PRM_SEPARATORS["head"]
    request = ScoreRequest(
        "shared", items=_items("head"), query=f"{QUERY} Known{separator} facts{separator} ",
        token_outputs="steps", return_token_hidden_states=True,
    )  # fmt: skip
    prompts = _prompts(model_dir, request)
    assert scorer.plan.shared_prefixes(prompts), "the items must share their query's tokens"
    (result,) = scorer.score([request])
    assert [len(at) for at in result.token_positions or ()] == [2, 3, 6]
    _check_request(scorer, model_dir, "head", request, result, prompts)


@pytest.mark.parametrize("settings", [{"deterministic": True}, {"last_layer_pooled_rows": True}])
def test_token_outputs_on_the_deterministic_and_restricted_last_layer_paths(
    prm_root: str, settings: dict[str, Any]
) -> None:
    model_dir = _prm_dir(prm_root, "qwen3", "lm")
    extra: dict[str, Any] = {}
    if "last_layer_pooled_rows" in settings:  # the varlen path, where the last layer computes the rows read
        extra = {"attention": "varlen", "varlen_kernel": CpuVarlenKernelGqa(), "compile": "off"}
    scorer = _scorer(model_dir, **settings, **extra)
    if extra:
        assert scorer.executor.pooled_layer is not None
    request = ScoreRequest(
        "paths", items=_items("lm"), query=QUERY, token_outputs="steps", label_token_ids=_labels(model_dir),
        return_token_hidden_states=True, return_pooled_hidden_states=True,
    )  # fmt: skip
    plain = ScoreRequest("plain", items=["a plain item"], query=QUERY, label_token_ids=_labels(model_dir))
    result, other = scorer.score([request, plain])
    assert other.ok and other.token_positions is None
    _check_request(scorer, model_dir, "lm", request, result, _prompts(model_dir, request))


def test_hidden_states_only_and_the_size_bound(prm_root: str) -> None:
    model_dir = _prm_dir(prm_root, "mistral", "head")
    scorer = _scorer(model_dir)
    request = ScoreRequest(
        "hidden-only", items=_items("head"), token_outputs="tokens", return_token_scores=False,
        return_token_hidden_states=True, hidden_states_dtype="bfloat16", metadata={"k": 1},
    )  # fmt: skip
    prepared = scorer.prepare(request)
    assert not isinstance(prepared, ScoreResult)
    (result,) = scorer.score([request])
    assert result.token_scores is None and result.token_hidden_states is not None
    assert decode_result(encode_result(result)) == result
    size = len(encode_result(result))
    bound = result_size_bound(
        request,
        result.model,
        len(request.items),
        scorer.num_labels,
        scorer.hidden_size,
        prepared.num_positions,
    )
    assert size <= bound


def test_step_separator_errors_before_any_model_work(prm_root: str, tiny_llama_dir: Path) -> None:
    prm = _scorer(_prm_dir(prm_root, "llama", "head"))
    plain = _scorer(tiny_llama_dir)
    cases = [
        (plain, ScoreRequest("none", items=["a"], token_outputs="steps")),  # no separator anywhere
        (prm, ScoreRequest("two", items=["a"], token_outputs="steps", step_separator="two words")),
        (prm, ScoreRequest("outside", items=["a"], token_outputs="steps", step_separator=10**6)),
    ]
    for scorer, request in cases:
        result = scorer.prepare(request)
        assert isinstance(result, ScoreResult) and result.error is not None, request.request_id
        assert result.error.code is ErrorCode.STEP_SEPARATOR_INVALID
    # A request's own separator (by id) on a model that declares none.
    separator = tokenizer(tiny_llama_dir)("boats", add_special_tokens=False)["input_ids"]
    request = ScoreRequest("own", items=["the boats"], token_outputs="steps", step_separator=separator[-1])
    (result,) = plain.score([request])
    assert result.ok and result.token_positions is not None and len(result.token_positions[0]) == 1


def test_cross_encoders_give_hidden_states_at_tokens_but_no_token_scores(model_dirs_encoders: Any) -> None:
    model_dir = model_dirs_encoders
    scorer = _scorer(model_dir)
    refused = scorer.prepare(ScoreRequest("scores", items=["a b"], query="q", token_outputs="tokens"))
    assert isinstance(refused, ScoreResult) and refused.error is not None
    assert refused.error.code is ErrorCode.TOKEN_OUTPUTS_NOT_SUPPORTED
    request = ScoreRequest(
        "hidden", items=["a b c"], query="q", token_outputs="tokens", return_token_scores=False,
        return_token_hidden_states=True,
    )  # fmt: skip
    (result,) = scorer.score([request])
    assert result.ok and result.token_hidden_states is not None
    base = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    encoded = tokenizer(model_dir)("q", "a b c", return_tensors="pt")
    with torch.inference_mode():
        expected = base(**encoded).last_hidden_state[0].numpy()
    got = result.token_hidden_states[0].to_numpy()
    atol = forward_bound(
        torch.float32,
        length=forward_length(model_dir, expected.shape[0]),
        magnitude=max(1.0, float(np.abs(expected).max())),
    )
    np.testing.assert_allclose(got, expected, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def model_dirs_encoders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("bert") / "bert", "bert", seed=5)

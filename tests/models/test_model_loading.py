"""Loading errors, configuration checks and the tiny-model writer (library and command line)."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from scoring_testkit import (
    assert_forward_close,
    forward_atol,
    hf_reference,
    hidden_of,
    scores_of,
    self_check_atol,
    tokenize,
)
from tolerances import FUNCTION_ULPS, assert_within, gamma, rounding_bound, sum_bound, unit_roundoff
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import logging as hf_logging

from models import ModelLoadError, Scorer, ScorerConfig, loading, tiny, write_tiny_model
from schemas import ScoreRequest


def _copy_with_config(source: Path, target: Path, **changes: object) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        Scorer(tmp_path / "missing", ScorerConfig(device="cpu"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        Scorer(tmp_path / "file", ScorerConfig(device="cpu"))


def test_no_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        Scorer(tmp_path, ScorerConfig(device="cpu"))


def test_unreadable_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        Scorer(tmp_path, ScorerConfig(device="cpu"))


def test_not_a_sequence_classifier(tiny_llama_dir: Path, tmp_path: Path) -> None:
    causal = _copy_with_config(tiny_llama_dir, tmp_path / "lm", architectures=["LlamaForCausalLM"])
    with pytest.raises(ModelLoadError, match="ForSequenceClassification"):
        Scorer(causal, ScorerConfig(device="cpu"))


def test_unsupported_architecture(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = _copy_with_config(
        tiny_llama_dir, tmp_path / "gpt2", model_type="gpt2", architectures=["GPT2ForSequenceClassification"]
    )
    with pytest.raises(ModelLoadError, match=r"not supported.*llama"):
        Scorer(other, ScorerConfig(device="cpu"))


def test_judge_only_and_unserved_families_say_what_loads(tmp_path: Path) -> None:
    """Gemma 4's text model loads as a judge only; its multimodal wrapper, and bidirectional attention over
    every token, are refused with what to do instead."""
    judge = write_tiny_model(tmp_path / "gemma4", "gemma4_text", seed=2)
    assert Scorer(judge, ScorerConfig(device="cpu")).model.judge  # written as a judge whatever was asked
    classifier = _copy_with_config(
        judge, tmp_path / "classifier", architectures=["Gemma4ForSequenceClassification"]
    )
    with pytest.raises(ModelLoadError, match="no sequence classifier for 'gemma4_text'"):
        Scorer(classifier, ScorerConfig(device="cpu"))
    wrapper = _copy_with_config(
        judge, tmp_path / "wrapper", model_type="gemma4", architectures=["Gemma4ForConditionalGeneration"]
    )
    with pytest.raises(ModelLoadError, match="'gemma4_text', Gemma4ForCausalLM"):
        Scorer(wrapper, ScorerConfig(device="cpu"))
    both_ways = _copy_with_config(judge, tmp_path / "bidirectional", use_bidirectional_attention="all")
    with pytest.raises(ModelLoadError, match="packed engine's sequences are causal"):
        Scorer(both_ways, ScorerConfig(device="cpu"))
    with pytest.raises(ValueError, match="judge only"):
        write_tiny_model(tmp_path / "prm", "gemma4_text", prm="head")


def test_missing_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    broken = _copy_with_config(tiny_llama_dir, tmp_path / "noweights")
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="cannot load the model"):
        Scorer(broken, ScorerConfig(device="cpu"))


def test_broken_tokenizer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    broken = _copy_with_config(tiny_llama_dir, tmp_path / "badtok")
    (broken / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        Scorer(broken, ScorerConfig(device="cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is missing")
def test_cuda_requested_without_cuda(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        Scorer(tiny_llama_dir, ScorerConfig(device="cuda"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dtype": "float64"}, "dtype"),
        ({"attention": "flash"}, "attention"),
        ({"max_batch_tokens": 0}, "max_batch_tokens"),
        ({"max_input_tokens": 0}, "max_input_tokens"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_config_validation(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScorerConfig(**fields)  # type: ignore[arg-type]


def test_defaults_on_cpu(tiny_llama_dir: Path) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    assert scorer.dtype == torch.float32 and scorer.attention == "reference"
    bf16 = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", dtype="bfloat16"))
    (result,) = bf16.score(
        [ScoreRequest(request_id="x", items=("hello there",), return_pooled_hidden_states=True)]
    )
    assert result.ok and result.pooled_hidden_states is not None  # bf16 weights on CPU run too


def test_write_tiny_model_is_deterministic(tmp_path: Path) -> None:
    first = write_tiny_model(tmp_path / "a", "qwen2", seed=5, num_labels=3)
    second = write_tiny_model(tmp_path / "b", "qwen2", seed=5, num_labels=3)
    other = write_tiny_model(tmp_path / "c", "qwen2", seed=6, num_labels=3)
    names = sorted(p.name for p in first.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["pad_token_id"] == 0
    assert AutoConfig.from_pretrained(str(first)).num_labels == 3


def test_tiny_tokenizer_adds_bos(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = tokenizer("the reward model", add_special_tokens=True)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == 2 and len(ids) > 1
    assert tokenizer.pad_token_id == 0 and tokenizer.unk_token_id == 1


def test_make_tiny_model_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    tiny.add_arguments(parser)
    args = parser.parse_args(
        [str(tmp_path / "m"), "--architecture", "mistral", "--seed", "3", "--num-labels", "2"]
    )
    assert tiny.run(args) == 0
    assert "mistral" in capsys.readouterr().out
    scorer = Scorer(tmp_path / "m", ScorerConfig(device="cpu"))
    (result,) = scorer.score([ScoreRequest(request_id="x", items=("hello",))])
    assert result.ok and len(result.scores[0]) == 2
    bad = parser.parse_args([str(tmp_path / "n"), "--num-labels", "0"])
    assert tiny.run(bad) == 2
    # A process reward model of each family: its step separator declared, its steps scored.
    for kind in tiny.PRM_KINDS:
        assert (
            tiny.run(parser.parse_args([str(tmp_path / kind), "--architecture", "qwen2", "--prm", kind])) == 0
        )
        assert "process reward model" in capsys.readouterr().out
        prm = Scorer(tmp_path / kind, ScorerConfig(device="cpu"))
        labels = prm.prompt_builder.tokenizer.convert_tokens_to_ids(list(tiny.PRM_LABELS))
        item = f"one{tiny.PRM_SEPARATORS[kind]} two{tiny.PRM_SEPARATORS[kind]}"
        request = ScoreRequest(
            "p", items=(item,), token_outputs="steps", label_token_ids=labels if kind == "lm" else None
        )
        (stepped,) = prm.score([request])
        assert stepped.ok and stepped.token_positions is not None and len(stepped.token_positions[0]) == 2
    assert tiny.run(parser.parse_args([str(tmp_path / "e"), "--architecture", "bert", "--prm", "head"])) == 2
    # A family without a classifier in transformers is written as a judge.
    assert tiny.run(parser.parse_args([str(tmp_path / "g"), "--architecture", "gemma4_text"])) == 0
    assert "judge" in capsys.readouterr().out
    assert Scorer(tmp_path / "g", ScorerConfig(device="cpu")).model.judge


def test_attention_choice_follows_device_and_dtype() -> None:
    # The flash-based varlen kernel has no float32: float32 on CUDA must take the exact path, not fail.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = ScorerConfig()
    assert auto.resolve_attention(cuda, torch.bfloat16) == "varlen"
    assert auto.resolve_attention(cuda, torch.float16) == "varlen"
    assert auto.resolve_attention(cuda, torch.float32) == "reference"
    assert auto.resolve_attention(cpu, torch.bfloat16) == "reference"
    with pytest.raises(ValueError, match="float16 or bfloat16 only"):
        ScorerConfig(attention="varlen").resolve_attention(cuda, torch.float32)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ScorerConfig(attention="varlen").resolve_attention(cpu, torch.bfloat16)


def test_soft_capped_attention_takes_the_exact_path_or_is_refused(tiny_gemma2_dir: Path) -> None:
    """The varlen kernel cannot cap logits: 'auto' falls back to the exact path, 'varlen' is refused."""
    cuda = torch.device("cuda")
    assert ScorerConfig().resolve_attention(cuda, torch.bfloat16, softcap=50.0) == "reference"
    with pytest.raises(ValueError, match="caps attention logits"):
        ScorerConfig(attention="varlen").resolve_attention(cuda, torch.bfloat16, softcap=50.0)

    def kernel(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the varlen kernel must not run for a soft-capped model")

    with pytest.raises(ModelLoadError, match="caps attention logits"):
        Scorer(tiny_gemma2_dir, ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel))
    assert Scorer(tiny_gemma2_dir, ScorerConfig(device="cpu")).info.attention == "reference"


def test_checkpoint_without_head_weights_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # A causal-LM checkpoint under a classifier config: HF would give it a freshly initialised random head,
    # warn once in a log, and every score would be noise. That must stop the start-up instead.
    broken = _copy_with_config(tiny_llama_dir, tmp_path / "nohead")
    weights = load_file(broken / "model.safetensors")
    del weights["score.weight"]
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"score\.weight") as error:
        Scorer(broken, ScorerConfig(device="cpu"))
    assert "randomly initialised" in str(error.value) and str(error.value).endswith(".")


def test_extra_checkpoint_weights_are_allowed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # Weights the classifier does not use (e.g. an lm_head kept from training) change nothing.
    extra = _copy_with_config(tiny_llama_dir, tmp_path / "extra")
    weights = load_file(extra / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, extra / "model.safetensors", metadata={"format": "pt"})
    request = ScoreRequest(request_id="x", items=("hello there",))
    (with_extra,) = Scorer(extra, ScorerConfig(device="cpu")).score([request])
    (plain,) = Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).score([request])
    # The same values through the same code, but read from another file: the weights lie at other offsets,
    # and MKL may block a GEMM differently for other alignments. Two float32 forwards at most
    # (forward_atol); a weight the head used, or lost, would move the score by its whole scale.
    longest = len(tokenize(tiny_llama_dir, "hello there"))
    assert_forward_close(with_extra.scores, plain.scores, tiny_llama_dir, longest=longest)


def test_loading_and_writing_print_no_progress_bars(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    capfd.readouterr()
    model_dir = write_tiny_model(tmp_path / "m", "qwen2", seed=9)
    Scorer(model_dir, ScorerConfig(device="cpu"))
    captured = capfd.readouterr()
    for bar in ("Loading weights", "Writing model shards", "it/s"):
        assert bar not in captured.err + captured.out, captured.err
    # The switch is scoped to our own calls: a caller's progress bars keep their setting.
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        Scorer(model_dir, ScorerConfig(device="cpu"))
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def test_weights_load_straight_onto_a_gpu_when_transformers_can(monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers needs accelerate for a device_map; without it the engine loads on the host and moves.
    cuda = torch.device("cuda", 1)
    monkeypatch.setattr(loading, "is_accelerate_available", lambda: True)
    assert loading._placement(cuda) == {"device_map": {"": cuda}}
    assert loading._placement(torch.device("cpu")) == {}
    monkeypatch.setattr(loading, "is_accelerate_available", lambda: False)
    assert loading._placement(cuda) == {}


def test_a_head_bias_in_the_checkpoint_is_loaded_not_dropped(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """HF's decoder classifiers have a bias-free head and drop `score.bias` with a log line; we add it."""

    biased = _copy_with_config(tiny_llama_dir, tmp_path / "biased")
    weights = load_file(biased / "model.safetensors")
    weights["score.bias"] = torch.tensor([0.75])
    save_file(weights, biased / "model.safetensors", metadata={"format": "pt"})
    request = ScoreRequest(
        request_id="r", items=("The quick brown fox.", "Yes"), return_pooled_hidden_states=True
    )
    with_bias = Scorer(biased, ScorerConfig(device="cpu")).score([request])[0]
    without = Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).score([request])[0]
    prompts = [tokenize(tiny_llama_dir, t) for t in ("The quick brown fox.", "Yes")]
    reference = hf_reference(tiny_llama_dir, prompts)
    longest = max(len(p) for p in prompts)
    # The engine and HF, both float32 (forward_atol); the bias is one more rounding of the sum, in the
    # engine's head and in this float32 addition (u of |score| each).
    shifted = reference.logits + np.float32(0.75)
    atol = forward_atol(tiny_llama_dir, shifted, longest=longest)
    atol += 2 * rounding_bound(torch.float32, float(np.abs(shifted).max()))
    np.testing.assert_allclose(scores_of(with_bias), shifted, atol=atol, rtol=0)
    assert_forward_close(scores_of(without), reference.logits, tiny_llama_dir, longest=longest)
    # The head comes after the state: the same trunk, read from another file (other weight offsets, so
    # possibly other GEMM blocking): two float32 forwards at most.
    assert_forward_close(hidden_of(with_bias), hidden_of(without), tiny_llama_dir, longest=longest)


@pytest.mark.parametrize(
    "extra",
    [{"score.1.weight": torch.zeros(1, 1)}, {"score.bias": torch.zeros(3)}],
    ids=["unknown-head-layer", "bias-of-the-wrong-shape"],
)
def test_head_weights_the_model_does_not_use_are_fatal(
    extra: dict[str, torch.Tensor], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    odd = _copy_with_config(tiny_llama_dir, tmp_path / "odd")
    weights = load_file(odd / "model.safetensors")
    weights.update(extra)
    save_file(weights, odd / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="head weights the model's own head does not use") as error:
        Scorer(odd, ScorerConfig(device="cpu"))
    assert next(iter(extra)) in str(error.value)


def test_a_trl_value_head_makes_a_causal_lm_a_reward_model(tmp_path: Path) -> None:
    """TRL's AutoModelForCausalLMWithValueHead saves v_head.summary.* beside the causal LM: the score is that
    head on the last token's final hidden state, not label logits."""
    from models.selfcheck import run_self_check

    model_dir = write_tiny_model(tmp_path / "valued", "llama", seed=3, judge=True)
    weights = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(1, 64, generator=generator), torch.tensor([0.25])
    weights.update({"v_head.summary.weight": weight, "v_head.summary.bias": bias})
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    scorer = Scorer(model_dir, ScorerConfig(device="cpu"))
    assert not scorer.model.judge and scorer.info.pooling == "last_token"
    prompt = (12, 40, 77, 9, 0)  # ends in the pad id: a value head reads the true last token anyway
    result = scorer.score([ScoreRequest(request_id="r", items=(prompt,), return_pooled_hidden_states=True)])[
        0
    ]
    assert result.ok and result.pooled_hidden_states is not None
    hidden = torch.from_numpy(result.pooled_hidden_states[0].to_numpy().copy())
    # The value head twice in float32 (the engine's and this product): 64 terms and the bias, each within
    # gamma(65) of sum |w h| + |b|.
    magnitude = (hidden.abs() @ weight.abs().T + bias.abs()).numpy()
    bound = sum_bound(torch.float32, 64 + 1, magnitude, implementations=2)
    assert_within(result.scores[0], (hidden @ weight.T + bias).numpy(), bound)
    report = run_self_check(scorer)
    assert report.max_score_diff < self_check_atol(model_dir, report)
    labelled = ScoreRequest(request_id="l", items=(prompt,), label_token_ids=(5,))
    assert scorer.score([labelled])[0].error.code.value == "LABEL_IDS_NOT_SUPPORTED"  # type: ignore[union-attr]


def _with_mlp_head(tiny_llama_dir: Path, target: Path, declared: object) -> tuple[Path, torch.nn.Module]:
    model_dir = _copy_with_config(tiny_llama_dir, target)
    weights = load_file(model_dir / "model.safetensors")
    del weights["score.weight"]
    generator = torch.Generator().manual_seed(1)
    head = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    weights.update({f"score.{key}": value.clone() for key, value in head.state_dict().items()})
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    if declared is not None:
        config["score_worker_head"] = declared
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir, head


def test_a_declared_mlp_head_is_loaded_and_applied(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir, head = _with_mlp_head(tiny_llama_dir, tmp_path / "mlp", {"type": "mlp", "activation": "gelu"})
    scorer = Scorer(model_dir, ScorerConfig(device="cpu"))
    request = ScoreRequest(request_id="r", items=("The quick brown fox.",), return_pooled_hidden_states=True)
    result = scorer.score([request])[0]
    assert result.ok and result.pooled_hidden_states is not None
    hidden = torch.from_numpy(result.pooled_hidden_states[0].to_numpy().copy())
    with torch.no_grad():
        expected = head(hidden).numpy()
    # The head twice in float32 (the engine's and this call): Linear(64, 16) within gamma(65) of
    # |W1||h| + |b1|, GELU carrying that with slope at most 1.13 plus erf's and its products' roundings
    # ((2 FUNCTION_ULPS + 3) u of |g|), then Linear(16, 1) carrying it by |W2| plus its own gamma(17).
    first, second = head[0], head[2]
    u = unit_roundoff(torch.float32)
    w1, b1, w2, b2 = (t.detach().double() for t in (first.weight, first.bias, second.weight, second.bias))
    h = hidden.double()
    g = torch.nn.functional.gelu(h @ w1.T + b1)
    g_error = 1.13 * gamma(65) * (h.abs() @ w1.abs().T + b1.abs()) + (2 * FUNCTION_ULPS + 3) * u * g.abs()
    bound = g_error @ w2.abs().T + gamma(17) * (g.abs() @ w2.abs().T + b2.abs())
    assert_within(result.scores[0], expected, 2 * bound)


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        (None, r"weights for score\.weight"),
        ({"type": "mlp", "activation": "swish"}, "activation"),
    ],
    ids=["undeclared", "unknown-activation"],
)
def test_an_mlp_head_must_be_declared_properly(
    declared: object, message: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir, _ = _with_mlp_head(tiny_llama_dir, tmp_path / "mlp", declared)
    with pytest.raises(ModelLoadError, match=message):
        Scorer(model_dir, ScorerConfig(device="cpu"))


_CUSTOM_CODE = """
import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel, LlamaPreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutputWithPast


class HouseConfig(LlamaConfig):
    model_type = "house-llama"


class HouseForSequenceClassification(LlamaPreTrainedModel):
    config_class = HouseConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, output_hidden_states=None,
                **kw):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         output_hidden_states=output_hidden_states, **kw)
        logits = self.score(out.last_hidden_state)
        last = (input_ids != self.config.pad_token_id).int().cumsum(-1).argmax(-1)
        pooled = logits[torch.arange(logits.shape[0]), last]
        return SequenceClassifierOutputWithPast(logits=pooled, hidden_states=out.hidden_states)
"""


def test_a_model_with_its_own_code_loads_only_on_opt_in(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Remote code runs when loaded: refused by default; with trust_remote_code it takes the plain path,
    scored like the model it wraps, and the self-check guards it."""
    from models.selfcheck import run_self_check

    custom = _copy_with_config(tiny_llama_dir, tmp_path / "house")
    (custom / "house_model.py").write_text(_CUSTOM_CODE)
    config = json.loads((custom / "config.json").read_text())
    config.update(
        model_type="house-llama",
        architectures=["HouseForSequenceClassification"],
        auto_map={
            "AutoConfig": "house_model.HouseConfig",
            "AutoModelForSequenceClassification": "house_model.HouseForSequenceClassification",
        },
    )
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="ships its own model code"):
        Scorer(custom, ScorerConfig(device="cpu"))
    scorer = Scorer(custom, ScorerConfig(device="cpu", trust_remote_code=True))
    assert scorer.info.attention == "plain" and scorer.info.architecture == "HouseForSequenceClassification"
    request = ScoreRequest(request_id="r", items=("The quick brown fox.", "Yes"))
    same = Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).score([request])[0]
    # HF's padded forward of its own code vs the packed engine: two float32 forwards (forward_atol).
    longest = max(len(p) for p in scorer.prepare(request).prompts)
    assert_forward_close(scorer.score([request])[0].scores, same.scores, tiny_llama_dir, longest=longest)
    report = run_self_check(scorer)
    assert report.max_score_diff < self_check_atol(custom, report)


def _pickle_only_copy(source: Path, target: Path) -> Path:
    """The same model with its weights as pytorch_model.bin (a pickle) instead of safetensors."""
    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    torch.save(load_file(str(weights)), target / "pytorch_model.bin")
    weights.unlink()
    return target


def test_pickle_weights_load_only_on_opt_in(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Unpickling can run code hidden in the file: a directory with only pickle weights is refused, naming the
    setting that allows it; with the setting it scores like the safetensors original."""
    pickled = _pickle_only_copy(tiny_llama_dir, tmp_path / "pickled")
    with pytest.raises(ModelLoadError) as info:
        Scorer(pickled, ScorerConfig(device="cpu"))
    message = str(info.value)
    assert "pytorch_model.bin" in message and "safetensors" in message
    assert "allow_pickle_weights" in message and "SCORE_WORKER_ALLOW_PICKLE_WEIGHTS" in message
    request = ScoreRequest(request_id="r", items=("The quick brown fox.", "Yes"))
    scorer = Scorer(pickled, ScorerConfig(device="cpu", allow_pickle_weights=True))
    scores = scorer.score([request])[0].scores
    same = Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).score([request])[0].scores
    # The same values through the same code, but unpickled copies rather than a file mapping: other
    # addresses, so possibly other GEMM blocking. Two float32 forwards at most (forward_atol).
    longest = max(len(p) for p in scorer.prepare(request).prompts)
    assert_forward_close(scores, same, tiny_llama_dir, longest=longest)


def test_pickle_weights_with_fp8_load_through_hf_and_quantize(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """FP8 decoders with safetensors load layer by layer; pickle-only weights (opted into) have no file to
    read slices from and keep HF's own loading, quantized after it."""
    from models.fp8 import Fp8Linear
    from models.tensor_parallel import RowParallelLinear

    pickled = _pickle_only_copy(tiny_llama_dir, tmp_path / "pickled")
    scorer = Scorer(pickled, ScorerConfig(device="cpu", quantization="fp8", allow_pickle_weights=True))
    layer = scorer.hf_model.base_model.layers[0]
    assert not isinstance(layer.self_attn.o_proj, RowParallelLinear)
    assert isinstance(layer.self_attn.o_proj, Fp8Linear)
    assert scorer.score([ScoreRequest(request_id="r", items=("The quick brown fox.",))])[0].ok


def test_transformers_is_always_told_no_remote_code_and_safetensors_only(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every from_pretrained call of a default load, the ones transformers makes inside included."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    calls: list[tuple[str, object, object]] = []
    for cls in (AutoConfig, AutoTokenizer, AutoModelForSequenceClassification, AutoModelForCausalLM):
        original = cls.from_pretrained

        def spy(
            *args: object, _name: str = cls.__name__, _original: object = original, **kwargs: object
        ) -> object:
            calls.append((_name, kwargs.get("trust_remote_code", "absent"), kwargs.get("use_safetensors")))
            return _original(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(cls, "from_pretrained", spy)
    Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    names = {name for name, _, _ in calls}
    assert {"AutoModelForSequenceClassification", "AutoTokenizer", "AutoConfig"} <= names, calls
    assert all(trust is False for _, trust, _ in calls), calls
    assert [safe for name, _, safe in calls if name.startswith("AutoModel")] == [True]


def test_a_tokenizer_that_ships_its_own_code_never_runs_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """auto_map in tokenizer_config.json (config.json has none, so nothing asks for trust): the module it
    names is never imported, whether the tokenizer then loads with its built-in class or is refused."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    marker = tmp_path / "tokenizer-code-ran"
    (model / "house_tokenizer.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast as HouseTokenizer\n"
    )
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "house_tokenizer.HouseTokenizer"]}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with contextlib.suppress(ModelLoadError):
        Scorer(model, ScorerConfig(device="cpu"))
    assert not marker.exists()

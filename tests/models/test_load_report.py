"""The log says what happened at load: transformers' load report calls the weights the engine places
itself (a process reward model's MLP head, a head's bias, a TRL value head) UNEXPECTED, and the linear head
it built in their place MISSING and "newly initialized"; that report is held back for them
(models/load_report.py). A checkpoint that really lacks weights is still refused, with HF's report."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import ModelLoadError, Scorer, ScorerConfig, write_tiny_model
from schemas import ScoreRequest

WRONG = ("LOAD REPORT", "MISSING", "UNEXPECTED", "newly initialized")


@pytest.fixture
def load_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every record of the load: transformers' own logger does not propagate to the root outside CI."""
    hf = logging.getLogger("transformers")
    hf.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG)
    try:
        yield caplog
    finally:
        hf.removeHandler(caplog.handler)


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Each record once: where another test of the process turned transformers' propagation on, the
    handler sees a record both on transformers' logger and again at the root."""
    return list({id(record): record for record in caplog.records}.values())


def _said(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(record.getMessage() for record in _records(caplog))


def _rewritten(source: Path, target: Path, change: dict[str, torch.Tensor | None]) -> Path:
    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    for key, value in change.items():
        if value is None:
            del weights[key]
        else:
            weights[key] = value
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_a_process_reward_models_head_loads_without_a_report_saying_otherwise(
    tmp_path: Path, load_logs: pytest.LogCaptureFixture
) -> None:
    model_dir = write_tiny_model(tmp_path / "prm", "qwen2", prm="head")
    load_logs.clear()
    scorer = Scorer(model_dir, ScorerConfig(device="cpu"))
    said = _said(load_logs)
    assert not [word for word in WRONG if word in said], said
    head = scorer.model.head
    assert isinstance(head, torch.nn.Sequential) and head[-1].out_features == 2, "the declared MLP head"
    (result,) = scorer.score([ScoreRequest(request_id="p", items=("one step <extra_0>",))])
    assert result.error is None


def test_a_head_bias_is_not_reported_unexpected(
    tiny_llama_dir: Path, tmp_path: Path, load_logs: pytest.LogCaptureFixture
) -> None:
    biased = _rewritten(tiny_llama_dir, tmp_path / "biased", {"score.bias": torch.tensor([0.5])})
    load_logs.clear()
    scorer = Scorer(biased, ScorerConfig(device="cpu"))
    assert not [word for word in WRONG if word in _said(load_logs)], _said(load_logs)
    assert scorer.model.head.bias is not None and float(scorer.model.head.bias.detach()) == 0.5


def test_weights_left_out_are_named_once_as_such(
    tiny_llama_dir: Path, tmp_path: Path, load_logs: pytest.LogCaptureFixture
) -> None:
    embed = load_file(tiny_llama_dir / "model.safetensors")["model.embed_tokens.weight"]
    extra = _rewritten(tiny_llama_dir, tmp_path / "extra", {"lm_head.weight": embed.clone()})
    load_logs.clear()
    Scorer(extra, ScorerConfig(device="cpu"))
    said = _said(load_logs)
    assert "LOAD REPORT" not in said
    infos = [r for r in _records(load_logs) if "lm_head.weight" in r.getMessage()]
    assert len(infos) == 1 and infos[0].levelno == logging.INFO and "left out" in infos[0].getMessage()


def test_a_checkpoint_without_its_head_is_refused_and_hfs_report_kept(
    tiny_llama_dir: Path, tmp_path: Path, load_logs: pytest.LogCaptureFixture
) -> None:
    broken = _rewritten(tiny_llama_dir, tmp_path / "nohead", {"score.weight": None})
    load_logs.clear()
    with pytest.raises(ModelLoadError, match=r"score\.weight"):
        Scorer(broken, ScorerConfig(device="cpu"))
    reports = [r for r in _records(load_logs) if "LOAD REPORT" in r.getMessage()]
    assert len(reports) == 1 and "MISSING" in reports[0].getMessage()

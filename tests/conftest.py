"""Shared test fixtures: tiny random-weight models generated once per test session (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels (models/triton_attention.py) run in Triton's interpreter on CPU tensors.
# Triton reads the choice when it is imported, which importing `models` does: so it is made here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LlamaForSequenceClassification (1 label) with its tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0, num_labels=1)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3ForSequenceClassification (head_dim != hidden/heads, q/k norms) with its tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", seed=1, num_labels=1)

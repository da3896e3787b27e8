"""The small models of every architecture that the GPU tests check against HuggingFace, written once."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from architecture_check import write_models


@pytest.fixture(scope="session")
def architecture_models() -> Iterator[dict[str, Path]]:
    """Every tiny architecture of models.write_tiny_model, plus the 4:1 grouped-query llama (GQA_MODEL)."""
    with tempfile.TemporaryDirectory() as tmp:
        yield write_models(Path(tmp))


@pytest.fixture
def strict_float32() -> Iterator[None]:
    """Float32 products rounded as float32 (no TF32: the patch embedding is a convolution, which cuDNN
    would otherwise run in TF32, 10 bits of mantissa), so a test's float32 bound holds."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved

"""The small models of every architecture that the GPU tests check against HuggingFace, written once."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from architecture_check import write_models


@pytest.fixture(scope="session")
def architecture_models() -> Iterator[dict[str, Path]]:
    """Every tiny architecture of models.write_tiny_model, plus the 4:1 grouped-query llama (GQA_MODEL)."""
    with tempfile.TemporaryDirectory() as tmp:
        yield write_models(Path(tmp))

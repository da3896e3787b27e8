"""Shared by the fault kit: the words of generated requests, topic layout, and how figures are printed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

WORKER_BIN = Path(sys.executable).with_name("score-worker")
PARTITIONS = 4
_WORD_TEXT = (
    "the quick brown fox jumps over lazy dog reward model reads prompt and response then returns single "
    "number good answers are helpful honest harmless streaming workers batch tokens publish results"
)
WORDS = _WORD_TEXT.split()


def figures(name: str, **values: Any) -> None:
    """One line of measured figures, for `pytest -s` readers."""
    shown = ", ".join(
        f"{key} {value:.2f}" if isinstance(value, float) else f"{key} {value}"
        for key, value in values.items()
    )
    print(f"\nFIGURES {name}: {shown}")

"""Static checks run as part of the test command: ruff (lint and format) everywhere, mypy on the packages,
and the layering contract of pyproject.toml's [tool.importlinter] (schemas <- models <- worker, no import
circle inside a package)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.parametrize(
    "args",
    [
        ("ruff", "check", "."),
        ("ruff", "format", "--check", "."),
    ],
    ids=["ruff-lint", "ruff-format"],
)
def test_ruff(args: tuple[str, ...]) -> None:
    proc = _run(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy() -> None:
    # The file list and strictness (strict on schemas/) live in pyproject.toml, so editors and CI agree.
    proc = _run("mypy", "--no-error-summary")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_layers_and_no_circles() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

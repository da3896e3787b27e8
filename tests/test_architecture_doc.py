"""docs/architecture.md names only what exists: every module or file of the repository it mentions
(`worker/sink.py`, or `models/engine` in its diagram), and every class, constant or method it names in
backticks (`Scorer.launch`, `ErrorCode`, `EMPTY_INPUT`) is defined in the packages."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("schemas", "models", "worker")
_FENCED = re.compile(r"```.*?```", re.DOTALL)
_QUOTED = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"\b(?:schemas|models|worker|tests|bench|deploy|docs)/[\w./-]*\w")
_NAME = re.compile(r"^([A-Z][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?")


def defined_names() -> set[str]:
    """Every class, function, method and assigned name (module or class level) in the packages."""
    names: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(node.name)
                elif isinstance(node, ast.Assign):
                    names.update(t.id for t in node.targets if isinstance(t, ast.Name))
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
    return names


def quoted() -> list[str]:
    """What the page quotes inline (code blocks left out)."""
    return _QUOTED.findall(_FENCED.sub("", DOC.read_text(encoding="utf-8")))


def test_every_module_and_file_named_exists() -> None:
    paths = set(_PATH.findall(DOC.read_text(encoding="utf-8")))
    assert paths, "the page names no file: the pattern no longer matches how it names them"
    missing = sorted(p for p in paths if not ((ROOT / p).exists() or (ROOT / f"{p}.py").exists()))
    assert not missing, f"docs/architecture.md names modules or files that do not exist: {missing}"


def test_every_named_class_constant_and_method_exists() -> None:
    names = defined_names()
    named = [match.groups() for q in quoted() if (match := _NAME.match(q))]
    assert named, "the page names no class: the pattern no longer matches how it names them"
    missing = sorted(
        {".".join(p for p in parts if p) for parts in named if any(p and p not in names for p in parts)}
    )
    assert not missing, f"docs/architecture.md names what the packages do not define: {missing}"

"""Configuration comes from the settings layer: no code of the packages or the benchmarks outside
models/settings.py, worker/config.py and worker/environment.py reads a SCORE_WORKER_* variable itself
(`os.environ[...]`, `os.environ.get(...)`, `os.getenv(...)`, `... in os.environ`); the settings objects
are built once at start-up and handed down."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("schemas", "models", "worker", "bench")
SETTINGS_MODULES = {"models/settings.py", "worker/config.py", "worker/environment.py"}
PREFIX = "SCORE_WORKER_"
PREFIX_NAMES = {"ENV_PREFIX"}  # worker.config's name for the prefix


def _names_prefix(node: ast.expr) -> bool:
    """Whether an expression names a variable of ours: "SCORE_WORKER_X", f"{ENV_PREFIX}X", ENV_PREFIX + x."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith(PREFIX)
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.FormattedValue):
            return isinstance(first.value, ast.Name) and first.value.id in PREFIX_NAMES
        return _names_prefix(first)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _names_prefix(node.left)
    return isinstance(node, ast.Name) and node.id in PREFIX_NAMES


def _is_environ(node: ast.expr) -> bool:
    """`os.environ` or a bare `environ` (from os import environ)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_getenv(func: ast.expr) -> bool:
    """`os.getenv`, `os.getenvb` or a bare `getenv`."""
    if isinstance(func, ast.Attribute):
        return func.attr in ("getenv", "getenvb")
    return isinstance(func, ast.Name) and func.id == "getenv"


def environment_reads(source: str) -> list[int]:
    """Lines where a module reads one of our variables from the process environment."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        key: ast.expr | None = None
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault"):
                key = node.args[0] if _is_environ(func.value) else None
            elif _is_getenv(func):
                key = node.args[0]
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None and _names_prefix(key):
            lines.append(node.lineno)
    return lines


def test_only_the_settings_modules_read_score_worker_variables() -> None:
    found = {}
    scanned = 0
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            scanned += 1
            lines = environment_reads(path.read_text(encoding="utf-8"))
            if lines and module not in SETTINGS_MODULES:
                found[module] = lines
    assert scanned > 50, "the walk no longer finds the modules"
    assert not found, (
        "SCORE_WORKER_* variables read outside the settings layer (declare them on a settings class of "
        f"worker/config.py, worker/environment.py or models/settings.py and pass the value down): {found}"
    )


def test_every_way_of_reading_a_variable_is_seen() -> None:
    source = """
import os
from os import environ, getenv
a = os.environ["SCORE_WORKER_A"]
b = os.environ.get(f"{ENV_PREFIX}B", "")
c = os.getenv("SCORE_WORKER_C")
d = "SCORE_WORKER_D" in os.environ
e = environ.get(ENV_PREFIX + "E")
f = getenv("SCORE_WORKER_F")
g = os.environ.pop("SCORE_WORKER_G", None)
fine = os.environ.get("OMP_NUM_THREADS")
fine_too = {k: v for k, v in os.environ.items() if not k.startswith("SCORE_WORKER_")}
fine_as_well = {"SCORE_WORKER_H": "1"}.get("SCORE_WORKER_H")
"""
    assert environment_reads(source) == [4, 5, 6, 7, 8, 9, 10]

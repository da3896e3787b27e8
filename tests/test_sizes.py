"""docs/architecture.md's size rule for classes holds in the packages: no class over 25 methods (properties
and static or class methods count; nested functions do not), save the exceptions that page names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "models", "worker")
MAX_METHODS = 25
# "module:Class" -> its allowed count, each named on docs/architecture.md with its reason (none today).
EXCEPTIONS: dict[str, int] = {}


def method_counts(source: str) -> dict[str, int]:
    """Every class of a module (nested ones by their dotted path) and the functions its body defines."""
    counts: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                counts[name] = sum(
                    isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) for item in child.body
                )
                visit(child, f"{name}.")
            elif not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, prefix)  # classes under `if TYPE_CHECKING:` or `try:` count too

    visit(ast.parse(source), "")
    return counts


def package_counts() -> dict[str, int]:
    counts = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            for name, count in method_counts(path.read_text(encoding="utf-8")).items():
                counts[f"{module}:{name}"] = count
    return counts


def test_no_class_of_the_packages_has_over_25_methods() -> None:
    counts = package_counts()
    assert counts.get("models/engine.py:Scorer", 0) > 10, "the walk no longer finds the packages' classes"
    over = {name: count for name, count in counts.items() if count > EXCEPTIONS.get(name, MAX_METHODS)}
    assert not over, (
        f"classes over {MAX_METHODS} methods (move a cohesive group into an object of its own, or name "
        f"the exception and its reason on docs/architecture.md and here): {over}"
    )


def test_exceptions_name_classes_that_exist() -> None:
    counts = package_counts()
    assert not set(EXCEPTIONS) - set(counts), "an exception names a class the packages no longer define"


def test_the_count_takes_every_kind_of_method_and_no_nested_function() -> None:
    source = (
        "class Big:\n"
        + "".join(f"    def m{i}(self):\n        def inner(): pass\n" for i in range(24))
        + "    @property\n    def p(self): return 1\n"
        + "    async def a(self): pass\n"
        + "    class Inner:\n        def only(self): pass\n"
        + "if True:\n    class Guarded:\n        def one(self): pass\n"
    )
    assert method_counts(source) == {"Big": 26, "Big.Inner": 1, "Guarded": 1}

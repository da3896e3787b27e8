"""docs/architecture.md's size rules hold in the packages: no module over about 600 lines (held at 620), no
class over 25 methods (properties and static or class methods count; nested functions do not), no function
over 60 lines (from its `def` to its end, decorators excluded; methods and nested functions each count),
save the exceptions that page names."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "models", "worker")
MAX_MODULE_LINES = 620
MAX_METHODS = 25
MAX_FUNCTION_LINES = 60
# Each exception maps "module" or "module:Name" to its allowed size and is named on docs/architecture.md
# with its reason.
MODULE_EXCEPTIONS: dict[str, int] = {}
EXCEPTIONS: dict[str, int] = {}  # classes
FUNCTION_EXCEPTIONS: dict[str, int] = {
    # Pieces that read better whole.
    "models/attention.py:varlen_attention": 73,
    "models/triton_attention.py:_varlen_attention_forward": 103,
    "worker/metrics.py:WorkerMetrics._define": 103,
    "worker/submit.py:add_arguments": 65,
    "worker/sample_producer.py:add_arguments": 64,
}


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


def function_lengths(source: str) -> dict[str, int]:
    """Every function of a module, by its dotted path through classes and enclosing functions, and its
    lines from `def` to its last line."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                assert child.end_lineno is not None
                lengths[name] = child.end_lineno - child.lineno + 1  # lineno is the `def`'s line
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def package_sizes(measure: Callable[[str], dict[str, int]]) -> dict[str, int]:
    """`measure` of every module of the packages, keyed "module:name"."""
    sizes = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            for name, size in measure(path.read_text(encoding="utf-8")).items():
                sizes[f"{module}:{name}"] = size
    return sizes


def package_counts() -> dict[str, int]:
    return package_sizes(method_counts)


def package_functions() -> dict[str, int]:
    return package_sizes(function_lengths)


def module_lengths() -> dict[str, int]:
    return {
        name.removesuffix(":"): lines
        for name, lines in package_sizes(lambda source: {"": len(source.splitlines())}).items()
    }


class Rule(NamedTuple):
    """One size rule: what it measures, the bound, its exceptions, a name the walk must find with more
    than `found` (so that a broken walk cannot pass), and what to do when something is over."""

    what: str
    sizes: Callable[[], dict[str, int]]
    bound: int
    exceptions: dict[str, int]
    sample: str
    found: int
    remedy: str


RULES = (
    Rule(
        f"modules over {MAX_MODULE_LINES} lines", module_lengths, MAX_MODULE_LINES, MODULE_EXCEPTIONS,
        "models/packing.py", 100, "move a cohesive part into a module of its own",
    ),
    Rule(
        f"classes over {MAX_METHODS} methods", package_counts, MAX_METHODS, EXCEPTIONS,
        "models/engine.py:Scorer", 10, "move a cohesive group into an object of its own",
    ),
    Rule(
        f"functions over {MAX_FUNCTION_LINES} lines", package_functions, MAX_FUNCTION_LINES,
        FUNCTION_EXCEPTIONS, "models/packing.py:pack", 20, "split them into pieces named for what they do",
    ),
)  # fmt: skip


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.what)
def test_the_packages_keep_to_the_size_rules(rule: Rule) -> None:
    sizes = rule.sizes()
    assert sizes.get(rule.sample, 0) > rule.found, f"the walk no longer finds {rule.sample}"
    over = {name: size for name, size in sizes.items() if size > rule.exceptions.get(name, rule.bound)}
    assert not over, (
        f"{rule.what} ({rule.remedy}, or name the exception and its reason on docs/architecture.md and "
        f"here): {over}"
    )


def test_the_walk_finds_methods_inner_functions() -> None:
    assert "worker/metrics.py:WorkerMetrics._define.hist" in package_functions()


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.what)
def test_exceptions_name_what_the_packages_define_and_what_still_needs_them(rule: Rule) -> None:
    sizes = rule.sizes()
    assert not set(rule.exceptions) - set(sizes), "an exception names what the packages no longer define"
    within = sorted(name for name in rule.exceptions if sizes[name] <= rule.bound)
    assert not within, f"back within the rule: drop their exceptions here and on the page: {within}"


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


def test_a_function_counts_from_def_to_its_end_and_so_does_each_nested_one() -> None:
    source = (
        "@decorator\n@another(\n    1,\n)\n"
        "def outer(\n    a,\n):\n    def inner():\n        pass\n\n    return a\n"
        "class C:\n    @property\n    async def m(self):\n        return 1\n"
        "if True:\n    def guarded(): pass\n"
    )
    assert function_lengths(source) == {"outer": 7, "outer.inner": 2, "C.m": 2, "guarded": 1}


def test_docs_name_every_exception_with_its_count() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    unnamed = sorted(
        key
        for rule in RULES
        for key, size in rule.exceptions.items()
        if any(f"`{part}`" not in page for part in key.split(":")) or f"({size}" not in page
    )
    assert not unnamed, f"exceptions docs/architecture.md does not name with their count: {unnamed}"

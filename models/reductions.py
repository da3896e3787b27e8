"""One-pass row reductions in the compiled layers: inductor's heuristic, with rows of up to ONE_PASS_MAX.

A row-wise reduction whose result the row's own elements then use (an RMSNorm; an FP8 projection's scale per
token, which needs the row's largest magnitude before any element can be rounded) compiles to one of two
kinds of Triton kernel: "persistent", which holds the row in registers and reads it once, or "looped", which
walks the row in blocks for the reduction and walks it again for the elements. Inductor takes the persistent
kind only for rows of up to 1,024 elements along the contiguous dimension. Wider rows are read twice: the
FP8 path's SiLU-and-multiply with the down projection's scale reads both [T, 3072] halves of Qwen3-0.6B's
MLP twice, and an 8B model's norms read their 4,096-wide rows twice. Here reductions along contiguous rows
(inductor's INNER hint) of up to ONE_PASS_MAX elements are persistent too; every other choice is
inductor's.

Inductor reads its heuristics from a handler local to the thread that compiles, and it compiles on the
thread that first calls a compiled function, so CompiledLayers installs the handler around the packed
forward (`one_pass_rows`), on whatever thread runs it. Kernels compiled before and kept in inductor's cache
are reused as they were.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

ONE_PASS_MAX = 4096


@functools.cache
def heuristics() -> Any:
    """The heuristics object (one per process; inductor's classes are imported on first use)."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class OnePassRows(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features: Any, *args: Any, **kwargs: Any) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, *args, **kwargs):
                return True
            cooperative = bool(args[0] if args else kwargs.get("cooperative_reduction", False))
            if cooperative or not config.triton.persistent_reductions:
                return False  # inductor's answer stands
            return features.get_reduction_hint() == ReductionHint.INNER and bool(
                V.graph.sizevars.statically_known_leq(features.reduction_numel, ONE_PASS_MAX)
            )

    return OnePassRows()


@contextlib.contextmanager
def one_pass_rows() -> Iterator[None]:
    """Inside the block, inductor compiles row reductions of up to ONE_PASS_MAX elements to one pass, on
    this thread."""
    from torch._inductor.virtualized import V

    with V.set_choices_handler(heuristics()):
        yield

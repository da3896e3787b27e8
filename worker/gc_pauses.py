"""Python's garbage collector in a long-running worker: fewer full scans, and every pause measured.

A full (generation 2) collection walks every container object the process holds and stops every thread
while it does, the model thread included, so the GPU runs dry for its length. A worker holds several
hundred thousand such objects from the moment its model is loaded (torch, transformers and their modules,
the model's own modules): on a 2-core machine one full scan of them takes about 0.2 s, and under load a
full collection comes every few seconds. Almost none of those objects ever become garbage, so the worker
freezes them at start-up (`gc.freeze`): later collections scan only what arrived since.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any


def freeze_startup_heap() -> int:
    """Collect once, then move every object still alive out of the collector's scans; returns how many
    objects are frozen. Safe to call again (a later call freezes what arrived since)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (the worker is stopping). Frozen objects are never
    collected, not even as the interpreter exits, so extension modules that count their objects at exit
    (Triton's, through nanobind) would report each one as leaked."""
    gc.unfreeze()


class GcPauses:
    """While entered, times every collection and passes (generation, seconds) to `observe`.

    gc.callbacks run on the thread that triggered the collection, with the GIL held, so start and stop
    of one collection always pair up.
    """

    def __init__(self, observe: Callable[[int, float], None]) -> None:
        self._observe = observe
        self._started = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._observe(int(info["generation"]), time.perf_counter() - self._started)

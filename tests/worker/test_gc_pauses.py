"""The worker's garbage-collector handling: the start-up heap frozen, every pause timed into the metrics."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from worker.gc_pauses import GcPauses, freeze_startup_heap, thaw_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Whatever a test freezes goes back to the collector afterwards."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freezing_takes_the_heap_out_of_full_collections(unfrozen: None) -> None:
    alive = [Cycle() for _ in range(1000)]
    frozen = freeze_startup_heap()
    # The count it returns is the collector's; frozen objects that other threads of this process free
    # meanwhile leave it (the permanent generation only shrinks), so a later read may be a little lower.
    assert frozen >= len(alive) and len(alive) <= gc.get_freeze_count() <= frozen
    assert not any(gc.is_tracked(x) and x in gc.get_objects(generation=2) for x in alive[:3])
    # What arrives later is collected as usual, frozen objects or not.
    later = Cycle()
    del later
    assert gc.collect() >= 1
    # A stopping worker gives them back: the collector (and the interpreter's exit) sees them again.
    thaw_heap()
    assert gc.get_freeze_count() == 0
    assert any(x is alive[0] for x in gc.get_objects())


def test_every_collection_is_timed_while_installed_and_none_after() -> None:
    seen: list[tuple[int, float]] = []
    with GcPauses(lambda generation, seconds: seen.append((generation, seconds))):
        gc.collect(0)
        gc.collect(2)
    assert [g for g, _ in seen] == [0, 2]
    assert all(0 <= s < 60 for _, s in seen)
    gc.collect()
    assert len(seen) == 2  # the callback is gone

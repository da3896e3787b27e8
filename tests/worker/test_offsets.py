"""Offset gap tracking: the committed offset never passes a request whose result is not acknowledged."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from worker.offsets import OffsetTracker, PartitionOffsets


def test_commits_up_to_the_first_open_offset() -> None:
    offsets = PartitionOffsets()
    assert offsets.committable() is None
    for offset in range(10, 15):
        offsets.track(offset)
    assert offsets.committable() == 10
    assert offsets.done(11) and offsets.done(13)
    assert offsets.committable() == 10  # 10 is still open: 11 and 13 wait behind it
    assert offsets.done(10)
    assert offsets.committable() == 12
    assert offsets.done(12) and offsets.done(14)
    assert offsets.committable() == 15
    assert len(offsets) == 0


def test_done_twice_or_untracked_is_refused() -> None:
    offsets = PartitionOffsets()
    offsets.track(0)
    assert offsets.done(0)
    assert not offsets.done(0)
    assert not offsets.done(7)
    assert offsets.committable() == 1


def test_gaps_in_offsets_do_not_stall_commits() -> None:
    offsets = PartitionOffsets()
    for offset in (3, 7, 20):  # compacted topic: offsets 4-6 and 8-19 do not exist
        offsets.track(offset)
    offsets.done(3)
    assert offsets.committable() == 7
    offsets.done(20)
    offsets.done(7)
    assert offsets.committable() == 21


def test_tracker_commits_only_what_moved_and_forgets_revoked_partitions() -> None:
    tracker: OffsetTracker[str] = OffsetTracker()
    for offset in range(3):
        tracker.track("p0", offset)
        tracker.track("p1", offset)
    assert tracker.pending() == 6
    assert tracker.to_commit() == {"p0": 0, "p1": 0}
    tracker.mark_committed({"p0": 0, "p1": 0})
    assert tracker.to_commit() == {}
    tracker.done("p0", 0)
    tracker.done("p1", 1)
    assert tracker.to_commit() == {"p0": 1}
    assert tracker.to_commit(["p1"]) == {}
    assert tracker.pending(["p1"]) == 2
    tracker.drop(["p0"])
    assert tracker.pending() == 2
    assert not tracker.done("p0", 1)  # a late completion of a revoked partition is ignored
    assert tracker.to_commit() == {}  # p1 still at 0, which was committed


@given(
    steps=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=80),
    order=st.randoms(use_true_random=False),
    batch_size=st.integers(min_value=1, max_value=10),
)
def test_out_of_order_completion_never_commits_past_an_open_offset(
    steps: list[int], order: random.Random, batch_size: int
) -> None:
    """Offsets with gaps, done in random order and in batches: the committable offset is always the first
    open one (or one past the last), it never moves backwards, and it ends one past the last offset."""
    offsets_list, position = [], 0
    for step in steps:
        position += step
        offsets_list.append(position)
    tracker = PartitionOffsets()
    for offset in offsets_list:
        tracker.track(offset)
    shuffled = offsets_list[:]
    order.shuffle(shuffled)
    open_offsets = set(offsets_list)
    previous = tracker.committable()
    for start in range(0, len(shuffled), batch_size):
        for offset in shuffled[start : start + batch_size]:
            assert tracker.done(offset)
            open_offsets.discard(offset)
        committable = tracker.committable()
        assert committable is not None and previous is not None
        expected = min(open_offsets) if open_offsets else offsets_list[-1] + 1
        assert committable == expected
        assert all(committable <= o for o in open_offsets)
        assert committable >= previous
        previous = committable
    assert tracker.committable() == offsets_list[-1] + 1


@given(
    st.lists(
        st.tuples(st.sampled_from(["track", "done"]), st.integers(min_value=0, max_value=30)), max_size=120
    )
)
def test_matches_a_simple_model_under_interleaved_tracking(ops: list[tuple[str, int]]) -> None:
    """Tracking and completion interleaved as several batches in flight do: compare with a naive model."""
    tracker = PartitionOffsets()
    tracked: set[int] = set()
    done: set[int] = set()
    fetched_up_to = -1
    for op, offset in ops:
        if op == "track":
            # A consumer fetches increasing offsets: the model tracks the next one at most once.
            fetched_up_to += 1
            tracker.track(fetched_up_to)
            tracked.add(fetched_up_to)
        else:
            accepted = tracker.done(offset)
            assert accepted == (offset in tracked and offset not in done)
            if accepted:
                done.add(offset)
        open_offsets = tracked - done
        expected = min(open_offsets) if open_offsets else (max(tracked) + 1 if tracked else None)
        assert tracker.committable() == expected
        assert len(tracker) == len(open_offsets)


def test_a_range_answered_as_one_holds_the_commit_at_its_first_offset_then_passes_its_last() -> None:
    offsets = PartitionOffsets()
    offsets.track(4)
    offsets.track_range(5, 9)  # a batch skipped unread: one dead-letter record answers all of it
    assert offsets.committable() == 4
    offsets.done(4)
    assert offsets.committable() == 5  # not past the range while its record is unacknowledged
    offsets.track(10)  # read after the range meanwhile
    offsets.done(10)
    assert offsets.committable() == 5
    assert offsets.done(5)
    assert offsets.committable() == 11
    alone = PartitionOffsets()
    alone.track_range(0, 2)
    alone.done(0)
    assert alone.committable() == 3

"""The one token-budget rule: what a batch computes, where a sequence of requests is cut into batches, a
request larger than one batch cut into parts whose results are joined again, and the turns such parts and
items over the budget take with ordinary batches."""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from models.compare import answer
from models.graphs import KEYS_PER_TOKEN
from models.packing import (
    SharedPrefix,
    find_shared_prefixes,
    packed_length,
    saved_tokens,
    shareable_prefix,
)
from models.prepare import PreparedRequest, Prompt
from schemas import Compare, ResultStatus, ScoreResult, Tensor

# What prompts cost together in one packed row: the sum of their lengths, or less where shared prefixes are
# computed once (BatchPlan.tokens).
PromptsMeasure = Callable[[Sequence[Prompt]], int]
RangeMeasure = Callable[[int, int], int]


# Whether two requests share a prefix that one batch holding both computes once (BatchPlan.joins).
RequestsJoin = Callable[[PreparedRequest, PreparedRequest], bool]
# Whether entry k of a sequence shares such a prefix with a later entry.
RangeJoins = Callable[[int, int], bool]
T = TypeVar("T")


def token_runs(
    sizes: Sequence[int],
    max_tokens: int,
    measure: RangeMeasure | None = None,
    joins: RangeJoins | None = None,
) -> Iterator[range]:
    """Consecutive index ranges whose sizes add up to at most `max_tokens`; a size above it stands alone.

    `measure(start, stop)`, when given, is what entries start..stop cost together where that can be less
    than the sum of their sizes (prompts sharing a prefix computed once); it is asked only when the sum is
    over the budget, so a run is cut where what it computes, not what it holds, reaches the budget.
    `joins(k, index)`, given with `measure`, says whether entry k shares a prefix with entry index: where
    a run is cut, the entries at its end that share one with the next entry move to the next run with it
    (`group_cut`), so that prefix is computed once, not in both runs.

    The one rule for cutting a sequence into token-budget batches: the worker's batcher, the engine's split
    and the cutting of a large request all follow it. Sequences that fit whole as measured (a batch the
    worker's batcher closed within the budget) are measured once, not once per entry beyond the sum; past
    the sum, how far a run reaches within the budget is found in a logarithmic number of measures
    (`_furthest_within`), not one per entry: each measure sorts the run's prompts.
    """
    if measure is not None and sum(sizes) > max_tokens and measure(0, len(sizes)) <= max_tokens:
        yield range(0, len(sizes))
        return
    start, tokens = 0, 0
    # Measured for the current run: entries up to `fits_until` fit in it, entry `fails_at` does not.
    fits_until, fails_at = -1, -1
    for index, size in enumerate(sizes):
        over = index > start and tokens + size > max_tokens and index > fits_until
        if over and (measure is None or index == fails_at or measure(start, index + 1) > max_tokens):
            cut = index
            if measure is not None and joins is not None and size <= max_tokens:
                cut = group_cut(start, index, joins, measure, max_tokens)
            yield range(start, cut)
            start, tokens, fits_until, fails_at = cut, sum(sizes[cut:index]), -1, -1
        elif over and measure is not None:
            fits_until, fails_at = _furthest_within(measure, start, index, len(sizes), max_tokens)
        tokens += size
    if start < len(sizes):
        yield range(start, len(sizes))


def _furthest_within(
    measure: RangeMeasure, start: int, fits: int, count: int, max_tokens: int
) -> tuple[int, int]:
    """The furthest entry j (fits <= j < count) such that entries start..j measure within `max_tokens`,
    given that start..fits does, and the entry after it when that one was measured not to fit (else -1):
    steps that double, then halving between the last that fit and the first that did not. What a run
    computes grows with every entry (each keeps a token of its own), so the entries before j fit too; every
    j returned was measured."""
    good, step = fits, 1
    bad = count
    while good + step < count:
        if measure(start, good + step + 1) <= max_tokens:
            good, step = good + step, 2 * step
        else:
            bad = good + step
            break
    while bad - good > 1:
        middle = (good + bad) // 2
        if measure(start, middle + 1) <= max_tokens:
            good = middle
        else:
            bad = middle
    return good, bad if bad < count else -1


def group_cut(start: int, index: int, joins: RangeJoins, measure: RangeMeasure, max_tokens: int) -> int:
    """Where a run of entries start..index-1 closes when entry `index` does not fit in it: at `index`, or
    earlier, so that the entries at the run's end sharing a prefix with `index` (`joins(k, index)`, walked
    back from the end) start the next run with it and their prefix is computed once, not in both runs.

    They move only when one entry at least stays behind, the run is not full already, they fit the budget
    with `index`, and the two runs then compute fewer tokens than the whole run and `index` would: arrival
    order is kept, and a run never closes emptier for nothing. Entries that share nothing cost one `joins`
    call per cut.
    """
    cut = index
    while cut - 1 > start and joins(cut - 1, index):
        cut -= 1
    if cut == index:
        return index
    run = measure(start, index)
    if run >= max_tokens:  # full before `index` came: the worker's batcher has closed it already
        return index
    carried = measure(cut, index + 1)
    if carried > max_tokens:
        return index
    return cut if measure(start, cut) + carried < run + measure(index, index + 1) else index


def take_turns(ordinary: Sequence[T], large: Sequence[T]) -> list[T]:
    """The order in which the worker's pipeline runs a backlog of ordinary batches and large turns (each a
    part of a request too large for one batch, or one item over the token budget, which nothing can cut),
    each list in arrival order: one of each in turn, an ordinary batch first, the rest of the longer list
    at the end. A request of the k-th ordinary batch waits behind k - 1 large turns, however many queued."""
    order: list[T] = []
    for k in range(max(len(ordinary), len(large))):
        order += [*ordinary[k : k + 1], *large[k : k + 1]]
    return order


def split_request(
    prepared: PreparedRequest, max_tokens: int, measure: PromptsMeasure | None = None
) -> list[PreparedRequest]:
    """The request as parts of consecutive items, each within `max_tokens` (an item above it alone), as
    counted by `measure` when given (shared prefixes once), else by the prompts' lengths.

    A request that fits is returned whole. Tokenizing time is charged to the first part.
    """
    prompts = prepared.prompts
    if len(prompts) == 1 or (prepared.num_tokens if measure is None else measure(prompts)) <= max_tokens:
        return [prepared]  # it fits, or it is one prompt: nothing to cut
    by_range: RangeMeasure | None = None
    if measure is not None:

        def by_range(start: int, stop: int) -> int:
            return measure(prompts[start:stop])

    parts = []
    for number, run in enumerate(token_runs([len(p) for p in prompts], max_tokens, by_range)):
        cut = slice(run.start, run.stop)
        parts.append(
            dataclasses.replace(
                prepared,
                prompts=prepared.prompts[cut],
                token_types=None if prepared.token_types is None else prepared.token_types[cut],
                truncated=None if prepared.truncated is None else prepared.truncated[cut],
                positions=None if prepared.positions is None else prepared.positions[cut],
                tokenize_s=prepared.tokenize_s if number == 0 else 0.0,
            )
        )
    return parts


def join_results(parts: Sequence[ScoreResult], compare: Compare | None = None) -> ScoreResult:
    """One result from the results of a request's parts, in item order; the first failed part's error
    result stands for the whole request (a result never carries some items' scores and not others). Parts
    of a request with `compare` carry their items' rewards: the comparison is made here, over them all."""
    if len(parts) == 1:
        return parts[0]
    for part in parts:
        if part.status is ResultStatus.ERROR:
            return part
    first = parts[0]
    hidden: tuple[Tensor, ...] | None = None
    if first.pooled_hidden_states is not None:
        hidden = tuple(t for part in parts for t in part.pooled_hidden_states or ())
    truncated = None
    if first.truncated_tokens is not None:
        truncated = tuple(n for part in parts for n in part.truncated_tokens or ())
    heads = None
    if first.head_scores is not None:
        heads = {
            name: tuple(row for part in parts for row in (part.head_scores or {})[name])
            for name in first.head_scores
        }
    timings: dict[str, float] = {}
    for part in parts:
        for name, seconds in part.timings.items():
            timings[name] = timings.get(name, 0.0) + seconds
    rewards = _joined(parts, "rewards")
    compared = None if rewards is None or compare is None else answer(rewards, compare)
    return dataclasses.replace(
        first,
        rewards=rewards,
        preference=None if compared is None else compared.preference,
        ranking=None if compared is None else compared.ranking,
        best_probability=None if compared is None else compared.best_probability,
        scores=tuple(row for part in parts for row in part.scores),
        pooled_hidden_states=hidden,
        prompt_tokens=sum(part.prompt_tokens for part in parts),
        timings=timings,
        truncated_tokens=truncated,
        token_positions=_joined(parts, "token_positions"),
        token_scores=_joined(parts, "token_scores"),
        token_hidden_states=_joined(parts, "token_hidden_states"),
        head_scores=heads,
    )


def _joined(parts: Sequence[ScoreResult], field: str) -> tuple[Any, ...] | None:
    """A per-item field of the parts' results, in item order (None where the first part has none)."""
    if getattr(parts[0], field) is None:
        return None
    return tuple(entry for part in parts for entry in getattr(part, field) or ())


class BatchPlan:
    """How an engine's batches are measured and cut; the worker's batcher, the engine's own split, a large
    request's parts and the benchmarks all ask this one object.

    With `share_prefix_min_tokens` > 0 (a packed causal decoder that is not deterministic), prompts of one
    batch that share a prefix of at least that many tokens compute it once, and the budget counts what a
    batch computes; otherwise it counts the tokens the prompts hold.
    """

    def __init__(
        self, share_prefix_min_tokens: int = 0, key: Callable[[PreparedRequest], int] | None = None
    ) -> None:
        self.min_shared_tokens = share_prefix_min_tokens
        # What a request's prompts are computed under (its LoRA adapter's index): prompts share a prefix
        # only under one key. None: one key for every request.
        self.key = key
        # The shared prefixes of the batch last measured or launched (see shared_prefixes).
        self._memo: tuple[tuple[Prompt, ...], tuple[SharedPrefix, ...]] | None = None

    @property
    def shares_prefixes(self) -> bool:
        """Batches compute the prefixes their prompts share once."""
        return self.min_shared_tokens > 0

    def tokens(self, prompts: Sequence[Prompt]) -> int:
        """What a batch of these prompts counts against the token budget: the tokens its packed row
        computes, a shared prefix once. Where keys are gathered (sliding windows, the exact path) each suffix
        reads its prefix's keys again, so the count is never below 1/KEYS_PER_TOKEN of the tokens the prompts
        hold: that bounds the keys a layer gathers (and a graph's key buffer holds)."""
        held = sum(len(p) for p in prompts)
        if not self.shares_prefixes:
            return held
        return max(held - saved_tokens(self.shared_prefixes(prompts)), -(-held // KEYS_PER_TOKEN))

    def joins(self, earlier: PreparedRequest, later: PreparedRequest) -> bool:
        """Whether a batch holding both requests would compute a prefix of theirs once: the last prompt of
        the one and the first of the other share at least `min_shared_tokens`, each keeping a token of its
        own. Batch cuts keep such requests together where they can (group_cut)."""
        if not (self.shares_prefixes and earlier.prompts and later.prompts):
            return False
        if self.key is not None and self.key(earlier) != self.key(later):
            return False
        return shareable_prefix(earlier.prompts[-1], later.prompts[0]) >= self.min_shared_tokens

    def fits(self, prepared: Sequence[PreparedRequest], max_tokens: int) -> bool:
        """Whether the requests make one batch of at most `max_tokens` (measured as `runs` measures it)."""
        if sum(p.num_tokens for p in prepared) <= max_tokens:
            return True
        return (
            self.shares_prefixes
            and self.tokens([prompt for p in prepared for prompt in p.prompts]) <= max_tokens
        )

    def runs(self, prepared: Sequence[PreparedRequest], max_tokens: int) -> Iterator[range]:
        """The requests cut, in order, into runs of at most `max_tokens` tokens each (a request over it
        alone): with shared prefixes by what a run computes, and with the requests that share a prompt kept
        together at a cut (token_runs)."""
        sizes = [p.num_tokens for p in prepared]
        if not self.shares_prefixes:
            return token_runs(sizes, max_tokens)

        def measure(start: int, stop: int) -> int:
            return self.tokens([prompt for p in prepared[start:stop] for prompt in p.prompts])

        def joins(earlier: int, later: int) -> bool:
            return self.joins(prepared[earlier], prepared[later])

        return token_runs(sizes, max_tokens, measure, joins)

    def grouped_runs(
        self, prepared: Sequence[PreparedRequest], group_of: Sequence[int], max_tokens: int
    ) -> Iterator[range]:
        """`runs` for requests in grouped order (`grouped_places`: each group's members side by side, and
        `group_of[i]` request i's group), measured group by group: requests of different groups share less
        than `min_shared_tokens` (else one group would hold them), so what a run computes is the sum of what
        its groups' parts compute, each part measured once, however many runs are tried. Where a request's
        other prompts share with another group's, the count is over, never under, what the run computes."""
        sizes = [p.num_tokens for p in prepared]
        if not self.shares_prefixes:
            return token_runs(sizes, max_tokens)
        ends = list(range(1, len(prepared) + 1))  # where the run of members of each request's group ends
        for index in range(len(prepared) - 2, -1, -1):
            if group_of[index] == group_of[index + 1]:
                ends[index] = ends[index + 1]
        parts: dict[tuple[int, int], int] = {}

        def computed(lo: int, hi: int) -> int:
            if (lo, hi) not in parts:
                prompts = [prompt for p in prepared[lo:hi] for prompt in p.prompts]
                parts[lo, hi] = packed_length(prompts, self.min_shared_tokens)
            return parts[lo, hi]

        def measure(start: int, stop: int) -> int:
            total, index = 0, start
            while index < stop:
                end = min(ends[index], stop)
                total += computed(index, end)
                index = end
            return max(total, -(-sum(sizes[start:stop]) // KEYS_PER_TOKEN))

        def joins(earlier: int, later: int) -> bool:
            return self.joins(prepared[earlier], prepared[later])

        return token_runs(sizes, max_tokens, measure, joins)

    def grouped_places(
        self,
        prepared: Sequence[PreparedRequest],
        keys: Sequence[int] | None = None,
        arrivals: Sequence[int] | None = None,
        reach: int | None = None,
    ) -> list[int]:
        """Where each request goes (`order_of_places` puts them in that order): its own index (it keeps its
        place), or the index of the first request of its group, which it follows. A group is the requests
        whose first prompts share a prefix of at least `min_shared_tokens` under one key (`keys`, else the
        plan's `key`: one LoRA adapter); each group takes the place of its first request, its members in
        their order; a request that shares nothing keeps its place, so the order is the given order where
        nothing is shared.

        With `arrivals` (each request's arrival number) and `reach`, a request moves ahead only if it
        arrived at most `reach` after the oldest request given; one that came later keeps its place. So a
        request is overtaken only by requests that arrived at most `reach` after it, however often a
        stream's pending requests are ordered again (a prompt shared by a whole stream cannot starve the
        requests that share nothing).

        Prompts that share a prefix are neighbours in lexicographic order (they all lie between the prefix
        and its successor), so sorting once and joining sorted neighbours finds every group: n log n prompt
        comparisons, each ending at the first token that differs."""
        count = len(prepared)
        if not self.shares_prefixes or count < 2:
            return list(range(count))
        if keys is not None:
            key_of = list(keys)
        elif self.key is not None:
            key_of = [self.key(p) for p in prepared]
        else:
            key_of = [0] * count
        firsts = [p.prompts[0] if p.prompts else () for p in prepared]
        by_prompt = sorted(range(count), key=lambda i: (key_of[i], firsts[i]))
        group = list(range(count))  # each request's group: the sorted run it belongs to, by its first member
        for before, after in itertools.pairwise(by_prompt):
            same_key = key_of[before] == key_of[after]
            if same_key and shareable_prefix(firsts[before], firsts[after]) >= self.min_shared_tokens:
                group[after] = group[before]
        movable = [True] * count
        if arrivals is not None and reach is not None:
            latest = min(arrivals) + reach
            movable = [arrival <= latest for arrival in arrivals]
        places = list(range(count))
        first: dict[int, int] = {}
        for index in range(count):
            anchor = first.setdefault(group[index], index)
            if anchor != index and movable[index]:
                places[index] = anchor
        return places

    def parts(self, prepared: PreparedRequest, max_tokens: int) -> list[PreparedRequest]:
        """The request whole when it fits `max_tokens`, else cut into parts that do (split_request)."""
        return split_request(prepared, max_tokens, self.tokens if self.shares_prefixes else None)

    @property
    def batch_measure(self) -> PromptsMeasure | None:
        """What prompts compute together, where that can be less than the sum of their lengths; else None
        (the worker's batcher then adds lengths without asking)."""
        return self.tokens if self.shares_prefixes else None

    @property
    def batch_joins(self) -> RequestsJoin | None:
        """`joins`, where requests can share a prefix; else None."""
        return self.joins if self.shares_prefixes else None

    def shared_prefixes(
        self, prompts: Sequence[Prompt], keys: Sequence[int] | None = None
    ) -> list[SharedPrefix]:
        """The prefixes a batch of these prompts computes once (models.packing.find_shared_prefixes; none
        without sharing), remembered for the last prompts asked about: the batch a caller has just measured
        (the worker's batcher, the engine's split) is the batch launched next, and finding a large batch's
        groups costs milliseconds of host time. The same prompt objects, not equal ones: comparing by
        identity costs nothing, and the memo is replaced in one assignment (the worker measures on its
        intake thread while the model thread launches)."""
        if not self.shares_prefixes:
            return []
        if keys is not None and len(set(keys)) > 1:
            return _keyed_prefixes(prompts, keys, self.min_shared_tokens)
        memo = self._memo
        if memo is not None and len(memo[0]) == len(prompts) and all(map(operator.is_, memo[0], prompts)):
            return list(memo[1])
        groups = find_shared_prefixes(prompts, self.min_shared_tokens)
        self._memo = (tuple(prompts), tuple(groups))
        return groups


def order_of_places(places: Sequence[int]) -> list[int]:
    """The order `BatchPlan.grouped_places` describes: each request that keeps its place, followed by the
    requests that follow it, in their order."""
    followers: dict[int, list[int]] = {}
    for index, place in enumerate(places):
        if place != index:
            followers.setdefault(place, []).append(index)
    order: list[int] = []
    for index, place in enumerate(places):
        if place == index:
            order.append(index)
            order.extend(followers.get(index, ()))
    return order


def _keyed_prefixes(prompts: Sequence[Prompt], keys: Sequence[int], min_tokens: int) -> list[SharedPrefix]:
    """Shared prefixes only among prompts of one key (one LoRA adapter: the same tokens give other states
    under another adapter), in the batch's prompt indices."""
    groups: list[SharedPrefix] = []
    for key in sorted(set(keys)):
        members = [index for index, k in enumerate(keys) if k == key]
        for group in find_shared_prefixes([prompts[i] for i in members], min_tokens):
            groups.append(SharedPrefix(tuple(members[i] for i in group.members), group.length))
    return sorted(groups, key=lambda g: g.members[0])

"""A cache of the layers' keys and values for prompt prefixes seen recently, so that a prompt whose beginning
an earlier batch computed computes only the rest (best-of-N answers spread over several calls, a long system
prompt or few-shot header sent with every request).

Prompts are cut into blocks of `block_tokens` tokens. A block is known by its parent block and its own tokens
(the first block's parent is the prompt's LoRA adapter: the same tokens give other states under another), so a
block stands for the whole prefix that ends with it, as in vLLM's automatic prefix caching; the lookup is a
dictionary keyed by (parent, tokens), which compares the tokens themselves, so two different prefixes never
share an entry (no hash is trusted alone). A block holds every layer's keys (after the rotary embedding:
a prefix always starts at position 0) and values for its tokens, in the model's dtype; in a hybrid model,
also each Gated DeltaNet layer's recurrent state and last convolution inputs at the block's end
(models/linear_cache.py), which is where a prompt whose cached run ends with it starts those layers.

By default a block is kept the second time it is seen (in an earlier batch, or by another prompt of the same
batch), not the first: a workload that never repeats a prefix (W1) then never fills the cache, and its
batches keep the CUDA graphs, which batches that read or fill the cache do without (they run the compiled
layers, the cache's traffic eager between their graphs: `CacheIO.extend`); `admit_first_sight` keeps every
block at once, for streams known to repeat. What was seen is
remembered by a hash of the prefix, in a bounded list (`SEEN_PREFIXES`, least recently seen forgotten
first); a collision there only admits a block early, it never serves one.

The cache is bounded by bytes. When a new block does not fit, the least recently used blocks that no other
block continues go first (a block's prefix is reachable only through its parents, so a parent goes after its
children). A prompt that reuses blocks touches them all, parent first.

What the engine asks (models/execute.py): for each prompt of a batch, the longest run of cached blocks within
the tokens it may take from the cache (`plan`: never the rows its results read, nor its last token), and which
of its full blocks the batch computes and should keep; after the forward pass, the captured keys and values
(`store`). Batches that pool the mean of every row, and anything deterministic, do not use it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from models.linear_cache import CachedStates, StateIO

# Prefixes remembered as seen once (a hash each), for admission on the second sight.
SEEN_PREFIXES = 1 << 16
# A block's parent: another block's number, or, for a prompt's first block, ("root", adapter index); in a
# batch's plan, also ("new", k): the k-th block the batch captures.
Parent = int | tuple[str, int]


@dataclass(eq=False)
class _Block:
    parent: Parent
    tokens: tuple[int, ...]
    slot: int  # its rows in the pools: slot * block_tokens onwards
    children: int = 0


class CacheRegion(NamedTuple):
    """A batch's cached keys and values, where they lie: the pools [L, Hkv, S, D] and the pool rows of the
    batch's cached runs, one after another [C]; in a hybrid model, the pools of states kept at block ends
    ([Lg, slots, ...] each) and per prompt the slot of its run's last block (-1: none)."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: torch.Tensor
    states: tuple[torch.Tensor, ...] = ()
    last_slots: tuple[int, ...] = ()


@dataclass(frozen=True)
class Capture:
    """A block a batch computes and the cache keeps: its parent (a cached block's number, or the index of an
    earlier Capture of the same batch, as `("new", index)`), its tokens, and the prompt and token offset whose
    rows hold it."""

    parent: Parent
    tokens: tuple[int, ...]
    prompt: int
    start: int


@dataclass
class CacheUse:
    """What one batch takes from the cache and gives it. `hits[i]`: prompt i's cached blocks, in order (its
    first len * block_tokens tokens come from the cache). `regions`: the distinct runs of cached blocks, laid
    out one after another; `offsets[i]`: where prompt i's run starts in that layout (its cached rows)."""

    block_tokens: int
    hits: list[tuple[int, ...]]
    regions: list[tuple[int, ...]]
    offsets: list[int]
    captures: list[Capture] = field(default_factory=list)

    def cached_tokens(self, prompt: int) -> int:
        return len(self.hits[prompt]) * self.block_tokens

    @property
    def active(self) -> bool:
        return bool(self.regions or self.captures)


class CacheTraffic(NamedTuple):
    """What batches took from the cache: prompts looked up, those that found a cached prefix, and the
    tokens they took; and the bytes it holds."""

    lookups: int
    hits: int
    tokens: int
    bytes: int


@dataclass
class CacheStats:
    """Counters since the cache was made: prompts looked up and those that found a cached prefix, the tokens
    they did not compute, blocks stored and evicted."""

    lookups: int = 0
    hits: int = 0
    tokens_saved: int = 0
    stored: int = 0
    evicted: int = 0


class PrefixCache:
    """Keys and values of recently computed prompt prefixes, in blocks of `block_tokens`, at most `max_bytes`
    (docs/models.md, "Prefix cache"). They lie in two pools, keys and values [L, Hkv, slots * block, D],
    allocated at the first block kept (its shapes, dtype and device are the model's): a batch reads its
    cached rows with one gather per layer, and memory is what the bound says from then on, not a copy of
    every block a batch reads. A hybrid model's states at block ends lie in pools of their own, a block's
    slot in each, and count in the bound with its keys and values."""

    def __init__(self, block_tokens: int, max_bytes: int, admit_first_sight: bool = False) -> None:
        if block_tokens <= 0 or max_bytes <= 0:
            raise ValueError("a prefix cache needs a positive block size and a positive memory bound")
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self._admit_first_sight = admit_first_sight
        self._seen: OrderedDict[int, None] = OrderedDict()  # prefix hashes seen once, least recent first
        self.bytes = 0
        self.stats = CacheStats()
        self._pools: tuple[torch.Tensor, torch.Tensor] | None = None
        self._state_pools: tuple[torch.Tensor, ...] = ()  # [Lg, slots, ...] each
        self._block_bytes = 0
        self._free: list[int] = []  # slots of the pools no block holds
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._index: dict[tuple[Parent, tuple[int, ...]], int] = {}
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self._blocks)

    def traffic(self, since: CacheTraffic | None = None) -> CacheTraffic:
        """The counters now (less those of `since`: what happened in between), and the bytes held now."""
        now = (self.stats.lookups, self.stats.hits, self.stats.tokens_saved)
        before = (0, 0, 0) if since is None else since[:3]
        lookups, hits, tokens = (a - b for a, b in zip(now, before, strict=True))
        return CacheTraffic(lookups, hits, tokens, self.bytes)

    def clear(self) -> None:
        """Drop every block and forget what was seen (the counters stay; the pools stay allocated)."""
        self._free += [block.slot for block in self._blocks.values()]
        self._blocks.clear()
        self._index.clear()
        self._seen.clear()
        self.bytes = 0

    def plan(
        self, prompts: Sequence[Sequence[int]], adapters: Sequence[int] | None, limits: Sequence[int]
    ) -> CacheUse:
        """Each prompt's longest cached prefix of whole blocks within its first `limits[i]` tokens, and the
        blocks of its first len(prompt) // block_tokens that the batch computes, the cache does not hold yet
        and admits (seen before; each once, where prompts share them)."""
        size = self.block_tokens
        hits: list[tuple[int, ...]] = []
        captures: list[Capture] = []
        pending: dict[tuple[Parent, tuple[int, ...]], int] = {}
        for index, prompt in enumerate(prompts):
            parent: Parent | None = ("root", -1 if adapters is None else adapters[index])
            prefix = hash(parent)  # the prefix so far, as a hash: what admission remembers
            run: list[int] = []
            usable = limits[index] // size
            whole = len(prompt) // size
            for block in range(whole):
                tokens = tuple(prompt[block * size : (block + 1) * size])
                prefix = hash((prefix, tokens))
                found = None if parent is None else self._index.get((parent, tokens))
                if found is not None:
                    if block < usable:  # else cached, but this prompt may not take it (rows it reads)
                        run.append(found)
                    parent = found
                    continue
                admitted = self._admits(prefix)  # remembered either way
                if parent is None or not admitted:
                    parent = None  # neither this block nor what follows it can be kept
                    continue
                key = (parent, tokens)
                if key not in pending:
                    pending[key] = len(captures)
                    captures.append(Capture(parent, tokens, index, block * size))
                parent = ("new", pending[key])
            hits.append(tuple(run))
        self.stats.lookups += len(prompts)
        regions: list[tuple[int, ...]] = []
        where: dict[tuple[int, ...], int] = {}
        offsets: list[int] = []
        for taken in hits:
            if taken and taken not in where:
                where[taken] = sum(len(r) for r in regions) * size
                regions.append(taken)
            offsets.append(where.get(taken, 0))
        return CacheUse(size, hits, regions, offsets, captures)

    def _admits(self, prefix: int) -> bool:
        """Whether a block the cache lacks is kept: seen before (its prefix's hash remembered), or every
        block where the cache admits on first sight. Remembers it either way."""
        if self._admit_first_sight:
            return True
        if prefix in self._seen:
            self._seen.move_to_end(prefix)
            return True
        self._seen[prefix] = None
        if len(self._seen) > SEEN_PREFIXES:
            self._seen.popitem(last=False)
        return False

    def region(self, use: CacheUse) -> CacheRegion | None:
        """Where the batch's cached runs lie, one after another (None where the batch takes nothing); marks
        them used, parents first, and counts the hits."""
        if not use.regions or self._pools is None:
            return None
        for run in use.hits:
            if run:
                self.stats.hits += 1
                self.stats.tokens_saved += len(run) * self.block_tokens
        slots = [self._blocks[number].slot for run in use.regions for number in run]
        for run in use.regions:
            for number in run:
                self._blocks.move_to_end(number)
        keys, values = self._pools
        size = self.block_tokens
        rows = (torch.tensor(slots, dtype=torch.int64).repeat_interleave(size) * size).add_(
            torch.arange(size).repeat(len(slots))
        )
        last = tuple(self._blocks[run[-1]].slot if run else -1 for run in use.hits)
        return CacheRegion(keys, values, rows.to(keys.device, non_blocking=True), self._state_pools, last)

    def state_pools(self) -> tuple[torch.Tensor, ...]:
        """The pools of states kept at block ends (empty before the first block, or without any)."""
        return self._state_pools

    def store(
        self,
        use: CacheUse,
        keys: torch.Tensor,
        values: torch.Tensor,
        states: Sequence[torch.Tensor] = (),
    ) -> None:
        """Keep the batch's captured blocks: `keys`/`values` [L, Hkv, R, D] hold the rows `capture_rows` gave,
        in that order, and each of `states` [Lg, K, ...] a state at each captured block's end. A block whose
        parent is not kept (the bound) is not kept either: nothing could reach it."""
        size = self.block_tokens
        if self._pools is None and not self._allocate(keys, states):
            return
        made: list[int | None] = []
        for number, capture in enumerate(use.captures):
            parent: Parent | None = capture.parent
            if isinstance(parent, tuple) and parent[0] == "new":
                parent = made[parent[1]]
            if parent is None or (isinstance(parent, int) and parent not in self._blocks):
                made.append(None)
                continue
            span = slice(number * size, (number + 1) * size)
            at_end = tuple(state[:, number] for state in states)
            made.append(self._insert(parent, capture.tokens, keys[:, :, span], values[:, :, span], at_end))

    def _allocate(self, keys: torch.Tensor, states: Sequence[torch.Tensor] = ()) -> bool:
        """The pools, shaped as `keys` [L, Hkv, R, D] (and each of `states` [Lg, K, ...]) with as many blocks
        as the bound holds; False when not one block fits it."""
        layers, heads, _, width = keys.shape
        self._block_bytes = 2 * layers * heads * self.block_tokens * width * keys.element_size()
        self._block_bytes += sum(state[:, 0].numel() * state.element_size() for state in states)
        slots = self.max_bytes // self._block_bytes
        if slots == 0:
            return False
        shape = (layers, heads, slots * self.block_tokens, width)
        self._pools = (keys.new_empty(shape), keys.new_empty(shape))
        self._state_pools = tuple(
            state.new_empty((state.shape[0], slots, *state.shape[2:])) for state in states
        )
        self._free = list(range(slots - 1, -1, -1))
        return True

    def _insert(
        self,
        parent: Parent,
        tokens: tuple[int, ...],
        keys: torch.Tensor,
        values: torch.Tensor,
        states: Sequence[torch.Tensor] = (),
    ) -> int | None:
        """Store a block (`keys`/`values` [L, Hkv, B, D], `states` at its end [Lg, ...] each), evicting least
        recently used leaves to make room; None when it cannot be kept."""
        key = (parent, tokens)
        existing = self._index.get(key)
        if existing is not None:  # another batch stored it meanwhile
            self._blocks.move_to_end(existing)
            return existing
        while not self._free:
            if not self._evict_one(protect=parent):
                return None
        assert self._pools is not None
        block = _Block(parent, tokens, self._free.pop())
        rows = slice(block.slot * self.block_tokens, (block.slot + 1) * self.block_tokens)
        self._pools[0][:, :, rows].copy_(keys)
        self._pools[1][:, :, rows].copy_(values)
        for pool, state in zip(self._state_pools, states, strict=True):
            pool[:, block.slot].copy_(state)
        number = next(self._numbers)
        self._blocks[number] = block
        self._index[key] = number
        self.bytes += self._block_bytes
        if isinstance(block.parent, int):
            self._blocks[block.parent].children += 1
            self._blocks.move_to_end(block.parent)
        self._blocks.move_to_end(number)
        self.stats.stored += 1
        return number

    def _evict_one(self, protect: Parent) -> bool:
        """Drop the least recently used block that no block continues (never `protect`, the parent of the
        block being stored); False when there is none."""
        for number, block in self._blocks.items():
            if block.children == 0 and number != protect:
                del self._blocks[number]
                del self._index[(block.parent, block.tokens)]
                self._free.append(block.slot)
                self.bytes -= self._block_bytes
                if isinstance(block.parent, int) and block.parent in self._blocks:
                    self._blocks[block.parent].children -= 1
                self.stats.evicted += 1
                return True
        return False


@dataclass(frozen=True)
class CacheLayout:
    """What the cache keeps of which layer: keys and values of `layers` (their `layer_idx`, in the pools'
    order), and in a hybrid model its Gated DeltaNet layers' states at block ends (`states`)."""

    layers: tuple[int, ...]
    states: CachedStates | None = None

    def io(
        self,
        cache: PrefixCache,
        use: CacheUse,
        capture_rows: torch.Tensor | None,
        resumed: Sequence[int] | None,
    ) -> CacheIO:
        """One batch's traffic with `cache`: `capture_rows` the rows of the blocks it keeps, `resumed` per
        sequence of the packed row the prompt whose cached tokens it continues (-1: none)."""
        region = cache.region(use)
        states = None
        if self.states is not None:
            last = () if region is None else region.last_slots
            states = self.states.io(cache.state_pools(), last, resumed, capture_rows, use.block_tokens)
        return CacheIO(region, capture_rows, self.layers, states)


class CacheIO:
    """One batch's traffic with the prefix cache inside attention (models/attention.py): each layer's cached
    keys and values put before the row's own (the region `pack` laid the keys out for), and the keys and
    values of the rows the cache keeps copied out, layer by layer. `layers`: the `layer_idx` of each layer
    whose keys the pools hold, in their order (a hybrid model's full-attention layers); `states`: its Gated
    DeltaNet layers' traffic (models/linear_cache.py)."""

    def __init__(
        self,
        region: CacheRegion | None,
        capture_rows: torch.Tensor | None,
        layers: Sequence[int],
        states: StateIO | None = None,
    ) -> None:
        self._region = region
        self._capture_rows = capture_rows
        self._order = {layer: index for index, layer in enumerate(layers)}
        self._captured_keys: list[torch.Tensor | None] = [None] * len(layers)
        self._captured_values: list[torch.Tensor | None] = [None] * len(layers)
        self.states = states

    @property
    def reads(self) -> bool:
        """Whether cached keys come before the row's own (pack gathered every sequence's keys for them)."""
        return self._region is not None

    # Compiled layers (models/layers.py) break their graph at this call and run it eager: traced, the layer's
    # index would give every layer a graph of its own, and the rows kept are a side effect no graph holds. The
    # graphs before and after it serve batches with and without the cache alike.
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def extend(
        self, module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`key`/`value` [1, Hkv, T, D] of the layer `module` belongs to, with the cached region's rows put
        first ([1, Hkv, C + T, D]); the rows to keep are copied out first."""
        layer = self._order[int(module.layer_idx)]  # type: ignore[arg-type]  # every packed decoder's has one
        if self._capture_rows is not None:
            self._captured_keys[layer] = key[0].index_select(1, self._capture_rows)
            self._captured_values[layer] = value[0].index_select(1, self._capture_rows)
        region = self._region
        if region is None:
            return key, value
        cached_keys = region.keys[layer].index_select(1, region.rows).unsqueeze(0).to(key.dtype)
        cached_values = region.values[layer].index_select(1, region.rows).unsqueeze(0).to(value.dtype)
        return torch.cat((cached_keys, key), dim=2), torch.cat((cached_values, value), dim=2)

    def captured(self) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """The kept rows' keys and values, [L, Hkv, R, D] each, and the states at the kept blocks' ends
        ([Lg, K, ...] each; none without Gated DeltaNet layers)."""
        keys, values = self._captured_keys, self._captured_values
        if any(k is None for k in keys) or any(v is None for v in values):
            raise RuntimeError("a layer's attention did not pass through the prefix cache")
        states = () if self.states is None else self.states.captured()
        return torch.stack(keys), torch.stack(values), states  # type: ignore[arg-type]

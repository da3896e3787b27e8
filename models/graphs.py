"""CUDA graphs for small packed batches: the whole packed forward replayed with one launch.

A small batch's GPU work takes well under a millisecond, but eager (or compiled) code launches a few hundred
kernels from Python, each costing microseconds of host time: at low load the host, not the GPU, sets the
latency. A CUDA graph records those launches once and replays them with one call.

A graph is recorded for fixed shapes, so a batch is padded up to a bucket (`GraphKey`):
- tokens: a multiple of 16 up to 128, then 8 steps per doubling (at most 1/8 of the bucket is padding);
- sequences (items): the next power of two, at least MIN_SEQUENCES; the unused slots are empty sequences
  (cu_seqlens repeats the total);
- longest item: the attention kernels size their grid by it, and the Triton kernel takes only batches whose
  longest is past its length switch (models.triton_attention.takes), so it is part of the key. In batches of
  up to SMALL_BATCH_TOKENS tokens only the side of the switch counts: the longest is keyed as the token
  bucket when past the switch, else as the switch (or the bucket, if smaller). Such batches cost the host far
  more than the GPU, so a grid sized by the bucket costs them nothing to speak of. Larger batches key the
  next power of two (at least 16, at most the bucket), so that their grids stay close to their work;
- with shared prefixes (models/packing.py): the groups, like the sequences, and the most suffix rows of a
  group and the longest prefix, like the longest item (the unused group slots are empty); where keys are
  gathered (sliding windows), also the key rows, bucketed like the tokens, and the longest key range, like
  the longest item. Padding key rows point at row 0 and belong to no sequence.
Where the last layer's row-wise modules run at the pooled rows only (models/pooled_rows.py), a buffer holds
those rows, one per item, padded to the sequence slots (pooled_row_slots) by repeating the
last.
Padding tokens belong to no sequence: attention never reads them, and every other layer of a dense
transformer works row by row, so whatever the padding rows hold never reaches an item's rows. Only the first
`total` rows of the output are read. The padding holds whatever an earlier batch left in the buffers: valid
token ids and positions, so no kernel can fault on them.

A shape is recorded when it comes a second time (the first batch of a shape takes the ordinary forward, the
second runs once on the buffers, which is its result, and is then recorded; later ones replay). The shapes
of a batch of up to MIN_SEQUENCES sequences and SMALL_BATCH_TOKENS tokens (one request of a few items: what
a worker at low load meets) are few, about two per token bucket, and the start-up warm-up records them all
ahead (`record_ahead`), so that such a request replays a graph the first time its shape comes. Graphs share
one memory pool (they never run at once) and copy their output into one buffer. Beyond `capacity` the least
recently used is dropped; those recorded ahead are held for good, outside it. A recording that fails turns
graphs off for the process with a warning; every batch then takes the ordinary forward.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from models.packing import KeyLayout, PackedBatch, PrefixCross

log = logging.getLogger(__name__)

MIN_TOKENS = 16
STEPS_PER_DOUBLING = 8
DEFAULT_CAPACITY = 256  # graphs held; their memory is one shared pool, each adds only its kernel list
KEYS_PER_TOKEN = 16  # key rows the buffers hold per token of the largest batch (shared prefixes repeat)
SEEN_SHAPES = 4096  # shapes met once, remembered so that the second batch of a shape records it
# Sequence slots a graph has at least: one request of one to four items takes the same graph. An empty slot
# costs the attention kernels a few programs that exit at once, and the last layer a pooled row.
MIN_SEQUENCES = 4
# Batches of up to this many tokens key their longest sequence by the side of the attention kernel's switch
# only (see above), and the warm-up records their graphs ahead. A W2 request (1-4 items of 32-512 tokens)
# is within it.
SMALL_BATCH_TOKENS = 2048


class PackedForward(Protocol):
    """(input_ids [1, T], position_ids [1, T], cu_seqlens [S + 1] int32, longest sequence, token_type_ids
    [1, T] or None; the gathered keys and the cross pass of shared prefixes, or None; the rows the batch
    pools, or None) -> the base model's last hidden states [T, H] (with `pooled_rows`, read only there)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_length: int,
        token_type_ids: torch.Tensor | None,
        *,
        keys: KeyLayout | None = None,
        cross: PrefixCross | None = None,
        pooled_rows: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


# Records `run` (which writes the output buffer) and returns what replays it. On CUDA: a CUDA graph. CPU
# tests pass one that simply runs it again, to exercise the padding and buffer logic without a GPU.
Recorder = Callable[[Callable[[], None]], Callable[[], None]]


class GraphKey(NamedTuple):
    """The padded shape one graph is recorded for; `groups`, `max_suffixes` and `max_prefix` are 0 without
    shared prefixes, `keys` and `max_keys` without gathered keys."""

    tokens: int
    sequences: int
    max_length: int
    keys: int = 0
    max_keys: int = 0
    groups: int = 0
    max_suffixes: int = 0
    max_prefix: int = 0


def token_bucket(tokens: int) -> int:
    """The padded token count for a batch of `tokens`: multiples of 16 to 128, then 8 steps per doubling."""
    if tokens <= 128:
        return max(MIN_TOKENS, -(-tokens // 16) * 16)
    step = (1 << ((tokens - 1).bit_length() - 1)) // STEPS_PER_DOUBLING
    return -(-tokens // step) * step


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def pooled_row_slots(sequences: int) -> int:
    """The pooled rows a batch of `sequences` packed sequences computes in its last layer
    (models/pooled_rows.py): its sequence slots in a CUDA graph of its shape (at least MIN_SEQUENCES), in
    the ordinary forward too, so that a shape multiplies as many rows on either path. Never one row:
    torch.compile specializes a dynamic size that is 1, which would give the last layer of a one-item batch
    graphs of its own."""
    return max(MIN_SEQUENCES, next_power_of_two(sequences))


def graph_key(
    total: int,
    items: int,
    longest: int,
    keys: int = 0,
    longest_keys: int = 0,
    groups: int = 0,
    most_suffixes: int = 0,
    longest_prefix: int = 0,
) -> GraphKey:
    """The bucket of a packed batch of `items` sequences, `total` tokens, the longest `longest` tokens; with
    shared prefixes, `groups` groups, at most `most_suffixes` suffix rows in one and `longest_prefix` prefix
    rows; with gathered keys, `keys` key rows in all and at most `longest_keys` for one sequence."""
    tokens = token_bucket(total)

    def length(n: int, within: int) -> int:
        return min(within, max(MIN_TOKENS, next_power_of_two(n)))

    if tokens <= SMALL_BATCH_TOKENS:
        switch = length_switch()
        max_length = tokens if longest > switch else min(tokens, switch)
    else:
        max_length = length(longest, tokens)
    key_rows = token_bucket(keys) if keys else 0
    return GraphKey(
        tokens,
        max(MIN_SEQUENCES, next_power_of_two(items)),
        max_length,
        key_rows,
        length(longest_keys, key_rows) if keys else 0,
        next_power_of_two(groups) if groups else 0,
        length(most_suffixes, tokens) if groups else 0,
        length(longest_prefix, tokens) if groups else 0,
    )


def length_switch() -> int:
    """The longest sequence the Triton attention kernel leaves to flash, read at each call."""
    from models import triton_attention  # here, not at the top: the kernel's module loads Triton

    return triton_attention.MIN_LENGTH


def small_batch_keys(max_tokens: int) -> list[GraphKey]:
    """The keys of every batch of up to MIN_SEQUENCES sequences and `max_tokens` tokens (at most
    SMALL_BATCH_TOKENS) without shared prefixes: for each token bucket, one per side of the attention
    kernel's length switch that such a batch can reach (none short past MIN_SEQUENCES short sequences)."""
    switch = length_switch()
    keys: dict[GraphKey, None] = {}
    fewest, tokens = 1, MIN_TOKENS  # the bucket's token counts run from `fewest` to `tokens`
    while tokens <= min(max_tokens, SMALL_BATCH_TOKENS):
        if fewest <= MIN_SEQUENCES * switch:
            keys[graph_key(tokens, 1, min(tokens, switch))] = None
        keys[graph_key(tokens, 1, tokens)] = None
        fewest, tokens = tokens + 1, token_bucket(tokens + 1)
    return list(keys)


def cuda_recorder(device: torch.device) -> Recorder:
    """Records on `device` into one memory pool shared by every graph of this recorder.

    Through the CUDAGraph calls rather than the torch.cuda.graph context, which synchronizes the device and
    empties the allocator's cache on every recording: the next large batch would then allocate its memory
    from the driver again, and a worker records new shapes while it serves.
    """
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def record(run: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)  # the buffers were filled on the current stream
        with torch.cuda.stream(side):
            # thread_local: the worker's other threads may use CUDA meanwhile (pinned host buffers).
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                run()
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return graph.replay

    return record


class GraphedForward:
    """The packed forward through recorded graphs for batches of at most `max_tokens` tokens."""

    def __init__(
        self,
        forward: PackedForward,
        device: torch.device,
        max_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        *,
        token_types: bool,
        pooled_rows: bool = False,
        recorder: Recorder | None = None,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self._forward = forward
        self.max_tokens = max_tokens
        self.capacity = capacity
        self.enabled = True
        self.recorded = 0  # graphs recorded since start (evicted ones included)
        self.replays = 0
        self._record = recorder or cuda_recorder(device)
        self._graphs: OrderedDict[GraphKey, Callable[[], None]] = OrderedDict()
        # Graphs recorded ahead (record_ahead): held for good, outside the capacity, so that a spell of large
        # batches in many shapes does not drop them before the next quiet spell needs them.
        self._ahead: dict[GraphKey, Callable[[], None]] = {}
        self._seen: OrderedDict[GraphKey, None] = OrderedDict()
        rows = token_bucket(max_tokens)
        # Buffers the graphs read and write: allocated once, outside the graphs' pool, at the largest shape.
        # Inference tensors, as the engine's own inputs are (it runs under inference_mode): torch.compile
        # guards on the difference, and a mix would recompile the layers (seconds) between the two paths.
        with torch.inference_mode():
            # One dimension, viewed as [1, T] per shape: the same strides as a packed row's, which
            # torch.compile also guards on.
            self._ids = torch.zeros(rows, dtype=torch.long, device=device)
            self._positions = torch.zeros(rows, dtype=torch.long, device=device)
            self._types = torch.zeros(rows, dtype=torch.long, device=device) if token_types else None
            self._cu = torch.zeros(next_power_of_two(rows) + 1, dtype=torch.int32, device=device)
            self._out = torch.empty((rows, hidden_size), dtype=dtype, device=device)
            # Shared prefixes: the cross pass's group bounds and its rows.
            self._cross_q = torch.zeros(next_power_of_two(rows) + 1, dtype=torch.int32, device=device)
            self._cross_k = torch.zeros(next_power_of_two(rows) + 1, dtype=torch.int32, device=device)
            self._cross_rows = torch.zeros(rows, dtype=torch.bool, device=device)
            # Gathered keys: each suffix's keys repeat its prefix's rows, so the keys outnumber the tokens.
            self._key_rows = token_bucket(KEYS_PER_TOKEN * max_tokens)
            self._key_index = torch.zeros(self._key_rows, dtype=torch.long, device=device)
            self._cu_k = torch.zeros(next_power_of_two(rows) + 1, dtype=torch.int32, device=device)
            # The rows the batch pools, one per item, padded to the sequence slots by repeating the last.
            self._rows = (
                torch.zeros(pooled_row_slots(rows), dtype=torch.long, device=device) if pooled_rows else None
            )

    @property
    def graphs(self) -> int:
        """Graphs held now."""
        return len(self._graphs) + len(self._ahead)

    def run(self, packed: PackedBatch) -> torch.Tensor | None:
        """Hidden states [total, H] of `packed`, or None when it takes the ordinary forward (too many tokens,
        or graphs turned off). A view of a shared buffer: read it before the next call."""
        bounds = packed.host_cu_seqlens
        total, items = int(bounds[-1]), len(bounds) - 1
        shared, cross = packed.shared, packed.cross
        keys = 0 if shared is None else int(shared.host_cu_seqlens_k[-1])
        if not self.enabled or total > self.max_tokens or keys > self._key_rows:
            return None
        key = graph_key(
            total,
            items,
            packed.max_length,
            keys,
            0 if shared is None else shared.max_length_k,
            0 if cross is None else len(cross.cu_q) - 1,
            0 if cross is None else cross.max_q,
            0 if cross is None else cross.max_k,
        )
        replay = self._ahead.get(key) or self._graphs.get(key)
        if replay is None and not self._seen_before(key):
            return None  # a shape met once may never come back: not worth a recording yet
        self._fill(packed, key, total, items)
        if replay is not None:
            if key in self._graphs:
                self._graphs.move_to_end(key)
            replay()
            self.replays += 1
            return self._out[:total]
        return self._run_and_record(key)[:total]

    def record_ahead(self, max_tokens: int = SMALL_BATCH_TOKENS) -> int:
        """Record now the graph of every batch of up to MIN_SEQUENCES sequences and `max_tokens` tokens
        (small_batch_keys; at most SMALL_BATCH_TOKENS and this forward's own limit) that is not held yet;
        how many it recorded. The buffers hold one sequence as long as the key's longest and whatever
        earlier batches left (valid ids and positions); what the forward computes from them is not read."""
        recorded = self.recorded
        for key in small_batch_keys(min(max_tokens, self.max_tokens)):
            if not self.enabled:
                break
            if key in self._ahead:
                continue
            if key in self._graphs:  # recorded from traffic already: held for good from now on
                self._ahead[key] = self._graphs.pop(key)
                continue
            length = min(key.tokens, key.max_length)
            self._cu[0] = 0
            self._cu[1 : key.sequences + 1].fill_(length)
            if self._rows is not None:
                self._rows[: pooled_row_slots(key.sequences)].fill_(length - 1)
            self._run_and_record(key, hold=True)
        return self.recorded - recorded

    def _run_and_record(self, key: GraphKey, hold: bool = False) -> torch.Tensor:
        """Run the forward of `key` on the buffers (the result of the batch they hold), then record it: held
        for good with `hold`, else among the least recently used. Returns the whole output buffer of that
        run. A failed recording turns graphs off."""
        hidden = self._call(key)  # recording below runs nothing
        try:
            graph = self._record(lambda: self._write(key))
        except Exception as exc:  # a kernel that cannot be recorded: the ordinary forward from now on
            self.enabled = False
            self._graphs.clear()
            self._ahead.clear()
            log.warning(
                "recording a CUDA graph failed (%s: %s): every batch takes the ordinary forward from now on",
                type(exc).__name__, exc,
            )  # fmt: skip
            return hidden
        self.recorded += 1
        if hold:
            self._ahead[key] = graph
            return hidden
        self._graphs[key] = graph
        if len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
        return hidden

    def _seen_before(self, key: GraphKey) -> bool:
        """Whether `key` came before (among the last SEEN_SHAPES shapes not recorded); notes it if not."""
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > SEEN_SHAPES:
            self._seen.popitem(last=False)
        return False

    def _fill(self, packed: PackedBatch, key: GraphKey, total: int, items: int) -> None:
        self._ids[:total].copy_(packed.input_ids[0], non_blocking=True)
        self._positions[:total].copy_(packed.position_ids[0], non_blocking=True)
        if self._types is not None and packed.token_type_ids is not None:
            self._types[:total].copy_(packed.token_type_ids[0], non_blocking=True)
        self._cu[: items + 1].copy_(packed.cu_seqlens, non_blocking=True)
        self._cu[items + 1 : key.sequences + 1].fill_(total)  # empty sequences in the unused slots
        if self._rows is not None:
            # One pooled row per item, at most one per sequence slot. The repeats of the last row compute the
            # same values into the same row, so the padding changes nothing.
            count = packed.pooled_rows.shape[0]
            self._rows[:count].copy_(packed.pooled_rows, non_blocking=True)
            self._rows[count : pooled_row_slots(key.sequences)].fill_(packed.pooled_rows[-1])
        cross = packed.cross
        if cross is not None:
            groups = len(cross.cu_q) - 1
            self._cross_q[: groups + 1].copy_(cross.cu_q, non_blocking=True)
            # Empty groups in the unused slots: their bounds repeat the last, read on the device (no sync).
            self._cross_q[groups + 1 : key.groups + 1].fill_(cross.cu_q[-1])
            self._cross_k[: groups + 1].copy_(cross.cu_k, non_blocking=True)
            self._cross_k[groups + 1 : key.groups + 1].fill_(cross.cu_k[-1])
            self._cross_rows[:total].copy_(cross.rows, non_blocking=True)
            self._cross_rows[total : key.tokens].fill_(False)  # padding takes no cross pass
        shared = packed.shared
        if shared is not None:
            keys = int(shared.host_cu_seqlens_k[-1])
            self._key_index[:keys].copy_(shared.key_index, non_blocking=True)
            # The padding keys are gathered too (no sequence reads them): rows that exist, whatever the shape.
            self._key_index[keys : key.keys].zero_()
            self._cu_k[: items + 1].copy_(shared.cu_seqlens_k, non_blocking=True)
            self._cu_k[items + 1 : key.sequences + 1].fill_(keys)

    def _call(self, key: GraphKey) -> torch.Tensor:
        pooled = None if self._rows is None else self._rows[: pooled_row_slots(key.sequences)]
        tokens = key.tokens
        types = None if self._types is None else self._types[:tokens].unsqueeze(0)
        keys = cross = None
        if key.keys:
            keys = KeyLayout(self._key_index[: key.keys], self._cu_k[: key.sequences + 1], key.max_keys)
        if key.groups:
            cross = PrefixCross(
                self._cross_q[: key.groups + 1],
                self._cross_k[: key.groups + 1],
                key.max_suffixes,
                key.max_prefix,
                self._cross_rows[:tokens],
            )
        return self._forward(
            self._ids[:tokens].unsqueeze(0),
            self._positions[:tokens].unsqueeze(0),
            self._cu[: key.sequences + 1],
            key.max_length,
            types,
            keys=keys,
            cross=cross,
            pooled_rows=pooled,
        )

    def _write(self, key: GraphKey) -> None:
        self._out[: key.tokens].copy_(self._call(key))

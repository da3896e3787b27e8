"""Padding-free packing of prompts into one sequence: shared prefixes, pooled positions, the pooling."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

# How an item's tokens become one pooled hidden state (see Pooling in docs/models.md):
# - "last": HF's rule for decoder classifiers, the last token that is not the pad id (the first token when
#   every token is the pad id; the true last token when the model has no pad id). On reward models whose pad
#   id is their EOS, a prompt ending in EOS is pooled one token earlier, exactly as HF scores it.
# - "last_token": the item's true last token, whatever its id.
# - "cls": the item's first token (encoder classifiers).
# - "mean": the mean over the item's tokens, in float32.
Pooling = Literal["last", "last_token", "cls", "mean"]
POOLINGS: tuple[Pooling, ...] = ("last", "last_token", "cls", "mean")


@dataclass(frozen=True)
class SharedPrefix:
    """Prompts of a batch (their indices) whose first `length` tokens are the same: computed once."""

    members: tuple[int, ...]
    length: int


@dataclass(frozen=True)
class SharedKeys:
    """Gathered keys: where each attention sequence of a packed row with shared prefixes finds its keys, for
    attention that reads a suffix's prefix and its own keys as one range (the exact path, sliding windows).

    Sequence i (rows cu_seqlens[i]:[i+1] of the row) attends to the rows key_index[cu_seqlens_k[i]:[i+1]]:
    a shared prefix's sequence to itself; a suffix to its prefix, then itself; any other prompt to itself.
    """

    key_index: torch.Tensor  # [K] int64 rows of the packed row, on the device
    cu_seqlens_k: torch.Tensor  # [S + 1] int32, on the device
    host_cu_seqlens_k: torch.Tensor  # the same on the host
    max_length_k: int


class KeyLayout(NamedTuple):
    """What a packed forward's attention needs of gathered keys: the key rows of each sequence
    (key_index[cu_seqlens_k[i]:[i+1]]) and the longest such range, on the device or host it reads them."""

    key_index: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_length_k: int


class PrefixCross(NamedTuple):
    """The second attention pass of shared prefixes (models/attention.py): each group's suffixes, as one
    sequence of queries, attend to the group's prefix with no mask (every prefix token comes before every
    suffix token); merged with every sequence's own causal pass, a suffix sees its prefix, then itself.
    Neither pass copies a key: a suffix's prefix is read where the packed row holds it once."""

    cu_q: torch.Tensor  # [G + 1] int32 rows of each group's suffixes (all suffix rows are contiguous)
    cu_k: torch.Tensor  # [G + 1] int32 rows of each group's prefix (all prefix rows are contiguous)
    max_q: int  # the most suffix rows of a group
    max_k: int  # the longest prefix
    rows: torch.Tensor  # [T] bool: the rows in some group's suffixes, whose own pass is merged with it


@dataclass(frozen=True)
class PackedBatch:
    """Prompts concatenated into one row. Without shared prefixes, item i spans tokens
    cu_seqlens[i]:cu_seqlens[i+1]; with them (`cross` set), cu_seqlens bounds attention sequences instead
    (every shared prefix once, then every group's suffixes, then the other prompts), and pooling finds every
    item's rows by index."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 for every item (suffixes after their prefix)
    cu_seqlens: torch.Tensor  # [S + 1] int32, on the device
    host_cu_seqlens: torch.Tensor  # the same on the host: reading item bounds from it needs no device sync
    pooled_rows: torch.Tensor  # [N] int64: the pooled token of every item ("last", "last_token", "cls")
    token_type_ids: torch.Tensor | None  # [1, T] int64 segment ids, for encoders that embed them
    item_of_token: torch.Tensor | None  # [V] int64 item of every token of every prompt; only for "mean"
    lengths: torch.Tensor  # [N] int64 tokens per item (its whole prompt), on the device
    max_length: int
    # For "mean" with shared prefixes: the packed row of every token of every prompt (V >= T); None when
    # each prompt is packed whole, in order (then token v is row v).
    row_of_token: torch.Tensor | None = None
    cross: PrefixCross | None = None  # with shared prefixes: the suffixes' pass over their prefixes
    shared: SharedKeys | None = None  # with shared prefixes, where asked: each sequence's keys gathered
    # [M] int64: the row of every position token outputs read (`positions` of `pack`), item by item
    position_rows: torch.Tensor | None = None
    # With positions: the pooled rows and the positions' rows, each once, in order (what a last layer
    # restricted to the rows read computes: models/pooled_rows.py)
    rows_read: torch.Tensor | None = None
    # [T] int64: the LoRA adapter of every row (-1: the base model); None when no prompt has one
    adapter_rows: torch.Tensor | None = None
    # [R] int64: the rows whose keys and values the prefix cache keeps, span after span (pack's `capture`)
    capture_rows: torch.Tensor | None = None
    # With the prefix cache: per attention sequence, the prompt whose cached tokens it continues (-1: none)
    resumed: tuple[int, ...] | None = None


def find_shared_prefixes(prompts: Sequence[Sequence[int]], min_tokens: int) -> list[SharedPrefix]:
    """Groups of at least two prompts sharing a prefix of at least `min_tokens` tokens, each member keeping
    one token or more of its own (its pooled token is computed with its own suffix).

    Sorting puts prompts with common prefixes next to each other. The prefix a run of neighbours shares is
    the smallest one two adjacent ones share; splitting the run there gives two runs with longer prefixes.
    Over the tree of such splits (a Cartesian tree of the neighbours' shared lengths), each run is kept
    whole or split, whichever saves more tokens: many requests with one long query stay one group even
    if a few share a shorter start with them. A prompt joins one group at most. Costs a sort and one
    comparison per neighbour: nothing measurable when nothing is shared.
    """
    if min_tokens <= 0 or len(prompts) < 2:
        return []
    rows = [p if isinstance(p, tuple) else tuple(p) for p in prompts]  # one type: slices compare in C
    order = sorted(range(len(rows)), key=rows.__getitem__)
    # Neighbour pair k (order[k], order[k + 1]): the prefix they could share, leaving each a token.
    shared = [shareable_prefix(rows[a], rows[b]) for a, b in itertools.pairwise(order)]
    left, right, root = _cartesian_tree(shared)
    # Bottom-up: the pairs under each node, and the most tokens its run saves (whole, or its two halves).
    low, high, best, whole = (
        list(range(len(shared))),
        list(range(len(shared))),
        [0] * len(shared),
        [False] * len(shared),
    )
    for node in _post_order(root, left, right):
        lo_child, hi_child = left[node], right[node]
        low[node] = low[lo_child] if lo_child >= 0 else node
        high[node] = high[hi_child] if hi_child >= 0 else node
        kept = (high[node] - low[node] + 1) * shared[node] if shared[node] >= min_tokens else 0
        split = (best[lo_child] if lo_child >= 0 else 0) + (best[hi_child] if hi_child >= 0 else 0)
        best[node], whole[node] = max(kept, split), kept > 0 and kept >= split
    groups: list[SharedPrefix] = []
    pending = [root]
    while pending:
        node = pending.pop()
        if node < 0:
            continue
        if whole[node]:
            members = tuple(sorted(order[low[node] : high[node] + 2]))
            groups.append(SharedPrefix(members, shared[node]))
        else:
            pending += [left[node], right[node]]
    return sorted(groups, key=lambda g: g.members[0])


def shareable_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The prefix two prompts could compute once: their common prefix, leaving each one token of its own."""
    return min(_common_prefix(a, b), len(a) - 1, len(b) - 1)


def packed_length(prompts: Sequence[Sequence[int]], min_tokens: int) -> int:
    """Tokens of the packed row of `prompts` with the prefixes `find_shared_prefixes` finds computed once:
    what the forward pass computes, and so what a batch's token budget counts."""
    return sum(len(p) for p in prompts) - saved_tokens(find_shared_prefixes(prompts, min_tokens))


def saved_tokens(groups: Sequence[SharedPrefix]) -> int:
    """Tokens the packed row leaves out: each group's prefix once instead of once per member."""
    return sum((len(g.members) - 1) * g.length for g in groups)


def _cartesian_tree(values: Sequence[int]) -> tuple[list[int], list[int], int]:
    """Children (-1: none) and root of the min-rooted Cartesian tree of `values` (ties: left one on top)."""
    left, right = [-1] * len(values), [-1] * len(values)
    stack: list[int] = []
    for i, value in enumerate(values):
        last = -1
        while stack and values[stack[-1]] > value:
            last = stack.pop()
        left[i] = last
        if stack:
            right[stack[-1]] = i
        stack.append(i)
    return left, right, stack[0] if stack else -1


def _post_order(root: int, left: Sequence[int], right: Sequence[int]) -> list[int]:
    """Nodes children first, without recursion (a sorted batch can make the tree as deep as it is long)."""
    out, stack = [], [root] if root >= 0 else []
    while stack:
        node = stack.pop()
        out.append(node)
        stack += [child for child in (left[node], right[node]) if child >= 0]
    return out[::-1]


# Tokens compared at once, as tuple slices, before the first differing block is walked token by token: a
# batch's prompts may share queries of thousands of tokens, and each neighbour pair is compared on every
# measure of the batch.
_PREFIX_BLOCK = 64


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i + _PREFIX_BLOCK <= n and a[i : i + _PREFIX_BLOCK] == b[i : i + _PREFIX_BLOCK]:
        i += _PREFIX_BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pooled_positions(
    prompts: Sequence[Sequence[int]],
    starts: np.ndarray,
    ends: np.ndarray,
    pooling: Pooling,
    pad_id: int | None,
) -> np.ndarray:
    """Index into the row of each item's pooled token, item i being the tokens `prompts[i]` laid out from
    row starts[i] to ends[i] (for every pooling but "mean"). "last" takes the last token that is not the
    pad id, read back from the item's end (a step where it ends unpadded); an all-pad item its first."""
    if pooling == "cls":
        return starts
    if pooling == "last_token" or pad_id is None:
        return ends - 1
    return np.fromiter(
        (start + _last_not(prompt, pad_id) for prompt, start in zip(prompts, starts.tolist(), strict=True)),
        dtype=np.int64,
        count=len(prompts),
    )


def _last_not(prompt: Sequence[int], pad_id: int) -> int:
    """Index of the prompt's last token other than `pad_id`; 0 when every token is padding."""
    for index in range(len(prompt) - 1, -1, -1):
        if prompt[index] != pad_id:
            return index
    return 0


def pack(
    prompts: Sequence[Sequence[int]],
    device: torch.device,
    pooling: Pooling = "last_token",
    pad_id: int | None = None,
    token_types: Sequence[Sequence[int]] | None = None,
    position_pad: int | None = None,
    shared: Sequence[SharedPrefix] = (),
    gather_keys: bool = False,
    read_at: Sequence[Sequence[int]] | None = None,
    adapters: Sequence[int] | None = None,
    cached: Sequence[tuple[int, int]] | None = None,
    capture: Sequence[tuple[int, int, int]] | None = None,
) -> PackedBatch:
    """Pack non-empty prompts; built on the host with numpy, then moved to `device` in one go each.

    `capture`: (prompt, start, stop) spans of tokens whose keys and values the prefix cache keeps; their
    rows, span after span, become PackedBatch.capture_rows.

    `cached`: per prompt, how many of its first tokens come from the prefix cache and where their keys start
    in the batch's cached region (models/prefix_cache.py), which attention puts before the row's own keys:
    such a prompt packs only its other tokens (positions continuing after the cached ones) and every
    sequence's keys are gathered, the row's indices shifted past the region. A prompt with cached tokens
    belongs to no shared group.

    `adapters`: per prompt, its LoRA adapter's index (-1: none), for PackedBatch.adapter_rows; a shared
    prefix must be shared by prompts of one adapter.

    `read_at`: per prompt, the token positions whose rows token outputs read (PackedBatch.position_rows).

    `token_types`: segment ids per prompt (BERT). `position_pad`: RoBERTa-style positions, which start at
    the pad id + 1 and leave pad tokens at the pad id, as HF computes them from unpacked input ids.
    `shared`: prefixes to pack once (`find_shared_prefixes`; causal models only, without either of those).
    `gather_keys`: with `shared`, also lay out each sequence's keys for gathering (`SharedKeys`).
    """
    if cached is not None and not any(tokens for tokens, _ in cached):
        cached = None
    if shared or cached is not None or capture:
        if token_types is not None or position_pad is not None:
            raise ValueError("shared prefixes and cached ones are packed for causal decoders only")
        if cached is not None and pooling == "mean":
            raise ValueError("mean pooling reads every row: a prompt with cached tokens has none for them")
        gather_keys = gather_keys or cached is not None
        return _pack_shared(
            prompts, shared, device, pooling, pad_id, gather_keys, read_at, adapters, cached, capture
        )
    return _pack_whole(prompts, device, pooling, pad_id, token_types, position_pad, read_at, adapters)


def _pack_whole(
    prompts: Sequence[Sequence[int]],
    device: torch.device,
    pooling: Pooling,
    pad_id: int | None,
    token_types: Sequence[Sequence[int]] | None,
    position_pad: int | None,
    read_at: Sequence[Sequence[int]] | None,
    adapters: Sequence[int] | None,
) -> PackedBatch:
    """Every prompt whole, in order: item i spans rows cu_seqlens[i]:cu_seqlens[i+1]."""
    lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1])
    ids = np.fromiter(itertools.chain.from_iterable(prompts), dtype=np.int64, count=total)
    positions = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
    pooled = pooled_positions(prompts, starts, ends, pooling, pad_id)  # the pooled rows, on the host
    if position_pad is not None:
        real = (ids != position_pad).astype(np.int64)
        counted = np.cumsum(real) - np.repeat(np.cumsum(real)[starts] - real[starts], lengths)
        positions = counted * real + position_pad
    cu = np.concatenate(([0], ends)).astype(np.int32)
    non_blocking = device.type == "cuda"
    return PackedBatch(
        input_ids=_to_device(ids, device, non_blocking).unsqueeze(0),
        position_ids=_to_device(positions, device, non_blocking).unsqueeze(0),
        cu_seqlens=_to_device(cu, device, non_blocking),
        host_cu_seqlens=torch.from_numpy(cu),
        pooled_rows=_to_device(pooled, device, non_blocking),
        token_type_ids=None
        if token_types is None
        else _to_device(
            np.fromiter((t for types in token_types for t in types), dtype=np.int64, count=total),
            device,
            non_blocking,
        ).unsqueeze(0),
        item_of_token=_item_of_token(lengths, device, non_blocking) if pooling == "mean" else None,
        lengths=_to_device(lengths, device, non_blocking),
        max_length=int(lengths.max()),
        **_rows_read(
            None if read_at is None else position_rows(read_at, starts),
            None if pooling == "mean" else pooled,
            device,
            non_blocking,
        ),
        adapter_rows=None
        if adapters is None
        else _to_device(np.repeat(np.asarray(adapters, dtype=np.int64), lengths), device, non_blocking),
    )


def _item_of_token(lengths: np.ndarray, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """PackedBatch.item_of_token: the item of every token of every prompt, prompt after prompt."""
    return _to_device(np.repeat(np.arange(len(lengths), dtype=np.int64), lengths), device, non_blocking)


def _rows_read(
    rows: np.ndarray | None, pooled: np.ndarray | None, device: torch.device, non_blocking: bool
) -> dict[str, Any]:
    """PackedBatch's position_rows and rows_read, from the host rows of the positions read (None: none)
    and of the pooled tokens (None for MEAN, which reads every row)."""
    if rows is None:
        return {"position_rows": None, "rows_read": None}
    read = None if pooled is None else np.unique(np.concatenate((pooled, rows)))
    return {
        "position_rows": _to_device(rows, device, non_blocking),
        "rows_read": None if read is None else _to_device(read, device, non_blocking),
    }


def position_rows(positions: Sequence[Sequence[int]], starts: np.ndarray) -> np.ndarray:
    """The rows of every prompt's `positions`, prompt i's tokens laid out from row starts[i] (a virtual
    row, for shared prefixes, that `row_of_token` maps to its packed row)."""
    counts = np.fromiter((len(at) for at in positions), dtype=np.int64, count=len(positions))
    flat = np.fromiter(itertools.chain.from_iterable(positions), dtype=np.int64, count=int(counts.sum()))
    rows: np.ndarray = flat + np.repeat(starts, counts)
    return rows


class _SharedLayout(NamedTuple):
    """Where `_pack_shared` lays each token out (host arrays): ids and positions per attention sequence, each
    prompt's rows (its prefix's and its own), each sequence's key rows (when keys are gathered), where each
    group's suffixes end, and the rows in all."""

    ids: list[np.ndarray]
    positions: list[np.ndarray]
    rows_of: list[np.ndarray]
    keys: list[np.ndarray]
    suffix_ends: list[int]
    rows: int


def _lay_out_shared(
    prompts: Sequence[Sequence[int]],
    groups: Sequence[SharedPrefix],
    gather_keys: bool,
    cached: Sequence[tuple[int, int]] | None = None,
) -> _SharedLayout:
    """Every group's shared prefix once, then every group's suffixes (positions continuing after their
    prefix), then every other prompt whole, or, where `cached` says its first tokens come from the cache,
    the rest of it. A prompt's rows for its cached tokens are -1 (no row holds them); key rows count the
    cached region first (its keys come before the row's in attention), so the row's own are shifted by its
    length."""
    shift = 0 if cached is None else _region_rows(cached)
    ids: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    keys: list[np.ndarray] = []  # per attention sequence: the rows it attends to
    rows_of: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(prompts)  # per prompt, its rows
    row = 0

    def emit(
        tokens: Sequence[int],
        first_position: int,
        prefix_rows: np.ndarray,
        cached_keys: np.ndarray | None = None,
    ) -> np.ndarray:
        """Lay out one sequence's tokens; returns the rows its prompt's tokens lie in (prefix and own)."""
        nonlocal row
        own = np.arange(row, row + len(tokens), dtype=np.int64)
        ids.append(np.asarray(tokens, dtype=np.int64))
        positions.append(np.arange(first_position, first_position + len(tokens), dtype=np.int64))
        rows = np.concatenate((prefix_rows, own)) if len(prefix_rows) else own
        if gather_keys:
            keys.append(rows + shift if cached_keys is None else np.concatenate((cached_keys, rows + shift)))
        row += len(tokens)
        return rows

    none = np.empty(0, dtype=np.int64)
    prefix_rows = [emit(prompts[g.members[0]][: g.length], 0, none) for g in groups]
    suffix_ends = []
    for group, prefix in zip(groups, prefix_rows, strict=True):
        for member in group.members:
            rows_of[member] = emit(prompts[member][group.length :], group.length, prefix)
        suffix_ends.append(row)
    grouped = {member for group in groups for member in group.members}
    for index, prompt in enumerate(prompts):
        if index in grouped:
            continue
        tokens, start = (0, 0) if cached is None else cached[index]
        if tokens:
            region = np.arange(start, start + tokens, dtype=np.int64)
            own = emit(prompt[tokens:], tokens, none, region)
            rows_of[index] = np.concatenate((np.full(tokens, -1, dtype=np.int64), own))
        else:
            rows_of[index] = emit(prompt, 0, none)
    return _SharedLayout(ids, positions, rows_of, keys, suffix_ends, row)


def _region_rows(cached: Sequence[tuple[int, int]]) -> int:
    """The cached region's rows: where the furthest prompt's cached keys end."""
    return max((start + tokens for tokens, start in cached if tokens), default=0)


def _pack_shared(
    prompts: Sequence[Sequence[int]],
    groups: Sequence[SharedPrefix],
    device: torch.device,
    pooling: Pooling,
    pad_id: int | None,
    gather_keys: bool,
    read_at: Sequence[Sequence[int]] | None = None,
    adapters: Sequence[int] | None = None,
    cached: Sequence[tuple[int, int]] | None = None,
    capture: Sequence[tuple[int, int, int]] | None = None,
) -> PackedBatch:
    """Every group's shared prefix once, then every group's suffixes (positions continuing after their
    prefix), then every other prompt whole (`_lay_out_shared`): the prefixes, and the suffixes, lie in one
    run of rows each, so the suffixes' pass over their prefixes (`PrefixCross`) is one varlen call with a
    sequence per group. A suffix attends to its prefix's rows, then its own: what it would attend to in its
    whole prompt, so its states are those of the whole prompt. A prompt with `cached` tokens attends to
    their keys in the cached region, then its own rows."""
    ids, positions, rows_of, keys, suffix_ends, row = _lay_out_shared(prompts, groups, gather_keys, cached)
    q_lengths = np.fromiter((len(p) for p in positions), dtype=np.int64, count=len(positions))
    cu = np.concatenate(([0], np.cumsum(q_lengths))).astype(np.int32)
    # Pooling reads each prompt as if it were packed whole ("virtual" tokens), then maps those to rows.
    lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    row_of_token = np.concatenate(rows_of)
    pooled = row_of_token[pooled_positions(prompts, starts, ends, pooling, pad_id)]  # on the host
    read_rows = None if read_at is None else row_of_token[position_rows(read_at, starts)]
    if (pooled < 0).any() or (read_rows is not None and (read_rows < 0).any()):
        raise ValueError("a row results read comes from the prefix cache, which holds keys and values only")
    captured = _captured_rows(rows_of, capture) if capture else None
    resumed = None if cached is None else _resumed(cached, rows_of, cu)
    non_blocking = device.type == "cuda"
    mean = pooling == "mean"
    return PackedBatch(
        input_ids=_to_device(np.concatenate(ids), device, non_blocking).unsqueeze(0),
        position_ids=_to_device(np.concatenate(positions), device, non_blocking).unsqueeze(0),
        cu_seqlens=_to_device(cu, device, non_blocking),
        host_cu_seqlens=torch.from_numpy(cu),
        pooled_rows=_to_device(pooled, device, non_blocking),
        token_type_ids=None,
        item_of_token=_item_of_token(lengths, device, non_blocking) if mean else None,
        lengths=_to_device(lengths, device, non_blocking),
        max_length=int(q_lengths.max()),
        row_of_token=_to_device(row_of_token, device, non_blocking) if mean else None,
        cross=_prefix_cross(groups, suffix_ends, row, device, non_blocking) if groups else None,
        shared=_shared_keys(keys, device, non_blocking) if gather_keys else None,
        # A position inside a shared prefix reads the prefix's one row: its state is every member's.
        **_rows_read(read_rows, None if mean else pooled, device, non_blocking),
        adapter_rows=None
        if adapters is None
        else _to_device(_row_adapters(rows_of, adapters, row), device, non_blocking),
        capture_rows=None if captured is None else _to_device(captured, device, non_blocking),
        resumed=resumed,
    )


def _prefix_cross(
    groups: Sequence[SharedPrefix],
    suffix_ends: Sequence[int],
    rows: int,
    device: torch.device,
    non_blocking: bool,
) -> PrefixCross:
    """The suffixes' pass over their prefixes: the prefixes lie first, in one run of rows, then each group's
    suffixes, in one run of rows ending at `suffix_ends`; a sequence per group."""
    prefix_lengths = np.fromiter((g.length for g in groups), dtype=np.int64, count=len(groups))
    cross_k = np.concatenate(([0], np.cumsum(prefix_lengths))).astype(np.int32)
    cross_q = np.concatenate((cross_k[-1:], suffix_ends)).astype(np.int32)
    suffix_rows = np.zeros(rows, dtype=np.bool_)
    suffix_rows[cross_q[0] : cross_q[-1]] = True
    return PrefixCross(
        cu_q=_to_device(cross_q, device, non_blocking),
        cu_k=_to_device(cross_k, device, non_blocking),
        max_q=int(np.diff(cross_q).max()),
        max_k=int(prefix_lengths.max()),
        rows=_to_device(suffix_rows, device, non_blocking),
    )


def _captured_rows(rows_of: Sequence[np.ndarray], capture: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """The rows of every (prompt, start, stop) span the prefix cache keeps, span after span."""
    captured = np.concatenate([rows_of[prompt][start:stop] for prompt, start, stop in capture])
    if (captured < 0).any():
        raise ValueError("a span to keep in the prefix cache was taken from it")
    return captured


def _resumed(
    cached: Sequence[tuple[int, int]], rows_of: Sequence[np.ndarray], cu: np.ndarray
) -> tuple[int, ...]:
    """Per attention sequence, the prompt whose cached tokens it continues (-1: none): a prompt with cached
    tokens is one sequence, from its first own row."""
    sequence_of = {
        int(np.searchsorted(cu, rows_of[prompt][tokens], side="right")) - 1: prompt
        for prompt, (tokens, _) in enumerate(cached)
        if tokens
    }
    return tuple(sequence_of.get(sequence, -1) for sequence in range(len(cu) - 1))


def _row_adapters(rows_of: Sequence[np.ndarray], adapters: Sequence[int], rows: int) -> np.ndarray:
    """The adapter of every packed row: its prompt's (a shared prefix's rows, its members' one adapter)."""
    out = np.full(rows, -1, dtype=np.int64)
    for prompt_rows, adapter in zip(rows_of, adapters, strict=True):
        out[prompt_rows[prompt_rows >= 0]] = adapter  # -1: a cached token, in no row
    return out


def _shared_keys(keys: Sequence[np.ndarray], device: torch.device, non_blocking: bool) -> SharedKeys:
    """The rows each suffix sequence reads its keys from (its prefix's, then its own), as one index."""
    k_lengths = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
    cu_k = np.concatenate(([0], np.cumsum(k_lengths))).astype(np.int32)
    return SharedKeys(
        key_index=_to_device(np.concatenate(keys), device, non_blocking),
        cu_seqlens_k=_to_device(cu_k, device, non_blocking),
        host_cu_seqlens_k=torch.from_numpy(cu_k),
        max_length_k=int(k_lengths.max()),
    )


def pool(hidden: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Pooled hidden states [N, H] from the packed output [T, H]: selected rows, or float32 item means."""
    if packed.item_of_token is None:
        return hidden.index_select(0, packed.pooled_rows)
    # An averaging matrix [N, T] times the states [T, H], not index_add_: CUDA's index_add_ sums with atomics,
    # whose order (and so rounding) changes from run to run; a matmul's does not.
    tokens = hidden.shape[0]
    weights = torch.zeros((packed.lengths.shape[0], tokens), dtype=torch.float32, device=hidden.device)
    columns = (
        torch.arange(tokens, device=hidden.device) if packed.row_of_token is None else packed.row_of_token
    )
    weights[packed.item_of_token, columns] = 1.0 / packed.lengths.to(torch.float32)[packed.item_of_token]
    return weights @ hidden.float()


def pool_each(hidden: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """`pool` of a batch that pools item means, one item at a time: each mean sums only its item's rows, in
    an order that depends on the item alone (the deterministic setting's; `pool`'s one product over the
    batch's rows sums them in tiles that follow the batch)."""
    if packed.item_of_token is None:
        return pool(hidden, packed)
    columns = packed.row_of_token
    if columns is None:
        columns = torch.arange(hidden.shape[0], device=hidden.device)
    items = packed.item_of_token.cpu()
    order = torch.argsort(items, stable=True)
    counts = torch.bincount(items, minlength=packed.lengths.shape[0]).tolist()
    rows = torch.split(columns.index_select(0, order.to(columns.device)), counts)
    lengths = packed.lengths.to(torch.float32)
    means = [hidden.index_select(0, r).float().sum(0) / lengths[i] for i, r in enumerate(rows)]
    return torch.stack(means)


def _to_device(array: np.ndarray, device: torch.device, non_blocking: bool) -> torch.Tensor:
    host = torch.from_numpy(array)
    if non_blocking:
        host = host.pin_memory()
    return host.to(device, non_blocking=non_blocking)

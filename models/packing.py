"""Padding-free packing of prompts into one sequence, and the single device-to-host copy of selected rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from schemas import HiddenDType, Tensor

_TORCH_DTYPES: dict[HiddenDType, torch.dtype] = {
    HiddenDType.FLOAT32: torch.float32,
    HiddenDType.FLOAT16: torch.float16,
    HiddenDType.BFLOAT16: torch.bfloat16,
}


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
class PackedBatch:
    """Prompts concatenated into one row; item i spans tokens cu_seqlens[i]:cu_seqlens[i+1]."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 for every item
    cu_seqlens: torch.Tensor  # [N + 1] int32, on the device
    host_cu_seqlens: torch.Tensor  # the same on the host: reading item bounds from it needs no device sync
    pooled_rows: torch.Tensor  # [N] int64: the pooled token of every item ("last", "last_token", "cls")
    token_type_ids: torch.Tensor | None  # [1, T] int64 segment ids, for encoders that embed them
    item_of_token: torch.Tensor | None  # [T] int64 item index of every token; only for "mean"
    lengths: torch.Tensor  # [N] int64 tokens per item, on the device
    max_length: int


def pooled_positions(
    ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, pooling: Pooling, pad_id: int | None
) -> np.ndarray:
    """Index into the packed row of each item's pooled token (for every pooling but "mean")."""
    if pooling == "cls":
        return starts
    if pooling == "last_token" or pad_id is None:
        return ends - 1
    # Last index whose token is not the pad id, per item; -1 where an item is all padding.
    candidates = np.where(ids != pad_id, np.arange(len(ids), dtype=np.int64), -1)
    last = np.maximum.reduceat(candidates, starts)
    return np.where(last >= starts, last, starts)


def pack(
    prompts: Sequence[Sequence[int]],
    device: torch.device,
    pooling: Pooling = "last_token",
    pad_id: int | None = None,
    token_types: Sequence[Sequence[int]] | None = None,
    position_pad: int | None = None,
) -> PackedBatch:
    """Pack non-empty prompts; built on the host with numpy, then moved to `device` in one go each.

    `token_types`: segment ids per prompt (BERT). `position_pad`: RoBERTa-style positions, which start at
    the pad id + 1 and leave pad tokens at the pad id, as HF computes them from unpacked input ids.
    """
    lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1])
    ids = np.fromiter((token for prompt in prompts for token in prompt), dtype=np.int64, count=total)
    positions = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
    if position_pad is not None:
        real = (ids != position_pad).astype(np.int64)
        counted = np.cumsum(real) - np.repeat(np.cumsum(real)[starts] - real[starts], lengths)
        positions = counted * real + position_pad
    cu = np.concatenate(([0], ends)).astype(np.int32)
    non_blocking = device.type == "cuda"
    item_of_token = None
    if pooling == "mean":
        item_of_token = _to_device(
            np.repeat(np.arange(len(prompts), dtype=np.int64), lengths), device, non_blocking
        )
    return PackedBatch(
        input_ids=_to_device(ids, device, non_blocking).unsqueeze(0),
        position_ids=_to_device(positions, device, non_blocking).unsqueeze(0),
        cu_seqlens=_to_device(cu, device, non_blocking),
        host_cu_seqlens=torch.from_numpy(cu),
        pooled_rows=_to_device(pooled_positions(ids, starts, ends, pooling, pad_id), device, non_blocking),
        token_type_ids=None
        if token_types is None
        else _to_device(
            np.fromiter((t for types in token_types for t in types), dtype=np.int64, count=total),
            device,
            non_blocking,
        ).unsqueeze(0),
        item_of_token=item_of_token,
        lengths=_to_device(lengths, device, non_blocking),
        max_length=int(lengths.max()),
    )


def pool(hidden: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Pooled hidden states [N, H] from the packed output [T, H]: selected rows, or float32 item means."""
    if packed.item_of_token is None:
        return hidden.index_select(0, packed.pooled_rows)
    # An averaging matrix [N, T] times the states [T, H], not index_add_: CUDA's index_add_ sums with atomics,
    # whose order (and so rounding) changes from run to run; a matmul's does not.
    tokens = hidden.shape[0]
    weights = torch.zeros((packed.lengths.shape[0], tokens), dtype=torch.float32, device=hidden.device)
    columns = torch.arange(tokens, device=hidden.device)
    weights[packed.item_of_token, columns] = 1.0 / packed.lengths.to(torch.float32)[packed.item_of_token]
    return weights @ hidden.float()


def _to_device(array: np.ndarray, device: torch.device, non_blocking: bool) -> torch.Tensor:
    host = torch.from_numpy(array)
    if non_blocking:
        host = host.pin_memory()
    return host.to(device, non_blocking=non_blocking)


@dataclass(frozen=True)
class RowRequest:
    """Rows of the pooled matrix that one request asked for, and in which dtype."""

    rows: tuple[int, ...]
    dtype: HiddenDType


def hidden_row_bytes(hidden_size: int, dtype: HiddenDType) -> int:
    """Bytes of one pooled hidden state of `hidden_size` values in `dtype`."""
    return hidden_size * _TORCH_DTYPES[dtype].itemsize


def copy_rows_to_host(pooled: torch.Tensor, wanted: Sequence[RowRequest]) -> list[tuple[Tensor, ...]]:
    """Gather only the asked rows of pooled [N, H], cast on device, and copy them to the host at once.

    Rows are grouped by dtype (one gather and one cast per dtype) and laid out as raw bytes in one buffer,
    so even a batch with mixed dtypes costs a single device-to-host copy.
    Returns one tuple of schemas.Tensor per entry of `wanted`.
    """
    if not wanted:
        return []
    hidden = pooled.shape[1]
    dtypes = list(dict.fromkeys(entry.dtype for entry in wanted))
    chunks: list[torch.Tensor] = []
    group_offset: dict[HiddenDType, int] = {}
    offset = 0
    for dtype in dtypes:
        rows = [row for entry in wanted if entry.dtype is dtype for row in entry.rows]
        index = torch.tensor(rows, dtype=torch.long).to(pooled.device, non_blocking=True)
        gathered = pooled.index_select(0, index).to(_TORCH_DTYPES[dtype]).contiguous()  # [n, H]
        chunks.append(gathered.view(torch.uint8).reshape(-1))
        group_offset[dtype] = offset
        offset += chunks[-1].numel()
    buffer = _to_host(torch.cat(chunks) if len(chunks) > 1 else chunks[0]).numpy()
    out: list[tuple[Tensor, ...]] = []
    for entry in wanted:
        width = hidden_row_bytes(hidden, entry.dtype)
        start = group_offset[entry.dtype]
        out.append(
            tuple(
                _to_tensor(buffer[start + i * width : start + (i + 1) * width], entry.dtype)
                for i in range(len(entry.rows))
            )
        )
        group_offset[entry.dtype] = start + len(entry.rows) * width
    return out


def _to_host(device_bytes: torch.Tensor) -> torch.Tensor:
    if device_bytes.device.type != "cuda":
        return device_bytes
    # Pinned memory makes the copy a real asynchronous DMA; wait for it on this stream only.
    host = torch.empty(device_bytes.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(device_bytes, non_blocking=True)
    torch.cuda.current_stream(device_bytes.device).synchronize()
    return host


def _to_tensor(raw: np.ndarray, dtype: HiddenDType) -> Tensor:
    if dtype is HiddenDType.BFLOAT16:
        return Tensor.from_bfloat16_bits(raw.view(np.uint16).copy())
    return Tensor.from_numpy(raw.view(np.float32 if dtype is HiddenDType.FLOAT32 else np.float16).copy())

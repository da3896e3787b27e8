"""Moving results off the device: the asked-for pooled rows in one copy, the logits, and the batch's timer."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from models.prepare import PreparedRequest
from schemas import HiddenDType, Tensor

_TORCH_DTYPES: dict[HiddenDType, torch.dtype] = {
    HiddenDType.FLOAT32: torch.float32,
    HiddenDType.FLOAT16: torch.float16,
    HiddenDType.BFLOAT16: torch.bfloat16,
}


@dataclass(frozen=True)
class RowRequest:
    """Rows of the pooled matrix that one request asked for, and in which dtype."""

    rows: tuple[int, ...]
    dtype: HiddenDType


def hidden_row_bytes(hidden_size: int, dtype: HiddenDType) -> int:
    """Bytes of one pooled hidden state of `hidden_size` values in `dtype`."""
    return hidden_size * _TORCH_DTYPES[dtype].itemsize


@dataclass(frozen=True)
class HostRows:
    """Rows of pooled hidden states on their way to the host (see `start_rows_copy`): `read` them once the
    stream has passed the copy."""

    buffer: torch.Tensor | None  # raw bytes on the host (pinned on CUDA); None when nothing was asked
    wanted: tuple[RowRequest, ...]
    offsets: tuple[int, ...]  # where each entry of `wanted` starts in the buffer
    hidden: int

    def read(self) -> list[tuple[Tensor, ...]]:
        """One tuple of schemas.Tensor per entry of `wanted`."""
        if self.buffer is None:
            return []
        shape = (self.hidden,)
        if sys.byteorder == "little":
            # The host's order is the wire's: each row is a slice of the buffer's bytes, one copy.
            raw = self.buffer.numpy().tobytes()

            def row(dtype: HiddenDType, begin: int, end: int) -> Tensor:
                return Tensor(dtype.value, shape, raw[begin:end])

        else:  # rows in the host's order: the schema's constructors convert them
            buffer = self.buffer.numpy()

            def row(dtype: HiddenDType, begin: int, end: int) -> Tensor:
                return _to_tensor(buffer[begin:end], dtype)

        out: list[tuple[Tensor, ...]] = []
        for entry, start in zip(self.wanted, self.offsets, strict=True):
            width = hidden_row_bytes(self.hidden, entry.dtype)
            stop = start + len(entry.rows) * width
            out.append(tuple(row(entry.dtype, begin, begin + width) for begin in range(start, stop, width)))
        return out

    def read_blocks(self) -> list[Tensor]:
        """One schemas.Tensor [rows, H] per entry of `wanted` (its rows in order; [0, H] for none)."""
        out: list[Tensor] = []
        raw = b"" if self.buffer is None else self.buffer.numpy().tobytes()
        for entry, start in zip(self.wanted, self.offsets, strict=True):
            shape = (len(entry.rows), self.hidden)
            stop = start + len(entry.rows) * hidden_row_bytes(self.hidden, entry.dtype)
            if sys.byteorder == "little":
                out.append(Tensor(entry.dtype.value, shape, raw[start:stop]))
            else:
                out.append(_to_tensor(np.frombuffer(raw[start:stop], dtype=np.uint8), entry.dtype, shape))
        return out


def _to_tensor(raw: np.ndarray, dtype: HiddenDType, shape: tuple[int, ...] = (-1,)) -> Tensor:
    """Host-order bytes as a tensor of `shape`."""
    if dtype is HiddenDType.BFLOAT16:
        return Tensor.from_bfloat16_bits(raw.view(np.uint16).reshape(shape).copy())
    values = raw.view(np.float32 if dtype is HiddenDType.FLOAT32 else np.float16)
    return Tensor.from_numpy(values.reshape(shape).copy())


def start_rows_copy(pooled: torch.Tensor, wanted: Sequence[RowRequest]) -> HostRows:
    """Queue the gather, cast and copy to the host of only the asked rows of pooled [N, H] on the current
    stream, without waiting for it: the host can launch the next batch while the copy runs.

    Rows are grouped by dtype (one gather and one cast per dtype) and laid out as raw bytes in one buffer,
    so even a batch with mixed dtypes costs a single device-to-host copy.
    """
    hidden = pooled.shape[1]
    if not wanted:
        return HostRows(None, (), (), hidden)
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
    offsets = []
    for entry in wanted:
        offsets.append(group_offset[entry.dtype])
        group_offset[entry.dtype] += len(entry.rows) * hidden_row_bytes(hidden, entry.dtype)
    device_bytes = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
    return HostRows(to_host_async(device_bytes), tuple(wanted), tuple(offsets), hidden)


def to_host_async(device: torch.Tensor) -> torch.Tensor:
    """A host copy of `device`, queued on the current stream (pinned memory makes it a real asynchronous
    copy); a CPU tensor is returned as it is. Read it only once the stream has passed this point."""
    if device.device.type != "cuda":
        return device
    host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
    host.copy_(device, non_blocking=True)
    return host


def start_hidden_copy(
    batch: Sequence[PreparedRequest], item_counts: Sequence[int], pooled: torch.Tensor
) -> tuple[HostRows, dict[str, int]]:
    """Queue the copy of the pooled hidden states [N, H] the requests asked for (the others cost nothing),
    and count the bytes copied to the host per dtype."""
    asking = [i for i, p in enumerate(batch) if wants_hidden(p)]
    ranges = list(item_ranges(item_counts))
    wanted = [RowRequest(tuple(ranges[i]), batch[i].request.hidden_states_dtype) for i in asking]
    return start_rows_copy(pooled, [w for w in wanted if w.rows]), _copied_bytes(wanted, pooled.shape[1])


def start_position_copy(
    batch: Sequence[PreparedRequest], at: torch.Tensor | None
) -> tuple[HostRows | None, dict[str, int]]:
    """Queue the copy of the hidden states at token positions [M, H] that requests asked for
    (return_token_hidden_states), one block per item, and count the bytes per dtype."""
    if at is None:
        return None, {}
    wanted: list[RowRequest] = []
    start = 0
    for p in batch:
        for item in p.positions or ():
            if p.request.return_token_hidden_states:
                wanted.append(
                    RowRequest(tuple(range(start, start + len(item))), p.request.hidden_states_dtype)
                )
            start += len(item)
    return start_rows_copy(at, wanted), _copied_bytes(wanted, at.shape[1])


def _copied_bytes(wanted: Sequence[RowRequest], hidden: int) -> dict[str, int]:
    """Bytes the rows of `wanted` take on the host, per dtype."""
    copied: dict[str, int] = {}
    for entry in wanted:
        copied[entry.dtype.value] = copied.get(entry.dtype.value, 0) + len(entry.rows) * hidden_row_bytes(
            hidden, entry.dtype
        )
    return copied


def read_hidden(batch: Sequence[PreparedRequest], rows: HostRows | None) -> list[tuple[Tensor, ...] | None]:
    """Per request: its pooled hidden states once copied (() for no items), or None where not asked."""
    copied = iter(rows.read() if rows is not None else [])
    return [(next(copied) if len(p.prompts) else ()) if wants_hidden(p) else None for p in batch]


def wants_hidden(prepared: PreparedRequest) -> bool:
    return bool(prepared.request.return_pooled_hidden_states)


def item_ranges(item_counts: Sequence[int]) -> Iterator[range]:
    """The rows of each request's items in the batch's pooled matrix."""
    start = 0
    for count in item_counts:
        yield range(start, start + count)
        start += count


@dataclass
class DeviceTimer:
    """When a batch's forward pass and its copies end: CUDA events on a GPU, where the host returns long
    before the device is done; the host's clock on the CPU, where the work is done when a call returns."""

    events: list[Any] | None  # torch.cuda.Event: the start, then one per mark
    host_marks: list[float] = field(default_factory=list)

    @classmethod
    def start(cls, device: torch.device) -> DeviceTimer:
        return cls([_recorded_event()] if device.type == "cuda" else None)

    def mark(self) -> None:
        if self.events is not None:
            self.events.append(_recorded_event())
        else:
            self.host_marks.append(time.perf_counter())

    def wait(self, started: float) -> tuple[float, float]:
        """Block until the device has passed the last mark; (forward, copy) seconds. On a GPU busy with an
        earlier batch when this one was launched, the forward counts from when it got to this batch."""
        if self.events is None:
            if len(self.host_marks) < 2:
                return 0.0, 0.0
            return self.host_marks[0] - started, self.host_marks[1] - self.host_marks[0]
        self.events[-1].synchronize()
        if len(self.events) < 3:
            return 0.0, 0.0
        start, forward, copies = self.events[:3]
        return start.elapsed_time(forward) / 1000, forward.elapsed_time(copies) / 1000


def _recorded_event() -> Any:
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record()
    return event

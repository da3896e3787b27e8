"""Tensors on the wire: a map {dtype, shape, data} with raw little-endian bytes; bfloat16 as raw bits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from schemas._checks import PLAIN_INT_TYPES, describe, invalid, quoted

MAX_TENSOR_DIMS = 8
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_LITTLE_ENDIAN: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}


class HiddenDType(StrEnum):
    """Element type of returned hidden states."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


def check_dtype(value: object, field: str) -> str:
    """A tensor/hidden-state dtype name as a plain string."""
    if isinstance(value, HiddenDType):
        return value.value
    if not isinstance(value, str) or value not in ITEMSIZE:
        shown = quoted(value) if isinstance(value, str) else describe(value)
        raise invalid(f'{field} is {shown}; send one of "float32", "float16" or "bfloat16".')
    return value


def check_tensor_parts(
    dtype: object, shape: object, data: object, field: str
) -> tuple[str, tuple[int, ...], bytes]:
    """Validate a tensor's three parts, including that data holds exactly prod(shape) elements."""
    if (
        type(dtype) is str
        and dtype in ITEMSIZE
        and type(shape) is tuple
        and len(shape) <= MAX_TENSOR_DIMS
        and set(map(type, shape)) <= PLAIN_INT_TYPES
        and min(shape, default=0) >= 0
        and type(data) is bytes
        and len(data) == math.prod(shape) * ITEMSIZE[dtype]
    ):
        return dtype, shape, data  # the common case, checked at once; the sentences below say what is wrong
    name = check_dtype(dtype, f"{field}.dtype")
    if not isinstance(shape, list | tuple) or len(shape) > MAX_TENSOR_DIMS:
        raise invalid(f"{field}.shape must be an array of at most {MAX_TENSOR_DIMS} non-negative integers.")
    dims: list[int] = []
    for index, dim in enumerate(shape):
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 0:
            raise invalid(f"{field}.shape[{index}] is {dim!r}; send a non-negative integer.")
        dims.append(int(dim))
    if not isinstance(data, bytes | bytearray | memoryview):
        raise invalid(f"{field}.data must be binary, not {describe(data)}; send the raw little-endian bytes.")
    raw = bytes(data)
    expected = math.prod(dims) * ITEMSIZE[name]
    if len(raw) != expected:
        raise invalid(
            f"{field}.data has {len(raw)} bytes but shape {dims} of {name} needs {expected}; "
            f"send exactly prod(shape) * {ITEMSIZE[name]} bytes."
        )
    return name, tuple(dims), raw


@dataclass(frozen=True, slots=True)
class Tensor:
    """A dense C-order tensor; data is little-endian, bfloat16 data is the upper 16 bits of float32 values."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        dtype, shape, data = check_tensor_parts(self.dtype, self.shape, self.data, "tensor")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "data", data)

    @classmethod
    def from_numpy(cls, array: npt.NDArray[Any]) -> Tensor:
        """A float32 or float16 array as a tensor (any byte order or memory layout)."""
        if array.dtype.kind != "f" or array.dtype.itemsize not in (2, 4):
            raise invalid(
                f"Tensor.from_numpy takes a float32 or float16 array, not {array.dtype}; convert it with "
                f"astype first, or use Tensor.from_bfloat16_bits for bfloat16."
            )
        name = "float32" if array.dtype.itemsize == 4 else "float16"
        data = np.ascontiguousarray(array, dtype=_LITTLE_ENDIAN[name]).tobytes()
        return cls(name, tuple(array.shape), data)

    @classmethod
    def from_bfloat16_bits(cls, bits: npt.NDArray[Any]) -> Tensor:
        """A bfloat16 tensor from its raw 16-bit patterns (e.g. torch's bf16.view(torch.int16).numpy())."""
        if bits.dtype.kind not in "ui" or bits.dtype.itemsize != 2:
            raise invalid(
                f"Tensor.from_bfloat16_bits takes a uint16 or int16 array of bfloat16 bit patterns, not "
                f"{bits.dtype}; view the bfloat16 data as 16-bit integers first."
            )
        # Same bytes read as unsigned in the array's own byte order: the values are then the bit patterns.
        unsigned = bits.view(np.dtype(np.uint16).newbyteorder(bits.dtype.byteorder))
        data = np.ascontiguousarray(unsigned, dtype=_LITTLE_ENDIAN["bfloat16"]).tobytes()
        return cls("bfloat16", tuple(bits.shape), data)

    def to_numpy(self) -> npt.NDArray[np.floating[Any]]:
        """A writable native-order array: float32 or float16 as sent; bfloat16 widened exactly to float32."""
        raw = np.frombuffer(self.data, dtype=_LITTLE_ENDIAN[self.dtype])
        if self.dtype == "bfloat16":
            # bfloat16 is the top half of a float32, so shifting the bits back is exact (NaN payloads too).
            widened: npt.NDArray[np.float32] = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
            return widened.reshape(self.shape)
        native: npt.NDArray[np.floating[Any]] = raw.astype(
            np.float32 if self.dtype == "float32" else np.float16
        )
        return native.reshape(self.shape)

"""Packing layout and the selective copy of pooled rows (the parts RoPE's shift invariance would hide)."""

from __future__ import annotations

import numpy as np
import torch

from models.packing import RowRequest, copy_rows_to_host, pack
from schemas import HiddenDType


def test_pack_layout() -> None:
    # RoPE only sees relative positions inside an item, so end-to-end scores cannot tell whether positions
    # restart; absolute-position models and bf16 precision at large offsets can, so check the layout itself.
    packed = pack([[5, 6, 7], [8], [9, 10]], torch.device("cpu"))
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert packed.host_cu_seqlens.device.type == "cpu" and packed.host_cu_seqlens.tolist() == [0, 3, 4, 6]
    assert packed.last_rows.tolist() == [2, 3, 5]
    assert packed.max_length == 3
    assert packed.input_ids.dtype == packed.position_ids.dtype == torch.int64


def test_copy_rows_selects_casts_and_keeps_order() -> None:
    pooled = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))  # [N, H]
    wanted = [
        RowRequest((4, 5), HiddenDType.BFLOAT16),
        RowRequest((0,), HiddenDType.FLOAT32),
        RowRequest((2, 3), HiddenDType.FLOAT16),
        RowRequest((1,), HiddenDType.BFLOAT16),
    ]
    out = copy_rows_to_host(pooled, wanted)
    assert [len(tensors) for tensors in out] == [2, 1, 2, 1]
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    for entry, tensors in zip(wanted, out, strict=True):
        for row, tensor in zip(entry.rows, tensors, strict=True):
            assert tensor.dtype == entry.dtype.value and tensor.shape == (5,)
            expected = pooled[row].to(torch_dtype[entry.dtype.value]).float().numpy()
            np.testing.assert_array_equal(tensor.to_numpy().astype(np.float32), expected)
    assert copy_rows_to_host(pooled, []) == []

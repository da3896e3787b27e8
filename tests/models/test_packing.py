"""Packing layout and the selective copy of pooled rows (the parts RoPE's shift invariance would hide)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from tolerances import assert_within, sum_bound

from models.packing import pack, pool, pooled_positions
from models.transfer import RowRequest, start_rows_copy
from schemas import HiddenDType


def test_pack_layout() -> None:
    # RoPE only sees relative positions inside an item, so end-to-end scores cannot tell whether positions
    # restart; absolute-position models and bf16 precision at large offsets can, so check the layout itself.
    packed = pack([[5, 6, 7], [8], [9, 10]], torch.device("cpu"))
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert packed.host_cu_seqlens.device.type == "cpu" and packed.host_cu_seqlens.tolist() == [0, 3, 4, 6]
    assert packed.pooled_rows.tolist() == [2, 3, 5]  # true last tokens by default
    assert packed.lengths.tolist() == [3, 1, 2] and packed.item_of_token is None
    assert packed.max_length == 3
    assert packed.input_ids.dtype == packed.position_ids.dtype == torch.int64


@pytest.mark.parametrize("byteorder", ["little", "big"])
def test_copy_rows_selects_casts_and_keeps_order(byteorder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a little-endian host the rows are sliced from the buffer as they are; the other branch converts
    # through the schema's constructors (on this host the conversion changes nothing, so both must agree).
    monkeypatch.setattr(sys, "byteorder", byteorder)
    pooled = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))  # [N, H]
    wanted = [
        RowRequest((4, 5), HiddenDType.BFLOAT16),
        RowRequest((0,), HiddenDType.FLOAT32),
        RowRequest((2, 3), HiddenDType.FLOAT16),
        RowRequest((1,), HiddenDType.BFLOAT16),
    ]
    out = start_rows_copy(pooled, wanted).read()  # a CPU tensor's copy is done when it returns
    assert [len(tensors) for tensors in out] == [2, 1, 2, 1]
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    for entry, tensors in zip(wanted, out, strict=True):
        for row, tensor in zip(entry.rows, tensors, strict=True):
            assert tensor.dtype == entry.dtype.value and tensor.shape == (5,)
            expected = pooled[row].to(torch_dtype[entry.dtype.value]).float().numpy()
            # The same one rounding of the same float32 values: bit for bit.
            np.testing.assert_array_equal(tensor.to_numpy().astype(np.float32), expected)
    assert start_rows_copy(pooled, []).read() == []


def test_pooled_positions_follow_each_rule() -> None:
    # Items: [5 6 0], [0], [7 0 0], [8 9]; pad id 0. HF's LAST skips trailing pad ids (and a pad id inside
    # an item too: it takes the last token that is not the pad id); an all-pad item pools its first token.
    prompts = [(5, 6, 0), (0,), (7, 0, 0), (8, 9)]
    starts, ends = np.array([0, 3, 4, 7]), np.array([3, 4, 7, 9])
    assert pooled_positions(prompts, starts, ends, "last", 0).tolist() == [1, 3, 4, 8]
    # No pad id: the true last token.
    assert pooled_positions(prompts, starts, ends, "last", None).tolist() == [2, 3, 6, 8]
    assert pooled_positions(prompts, starts, ends, "last_token", 0).tolist() == [2, 3, 6, 8]
    assert pooled_positions(prompts, starts, ends, "cls", 0).tolist() == [0, 3, 4, 7]


def test_mean_pooling_averages_each_item_in_float32() -> None:
    packed = pack([[5, 6, 7], [8], [9, 10]], torch.device("cpu"), pooling="mean")
    hidden = torch.arange(12, dtype=torch.bfloat16).reshape(6, 2)  # [T, H]
    pooled = pool(hidden, packed)
    assert pooled.dtype == torch.float32
    expected = [hidden[0:3].float().mean(0), hidden[3:4].float().mean(0), hidden[4:6].float().mean(0)]
    # Two float32 means of at most 3 positive terms (an averaging matmul with rounded 1/n weights, and a
    # sum then a division): each within gamma(3 + 1) of the exact mean.
    expected_means = torch.stack(expected)
    assert_within(pooled, expected_means, sum_bound(torch.float32, 3 + 1, expected_means, implementations=2))


def test_roberta_positions_start_after_the_pad_id_and_skip_pads_in_each_item() -> None:
    # HF: positions = cumsum(token != pad) * (token != pad) + pad, per sequence; pad id 1 here.
    packed = pack([[5, 6, 7], [8, 1, 9]], torch.device("cpu"), position_pad=1)
    assert packed.position_ids.tolist() == [[2, 3, 4, 2, 1, 3]]


def test_token_types_are_packed_with_their_prompts() -> None:
    packed = pack([[5, 6], [7, 8, 9]], torch.device("cpu"), token_types=[[0, 1], [0, 0, 1]])
    assert packed.token_type_ids is not None and packed.token_type_ids.tolist() == [[0, 1, 0, 0, 1]]

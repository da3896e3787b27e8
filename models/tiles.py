"""Row-invariant products for the deterministic setting: every matrix product of the forward in tiles of a
fixed number of rows.

A matrix product's kernel (its tiling, its split of the inner dimension, its vector width) is chosen by the
operands' shapes, so the same token's output row can round differently when a batch holds more or fewer
tokens. Cut into tiles of `rows` rows, the last one padded with zeros, every product the forward makes has
one shape per weight whatever the batch, so one kernel computes every tile; a row's output then depends on
the row alone, provided that kernel sums a row the same way wherever in the tile it sits. That holds for the
tiled kernels of cuBLAS and of the CPU libraries in the configurations we know, but not by contract (a
kernel that splits the inner dimension unevenly across the output's tiles would break it), so
`rows_invariant` checks it on the device, on the model's own shapes, before the setting relies on it.

What the tiles do not cover is the deterministic setting's to arrange: attention per sequence (the exact
path loops over sequences; torch's flash kernel tiles each sequence from its own first row), row-wise
norms and activations (a row's reduction depends on its width only), no shared prefixes, no fused or
compiled kernels whose configuration follows the batch, and pooling per item.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm)
_ADD_PRODUCTS = (torch.addmm, torch.Tensor.addmm, torch.Tensor.addmm_)


def _linear_into(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor
) -> torch.Tensor:
    """F.linear of a 2-D `x` written into `out`: the product F.linear itself makes on 2-D input (a matrix
    product by the weight's transpose, its bias added in the product's epilogue)."""
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def _mm_into(x: torch.Tensor, other: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, other, out=out)


# The products whose whole tiles are written straight into the joined output (no copy of the result).
_INTO: dict[Any, Callable[..., torch.Tensor]] = {F.linear: _linear_into, torch.mm: _mm_into}


def tiled_product(
    rows: int, product: Callable[..., torch.Tensor], left: torch.Tensor, *rest: Any, **kwargs: Any
) -> torch.Tensor:
    """`product(left, *rest)` computed `rows` rows of `left` [..., K] at a time, the last tile padded with
    zeros: every call has the shape [rows, K], whatever the number of rows. After the first tile (computed
    on its own: it gives the result's width, then is copied in), F.linear's and torch.mm's whole tiles are
    written into the result where their rows start on a 16-byte boundary (as a fresh output's do, so the
    kernel is the one a fresh output gets); the others, and the padded tile, are copied in."""
    flat = left.reshape(-1, left.shape[-1])
    count = flat.shape[0]
    if count == 0:
        return product(left, *rest, **kwargs)

    def padded(start: int) -> torch.Tensor:
        tile = flat[start : start + rows]
        short = rows - tile.shape[0]
        return torch.cat([tile, tile.new_zeros(short, tile.shape[1])]) if short else tile

    first = product(padded(0), *rest, **kwargs)
    if count <= rows:
        joined = first[:count]
    else:
        into = _INTO.get(product)
        joined = first.new_empty(count, first.shape[-1])
        joined[:rows].copy_(first)
        for start in range(rows, count, rows):
            stop = min(start + rows, count)
            target = joined[start:stop]
            if into is not None and stop - start == rows and target.data_ptr() % 16 == 0:
                into(flat[start:stop], *rest, **kwargs, out=target)
            else:
                target.copy_(product(padded(start), *rest, **kwargs)[: stop - start])
    return joined.reshape(*left.shape[:-1], joined.shape[-1])


class RowTiles(TorchFunctionMode):
    """Inside it, `F.linear(x, w)`, the products of a 2-D matrix of token rows by a 2-D matrix and `addmm`
    (without alpha or beta) run in tiles of `rows` rows (tiled_product). Products of other ranks
    (attention's per-head scores on the exact path) pass through: their rows are one sequence's, computed
    alike in every batch."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        if rows < 1:
            raise ValueError(f"tile rows must be >= 1, got {rows}")
        self.rows = rows

    def __torch_function__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and args and args[0].dim() >= 2:
            return tiled_product(self.rows, F.linear, *args, **kwargs)
        if (
            func in _MATMULS
            and len(args) == 2
            and not kwargs
            and isinstance(args[1], torch.Tensor)
            and args[0].dim() == 2
            and args[1].dim() == 2
        ):
            return tiled_product(self.rows, torch.mm, args[0], args[1])
        if func in _ADD_PRODUCTS and len(args) == 3 and not kwargs and all(a.dim() == 2 for a in args):
            # base + m1 @ m2 (a LoRA delta added to its projection's output): the product in tiles, then the
            # sum, elementwise (the fused form's single rounding would follow the product's kernel).
            base, left, right = args
            product = tiled_product(self.rows, torch.mm, left, right)
            if func is torch.Tensor.addmm_:
                return base.add_(product.to(base.dtype))
            return base + product.to(base.dtype)
        return func(*args, **kwargs)


@torch.inference_mode()
def rows_invariant(
    rows: int,
    widths: Sequence[tuple[int, int]],
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    product: Callable[..., torch.Tensor] = F.linear,
) -> str | None:
    """None when a row's `product` (x, weight) comes out bit for bit the same wherever it sits among others
    and however many there are, for products [rows, K] x [K, N] of each (K, N) in `widths` on `device`;
    else what differed. Checked: 2.5 tiles of rows against their first rows alone (one padded tile), and
    against the same rows shifted by a third of a tile."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for k, n in widths:
        count = rows * 5 // 2
        left = torch.randn(count, k, generator=generator).to(device=device, dtype=dtype)
        weight = torch.randn(n, k, generator=generator).div_(k**0.5).to(device=device, dtype=dtype)
        whole = tiled_product(rows, product, left, weight)
        first = max(rows // 5, 1)
        if not torch.equal(tiled_product(rows, product, left[:first], weight), whole[:first]):
            return f"a row's product [{rows}, {k}] x [{k}, {n}] changed with the rows beside it"
        shift = max(rows // 3, 1)
        shifted = tiled_product(rows, product, torch.roll(left, shift, 0), weight)
        if not torch.equal(torch.roll(shifted, -shift, 0), whole):
            return f"a row's product [{rows}, {k}] x [{k}, {n}] changed when it moved within the tile"
    return None

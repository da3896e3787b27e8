"""A grouped matmul in Triton for the mixture-of-experts blocks where torch's grouped product does not run.

torch._grouped_mm's fast kernel is bfloat16 on sm90/sm100; for other dtypes (a float16 or float32 model on
CUDA) torch falls back to a loop that copies the offsets to the host, which a CUDA graph cannot record. This
kernel reads the offsets on the device: out[r] = x[r] @ weight[e]^T for every row r of expert e's run
(rows sorted by expert, `ends[e]` where the run of e ends). Its grid is fixed by the row count and the
expert count alone (a run of n rows takes ceil(n / BLOCK_M) row tiles, so all runs together take at most
ceil(S / BLOCK_M) + E), and each program finds its expert and tile by walking the ends; programs past the
last tile exit. Float32 products accumulate in float32 at full precision (no TF32), as the model's own
matmuls do.

The kernel runs in Triton's interpreter on CPU tensors too, which is how the CPU tests check its tiling and
edges (empty experts, one expert taking every row); its speed is the GPU's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install may lack Triton; the experts then loop over experts there
    triton = None
    tl = None

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32


def available() -> bool:
    """Whether Triton is installed: the kernel needs it."""
    return triton is not None


def _grouped_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: its annotations are Triton's
    x, weight, out, ends, experts, n, k,
    stride_xm, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M x BLOCK_N tile of one expert's run: program (m, n) is the m-th row tile over all runs in
    expert order; it walks the runs' ends to find its expert and exits when it is past the last tile."""
    tile = tl.program_id(0)
    zero = tile * 0  # int32 scalars carried through the walk
    expert = zero - 1
    start = zero
    end = zero
    first = zero  # the first row tile of the current expert
    run_start = zero
    for e in range(0, experts):
        run_end = tl.load(ends + e)
        tiles = tl.cdiv(run_end - run_start, BLOCK_M)
        hit = (tile >= first) & (tile < first + tiles) & (expert < 0)
        expert = tl.where(hit, e, expert)
        start = tl.where(hit, run_start + (tile - first) * BLOCK_M, start)
        end = tl.where(hit, run_end, end)
        first += tiles
        run_start = run_end
    if expert >= 0:
        rows = start + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        depth = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = weight + expert.to(tl.int64) * stride_we
        for step in range(0, tl.cdiv(k, BLOCK_K)):
            at = step * BLOCK_K + depth
            a = tl.load(
                x + rows[:, None].to(tl.int64) * stride_xm + at[None, :],
                mask=(rows[:, None] < end) & (at[None, :] < k),
                other=0.0,
            )
            b = tl.load(
                w_base + cols[None, :] * stride_wn + at[:, None],
                mask=(cols[None, :] < n) & (at[:, None] < k),
                other=0.0,
            )
            if IEEE:  # noqa: SIM108 - a constexpr branch: Triton compiles only the taken one
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        mask = (rows[:, None] < end) & (cols[None, :] < n)
        at_out = out + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(at_out, acc.to(out.dtype.element_ty), mask=mask)


@functools.cache
def _kernel() -> Any:
    """The kernel, compiled by Triton on first use (or run by its interpreter on CPU tensors)."""
    if triton is None:
        raise RuntimeError("the grouped experts kernel needs the triton package")
    return triton.jit(_grouped_kernel)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [S, K] (rows sorted by expert, unit stride across), weight [E, N, K] (unit stride across), ends [E]
    int32 on x's device: [S, N] in x's dtype, row r of expert e's run being x[r] @ weight[e]^T."""
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("the grouped experts kernel needs unit stride along the inner dimension")
    rows, depth = x.shape
    experts, width, _ = weight.shape
    out = x.new_empty(rows, width)
    tiles = triton.cdiv(rows, BLOCK_M) + experts
    grid = (tiles, triton.cdiv(width, BLOCK_N))
    _kernel()[grid](
        x, weight, out, ends, experts, width, depth,
        x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out

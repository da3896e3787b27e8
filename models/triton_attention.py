"""A varlen flash-attention forward in Triton, for packed batches on Hopper.

torch 2.11's varlen flash kernel is FlashAttention-2's Ampere code: on an H200 it runs W1's batches (8B
shapes, sequences of a few hundred tokens) at 150-210 TFLOP/s. Triton compiles `tl.dot` to Hopper's
warpgroup instructions, and this kernel, the same online-softmax algorithm with the query heads that share a
K/V head computed together, runs those batches at 270-310 TFLOP/s and W3's whole prompts 1.8x as fast
(bench/attention.py, docs/benchmarks.md). Short batches keep flash (MIN_LENGTH): on them the two kernels
are at par once launched, and flash's launch costs less outside a CUDA graph. cuDNN's ragged attention ran
W1's batches faster still, but torch 2.11 builds its cuDNN graph again on every call (about 55 ms), which no
batch affords. FlashAttention-4, where installed, is the other choice (models/fa4_attention.py).

The kernel has the signature of torch's `varlen_attn` (models.config.VarlenKernel): q [T, H, D], k/v
[T, Hkv, D] (grouped-query: each K/V head serves H // Hkv consecutive query heads), cumulative sequence
offsets, causal or not, optionally the log-sum-exp of each row (the two-pass shared-prefix merge reads it).
A causal query row i of a sequence with Lq queries and Lk keys sees keys 0..i + Lk - Lq (queries are the
last Lq positions, as flash attention aligns them). Sliding windows are not here: a layer with one takes
torch's flash kernel (models.attention).

The same kernel source runs in Triton's interpreter on CPU tensors, so the CPU tests check this code path
(the arithmetic, masks and offsets) against the exact attention; only its speed needs the GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from models.varlen import checked_call, varlen_outputs

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install may lack Triton; models.attention then keeps torch's kernel
    triton = None
    tl = None

# Query lanes (token rows x packed heads) and key columns per block, warps and pipeline stages: the fastest
# of ten configurations on the H200 for head dim 128 on W1's and W3's batches (bench/attention.py,
# docs/benchmarks.md).
BLOCK_M = 128
BLOCK_N = 32
NUM_WARPS = 4
NUM_STAGES = 3
# At most this many query heads that share a K/V head are computed by one program (BLOCK_M lanes: BLOCK_M /
# PACK token rows of each), so that each key block is read once for them all.
PACK_HEADS = 4
# A batch whose longest sequence is no longer than this (a power of two) takes flash. Replayed from a CUDA
# graph the Triton kernel is at par or ahead on such batches (64 requests of 100 tokens: 0.045 ms a layer
# against 0.051, bench/attention.py), but launched from Python it takes 0.13 ms, and outside a graph (a
# shape's first batch, graphs off) flash's launch is the cheaper one; in a graph the gain would be about 1%
# of such a batch's step.
MIN_LENGTH = 256
LOG2_E = 1.4426950408889634
OP_NAME = "score_worker::varlen_flash_forward"


def takes(longest: int) -> bool:
    """Whether a batch whose longest sequence has `longest` tokens runs here rather than in flash: when that
    is over MIN_LENGTH. A CUDA graph is recorded with the longest rounded up (models.graphs.graph_key): in
    small batches to the token bucket past MIN_LENGTH and to MIN_LENGTH below it, in larger ones at most to
    the next power of two, and MIN_LENGTH is a power of two; so the rounded length is over it exactly when
    the batch's own is: a batch replayed from a graph takes the kernel it takes without one,
    and its results never depend on whether its shape had been recorded (the deterministic setting promises
    the same bits either way). One comparison, so that torch.compile guards on it and nothing more."""
    return longest > MIN_LENGTH


def available() -> bool:
    """Whether Triton is installed (the kernel needs it; the GPU also needs a CUDA build of torch)."""
    return triton is not None


def _varlen_attention_forward(  # type: ignore[no-untyped-def]  # a Triton kernel: its annotations are Triton's
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    head_dim,
    GROUP: tl.constexpr, PACK: tl.constexpr, CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M // PACK query rows of one sequence for PACK query heads that share one K/V head,
    over all the keys those rows may see.

    Online softmax in base 2 (scores scaled by scale * log2(e)), accumulated in float32 (the scores are cast
    so: torch.compile may pass the scale as a float64 constant). Key blocks wholly
    before the block's first row's diagonal need no mask; the rest (the diagonal, the sequence's end) do.
    """
    block = tl.program_id(0)
    sequence = tl.program_id(1)
    first_head = tl.program_id(2) * PACK
    q_start = tl.load(cu_q_ptr + sequence)
    q_len = tl.load(cu_q_ptr + sequence + 1) - q_start
    ROWS: tl.constexpr = BLOCK_M // PACK
    if block * ROWS >= q_len:
        return
    k_start = tl.load(cu_k_ptr + sequence)
    k_len = tl.load(cu_k_ptr + sequence + 1) - k_start
    kv_head = first_head // GROUP
    # Lane m of the block is token row m // PACK of query head first_head + m % PACK: the PACK heads that
    # share one K/V head read each key block once.
    lanes = tl.arange(0, BLOCK_M)
    rows = block * ROWS + lanes // PACK
    heads = first_head + lanes % PACK
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < q_len
    dim_ok = dims < head_dim
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    k_base = k_ptr + k_start * stride_kt + kv_head * stride_kh
    v_base = v_ptr + k_start * stride_vt + kv_head * stride_vh
    # A causal row r sees keys up to r + shift; the block's first row bounds the unmasked blocks, its last
    # row (or the sequence's last key) the masked ones.
    shift = k_len - q_len
    if CAUSAL:
        end = tl.minimum(k_len, (block + 1) * ROWS + shift)
        free = tl.maximum(block * ROWS + shift + 1, 0)
    else:
        end = k_len
        free = k_len
    free = (free // BLOCK_N) * BLOCK_N
    best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, free, BLOCK_N):
        key_cols = start + cols
        k = tl.load(k_base + key_cols[None, :] * stride_kt + dims[:, None], mask=dim_ok[:, None], other=0.0)
        scores = (tl.dot(q, k) * scale_log2).to(tl.float32)
        top = tl.maximum(best, tl.max(scores, 1))
        weights = tl.math.exp2(scores - top[:, None])
        rescale = tl.math.exp2(best - top)
        total = total * rescale + tl.sum(weights, 1)
        v = tl.load(v_base + key_cols[:, None] * stride_vt + dims[None, :], mask=dim_ok[None, :], other=0.0)
        acc = tl.dot(weights.to(v.dtype), v, acc * rescale[:, None])
        best = top
    for start in range(free, end, BLOCK_N):
        key_cols = start + cols
        col_ok = key_cols < k_len
        k = tl.load(
            k_base + key_cols[None, :] * stride_kt + dims[:, None],
            mask=dim_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        seen = col_ok[None, :]
        if CAUSAL:
            seen = seen & (key_cols[None, :] <= rows[:, None] + shift)
        scores = tl.where(seen, (tl.dot(q, k) * scale_log2).to(tl.float32), float("-inf"))
        top = tl.maximum(best, tl.max(scores, 1))
        # A row that has seen no key yet keeps -inf; exp2 of (-inf) - (-inf) must give 0, not NaN.
        safe_top = tl.where(top == float("-inf"), 0.0, top)
        weights = tl.math.exp2(scores - safe_top[:, None])
        rescale = tl.math.exp2(best - safe_top)
        total = total * rescale + tl.sum(weights, 1)
        v = tl.load(
            v_base + key_cols[:, None] * stride_vt + dims[None, :],
            mask=col_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(weights.to(v.dtype), v, acc * rescale[:, None])
        best = top
    # A row that sees no key (a causal row before every key) is 0 with log-sum-exp -inf, as flash's.
    seen_any = total > 0.0
    out = acc / tl.where(seen_any, total, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    if WRITE_LSE:
        lse = tl.where(seen_any, (best + tl.math.log2(tl.where(seen_any, total, 1.0))) / 1.4426950408889634,
                       float("-inf"))  # fmt: skip
        tl.store(lse_ptr + heads * stride_lh + q_start + rows, lse, mask=row_ok)


@functools.cache
def _kernel() -> Any:
    """The kernel, compiled for the GPU; in Triton's interpreter (CPU tensors) where the process started
    with TRITON_INTERPRET=1, which Triton reads when it is imported."""
    if triton is None:
        raise RuntimeError("the Triton attention kernel needs the triton package")
    return triton.jit(_varlen_attention_forward)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors): TRITON_INTERPRET=1 at import."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def heads_per_program(group: int, block_m: int) -> int:
    """How many of the `group` query heads that share a K/V head one program computes: the largest power of
    two that divides the group, at most PACK_HEADS and leaving the block at least 16 rows."""
    pack = 1
    while group % (pack * 2) == 0 and pack * 2 <= PACK_HEADS and block_m // (pack * 2) >= 16:
        pack *= 2
    return pack


def _varlen_flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    scale: float,
    causal: bool,
    want_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    heads, head_dim = q.shape[1], q.shape[2]
    out, lse = varlen_outputs(q, want_lse)
    # Compiled, the launch goes through wrap_triton so that torch.compile traces the kernel; interpreted, it
    # is called as it is (wrap_triton takes compiled kernels only).
    kernel = _kernel() if interpreting() else torch.library.wrap_triton(_kernel())
    group = heads // k.shape[1]
    pack = heads_per_program(group, BLOCK_M)
    grid = (triton.cdiv(max_q, BLOCK_M // pack), cu_q.shape[0] - 1, heads // pack)
    kernel[grid](
        q, k, v, out, lse, cu_q, cu_k,
        scale * LOG2_E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        head_dim,
        GROUP=group, PACK=pack, CAUSAL=causal, WRITE_LSE=want_lse,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out, lse


def _varlen_flash_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    scale: float,
    causal: bool,
    want_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return varlen_outputs(q, want_lse)


# The kernel as one operator, so that torch.compile keeps it whole inside a compiled layer and CUDA graphs
# record its launch. Compiled for the GPU, a triton_op: torch.compile sees the Triton kernel itself. In the
# interpreter (CPU tests), an opaque custom op: the interpreter cannot run inside a compiled graph.
if triton is not None and not interpreting():
    torch.library.triton_op(OP_NAME, _varlen_flash_forward, mutates_args=())
elif triton is not None:
    interpreted = torch.library.custom_op(OP_NAME, _varlen_flash_forward, mutates_args=())
    interpreted.register_fake(_varlen_flash_shapes)


def triton_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    return_aux: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention with varlen_attn's signature: causal for window_size (-1, 0), full for (-1, -1).
    With `return_aux.lse`, also the natural log-sum-exp of each row's scores, [H, T] float32."""
    call = checked_call("the Triton kernel", query, key, scale, window_size, enable_gqa, return_aux)
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit-stride last dimension")
    out, lse = torch.ops.score_worker.varlen_flash_forward(
        query, key, value, cu_seq_q, cu_seq_k, int(max_q), call.scale, call.causal, call.want_lse
    )
    return (out, lse) if call.want_lse else out

"""FlashAttention-4's varlen forward (the `flash-attn-4` package, CuTe DSL kernels), for packed batches on
Hopper and Blackwell.

torch 2.11's own varlen kernel is FlashAttention-2's Ampere code, and our Triton kernel
(models/triton_attention.py) is the same algorithm on Hopper's warpgroup instructions; FlashAttention-4's
SM90 forward is FlashAttention-3's design (TMA loads, warp-specialised producer and consumers, softmax
overlapped with the products). It is an optional install (`pip install flash-attn-4`, with
`nvidia-cutlass-dsl` for the GPU's CUDA), compiled on first use for each shape class.

The wrapper has the signature of torch's `varlen_attn` (models.config.VarlenKernel), causal or full windows
only (a layer with a sliding window keeps torch's flash kernel, models.attention.fa4_or_flash), and returns
the log-sum-exp [H, T] float32 when asked, as the shared-prefix merge needs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from models.varlen import checked_call, varlen_outputs

OP_NAME = "score_worker::fa4_varlen_forward"


@functools.cache
def _varlen_func() -> Any:
    """flash_attn.cute's varlen entry point, or None where the package (or its CUDA DSL) is missing."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # ImportError, or the DSL failing to load its libraries
        return None
    return flash_attn_varlen_func


def available() -> bool:
    """Whether FlashAttention-4 is installed and loads."""
    return _varlen_func() is not None


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
    want_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    run = _varlen_func()
    if run is None:
        raise RuntimeError("attention_kernel='fa4' needs the flash-attn-4 package")
    out, lse = run(
        q, k if k.is_contiguous() else k.contiguous(), v if v.is_contiguous() else v.contiguous(),
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=scale, causal=causal, return_lse=want_lse,
    )  # fmt: skip
    if not want_lse or lse is None:
        return out, q.new_empty((1, 1), dtype=torch.float32)  # varlen_outputs' placeholder
    return out, lse


def _shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
    want_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return varlen_outputs(q, want_lse)


# One opaque operator: torch.compile keeps it whole inside a compiled layer, and CUDA graphs record it.
_op = torch.library.custom_op(OP_NAME, _forward, mutates_args=())
_op.register_fake(_shapes)


def fa4_varlen_attn(
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
    call = checked_call("FlashAttention-4", query, key, scale, window_size, enable_gqa, return_aux)
    out, lse = torch.ops.score_worker.fa4_varlen_forward(
        query, key, value, cu_seq_q, cu_seq_k, int(max_q), int(max_k), call.scale, call.causal, call.want_lse
    )
    return (out, lse) if call.want_lse else out

"""The varlen attention kernel contract: what every kernel with the signature of torch's
`torch.nn.attention.varlen.varlen_attn` is called with, checks and returns.

The kernels (torch's flash kernel, models/triton_attention.py, models/fa4_attention.py) and the modules that
choose and call them (models/attention.py, models/config.py, models/graphs.py) import this module; it imports
none of them, so the kernels never import back what imports them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

# A varlen kernel with the signature of torch.nn.attention.varlen.varlen_attn:
# (q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, ...)
VarlenKernel = Callable[..., Any]


class LseRequest(NamedTuple):
    """`return_aux` of torch's varlen_attn (its AuxRequest, which torch 2.11 lacks): also return the
    log-sum-exp of every query row's scores, [H, T] float32."""

    lse: bool = True


WANT_LSE = LseRequest()
# varlen_attn's window_size values our own kernels run: causal, and full (encoders, the shared-prefix cross
# pass). A layer with a sliding window takes torch's flash kernel.
CAUSAL_OR_FULL = ((-1, 0), (-1, -1))


def varlen_outputs(q: torch.Tensor, want_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A varlen kernel's outputs, allocated: [T, H, D] like `q`, and the log-sum-exp [H, T] float32 (a 1x1
    placeholder when not wanted: a custom operator returns a tensor either way)."""
    lse_shape = (q.shape[1], q.shape[0]) if want_lse else (1, 1)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


class VarlenCall(NamedTuple):
    """What a kernel with varlen_attn's signature was asked for, checked (checked_call)."""

    scale: float
    causal: bool
    want_lse: bool


def checked_call(
    kernel_name: str,
    query: torch.Tensor,
    key: torch.Tensor,
    scale: float | None,
    window_size: tuple[int, int],
    enable_gqa: bool,
    return_aux: Any,
) -> VarlenCall:
    """Refuse a call that a causal-or-full, grouped-query kernel cannot run (a sliding window, heads that do
    not divide, grouped K/V without enable_gqa); else the softmax scale (1/sqrt(D) by default), whether it
    is causal and whether the log-sum-exp is wanted."""
    if tuple(window_size) not in CAUSAL_OR_FULL:
        raise ValueError(f"{kernel_name} runs here without a sliding window, got window_size={window_size}")
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads")
    if kv_heads != heads and not enable_gqa:
        raise ValueError("fewer key/value heads than query heads needs enable_gqa=True")
    return VarlenCall(
        scale=float(scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])),
        causal=tuple(window_size) == (-1, 0),
        want_lse=bool(return_aux is not None and getattr(return_aux, "lse", False)),
    )

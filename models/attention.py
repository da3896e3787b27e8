"""Attention for packed sequences, plugged into HuggingFace models through AttentionInterface.

The engine runs the base model on one packed sequence [1, T] (the items of a batch concatenated, position ids
restarting at 0 for each item) and passes `cu_seq_lens_q/k` and `max_length_q/k` as keyword arguments; HF
forwards them untouched from the model's forward to the attention function of every layer. So every HF
decoder architecture keeps its own layers (q/k norms, qkv biases, rotary variants) and only attention is ours.

Two implementations:
- "reference": exact, per item, in float32 with SDPA (causal, optional sliding window and logit softcap).
- "varlen": a varlen flash kernel (torch.nn.attention.varlen.varlen_attn by default, CUDA-only; where its
  varlen_attn has no grouped-query option, torch's flash kernel called directly, which has one), with the
  kernel injectable so CPU tests can drive the same wrapper logic with an SDPA-based kernel.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface

from models.packing import PrefixCross
from models.prefix_cache import CacheIO
from models.varlen import CAUSAL_OR_FULL, WANT_LSE, LseRequest, VarlenKernel

REFERENCE_ATTENTION = "score_worker_reference"
VARLEN_ATTENTION = "score_worker_varlen"


def attend_causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None,
    left_window: int | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Exact attention of one sequence in float32: query [H, Lq, D], key/value [Hkv, Lk, D] -> [H, Lq, D].

    Causal unless `causal` is False (encoders: every token sees the whole item). With fewer queries than
    keys (Lq < Lk: a suffix whose shared prefix was computed once) the queries are the last Lq positions,
    as flash attention aligns them. `left_window` w lets a query at position i see keys i-w..i
    (flash-attention convention), or i-w..i+w when not causal; None = all.
    """
    heads, length, head_dim = query.shape
    keys = key.shape[1]
    q = query.float()
    # Grouped-query attention: every KV head serves heads // kv_heads consecutive query heads (HF's layout).
    k = key.float().repeat_interleave(heads // key.shape[0], dim=0)
    v = value.float().repeat_interleave(heads // value.shape[0], dim=0)
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    if softcap is None and left_window is None and keys == length:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    rows = torch.arange(length, device=query.device).unsqueeze(1) + (keys - length)
    cols = torch.arange(keys, device=query.device).unsqueeze(0)
    allowed = cols <= rows if causal else torch.ones(length, keys, dtype=torch.bool, device=query.device)
    if left_window is not None:
        allowed &= cols >= rows - left_window
        if not causal:
            allowed &= cols <= rows + left_window
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    # SDPA has no softcap: scores are capped as tanh(s / cap) * cap before the mask, as HF's eager path does.
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _left_window(sliding_window: int | None) -> int | None:
    """HF's sliding_window W lets a token see W tokens including itself, i.e. a left window of W - 1."""
    return None if sliding_window is None else int(sliding_window) - 1


def reference_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    packed_key_index: torch.Tensor | None = None,
    prefix_cross: PrefixCross | None = None,
    prefix_cache: CacheIO | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention function: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None).

    With `prefix_cache`, the batch's cached keys and values come before the row's (key rows counted from
    the cached region's first), and the rows the cache keeps are copied out (models/prefix_cache.py).

    Sequence i's queries are rows cu_seq_lens_q[i]:[i+1]. Its keys are the same rows, or, with
    `packed_key_index`, the rows packed_key_index[cu_seq_lens_k[i]:[i+1]] (a shared prefix, then its own):
    shared prefixes reach this path with their keys gathered, never as two passes.
    """
    if cu_seq_lens_q is None:
        raise ValueError("packed attention needs cu_seq_lens_q; call the model through models.Scorer")
    if prefix_cross is not None and packed_key_index is None:
        raise ValueError("the exact path reads shared prefixes through gathered keys (packed_key_index)")
    if prefix_cache is not None:
        key, value = prefix_cache.extend(module, key, value)
    bounds = cu_seq_lens_q.tolist()
    key_bounds = bounds if packed_key_index is None or cu_seq_lens_k is None else cu_seq_lens_k.tolist()
    out = torch.empty(
        query.shape[0], query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype, device=query.device
    )  # [1, T, H, D]
    window = _left_window(sliding_window)
    for (start, end), (key_start, key_end) in zip(
        itertools.pairwise(bounds), itertools.pairwise(key_bounds), strict=True
    ):
        if packed_key_index is None:
            item_keys, item_values = key[0, :, start:end], value[0, :, start:end]
        else:
            rows = packed_key_index[key_start:key_end]
            item_keys, item_values = key[0].index_select(1, rows), value[0].index_select(1, rows)
        item = attend_causal(
            query[0, :, start:end],
            item_keys,
            item_values,
            scale=scaling,
            left_window=window,
            softcap=softcap,
            causal=_is_causal(module),
        )  # [H, L, D]
        out[0, start:end] = item.transpose(0, 1).to(query.dtype)
    return out, None


def _is_causal(module: torch.nn.Module) -> bool:
    """HF attention modules say whether they are causal (decoders) or not (encoders such as BERT)."""
    return bool(getattr(module, "is_causal", True))


def kernel_supports_gqa(kernel: VarlenKernel) -> bool:
    """torch 2.13's varlen_attn takes enable_gqa; 2.11's does not, and then K/V heads must be repeated."""
    try:
        return "enable_gqa" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # builtins without a Python signature
        return False


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    packed_key_index: torch.Tensor | None = None,
    prefix_cross: PrefixCross | None = None,
    prefix_cache: CacheIO | None = None,
    *,
    kernel: VarlenKernel,
    kernel_gqa: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Varlen-kernel attention: query [1, H, T, D], key/value [1, Hkv, T, D] -> [1, T, H, D].

    Shared prefixes (models/packing.py) take two passes, merged: every sequence over its own rows
    (causal), and each group's suffixes over the group's prefix (`prefix_cross`), the prefix's keys read
    where the row holds them once. A layer with a sliding window, given `packed_key_index`, gathers each
    sequence's keys instead (sequence i's are the rows packed_key_index[cu_seq_lens_k[i]:[i+1]]) and runs
    one pass: a window counts positions across the prefix and the suffix, which the cross pass cannot. The
    engine gathers keys only for batches whose prompts are longer than the window; in shorter ones the
    window cuts nothing and the two passes are exact."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(
            "packed attention needs cu_seq_lens_q and max_length_q; call it through models.Scorer"
        )
    if softcap is not None:
        raise NotImplementedError(
            "the varlen kernel has no attention logit softcap; use attention='reference'"
        )
    if prefix_cache is not None:  # cached keys first (pack gathers every sequence's keys then)
        key, value = prefix_cache.extend(module, key, value)
    cu_q = cu_seq_lens_q.to(torch.int32)  # flash kernels index with int32 offsets
    window = _left_window(sliding_window)
    left = -1 if window is None else window
    window_size = (left, 0 if _is_causal(module) else left)
    # The kernel wants [T, H, D] with a unit-stride last dim; HF hands over [1, H, T, D].
    q = query[0].transpose(0, 1).contiguous()
    key_rows, value_rows = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    # Cached keys before the row's shift its rows: then every sequence reads its keys gathered, one pass.
    cached = prefix_cache is not None and prefix_cache.reads
    gathered = packed_key_index is not None and (prefix_cross is None or window is not None or cached)
    cu_k, max_k = cu_q, max_length_q
    if gathered and packed_key_index is not None:
        if cu_seq_lens_k is None or max_length_k is None:
            raise ValueError("gathered keys need cu_seq_lens_k and max_length_k")
        key_rows = key_rows.index_select(0, packed_key_index)
        value_rows = value_rows.index_select(0, packed_key_index)
        cu_k, max_k = cu_seq_lens_k.to(torch.int32), max_length_k
    k, v, extra = _kernel_kv(q.shape[1], key_rows, value_rows, kernel_gqa)
    if prefix_cross is None or gathered:
        out = kernel(
            q, k, v, cu_q, cu_k, int(max_length_q), int(max_k),
            scale=scaling, window_size=window_size, **extra,
        )  # fmt: skip
        return out.unsqueeze(0), None  # [1, T, H, D]
    own, own_lse = kernel(
        q, k, v, cu_q, cu_q, int(max_length_q), int(max_length_q),
        scale=scaling, window_size=window_size, return_aux=WANT_LSE, **extra,
    )  # fmt: skip
    cross, cross_lse = kernel(
        q, k, v, prefix_cross.cu_q, prefix_cross.cu_k, int(prefix_cross.max_q), int(prefix_cross.max_k),
        scale=scaling, window_size=(-1, -1), return_aux=WANT_LSE, **extra,
    )  # fmt: skip
    return merge_passes(own, own_lse, cross, cross_lse, prefix_cross.rows).unsqueeze(0), None


def merge_passes(
    first: torch.Tensor,
    first_lse: torch.Tensor,
    second: torch.Tensor,
    second_lse: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """Attention over two disjoint sets of keys from each set's own: outputs [T, H, D] and log-sum-exps
    [H, T] of each pass. Softmax over the union weighs each pass's output by its share of the total mass,
    exp(lse) / (exp(first_lse) + exp(second_lse)): first + sigmoid(second_lse - first_lse) * (second -
    first), in float32. Only `rows` [T] (bool) took the second pass; the others keep the first's output
    (what the second left in them is not read, whatever it is)."""
    weight = torch.sigmoid(second_lse - first_lse).transpose(0, 1).unsqueeze(-1)  # [T, H, 1]
    merged = torch.lerp(first.float(), second.float(), weight).to(first.dtype)
    return torch.where(rows[:, None, None], merged, first)


def _kernel_kv(
    heads: int, key: torch.Tensor, value: torch.Tensor, kernel_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """K/V [T, Hkv, D] as the kernel takes them, and its extra arguments for grouped-query attention."""
    if key.shape[1] == heads:
        return key.contiguous(), value.contiguous(), {}
    if kernel_gqa:
        return key.contiguous(), value.contiguous(), {"enable_gqa": True}
    # torch 2.11's kernel has no GQA: every KV head serves heads // kv_heads consecutive query heads.
    groups = heads // key.shape[1]
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), {}


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function for our attention names: the packing is described by cu_seqlens, so no [T, T] mask."""
    return None


def flash_varlen_gqa(
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
    return_aux: LseRequest | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch's flash varlen kernel called as varlen_attn calls it, for torch versions whose varlen_attn has
    no enable_gqa (2.11). The flash kernel itself takes fewer K/V heads than query heads (each K/V head
    serving consecutive query heads, HF's layout), so K/V need not be repeated to the query's heads.
    With `return_aux.lse`, also the log-sum-exp of each row's scores, [H, T], as varlen_attn returns it."""
    left, right = window_size
    output: torch.Tensor
    lse: torch.Tensor
    output, lse = torch.ops.aten._flash_attention_forward(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        0.0,  # no dropout
        tuple(window_size) == (-1, 0),  # causal, as varlen_attn decides it
        return_debug_mask=False,
        scale=scale,
        window_size_left=left,
        window_size_right=right,
    )[:2]
    if return_aux is not None and return_aux.lse:
        return output, lse
    return output


def _default_varlen_kernel() -> VarlenKernel:
    from torch.nn.attention.varlen import varlen_attn

    if kernel_supports_gqa(varlen_attn) or not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return varlen_attn
    return flash_varlen_gqa


def triton_or_flash(flash: VarlenKernel) -> VarlenKernel:
    """Our Triton kernel (models/triton_attention.py) where it applies and gains, `flash` elsewhere: a layer
    with a sliding window, and batches of short sequences only (triton_attention.takes: none over
    MIN_LENGTH tokens, where flash is faster). Same signature as varlen_attn, grouped-query attention
    included."""
    from models import triton_attention

    return _preferred_or_flash(
        triton_attention.triton_varlen_attn,
        lambda window_size, max_q: tuple(window_size) in CAUSAL_OR_FULL and triton_attention.takes(max_q),
        flash,
    )


def fa4_or_flash(flash: VarlenKernel) -> VarlenKernel:
    """FlashAttention-4 (models/fa4_attention.py) for causal and full attention, `flash` for a layer with a
    sliding window. Same signature as varlen_attn, grouped-query attention included."""
    from models import fa4_attention

    return _preferred_or_flash(
        fa4_attention.fa4_varlen_attn,
        lambda window_size, max_q: tuple(window_size) in CAUSAL_OR_FULL,
        flash,
    )


def _preferred_or_flash(
    preferred: VarlenKernel, applies: Callable[[tuple[int, int], int], bool], flash: VarlenKernel
) -> VarlenKernel:
    """`preferred` (which takes grouped-query K/V as they are) for calls where `applies(window_size, max_q)`,
    `flash` for the rest, K/V heads repeated where it needs them."""
    flash_gqa = kernel_supports_gqa(flash)

    def kernel(
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
        return_aux: LseRequest | None = None,
    ) -> Any:
        if applies(window_size, max_q):
            return preferred(
                query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                scale=scale, window_size=window_size, enable_gqa=enable_gqa, return_aux=return_aux,
            )  # fmt: skip
        key, value, extra = _kernel_kv(query.shape[1], key, value, flash_gqa)
        if return_aux is not None:
            extra["return_aux"] = return_aux
        return flash(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size, **extra
        )

    return kernel


_registered_kernels: dict[int, tuple[VarlenKernel, str]] = {}


def register_attention(kind: str, kernel: VarlenKernel | None = None, kernel_choice: str = "flash") -> str:
    """Register the attention (and no-op mask) function for `kind`; returns the attn_implementation name.

    For "varlen", `kernel` (injected: tests, benchmarks) or else `kernel_choice`: "flash" (torch's
    kernel), "triton" (models/triton_attention.py) or "fa4" (models/fa4_attention.py), the last two with
    flash for sliding windows."""
    if kind == "reference":
        name = REFERENCE_ATTENTION
        # Compiled layers (compile="on") run it eager between their graphs, as the varlen kernels' custom ops
        # are: its loop over sequences reads the bounds on the host, and traced it would unroll every batch's
        # composition into a graph of its own (a compilation per batch).
        AttentionInterface.register(name, torch.compiler.disable(reference_attention))  # type: ignore[no-untyped-call]
    elif kind == "varlen":
        if kernel is None and kernel_choice == "triton":
            name, kernel = f"{VARLEN_ATTENTION}_triton", triton_or_flash(_default_varlen_kernel())
        elif kernel is None and kernel_choice == "fa4":
            name, kernel = f"{VARLEN_ATTENTION}_fa4", fa4_or_flash(_default_varlen_kernel())
        elif kernel is None:
            name, kernel = VARLEN_ATTENTION, _default_varlen_kernel()
        else:
            # One name per distinct injected kernel; the registry is global, so names must not collide.
            _, name = _registered_kernels.setdefault(
                id(kernel), (kernel, f"{VARLEN_ATTENTION}_{len(_registered_kernels) + 1}")
            )
        attention = functools.partial(varlen_attention, kernel=kernel, kernel_gqa=kernel_supports_gqa(kernel))
        AttentionInterface.register(name, attention)
    else:
        raise ValueError(f"unknown attention kind {kind!r}")
    AttentionMaskInterface.register(name, _no_mask)
    return name

"""Where a timed path's GPU time goes: CUDA kernel time from torch.profiler, grouped into a few categories."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Name fragments per category, checked in this order (cuBLAS on Hopper names its kernels nvjet_* / sm90_*;
# attention comes first because flash kernels carry "cutlass" in their template arguments). The fused MLP's
# kernel (models/fused_mlp.py) is two matmuls with an activation after them: a matmul.
_CATEGORIES = (
    ("attention", ("flash", "fmha", "attention")),
    ("matmul", ("gemm", "nvjet", "sm90_xmma", "cutlass", "gemv", "_gate_up_silu_kernel")),
    ("copy/index", ("copy", "index", "cat", "gather", "scatter", "repeat", "fill", "memcpy", "memset")),
    ("elementwise/norm", ("elementwise", "reduce", "norm", "softmax", "silu", "mul", "add")),
)


def categorize(name: str) -> str:
    lowered = name.lower()
    for category, fragments in _CATEGORIES:
        if category == "copy/index" and lowered.startswith("triton_"):
            # torch.compile's fused kernels: their names list the ops fused (a norm's dtype casts read
            # "_to_copy"), so one is elementwise work unless it holds attention or a matmul.
            return "elementwise/norm"
        if any(fragment in lowered for fragment in fragments):
            return category
    return "other"


def kernel_breakdown(fn: Callable[[], Any], top: int = 12) -> dict[str, Any]:
    """Run fn under the profiler; device time per category and the `top` kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = float(getattr(event, "self_device_time_total", 0.0) or 0.0)
        if device_us > 0:
            kernels[event.key] = kernels.get(event.key, 0.0) + device_us
    total = sum(kernels.values()) or 1.0
    categories: dict[str, float] = {}
    for name, micros in kernels.items():
        categories[categorize(name)] = categories.get(categorize(name), 0.0) + micros
    ranked = sorted(kernels.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return {
        "device_ms": total / 1e3,
        "categories_pct": {
            k: 100.0 * v / total for k, v in sorted(categories.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": [{"name": n[:160], "ms": us / 1e3, "pct": 100.0 * us / total} for n, us in ranked],
    }


def print_breakdown(name: str, wall_s: float, breakdown: dict[str, Any]) -> None:
    busy = 100.0 * breakdown["device_ms"] / 1e3 / wall_s if wall_s > 0 else float("nan")
    cats = ", ".join(f"{k} {v:.1f}%" for k, v in breakdown["categories_pct"].items())
    device_ms = breakdown["device_ms"]
    print(f"\n{name}: kernels busy {device_ms:.0f} ms of {wall_s * 1e3:.0f} ms wall ({busy:.0f}%); {cats}")
    for kernel in breakdown["top_kernels"]:
        print(f"  {kernel['pct']:5.1f}% {kernel['ms']:9.1f} ms  {kernel['name'][:100]}")

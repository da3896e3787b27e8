"""Probe of the GPU machine's torch/transformers APIs the packed engine relies on, and of varlen_attn itself.

Run there from the repository root:  PYTHONPATH=. python3 bench/probe.py
Checks torch.nn.attention.varlen.varlen_attn (causal, GQA by repeated K/V, several dtypes and head sizes)
against per-sequence SDPA in float64 on the CPU, and prints the transformers 5.x hooks' signatures.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError) as exc:
        return f"<no signature: {exc}>"


def print_apis() -> None:
    """Versions and the signatures of the hooks a custom attention backend plugs into."""
    import transformers
    from torch.nn.attention import varlen

    print(f"torch {torch.__version__} (cuda {torch.version.cuda}), transformers {transformers.__version__}")
    print(f"varlen_attn{_signature(varlen.varlen_attn)}")
    print(f"varlen module names: {[n for n in dir(varlen) if not n.startswith('_')]}")
    for name in ("AttentionInterface", "AttentionMaskInterface"):
        cls = getattr(transformers, name, None)
        print(f"transformers.{name}: {cls is not None}; register{_signature(getattr(cls, 'register', None))}")
        if cls is not None:
            print(f"  registered: {sorted(cls._global_mapping)}")
    from transformers import masking_utils

    for fn in ("create_causal_mask", "sdpa_mask", "eager_mask", "flash_attention_mask"):
        if hasattr(masking_utils, fn):
            print(f"masking_utils.{fn}{_signature(getattr(masking_utils, fn))}")
    from transformers.integrations import sdpa_attention

    print(f"sdpa_attention_forward{_signature(sdpa_attention.sdpa_attention_forward)}")
    from transformers.models.llama import modeling_llama

    print(f"LlamaAttention.forward{_signature(modeling_llama.LlamaAttention.forward)}")
    print(f"LlamaModel.forward{_signature(modeling_llama.LlamaModel.forward)}")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: Sequence[int]) -> torch.Tensor:
    """Per-sequence causal SDPA in float64 on the CPU; q [T, H, D], k/v [T, Hkv, D]."""
    groups = q.shape[1] // k.shape[1]
    out = []
    for start, end in itertools.pairwise(cu):
        qs, ks, vs = (t[start:end].double().cpu().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    return torch.cat(out)


def check_varlen(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> tuple[bool, str]:
    """One varlen_attn call over mixed lengths (incl. length 1) vs the float64 reference."""
    from torch.nn.attention.varlen import varlen_attn

    lengths = [1, 7, 64, 129, 500, 1031]
    cu_list = [0]
    for length in lengths:
        cu_list.append(cu_list[-1] + length)
    gen = torch.Generator(device="cuda").manual_seed(heads * head_dim)
    total = cu_list[-1]
    q = torch.randn(total, heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(total, kv_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(total, kv_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    cu = torch.tensor(cu_list, device="cuda", dtype=torch.int32)
    groups = heads // kv_heads
    # torch 2.11 has no enable_gqa: K/V heads are repeated to the query heads, as the engine must do there.
    kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    try:
        out: Any = varlen_attn(q, kr, vr, cu, cu, max(lengths), max(lengths), window_size=(-1, 0))
        torch.cuda.synchronize()
    except Exception as exc:  # report the kernel's refusal (e.g. an unsupported dtype) rather than stop
        return False, f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    ref = _reference(q, k, v, cu_list)
    rel = float((out.double().cpu() - ref).norm() / ref.norm())
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    return rel < tol, f"rel err {rel:.2e} (tol {tol:.0e}), out dtype {out.dtype}, shape {tuple(out.shape)}"


def main() -> int:
    print_apis()
    if not torch.cuda.is_available():
        print("no CUDA device: varlen checks skipped")
        return 2
    failures = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for heads, kv_heads, head_dim in ((32, 8, 128), (16, 8, 128), (8, 2, 64), (4, 4, 256), (4, 2, 16)):
            ok, detail = check_varlen(dtype, heads, kv_heads, head_dim)
            failures += not ok
            label = f"{str(dtype).removeprefix('torch.')} H{heads}/KV{kv_heads} D{head_dim}"
            print(f"varlen_attn {label:<28} {'PASS' if ok else 'FAIL'}  {detail}")
    print(f"probe: {failures} varlen failures")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Would one matmul for q/k/v and one for gate/up beat the separate projections? Timed at the shapes that
matter, on the GPU, with the fused results checked against the separate ones and a float32 matmul.

Run there from the repository root:  PYTHONPATH=. python3 bench/fusion_probe.py
Cases: W1 (8B Llama shapes, a 16,384-token batch), 64 and 1 requests of 100 tokens on Qwen3-0.6B shapes.
Prints one JSON line per case; exits 1 when a fused result disagrees with the separate ones.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import gpu_ms

# (name, tokens, hidden, q width, k/v width, MLP width)
CASES = (
    ("w1-8b-16k", 16384, 4096, 4096, 1024, 14336),
    ("qwen3-0.6b-64x100", 6400, 1024, 2048, 1024, 3072),
    ("qwen3-0.6b-1x100", 100, 1024, 2048, 1024, 3072),
)
# bf16 outputs of the same dot products in another GEMM: within a few bf16 ulps of each other.
TOLERANCE = 2e-2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def case(name: str, tokens: int, hidden: int, q: int, kv: int, mlp: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    widths = {"q": q, "k": kv, "v": kv, "gate": mlp, "up": mlp}
    w = {
        k: torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) / hidden**0.5
        for k, n in widths.items()
    }
    qkv, gate_up = torch.cat([w["q"], w["k"], w["v"]]), torch.cat([w["gate"], w["up"]])
    separate_qkv = torch.cat([F.linear(x, w[k]) for k in ("q", "k", "v")], dim=1)
    separate_gu = torch.cat([F.linear(x, w[k]) for k in ("gate", "up")], dim=1)
    errors = {
        "qkv_fused_vs_separate": relative_error(F.linear(x, qkv), separate_qkv),
        "gate_up_fused_vs_separate": relative_error(F.linear(x, gate_up), separate_gu),
        "qkv_fused_vs_float32": relative_error(F.linear(x, qkv), F.linear(x.float(), qkv.float())),
    }
    flops_qkv, flops_gu = 2 * tokens * hidden * (q + 2 * kv), 2 * tokens * hidden * 2 * mlp
    timings = {
        "qkv_separate_ms": gpu_ms(lambda: [F.linear(x, w[k]) for k in ("q", "k", "v")]),
        "qkv_fused_ms": gpu_ms(lambda: F.linear(x, qkv)),
        "gate_up_separate_ms": gpu_ms(lambda: [F.linear(x, w[k]) for k in ("gate", "up")]),
        "gate_up_fused_ms": gpu_ms(lambda: F.linear(x, gate_up)),
    }
    rates = {
        "qkv_separate_tflops": flops_qkv / timings["qkv_separate_ms"] / 1e9,
        "qkv_fused_tflops": flops_qkv / timings["qkv_fused_ms"] / 1e9,
        "gate_up_separate_tflops": flops_gu / timings["gate_up_separate_ms"] / 1e9,
        "gate_up_fused_tflops": flops_gu / timings["gate_up_fused_ms"] / 1e9,
    }
    ok = all(e <= TOLERANCE for e in errors.values())
    return {"case": name, "ok": ok, **timings, **rates, **errors}


def main() -> int:
    if not torch.cuda.is_available():
        print("the fusion probe needs a CUDA GPU", file=sys.stderr)
        return 2
    failed = False
    with torch.inference_mode():
        for shapes in CASES:
            row = case(*shapes)
            failed |= not row["ok"]
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            print(json.dumps(shown), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

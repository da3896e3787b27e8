"""The fused gate/up/SiLU kernel (models/fused_mlp.py) against what it replaces: two cuBLAS products and
inductor's fused SiLU-and-multiply, at the MLP shapes of several model sizes, in a few kernel
configurations. The measurement `fused_mlp="auto"` and the kernel's constants were chosen by.

Run on the GPU machine from the repository root:  PYTHONPATH=. python3 bench/gate_up_probe.py
Every timed output is checked against float32 first; exits 1 when one is off. Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from models import fused_mlp
from models.fused_mlp import KernelConfig

# (name, tokens, hidden size, MLP width)
CASES = (
    ("w1-8b-16k", 16384, 4096, 14336),
    ("llama-3b-16k", 16384, 3072, 8192),
    ("llama-1b-16k", 16384, 2048, 8192),
    ("qwen-1.5b-16k", 16384, 1536, 8960),
    ("qwen3-0.6b-64x100", 6400, 1024, 3072),
)
CONFIGS = (
    KernelConfig(),  # the module's constants
    KernelConfig(group_m=8),
    KernelConfig(stages=4),
    KernelConfig(block_m=256, block_n=64),
)
TOLERANCE = 1e-2  # relative Frobenius error against float32: bf16 rounding of inputs and output


@torch.compile(dynamic=True)
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def label(config: KernelConfig) -> str:
    return ",".join(str(v) for v in config)


def case(name: str, tokens: int, hidden: int, width: int, repeats: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate, up = (
        torch.randn(width, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) / hidden**0.5
        for _ in range(2)
    )
    want = F.silu(x.float() @ gate.float().t()) * (x.float() @ up.float().t())
    runs: dict[str, Callable[[], Any]] = {
        "cublas_and_inductor": lambda: silu_mul(F.linear(x, gate), F.linear(x, up)),
        "fused": lambda: fused_mlp.gate_up_silu(x, gate, up),
    }
    runs.update({label(c): lambda c=c: fused_mlp.launch(x, gate, up, c) for c in CONFIGS})
    errors = {path: relative_error(run(), want) for path, run in runs.items()}
    del want
    runs["cublas_products_alone"] = lambda: (F.linear(x, gate), F.linear(x, up))
    timings: dict[str, list[float]] = {}
    for _ in range(3):  # rounds, interleaved so that every path sees the same clocks
        for path, run in runs.items():
            timings.setdefault(path, []).append(median_ms(run, repeats))
    flops = 4.0 * tokens * hidden * width
    report: dict[str, Any] = {
        "case": name,
        "ok": all(error < TOLERANCE for error in errors.values()),
        "errors": errors,
    }
    for path, values in timings.items():
        ms = statistics.median(values)
        report[path] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
    report["fused_vs_unfused"] = round(report["cublas_and_inductor"]["ms"] / report["fused"]["ms"], 3)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the probe needs a CUDA GPU", file=sys.stderr)
        return 2
    failed = False
    for spec in CASES:
        report = case(*spec, repeats=args.repeats)
        print(json.dumps(report), flush=True)
        failed = failed or not report["ok"]
    if failed:
        print("GATE/UP PROBE FAILED: a timed output is off float32", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

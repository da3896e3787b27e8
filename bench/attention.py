"""Attention alone: torch's flash varlen kernel against the Triton kernel (and FlashAttention-4 where it is
installed), on packed W1, W3 and L1 batches.

Run on the GPU machine from the repository root:  PYTHONPATH=. python3 bench/attention.py

Each case is one packed batch as the engine hands it to the kernel (q [T, H, D], k/v [T, Hkv, D], causal):
W1's first token-budget batches (8B shapes, lognormal lengths), W3's prompts whole (query 512 + item 64,
Qwen3-0.6B shapes), L1's 64 requests of 100 tokens, W2-sized requests of one and four items, and a
shared-prefix cross pass (suffixes over their prefix, not causal, with the log-sum-exp). Prints milliseconds
and TFLOP/s of each kernel (the FLOPs the mask leaves: causal counts half the square), launched back to back
and replayed from a CUDA graph (the kernels alone, as the engine's graphs run them: short batches' launches
take longer than their kernels), for every block configuration in `--configs`. Both kernels' outputs are
compared with float32 attention on a sample of sequences; the script exits 1 when the Triton
kernel's error exceeds twice flash's (plus 0.01), or its log-sum-exp differs by more than 0.01.
Writes $OUT/attention.json.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.common import (
    argument_parser,
    gpu_ms,
    graph_ms,
    make_lognormal_workload,
    pick_device,
    report_header,
    report_path,
    write_verdict,
)
from models import fa4_attention, triton_attention
from models.attention import attend_causal, flash_varlen_gqa
from models.plan import token_runs
from models.varlen import WANT_LSE

# The module's configuration: block lanes, block keys, warps, stages, query heads per program at most.
DEFAULT = (
    triton_attention.BLOCK_M, triton_attention.BLOCK_N, triton_attention.NUM_WARPS,
    triton_attention.NUM_STAGES, triton_attention.PACK_HEADS,
)  # fmt: skip
CONFIGS = (DEFAULT, (64, 64, 4, 3, 4), (64, 64, 4, 3, 1), (128, 64, 8, 3, 4), (128, 128, 8, 3, 4))


class Case:
    def __init__(
        self, name: str, q_lengths: Sequence[int], heads: int, kv_heads: int, head_dim: int = 128,
        k_lengths: Sequence[int] | None = None, causal: bool = True,
    ) -> None:  # fmt: skip
        self.name, self.causal = name, causal
        self.q_lengths = list(q_lengths)
        self.k_lengths = list(k_lengths) if k_lengths is not None else self.q_lengths
        gen = torch.Generator(device="cuda").manual_seed(0)

        def rows(count: int, width: int) -> torch.Tensor:
            return torch.randn(count, width, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)

        self.q = rows(sum(self.q_lengths), heads)
        self.k, self.v = rows(sum(self.k_lengths), kv_heads), rows(sum(self.k_lengths), kv_heads)
        self.cu_q = _offsets(self.q_lengths)
        self.cu_k = _offsets(self.k_lengths)
        self.window = (-1, 0) if causal else (-1, -1)
        pairs = sum(
            q * (q + 1) / 2 if causal else q * k for q, k in zip(self.q_lengths, self.k_lengths, strict=True)
        )
        self.flops = 4.0 * pairs * heads * head_dim

    def run(self, kernel: Callable[..., Any], lse: bool = False) -> Any:
        return kernel(
            self.q, self.k, self.v, self.cu_q, self.cu_k, max(self.q_lengths), max(self.k_lengths),
            window_size=self.window, enable_gqa=True, return_aux=WANT_LSE if lse else None,
        )  # fmt: skip

    def errors(self, out: torch.Tensor, lse: torch.Tensor | None, sample: int = 4) -> tuple[float, float]:
        """Max |out - float32 attention| and |lse - float32 log-sum-exp|, `sample` longest sequences."""
        out_err = lse_err = 0.0
        by_length = sorted(range(len(self.q_lengths)), key=lambda i: -self.q_lengths[i])
        longest = [i for i in by_length if self.q_lengths[i] > 0][:sample]
        bounds_q, bounds_k = self.cu_q.tolist(), self.cu_k.tolist()
        for i in longest:
            q = self.q[bounds_q[i] : bounds_q[i + 1]].transpose(0, 1)
            k = self.k[bounds_k[i] : bounds_k[i + 1]].transpose(0, 1)
            v = self.v[bounds_k[i] : bounds_k[i + 1]].transpose(0, 1)
            want = attend_causal(q, k, v, scale=None, causal=self.causal).transpose(0, 1)
            got = out[bounds_q[i] : bounds_q[i + 1]].float()
            out_err = max(out_err, float((got - want).abs().max()))
            if lse is not None:
                scores = q.float() @ k.float().repeat_interleave(q.shape[0] // k.shape[0], 0).transpose(1, 2)
                want_lse = torch.logsumexp(scores / q.shape[-1] ** 0.5, dim=-1)
                lse_err = max(lse_err, float((lse[:, bounds_q[i] : bounds_q[i + 1]] - want_lse).abs().max()))
        return out_err, lse_err


def _offsets(lengths: Sequence[int]) -> torch.Tensor:
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return torch.tensor(bounds, dtype=torch.int32, device="cuda")


def cases() -> list[Case]:
    w1 = make_lognormal_workload(512, 128256)
    batches = list(token_runs(w1.lengths, 16384))
    groups, suffixes = 16, 16  # W3's shape as the shared path runs it: 16 suffixes of 64 over a 512 query
    return [
        Case("w1_batch0", w1.lengths[batches[0].start : batches[0].stop], 32, 8),
        Case("w1_batch1", w1.lengths[batches[1].start : batches[1].stop], 32, 8),
        Case("w3_whole", [576] * 28, 16, 8),
        Case("l1_64x100", [100] * 64, 16, 8),
        # One W2 request as a small-batch graph runs it: four sequence slots, the unused ones empty.
        Case("w2_1x100", [100, 0, 0, 0], 16, 8),
        Case("w2_4items", [40, 120, 250, 90], 16, 8),
        Case("w3_cross", [64 * suffixes] * groups, 16, 8, k_lengths=[512] * groups, causal=False),
    ]


def set_config(config: Sequence[int]) -> None:
    block_m, block_n, warps, stages, pack = (*config, *DEFAULT[len(config) :])
    triton_attention.BLOCK_M, triton_attention.BLOCK_N = block_m, block_n
    triton_attention.NUM_WARPS, triton_attention.NUM_STAGES = warps, stages
    triton_attention.PACK_HEADS = pack


def _timed(
    case: Case, kernel: Callable[..., Any], flash_err: tuple[float, float], repeats: int
) -> dict[str, Any]:
    """`kernel` on `case`: milliseconds, TFLOP/s, its errors against float32 and whether they pass (at most
    twice flash's error plus 0.01, log-sum-exp within 0.01)."""
    wants_lse = not case.causal
    out = case.run(kernel, lse=wants_lse)
    err = case.errors(*out) if wants_lse else case.errors(out, None)
    ms = gpu_ms(lambda: case.run(kernel), repeats)
    in_graph = graph_ms(lambda: case.run(kernel), repeats)
    ok = err[0] <= 2 * flash_err[0] + 0.01 and err[1] <= 0.01
    return {
        "ms": ms, "tflops": case.flops / ms / 1e9, "graph_ms": in_graph,
        "graph_tflops": case.flops / in_graph / 1e9, "error": err, "ok": ok,
    }  # fmt: skip


def _line(name: str, timed: dict[str, Any]) -> str:
    err = timed["error"]
    return (
        f"{name} {timed['ms']:7.3f} ms {timed['tflops']:6.0f} TFLOP/s, in a graph {timed['graph_ms']:7.3f} ms"
        f" {timed['graph_tflops']:6.0f}; err {err[0]:.2e}/{err[1]:.2e}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--configs",
        default=";".join(",".join(map(str, c)) for c in CONFIGS),
        help="BLOCK_M,BLOCK_N,warps,stages[,pack];... (missing fields: the module's; the first: its default)",
    )
    args = parser.parse_args(argv)
    if pick_device("the attention benchmark", cpu_allowed=False) is None:
        return 2
    configs = [tuple(int(x) for x in part.split(",")) for part in args.configs.split(";") if part]
    report: dict[str, Any] = {**report_header(), "default_config": DEFAULT, "cases": {}}
    failed = []
    for case in cases():
        wants_lse = not case.causal
        row: dict[str, Any] = {
            "tokens": len(case.q),
            "sequences": len(case.q_lengths),
            "tflop": case.flops / 1e12,
        }
        flash_out = case.run(flash_varlen_gqa, lse=wants_lse)
        flash_err = case.errors(*flash_out) if wants_lse else case.errors(flash_out, None)
        flash_ms = gpu_ms(lambda c=case: c.run(flash_varlen_gqa), args.repeats)
        flash_graph_ms = graph_ms(lambda c=case: c.run(flash_varlen_gqa), args.repeats)
        row["flash"] = {
            "ms": flash_ms, "tflops": case.flops / flash_ms / 1e9, "graph_ms": flash_graph_ms,
            "graph_tflops": case.flops / flash_graph_ms / 1e9, "error": flash_err,
        }  # fmt: skip
        label = f"{case.name:<10} "
        flash_line = "  | " + _line("flash", row["flash"])
        if fa4_attention.available():
            row["fa4"] = _timed(case, fa4_attention.fa4_varlen_attn, flash_err, args.repeats)
            if not row["fa4"]["ok"]:
                failed.append(f"{case.name} fa4: error {row['fa4']['error']} (flash {flash_err})")
            print(label + _line("fa4    ", row["fa4"]) + flash_line, flush=True)
        row["triton"] = {}
        for config in configs:
            set_config(config)
            key = ",".join(map(str, config))
            timed = row["triton"][key] = _timed(
                case, triton_attention.triton_varlen_attn, flash_err, args.repeats
            )
            if not timed["ok"]:
                failed.append(f"{case.name} {key}: error {timed['error']} (flash {flash_err})")
            print(label + _line(f"triton {key:<12}", timed) + flash_line, flush=True)
        set_config(DEFAULT)
        report["cases"][case.name] = row
    return write_verdict(report, failed, report_path("attention"), "attention")


if __name__ == "__main__":
    sys.exit(main())

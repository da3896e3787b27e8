"""Shared pieces of the GPU benchmarks: environment facts, CUDA timing, the W1 workload and its FLOP count."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Qwen3-0.6B shapes (the reference's W2 and the small-batch latency case); random weights from the HF
# initialiser (normal, std 0.02).
QWEN3_06B_SHAPES: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class Workload:
    """Token-id requests (one item each) in arrival order."""

    token_ids: list[torch.Tensor]  # each [L] int64 on the CPU

    @property
    def lengths(self) -> list[int]:
        return [int(t.numel()) for t in self.token_ids]

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)


def make_lognormal_workload(
    num_requests: int,
    vocab_size: int,
    *,
    seed: int = 1,
    median: float = 500.0,
    sigma: float = 0.7,
    min_len: int = 32,
    max_len: int = 2048,
) -> Workload:
    """W1's request stream: lengths exp(N(0,1)*sigma + ln median) clipped and truncated, then uniform ids."""
    gen = torch.Generator().manual_seed(seed)
    # Lengths first, then ids, from the one generator: the reference's order, so the stream is reproducible.
    raw = torch.exp(torch.randn(num_requests, generator=gen) * sigma + math.log(median))
    lengths = raw.clamp(min_len, max_len).long().tolist()
    ids = [torch.randint(1, vocab_size, (length,), generator=gen, dtype=torch.int64) for length in lengths]
    return Workload(token_ids=ids)


def token_budget_chunks(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Greedy arrival-order batches of request indices whose token sum stays within max_tokens."""
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, length in enumerate(lengths):
        if current and used + length > max_tokens:
            chunks.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        chunks.append(current)
    return chunks


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters that cost 2 FLOPs per token: everything but the input embedding table."""
    return sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)


def flops_per_token(
    non_embedding: int, layers: int, attn_width: int, lengths: Sequence[int]
) -> dict[str, float]:
    """2 x non-embedding params plus causal attention (4 * layers * width * L / 2 per token)."""
    total = sum(lengths)
    # A token of a length-L row attends to L/2 keys on average (QK^T and AV: 2 + 2 FLOPs per key and dim).
    attention = sum(4.0 * layers * attn_width * (length / 2.0) * length for length in lengths) / total
    dense = 2.0 * non_embedding
    return {"dense": dense, "attention": attention, "total": dense + attention}


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def event_times_ms(run: Callable[[int], Any], warmup: int, repeats: int) -> list[float]:
    """Milliseconds of run(i) for i in range(repeats), timed with CUDA events after `warmup` calls."""
    for i in range(warmup):
        run(i)
    events = [(_event(), _event()) for _ in range(repeats)]
    for i, (start, end) in enumerate(events):
        start.record()
        run(i)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def matmul_tflops(
    size: int = 8192, warmup: int = 5, repeats: int = 30, fp8: bool = False
) -> dict[str, float]:
    """size^3 matmul rate with CUDA events: the arithmetic ceiling the roofline is drawn from. bf16, or with
    `fp8` the FP8 product with the scales the engine uses (per row of each operand, models/fp8.py)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Two input sets, alternated, so no repeat reads operands a previous product left in L2; never zeros.
    pairs = [
        tuple(torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        for _ in range(2)
    ]
    last = {"out": torch.empty(size, size, device="cuda", dtype=torch.bfloat16)}
    if fp8:
        from models.fp8 import quantize_rows

        # Per row of A, per column of B (B's rows are its transpose's columns).
        quantized = [(*quantize_rows(a), *quantize_rows(b)) for a, b in pairs]
        operands = [(a, a_scale, b.t(), b_scale.reshape(1, -1)) for a, a_scale, b, b_scale in quantized]

        def run(i: int) -> None:
            a, a_scale, b_t, b_scale = operands[i % 2]
            last["out"] = torch._scaled_mm(a, b_t, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)

    else:

        def run(i: int) -> None:
            torch.mm(*pairs[i % 2], out=last["out"])

    millis = event_times_ms(run, warmup, repeats)
    if not torch.isfinite(last["out"]).all():
        raise RuntimeError("matmul roofline produced non-finite values")
    flops = 2.0 * size**3
    median_ms = statistics.median(millis)
    return {
        "size": float(size),
        "median_ms": median_ms,
        "tflops_median": flops / (median_ms * 1e-3) / 1e12,
        "tflops_best": flops / (min(millis) * 1e-3) / 1e12,
        "tflops_worst": flops / (max(millis) * 1e-3) / 1e12,
    }


def gpu_ms(fn: Callable[[], Any], repeats: int = 30, warmup: int = 5) -> float:
    """Mean GPU milliseconds of a call to fn over `repeats` calls after warm-up (CUDA events)."""
    for _ in range(warmup):
        fn()
    start, end = _event(), _event()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / repeats


def graph_ms(fn: Callable[[], Any], repeats: int = 30) -> float:
    """Mean GPU milliseconds of fn's kernels replayed from a CUDA graph, `repeats` replays: what a call
    costs inside the engine's graphs, without the host's launch cost that `gpu_ms` includes when the
    kernels are shorter than their launches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and warms up outside the graph, as the engine's warm-up does
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return gpu_ms(graph.replay, repeats)


def call_percentiles(run: Callable[[], Any], warmup: int, repeats: int) -> dict[str, float]:
    """Milliseconds per call (synchronised on CUDA), p50 and p90 over `repeats` calls after `warmup`."""
    for _ in range(warmup):
        run()
    _synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        _synchronize()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return {"p50_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))]}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run fn between two device synchronisations (none on the CPU); return its value and the wall seconds."""
    _synchronize()
    start = time.perf_counter()
    value = fn()
    _synchronize()
    return value, time.perf_counter() - start


def _nvidia_smi() -> dict[str, str]:
    query = "name,driver_version,memory.total,clocks.max.sm"
    try:
        proc = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": str(exc)}
    fields = [f.strip() for f in proc.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(query.split(","), fields, strict=False))


def environment() -> dict[str, Any]:
    """What ran the benchmark: versions, GPU, driver and the date."""
    import transformers

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_sms"] = props.multi_processor_count
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["nvidia_smi"] = _nvidia_smi()
    return info


def relative_errors(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per-row ||v - r|| / ||r|| in float64."""
    diff = np.linalg.norm(values.astype(np.float64) - reference.astype(np.float64), axis=-1)
    return np.asarray(diff / np.maximum(np.linalg.norm(reference.astype(np.float64), axis=-1), 1e-30))


def write_verdict(report: dict[str, Any], failures: list[str], target: Path, what: str) -> int:
    """Write the report with its verdict; the exit status: 1 when a check of the timed results failed (a
    figure whose results were wrong is no figure)."""
    report["verdict"] = failures or "ok"
    target.write_text(json.dumps(report, indent=2))
    print(f"wrote {target}")
    for failure in failures:
        print(f"{what} FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def out_dir() -> Path | None:
    """$OUT on the device machine (results come back from there); None elsewhere."""
    value = os.environ.get("OUT")
    return Path(value) if value else None


def layer_gemm_ceiling(
    hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int, tokens: int = 16384, repeats: int = 10
) -> dict[str, float]:
    """A decoder layer's seven projections at M=tokens, timed alone: what the matmuls allow a packed batch."""
    # (in, out) of q, k, v, o, gate, up, down: F.linear with weight [out, in], as the HF layers call it.
    shapes = [
        (hidden, heads * head_dim),
        (hidden, kv_heads * head_dim),
        (hidden, kv_heads * head_dim),
        (heads * head_dim, hidden),
        (hidden, mlp),
        (hidden, mlp),
        (mlp, hidden),
    ]
    gen = torch.Generator(device="cuda").manual_seed(1)
    operands = [
        (
            torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen),
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02,
        )
        for k, n in shapes
    ]
    # The products must be products: the first against float32, within bf16's rounding.
    x, w = operands[0]
    exact = x.float() @ w.float().t()
    error = float(((torch.nn.functional.linear(x, w).float() - exact).norm() / exact.norm()).item())
    if not error < 0.01:
        raise RuntimeError(f"layer_gemm_ceiling: product off float32 by {error:.3g}")

    def layer() -> None:
        for x, w in operands:
            torch.nn.functional.linear(x, w)

    median_ms = statistics.median(event_times_ms(lambda _: layer(), 3, repeats))
    flops = 2.0 * tokens * sum(k * n for k, n in shapes)
    return {"tokens": float(tokens), "ms_per_layer": median_ms, "tflops": flops / (median_ms * 1e-3) / 1e12}


class GpuSampler:
    """Samples SM clock, power and temperature through NVML on a thread while a timed pass runs."""

    def __init__(self, period_s: float = 0.25) -> None:
        self._period = period_s
        self._samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle: Any = None

    def __enter__(self) -> GpuSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # NVML is a diagnostic: without it the pass is still timed, only not annotated
            return self
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        import pynvml

        while not self._stop.wait(self._period):
            clock = pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_SM)
            power = pynvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
            temp = pynvml.nvmlDeviceGetTemperature(self._handle, pynvml.NVML_TEMPERATURE_GPU)
            self._samples.append((float(clock), power, float(temp)))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, float]:
        if not self._samples:
            return {}
        clocks, power, temp = (np.array(column) for column in zip(*self._samples, strict=True))
        return {
            "sm_clock_mhz_median": float(np.median(clocks)),
            "sm_clock_mhz_min": float(clocks.min()),
            "power_w_median": float(np.median(power)),
            "power_w_max": float(power.max()),
            "temp_c_max": float(temp.max()),
        }

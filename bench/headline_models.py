"""The headline run's phases for the newer model families: a hybrid linear-attention model, a mixture of
experts and an image-text classifier. Each calls its workload script's own run at a size that fits the run
(bench/hybrid.py, bench/moe.py, bench/vision.py) and returns its figures and the float32 check of what it
timed, as bench/headline_phases.py's phases do."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.headline_kit import Context, check, figure

Phase = dict[str, Any]


def _matmul(report: dict[str, Any]) -> dict[str, Any]:
    """The run's bf16 matmul rate where the script measured one (the roofline's numerator)."""
    rate = report.get("matmul") or (report.get("roofline") or {}).get("matmul_tflops")
    if isinstance(rate, dict):
        rate = rate.get("tflops_median")
    return {} if rate is None else {"bf16 matmul rate (8192^3)": figure(float(rate), "TFLOP/s")}


def hybrid(ctx: Context) -> Phase:
    """Qwen3.5-9B-like hybrid (Gated DeltaNet layers, full attention every fourth) on W1's lengths, against
    the roofline of its active parameters and its full layers' attention (bench/hybrid.py)."""
    from bench.hybrid import run

    requests = 12 if ctx.quick else 128
    report, failures = run("qwen3_5_text", quick=ctx.quick, requests=requests, sample=4, repeats=2)
    tokens = report["tokens"]
    samples = [tokens / s for s in report["timing"]["seconds"]]
    figures: dict[str, Any] = {"tokens/s": figure(max(samples), "tokens/s", samples), **_matmul(report)}
    if "pct_roofline" in report:
        figures["share of the active-parameter roofline"] = figure(report["pct_roofline"], "%")
    checks = {"scores against float32": check(not failures, report["vs_float32"], failures=failures)}
    notes = [
        f"{requests} of W1's requests (W1 has 512); Gated DeltaNet on {report['linear_kernel']} kernels",
        f"attention {report['attention']}",
    ]
    return {"figures": figures, "checks": checks, "notes": notes, "detail": report}


def moe(ctx: Context) -> Phase:
    """Qwen3-30B-A3B's shapes with fewer layers on W1's lengths, against the roofline of the parameters a
    token multiplies (bench/moe.py); HF's baseline is left to the script's own run."""
    from bench.moe import PACKED, moe_benchmark

    layers, requests = (2, 16) if ctx.quick else (8, 128)
    report, failures = moe_benchmark(
        quick=ctx.quick, layers=layers, requests=requests, repeats=2, fp32_requests=4, baseline=False,
        device=ctx.device,
    )  # fmt: skip
    packed = report["runs"][PACKED]
    tokens = report["tokens"]
    samples = [tokens / s for s in packed["seconds"]]
    figures: dict[str, Any] = {
        "tokens/s": figure(max(samples), "tokens/s", samples),
        **_matmul(report),
    }
    if "roofline_share" in packed:
        figures["share of the active-parameter roofline"] = figure(100 * packed["roofline_share"], "%")
    checks = {"scores against float32": check(not failures, report["vs_fp32"], failures=failures)}
    notes = [
        f"{layers} of Qwen3-30B-A3B's 48 layers, {requests} of W1's requests; experts on "
        f"{packed['experts_path']}"
    ]
    return {"figures": figures, "checks": checks, "notes": notes, "detail": report}


def vision(ctx: Context) -> Phase:
    """A Gemma-3-4B-like image-text classifier on a batch mixing image and text-only requests: images/s and
    tokens/s of the scorer, the host's decoding and processing timed apart (bench/vision.py)."""
    from bench.vision import GEMMA3_4B, time_scorer, workload
    from bench.vision import check as vision_check
    from models.tiny_vision import write_tiny_vision_model

    count = 8 if ctx.quick else 64
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(dir=ctx.workdir) as workdir:
        model_dir = write_tiny_vision_model(
            Path(workdir) / "gemma3", shapes=None if ctx.quick else GEMMA3_4B, device=ctx.device, dtype=dtype
        )
        requests = workload(count, (64, 48) if ctx.quick else (640, 480))
        timed, results = time_scorer(model_dir, ctx.device, requests)
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
        picks = list(range(4))  # two image requests (the even ones) and two text-only ones
        found = vision_check(model_dir, ctx.device, [requests[i] for i in picks], [results[i] for i in picks])
    samples = [timed["images"] / s for s in timed["timed"]["seconds"]]
    figures = {
        "images/s": figure(max(samples), "images/s", samples),
        "tokens/s": figure(timed["tokens_per_s"], "tokens/s"),
        "host: decode and process, images/s": figure(timed["images_per_s_host"], "images/s"),
    }  # fmt: skip
    checks = {"scores and hidden states against float32": check(found["ok"], found)}
    size = "64x48" if ctx.quick else "640x480"
    notes = [f"{count} requests, half with one {size} PNG (the processor's image tokens each)"]
    return {"figures": figures, "checks": checks, "notes": notes, "detail": {**timed, "vs_fp32": found}}

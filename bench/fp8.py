"""FP8 projections against bfloat16, side by side in one process: speed, and the deviation from float32.

Run on the GPU machine from the repository root:  PYTHONPATH=. python3 bench/fp8.py
`--quick` runs tiny shapes (on the CPU when there is no GPU): a smoke test of the script, not a measurement.
`--profile-top N` profiles the 64-request L1 step of both paths (0, the default: no profile).
`--variants` adds FP8 variants that keep part of each layer in bfloat16 (fp8_projections, fp8_keep_layers),
each timed and checked like `fp8`, and prints the trade-off: tokens/s against deviation from float32.

- L1: Qwen3-0.6B shapes, 1 and 64 requests of 100 tokens: p50 of the model step (`score_prepared`) with
  the defaults (compiled layers replayed from CUDA graphs), bfloat16 and FP8.
- W1: 8B Llama shapes, W1's 512 requests cut at the worker's 16,384-token budget, pooled hidden states for
  all: tokens/s of bfloat16 and FP8, against the bf16 matmul roofline and the FP8 one, both measured here.

Correctness, on a sample: the bf16 path against HF float32, and the FP8 path against HF float32 holding
the same FP8 projections (the same e4m3 weights and per-token rounding, products in float32). Each must be
within twice HF's own bf16 forward's error against that reference (HF's bf16 model, or it with the same FP8
projections) plus 5% of the score scale; exit 1 otherwise, or on a non-finite value: a figure whose results
are wrong is no figure. Reported besides: FP8's deviation from the unquantized float32 model and from bf16
(every request), and how a reward user judges it: of `--order-pairs` random pairs of W1's requests (256,
each request scored in float32 too), the share whose order by score each path keeps. These random-weight
models amplify rounding far more than trained ones (W1's bf16 path is already 6% from float32), so FP8's
deviation here is an upper bound of what a real model shows.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import hf_paths, packed_path
from bench.common import (
    QWEN3_06B_SHAPES,
    W1_QUICK_SHAPES,
    W1_SHAPES,
    add_options,
    argument_parser,
    build_model,
    call_percentiles,
    compare,
    float32_reference,
    flops_per_token,
    make_lognormal_workload,
    matmul_tflops,
    measure,
    non_embedding_params,
    order_kept,
    order_pairs,
    pick_device,
    report_header,
    report_path,
    score_bound,
    spread_picks,
    write_verdict,
)
from bench.hf_paths import PathOutput
from bench.profiling import kernel_breakdown, print_breakdown
from models.fp8 import Fp8Selection
from models.plan import token_runs

# FP8 variants by name: which projections run in FP8 (models/fp8.py; the rest keep bfloat16).
VARIANTS = {
    "fp8": Fp8Selection(),
    "fp8-attention": Fp8Selection("attention"),
    "fp8-mlp": Fp8Selection("mlp"),
    "fp8-keep-ends": Fp8Selection("all", (0, -1)),
}
L1_TOKENS = 100
L1_CASES = (1, 64)
L1_QUICK: dict[str, Any] = {**QWEN3_06B_SHAPES, "hidden_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                            "intermediate_size": 128, "vocab_size": 1024}  # fmt: skip


def make_scorer(model_dir: Path, path: str, device: str, budget: int) -> Any:
    """The engine on `path`: "none" (bfloat16) or a name of VARIANTS."""
    from models import Scorer, ScorerConfig

    selection = VARIANTS.get(path)
    fp8: dict[str, Any] = {}
    if selection is not None:
        fp8 = {
            "quantization": "fp8",
            "fp8_projections": selection.projections,
            "fp8_keep_layers": selection.keep_layers,
        }
    config = ScorerConfig(device=device, dtype="bfloat16", max_batch_tokens=budget, **fp8)
    return Scorer(str(model_dir), config)


def accuracy(
    model: torch.nn.Module,
    rows: Sequence[torch.Tensor],
    outputs: dict[str, PathOutput],
    count: int,
    pairs: int = 0,
) -> dict[str, Any]:
    """Every path and HF's own bf16 forward against HF float32 on `count` requests of spread lengths; each
    FP8 variant also against HF float32 holding the same FP8 projections (and HF's bf16 forward with them,
    the yardstick of its bound), and against bf16 on all requests. With `pairs`, also the share of that
    many pairs of requests (drawn at random, order_pairs) whose order by score each path keeps against the
    unquantized float32 model: how a reward user judges the rounding (bench/common.py, order_kept)."""
    picks = spread_picks([len(row) for row in rows], count)
    chosen = [rows[i] for i in picks]
    ordered = order_pairs(len(rows), pairs) if pairs else []
    order_rows = [rows[i] for i in ordered]

    def split(unquantized: PathOutput) -> tuple[PathOutput, PathOutput]:
        """The float32 outputs of `chosen`, then of the pairs' requests after them."""
        cut = len(chosen)
        return unquantized.rows(range(cut)), unquantized.rows(range(cut, len(unquantized.scores)))

    variants = [name for name in outputs if name in VARIANTS]
    with torch.inference_mode():
        hf_bf16 = hf_paths.run_reference(model, chosen)
    report: dict[str, Any] = {"fp32_subset": picks, "vs_fp32": {}, "vs_fp8_fp32": {}}
    reference: PathOutput | None = None
    order_reference: PathOutput | None = None
    for name in variants:
        selection = VARIANTS[name]
        with torch.inference_mode():
            hf_fp8 = hf_paths.run_reference(with_fp8(model, selection), chosen)
        # One float32 copy at a time (an 8B model's is 32 GB): the unquantized reference (the first time,
        # also on the pairs' requests), then the variant.
        extra = order_rows if order_reference is None else []
        unquantized, fp8_reference = float32_reference(
            model, chosen + extra, lambda float32, s=selection: with_fp8(float32, s, copy_first=False),
            variant_rows=len(chosen),
        )  # fmt: skip
        reference, extra_reference = split(unquantized)
        if order_reference is None:  # the first variant's: the pairs' requests were among its rows
            order_reference = extra_reference
        report["vs_fp8_fp32"][f"hf_{name}_bf16"] = compare(hf_fp8, fp8_reference)
        report["vs_fp8_fp32"][name] = compare(outputs[name].rows(picks), fp8_reference)
        report[f"{name}_vs_bf16"] = compare(outputs[name], outputs["none"])
    if reference is None:
        reference, order_reference = split(float32_reference(model, chosen + order_rows)[0])
    if ordered and order_reference is not None:
        report["order"] = {
            "requests": ordered,
            **{name: order_kept(values.rows(ordered).scores, order_reference.scores)
               for name, values in outputs.items()},
        }  # fmt: skip
    report["fp32_score_scale"] = float(np.max(np.abs(reference.scores)))
    report["vs_fp32"]["hf_bf16"] = compare(hf_bf16, reference)
    for name, values in outputs.items():
        report["vs_fp32"][name] = compare(values.rows(picks), reference)
    return report


def with_fp8(
    model: torch.nn.Module, selection: Fp8Selection = VARIANTS["fp8"], copy_first: bool = True
) -> torch.nn.Module:
    """`model` (or a copy) with the layers' projections `selection` picks replaced by the engine's FP8
    ones."""
    from models.fp8 import quantize_layers
    from models.layers import transformer_layers

    quantized = copy.deepcopy(model) if copy_first else model
    layers = transformer_layers(quantized.base_model)  # type: ignore[arg-type]
    if layers is None:
        raise RuntimeError("no layer list to quantize")
    quantize_layers(layers, selection)
    return quantized


def failures(case: str, checks: dict[str, Any]) -> list[str]:
    """Each path against its float32 reference, within twice HF's own bf16 error plus 5% of the score
    scale (scores) or plus 0.01 (the pooled hidden states' relative error)."""
    out = []
    variants = [name for name in checks["vs_fp8_fp32"] if name in VARIANTS]
    paths = [("none", "vs_fp32", "hf_bf16"), *((v, "vs_fp8_fp32", f"hf_{v}_bf16") for v in variants)]
    for path, table, hf_own in paths:
        got, hf = checks[table][path], checks[table][hf_own]
        bound = score_bound(hf["max_abs_score_diff"], checks["fp32_score_scale"])
        hidden_bound = 2 * hf["hidden_rel_err_max"] + 0.01
        if (
            not got["all_finite"]
            or got["max_abs_score_diff"] > bound
            or got["hidden_rel_err_max"] > hidden_bound
        ):
            out.append(
                f"{case} {path}: max |score - its float32 reference| {got['max_abs_score_diff']:.3g} "
                f"(bound {bound:.3g}), hidden relative error {got['hidden_rel_err_max']:.3g} (bound "
                f"{hidden_bound:.3g}), or non-finite"
            )
    return out


def l1_case(args: argparse.Namespace, device: str, workdir: Path) -> dict[str, Any]:
    shapes = L1_QUICK if args.quick else QWEN3_06B_SHAPES
    model = build_model("qwen3", shapes, device)  # bf16: HF's own bf16 error is the bound's yardstick
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, shapes["vocab_size"], (L1_TOKENS,), generator=gen) for _ in range(max(L1_CASES))]
    requests = packed_path.make_requests(rows)
    model_dir = workdir / "l1"
    packed_path.save_model_dir(model, model_dir)
    timings: dict[str, dict[str, float]] = {}
    outputs: dict[str, PathOutput] = {}
    profiles: dict[str, Any] = {}
    for quantization in ("none", *args.variants):
        scorer = make_scorer(model_dir, quantization, device, 16384)
        for case in L1_CASES:
            prepared = [scorer.prepare(r) for r in requests[:case]]
            timings[f"{quantization}/{case}"] = call_percentiles(
                lambda s=scorer, p=prepared: s.score_prepared(p), 2 if args.quick else 10, args.repeats
            )
            print(
                f"  L1 {quantization} {case} x {L1_TOKENS}: {timings[f'{quantization}/{case}']}", flush=True
            )
        if device == "cuda" and args.profile_top:  # where the largest case's step goes, kernel by kernel
            profiles[quantization] = kernel_breakdown(
                lambda s=scorer, p=prepared: s.score_prepared(p), top=args.profile_top
            )
            wall_s = timings[f"{quantization}/{len(prepared)}"]["p50_ms"] / 1e3
            print_breakdown(f"L1 {quantization}, {len(prepared)} requests", wall_s, profiles[quantization])
        outputs[quantization] = packed_path.results_to_arrays(scorer.score(requests), shapes["hidden_size"])
        del scorer
        gc.collect()
    checks = accuracy(model, rows, outputs, len(rows))
    return {"shapes": shapes, "timings": timings, "correctness": checks, "profiles": profiles}


def w1_case(args: argparse.Namespace, device: str, workdir: Path) -> dict[str, Any]:
    shapes = W1_QUICK_SHAPES if args.quick else W1_SHAPES
    model = build_model("llama", shapes, device)
    count = args.w1_requests or (16 if args.quick else 512)
    work = make_lognormal_workload(count, shapes["vocab_size"], max_len=512 if args.quick else 2048)
    chunks = list(token_runs(work.lengths, args.max_batch_tokens))
    requests = packed_path.make_requests(work.token_ids)
    model_dir = workdir / "w1"
    started = time.perf_counter()
    packed_path.save_model_dir(model, model_dir)
    print(f"  W1: model written in {time.perf_counter() - started:.1f} s", flush=True)
    attn_width = shapes["num_attention_heads"] * (shapes["hidden_size"] // shapes["num_attention_heads"])
    flops = flops_per_token(
        non_embedding_params(model), shapes["num_hidden_layers"], attn_width, work.lengths
    )
    runs: dict[str, dict[str, Any]] = {}
    outputs: dict[str, PathOutput] = {}
    for quantization in ("none", *args.variants):
        started = time.perf_counter()
        scorer = make_scorer(model_dir, quantization, device, args.max_batch_tokens)
        print(f"  W1 {quantization}: Scorer loaded in {time.perf_counter() - started:.1f} s", flush=True)

        def run(s: Any = scorer) -> list[Any]:
            return packed_path.run_scorer(s, requests, chunks)

        # Warm-up: a whole pass, every batch shape compiled and seen once.
        timing = measure(f"W1 {quantization}", run, run, args.repeats)
        runs[quantization] = {
            "seconds": timing["seconds"],
            "tokens_per_s": work.total_tokens / timing["best_seconds"],
            "peak_gib": timing["peak_memory_gib"],
        }
        outputs[quantization] = packed_path.results_to_arrays(timing.pop("output"), shapes["hidden_size"])
        if quantization == "none" and getattr(args, "hidden_cost", False):
            # What asking for hidden states costs: the same batches on the same Scorer, no request asking
            # (warmed by one batch: every shape is compiled and recorded already).
            bare = packed_path.make_requests(work.token_ids, hidden=False)
            timing_bare = measure(
                "W1 none, no hidden states",
                lambda s=scorer, r=bare: packed_path.run_scorer(s, r, chunks),
                lambda s=scorer, r=bare: packed_path.run_scorer(s, r, chunks[:1]),
                args.repeats,
            )
            runs[quantization]["no_hidden_seconds"] = timing_bare["seconds"]
            del timing_bare
        # `run`'s default argument holds the scorer too: left alive, one path's weights and graphs would
        # still be on the GPU while the next is measured, and the next path's peak memory would count both.
        del scorer, run, timing
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    roofline: dict[str, Any] = {"flops_per_token": flops}
    if device == "cuda":
        roofline["bf16"] = matmul_tflops()
        roofline["fp8"] = matmul_tflops(fp8=True)
        for kind in ("bf16", "fp8"):
            roofline[kind]["tokens_per_s"] = roofline[kind]["tflops_median"] * 1e12 / flops["total"]
    checks = accuracy(model, work.token_ids, outputs, args.fp32_requests, getattr(args, "order_pairs", 0))
    return {"shapes": shapes, "tokens": work.total_tokens, "batches": len(chunks), "runs": runs,
            "roofline": roofline, "correctness": checks}  # fmt: skip


def print_accuracy(case: str, checks: dict[str, Any]) -> None:
    print(f"\n{case}: against HF float32 on {len(checks['fp32_subset'])} requests "
          f"(score scale {checks['fp32_score_scale']:.3g}); fp8 against bf16 on all")  # fmt: skip
    print(f"{'path':<36}{'max|dscore|':>12}{'hidden rel err p50':>20}{'max':>10}{'min cosine':>12}")
    rows = {
        **{f"{k} vs fp32": v for k, v in checks["vs_fp32"].items()},
        **{f"{k} vs its fp32": v for k, v in checks["vs_fp8_fp32"].items()},
        **{f"{k[: -len('_vs_bf16')]} vs bf16": v for k, v in checks.items() if k.endswith("_vs_bf16")},
    }
    for name, v in rows.items():
        print(f"{name:<36}{v['max_abs_score_diff']:>12.4f}{v['hidden_rel_err_median']:>20.2e}"
              f"{v['hidden_rel_err_max']:>10.2e}{v['hidden_min_cosine']:>12.5f}")  # fmt: skip
    order = {k: v for k, v in checks.get("order", {}).items() if k != "requests"}
    if order:
        kept = ", ".join(f"{'bf16' if k == 'none' else k} {100 * v['share']:.1f}%" for k, v in order.items())
        pairs = next(iter(order.values()))["pairs"]
        print(f"pairs of requests in float32's order by score ({pairs} pairs): {kept}")


def trade_off(w1: dict[str, Any]) -> None:
    """Each FP8 variant's speed against bf16's, beside its deviation from the unquantized float32 model
    against bf16's own (the goal: within 2x of bf16's deviation)."""
    runs, vs_fp32 = w1["runs"], w1["correctness"]["vs_fp32"]
    bf16_rate, bf16_dev = runs["none"]["tokens_per_s"], vs_fp32["none"]
    order = w1["correctness"].get("order", {})
    print(f"  {'variant':<16}{'tokens/s':>10}{'x bf16':>8}{'max|dscore|':>13}{'x bf16':>8}{'min cosine':>12}"
          f"{'pairs kept':>12}")  # fmt: skip
    for name, run in runs.items():
        dev = vs_fp32[name]
        kept = f"{100 * order[name]['share']:.1f}%" if name in order else "-"
        print(f"  {'bf16' if name == 'none' else name:<16}{run['tokens_per_s']:>10,.0f}"
              f"{run['tokens_per_s'] / bf16_rate:>8.2f}{dev['max_abs_score_diff']:>13.4f}"
              f"{dev['max_abs_score_diff'] / bf16_dev['max_abs_score_diff']:>8.2f}"
              f"{dev['hidden_min_cosine']:>12.5f}{kept:>12}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    add_options(parser, "fp8", quick=False, max_batch_tokens=16384, fp32_requests=16, profile_top=0)
    parser.add_argument("--cases", default="l1,w1", help="which of l1, w1 to run")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (L1) / passes (W1)")
    parser.add_argument("--w1-requests", type=int, default=None, help="W1's requests (512; quick 16)")
    parser.add_argument(
        "--hidden-cost",
        action="store_true",
        help="W1's bf16 path timed again with no request asking for hidden states: what asking costs",
    )
    parser.add_argument(
        "--order-pairs",
        type=int,
        default=256,
        help="W1's requests in random pairs, each scored in float32 too: the share each path keeps in order",
    )
    parser.add_argument(
        "--variants",
        default="fp8",
        help=f"FP8 variants beside bf16, comma-separated, of: {', '.join(VARIANTS)}",
    )
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    device = pick_device("the FP8 benchmark (or --quick)", cpu_allowed=args.quick)
    if device is None:
        return 2
    if args.repeats is None:
        args.repeats = 2 if args.quick else 50
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    report = report_header(args)
    failed: list[str] = []
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        if "l1" in cases:
            report["l1"] = l1_case(args, device, Path(tmp))
            failed += failures("L1", report["l1"]["correctness"])
        if "w1" in cases:
            w1_repeats = args.repeats if args.quick else min(args.repeats, 2)
            report["w1"] = w1_case(
                argparse.Namespace(**{**vars(args), "repeats": w1_repeats}), device, Path(tmp)
            )
            failed += failures("W1", report["w1"]["correctness"])
    if "l1" in report:
        timings = report["l1"]["timings"]
        print(f"\nL1, model step p50 / p90 ms ({device})")
        for case in L1_CASES:
            bf16 = timings[f"none/{case}"]
            line = f"  {case:>2} x {L1_TOKENS} tokens: bf16 {bf16['p50_ms']:.2f} / {bf16['p90_ms']:.2f}"
            for name in args.variants:
                fp8 = timings[f"{name}/{case}"]
                speedup = bf16["p50_ms"] / fp8["p50_ms"]
                line += f", {name} {fp8['p50_ms']:.2f} / {fp8['p90_ms']:.2f} ({speedup:.2f}x)"
            print(line)
        print_accuracy("L1", report["l1"]["correctness"])
    if "w1" in report:
        w1 = report["w1"]
        print(f"\nW1, {w1['tokens']} tokens in {w1['batches']} batches ({device})")
        roofline = w1["roofline"]
        for name, run in w1["runs"].items():
            line = f"  {'bf16' if name == 'none' else name}: {run['tokens_per_s']:,.0f} tokens/s"
            if "bf16" in roofline:
                bf16_share = 100 * run["tokens_per_s"] / roofline["bf16"]["tokens_per_s"]
                fp8_share = 100 * run["tokens_per_s"] / roofline["fp8"]["tokens_per_s"]
                line += f", {bf16_share:.1f}% of the bf16 roofline, {fp8_share:.1f}% of the fp8 one"
            if run["peak_gib"] is not None:
                line += f"; peak {run['peak_gib']:.1f} GiB"
            print(line)
        trade_off(w1)
        if "bf16" in roofline:
            print(f"  matmul rate: bf16 {roofline['bf16']['tflops_median']:.0f} TFLOP/s, "
                  f"fp8 {roofline['fp8']['tflops_median']:.0f} TFLOP/s")  # fmt: skip
        print_accuracy("W1", w1["correctness"])
    return write_verdict(report, failed, report_path("fp8", args.json, args.quick), "FP8")


if __name__ == "__main__":
    sys.exit(main())

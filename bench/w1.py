"""W1 benchmark (8B reward model, 512 mixed-length requests): HF padded baselines vs our packed Scorer.

Run on the GPU machine from the repository root:  PYTHONPATH=. python3 bench/w1.py [--quick]
Prints a table (tokens/s, % of the matmul roofline, ratio vs HF padded-8, all measured in this process)
and correctness figures, and writes everything to $OUT/w1.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import hf_paths, packed_path
from bench.common import (
    W1_QUICK_SHAPES,
    W1_SHAPES,
    Workload,
    add_options,
    argument_parser,
    build_model,
    compare,
    float32_reference,
    flops_per_token,
    layer_gemm_ceiling,
    make_lognormal_workload,
    matmul_tflops,
    measure,
    non_embedding_params,
    pick_device,
    report_header,
    report_path,
    score_bound,
    spread_picks,
    timed,
    write_verdict,
)
from bench.hf_paths import PathOutput
from bench.profiling import kernel_breakdown, print_breakdown

HF8 = "hf_sdpa_padded8_arrival"
HF32S = "hf_sdpa_padded32_sorted"


def gemm_ceiling(shapes: dict[str, Any], tokens: int) -> dict[str, float]:
    """Tokens/s if a forward were only its projection matmuls at the packed batch size (no attention)."""
    heads = shapes["num_attention_heads"]
    gemms = layer_gemm_ceiling(
        shapes["hidden_size"],
        heads,
        shapes["num_key_value_heads"],
        shapes["hidden_size"] // heads,
        shapes["intermediate_size"],
        tokens=tokens,
    )
    gemms["tokens_per_s_gemm_only"] = tokens / (shapes["num_hidden_layers"] * gemms["ms_per_layer"] * 1e-3)
    return gemms


def hf_runs(model: torch.nn.Module, work: Workload, repeats: int) -> list[dict[str, Any]]:
    """(b) padded batches of 8 in arrival order and (c) batches of 32 sorted by length; SDPA, bf16."""
    runs = []
    for name, size, sort in ((HF8, 8, False), (HF32S, 32, True)):
        batches = hf_paths.padded_batches(work.lengths, size, sort)

        def run(batches: Sequence[Sequence[int]] = batches) -> PathOutput:
            return hf_paths.run_padded(model, work.token_ids, batches)

        def warm(batches: Sequence[Sequence[int]] = batches) -> PathOutput:
            return hf_paths.run_padded(model, work.token_ids, batches[:3])

        runs.append(measure(name, run, warm, repeats))
    return runs


def _path(scorer: Any) -> tuple[str, bool, bool]:
    """What a W1 variant can change of a Scorer's path: its attention kernel, whether its MLPs are fused,
    whether the last layer's row-wise modules run at the pooled rows only."""
    return (scorer.info.attention_kernel, scorer.info.fused_mlp, scorer.config.last_layer_pooled_rows)


def time_scorer(
    name: str,
    scorer: Any,
    requests: Sequence[Any],
    cut: Sequence[Sequence[int]],
    repeats: int,
    hidden_size: int,
    warm_batches: int = 1,
    before_pass: Callable[[], object] = lambda: None,
) -> dict[str, Any]:
    """`repeats` timed passes of `scorer` over the requests in the batches `cut` (after a warm-up on the
    first `warm_batches`), each pass (the warm-up's too) after `before_pass`; the last pass's results as
    arrays (hidden states where every request asked), with the Scorer's own stage timings. The conversion
    to arrays is outside the timed region: it is the benchmark's, not the engine's."""

    def one_pass(batches: Sequence[Sequence[int]]) -> list[Any]:
        before_pass()
        return packed_path.run_scorer(scorer, requests, batches)

    run = measure(name, lambda: one_pass(cut), lambda: one_pass(cut[:warm_batches]), repeats)
    results = run["output"]
    asked = all(r.return_pooled_hidden_states for r in requests)
    run["stage_timings"] = packed_path.stage_timings(results)
    run["output"] = packed_path.results_to_arrays(results, hidden_size, asked=asked)
    run["batches"] = len(cut)
    return run


def _with_prefix_cache(
    name: str,
    model_dir: Path,
    max_batch_tokens: int,
    cache_mib: int,
    requests: Sequence[Any],
    chunks: Sequence[Sequence[int]],
    repeats: int,
    hidden_size: int,
) -> dict[str, dict[str, Any]]:
    """W1 through a Scorer with a prefix cache of `cache_mib` MiB (kept at the second sight, the default):
    what the cache costs a stream it cannot serve. W1 repeats no prefix within a pass; the cache is emptied
    before each pass (the warm-up's too), so that no pass is a second sight of the one before. The run
    says what the cache did (`prefix_cache`): a lookup per prompt, nothing kept, nothing read."""
    scorer = packed_path.make_scorer(model_dir, max_batch_tokens, prefix_cache_mib=cache_mib)
    cache = scorer.executor.prefix_cache
    run = time_scorer(
        f"{name}_cache{cache_mib}", scorer, requests, chunks, repeats, hidden_size, before_pass=cache.clear
    )
    stats = cache.stats
    run.update(
        max_batch_tokens=max_batch_tokens,
        prefix_cache={"lookups": stats.lookups, "hits": stats.hits, "stored": stats.stored},
    )
    del scorer, cache
    gc.collect()
    torch.cuda.empty_cache()
    return {run["name"]: run}


def same_bits_in_other_company(
    scorer: Any, requests: Sequence[Any], batch: Sequence[int], hidden_size: int
) -> dict[str, Any]:
    """What the deterministic setting promises, on the timed Scorer: every other request of one batch,
    scored again in reverse order without the others (other batch-mates, other packing positions), gives
    the same bits as in the whole batch."""
    whole = packed_path.run_scorer(scorer, requests, [list(batch)])
    again = list(batch)[::2][::-1]
    apart = packed_path.run_scorer(scorer, requests, [again])
    a = packed_path.results_to_arrays([whole[i] for i in again], hidden_size)
    b = packed_path.results_to_arrays([apart[i] for i in again], hidden_size)
    same = bool(np.array_equal(a.scores, b.scores) and np.array_equal(a.hidden, b.hidden))
    return {"ok": same, "requests": len(again), "of_batch": len(batch)}


def packed_run(
    model: torch.nn.Module,
    work: Workload,
    max_batch_tokens: int,
    repeats: int,
    workdir: Path,
    deterministic: bool = False,
    eager: bool = False,
    budgets: Sequence[int] = (),
    share_min: int = 0,
    cache_mib: int = 0,
    profile_top: int = 12,
    other_kernels: Sequence[str] = (),
    other_fused_mlp: Sequence[str] = (),
    whole_last_layer: bool = False,
    tile_rows: int | None = None,
) -> dict[str, Any]:
    """(d) our Scorer: varlen packing, max_batch_tokens per batch, pooled hidden states for every request,
    its decoder layers compiled (the default on CUDA).

    With `deterministic`, the batch-invariant setting (batches packed with every product in tiles of rows,
    or every item alone where the device's check refuses tiles: result["deterministic_form"]): its cost,
    timed as the default path is (the best of `repeats` passes), no profile; `tile_rows`: its tiles' rows
    (None: the setting's default; the name says them where they are not the default's).
    With `eager`, the same path with the layers left eager: what compiling them gains, in the same run.
    `budgets`: other token budgets to time one pass each with the same Scorer (result["sweep_runs"]).
    `share_min`: also time a Scorer looking for shared prefixes of that many tokens (W1 has none).
    `cache_mib`: also time a Scorer with a prefix cache of that many MiB (W1 repeats no prefix).
    `other_kernels`: also time Scorers with these attention kernels ("flash", "triton") on the same batches.
    `other_fused_mlp`: likewise with these fused_mlp settings ("on", "off"), where they differ from the
    default's.
    `whole_last_layer`: likewise with the last layer whole: its query and output projections and its
    MLP at every row (last_layer_pooled_rows off).
    """
    from models.plan import token_runs  # here: the baselines alone (--no-scorer) need no models/
    from models.settings import EngineSettings

    name = "packed_deterministic" if deterministic else "packed_eager" if eager else "packed_varlen"
    default_rows = EngineSettings.model_fields["deterministic_tile_rows"].default
    tile_rows = default_rows if tile_rows is None else tile_rows
    if deterministic and tile_rows != default_rows:
        name = f"{name}_tiles{tile_rows}"
    model_dir = workdir / "w1-model"
    if not (model_dir / "config.json").is_file():
        (copied, save_s) = timed(lambda: packed_path.save_model_dir(model, model_dir))
        print(f"  saved model dir in {save_s:.1f} s (tokenizer files: {copied})", flush=True)
    else:
        save_s = 0.0
    compile = "off" if eager else "auto"
    largest = max([max_batch_tokens, *budgets])  # the Scorer must not cut the sweep's batches
    settings = {"deterministic": deterministic, "compile": compile, "deterministic_tile_rows": tile_rows}
    scorer, load_s = timed(lambda: packed_path.make_scorer(model_dir, largest, **settings))
    print(f"  Scorer loaded in {load_s:.1f} s", flush=True)
    requests = packed_path.make_requests(work.token_ids)
    chunks = list(token_runs(work.lengths, max_batch_tokens))
    config: Any = model.config
    hidden_size = int(config.hidden_size)

    result = time_scorer(name, scorer, requests, chunks, repeats, hidden_size)
    result.update(
        save_seconds=save_s,
        load_seconds=load_s,
        compiled=scorer.executor.compiled,
        attention_kernel=scorer.info.attention_kernel,
        fused_mlp=scorer.info.fused_mlp,
    )
    if deterministic:
        rows = scorer.executor.row_tiles
        result["deterministic_form"] = "every item alone" if rows is None else f"tiles of {rows} rows"
        result["same_bits"] = same_bits_in_other_company(scorer, requests, chunks[0], hidden_size)
        print(f"  {name}: {result['deterministic_form']}; {result['same_bits']}", flush=True)
    print(
        f"  {name}: attention kernel {scorer.info.attention_kernel}, fused MLP {scorer.info.fused_mlp}",
        flush=True,
    )
    if deterministic or eager:
        return result
    result["sweep_runs"] = {}
    # What asking for hidden states costs: the same batches, timed alike, with no request asking.
    bare_requests = packed_path.make_requests(work.token_ids, hidden=False)
    bare = time_scorer(f"{name}_no_hidden", scorer, bare_requests, chunks, repeats, hidden_size)
    bare["max_batch_tokens"] = max_batch_tokens
    result["sweep_runs"][bare["name"]] = bare
    if share_min:
        # W1 shares nothing: what looking for shared prefixes costs a batch that has none.
        sharing = packed_path.make_scorer(model_dir, largest, share_prefix_min_tokens=share_min)
        looked = time_scorer(f"{name}_share{share_min}", sharing, requests, chunks, repeats, hidden_size)
        looked["max_batch_tokens"] = max_batch_tokens
        result["sweep_runs"][looked["name"]] = looked
        del sharing
    if cache_mib:
        cached = _with_prefix_cache(
            name, model_dir, largest, cache_mib, requests, chunks, repeats, hidden_size
        )
        result["sweep_runs"].update(cached)
    variants = [(kernel, {"attention_kernel": kernel}) for kernel in other_kernels]
    variants += [(f"mlp_{choice}", {"fused_mlp": choice}) for choice in other_fused_mlp]
    variants += [("whole_last_layer", {"last_layer_pooled_rows": False})] if whole_last_layer else []
    default_path = _path(scorer)
    for label, settings in variants:
        mlp = settings.get("fused_mlp")
        wanted = (
            settings.get("attention_kernel", default_path[0]),
            default_path[1] if mlp is None else mlp == "on",
            settings.get("last_layer_pooled_rows", default_path[2]),
        )
        if wanted == default_path:
            continue  # the default's path: not worth loading the weights a second time to find that out
        other = packed_path.make_scorer(model_dir, largest, **settings)
        if _path(other) == default_path:
            del other  # the default's path after all ("on" where no MLP can be fused)
            continue
        timed_other = time_scorer(f"{name}_{label}", other, requests, chunks, repeats, hidden_size)
        timed_other.update(
            max_batch_tokens=max_batch_tokens,
            attention_kernel=other.info.attention_kernel,
            fused_mlp=other.info.fused_mlp,
        )
        result["sweep_runs"][timed_other["name"]] = timed_other
        del other
        gc.collect()
        torch.cuda.empty_cache()
    for budget in budgets:
        cut = list(token_runs(work.lengths, budget))
        run = time_scorer(f"{name}@{budget}", scorer, requests, cut, 1, hidden_size, warm_batches=2)
        run["max_batch_tokens"] = budget
        result["sweep_runs"][run["name"]] = run
    # The worker's start-up self-check on this 8B model: it must cost seconds, not minutes.
    from models.selfcheck import run_self_check

    check = run_self_check(scorer)
    result["self_check"] = dict(check.__dict__)
    print(f"  self-check: {check}", flush=True)
    # Where the time goes, on a few batches: unprofiled wall time first, then the kernels under the profiler.
    sample = chunks[: min(4, len(chunks))]
    try:
        _, wall = timed(lambda: packed_path.run_scorer(scorer, requests, sample))
        result["profile"] = kernel_breakdown(
            lambda: packed_path.run_scorer(scorer, requests, sample), top=profile_top
        )
    except Exception:  # the profile is a diagnostic: its failure must not cost the timed figures
        traceback.print_exc()
        return result
    result["profile"].update(wall_s=wall, batches=len(sample))
    print_breakdown(f"packed_varlen, {len(sample)} batches", wall, result["profile"])
    return result


def float32_subset(model: torch.nn.Module, work: Workload, count: int) -> tuple[list[int], PathOutput]:
    """HF float32 scores and hidden states, one request per forward, on `count` requests of spread lengths."""
    picks = spread_picks(work.lengths, count)
    (output,) = float32_reference(model, [work.token_ids[i] for i in picks])
    return picks, output


def correctness(runs: dict[str, dict[str, Any]], picks: list[int], ref: PathOutput) -> dict[str, Any]:
    """Each path against the float32 reference on the subset; the packed path against HF bf16 on all."""
    report: dict[str, Any] = {
        "fp32_subset": picks,
        "fp32_score_scale": float(np.max(np.abs(ref.scores))),
        "vs_fp32": {},
    }
    for name, run in runs.items():
        report["vs_fp32"][name] = compare(run["output"].rows(picks), ref)
    if "packed_varlen" in runs and HF8 in runs:
        report["packed_vs_hf8_bf16"] = compare(runs["packed_varlen"]["output"], runs[HF8]["output"])
    report["prefix_cache_untouched"] = {
        name: run["prefix_cache"]["hits"] == run["prefix_cache"]["stored"] == 0
        for name, run in runs.items()
        if "prefix_cache" in run
    }
    report["deterministic_same_bits"] = {
        name: run["same_bits"] for name, run in runs.items() if "same_bits" in run
    }
    if "packed_varlen" in runs and "packed_deterministic" in runs:
        # The batch drift the deterministic setting removes: the same requests, batched as usual vs batched
        # with it (whose bits do not follow the batch).
        report["batched_vs_deterministic"] = compare(
            runs["packed_varlen"]["output"], runs["packed_deterministic"]["output"]
        )
    return report


def verdict(checks: dict[str, Any]) -> list[str]:
    """Failures of the timed results against float32: an error beyond twice HF's own bf16 error (plus 5% of
    the score scale; 10% of it when the HF baselines were skipped), or a non-finite value; and a
    deterministic run whose bits changed with the batch; a run with a prefix cache that kept or read any
    block (W1 repeats nothing: its figure is the cost of a cache that cannot serve, or it is no such figure).
    A figure whose results are wrong is no figure."""
    errors = checks["vs_fp32"]
    hf = [v["max_abs_score_diff"] for k, v in errors.items() if k.startswith("hf_")]
    scale = checks["fp32_score_scale"]
    bound = score_bound(max(hf), scale) if hf else score_bound(0.0, scale, share=0.1)
    failures = [
        f"{name}: max |score - fp32| {v['max_abs_score_diff']:.3g} > {bound:.3g} or non-finite"
        for name, v in errors.items()
        if not v["all_finite"] or (not name.startswith("hf_") and v["max_abs_score_diff"] > bound)
    ]
    bits = checks.get("deterministic_same_bits", {})
    failures += [f"{name}: other bits in other company" for name, v in bits.items() if not v["ok"]]
    untouched = checks.get("prefix_cache_untouched", {})
    failures += [f"{name}: the prefix cache kept or served a block" for name, v in untouched.items() if not v]
    return failures


def table(runs: dict[str, dict[str, Any]], tokens: int, roofline_tps: float) -> list[dict[str, Any]]:
    """Rows of path, tokens/s, % of roofline and ratio vs HF padded-8 (same process, same inputs)."""
    base = runs[HF8]["best_seconds"] if HF8 in runs else None
    sorted32 = runs[HF32S]["best_seconds"] if HF32S in runs else None
    rows = []
    for name, run in runs.items():
        tps = tokens / run["best_seconds"]
        rows.append(
            {
                "path": name,
                "tokens_per_s": tps,
                "pct_roofline": 100.0 * tps / roofline_tps,
                "ratio_vs_hf8": (base / run["best_seconds"]) if base else None,
                "ratio_vs_hf32_sorted": (sorted32 / run["best_seconds"]) if sorted32 else None,
                "passes_s": run["seconds"],
                "peak_memory_gib": run["peak_memory_gib"],
            }
        )
    return rows


def print_summary(rows: list[dict[str, Any]], roofline: dict[str, Any], checks: dict[str, Any]) -> None:
    print(
        f"\nroofline: matmul {roofline['tflops_median']:.0f} TFLOP/s / "
        f"{roofline['flops_per_token']['total'] / 1e9:.2f} GFLOP per token = "
        f"{roofline['tokens_per_s']:.0f} tokens/s"
    )
    gemms = roofline["layer_gemms"]
    print(
        f"layer projections alone at M={gemms['tokens']:.0f}: {gemms['tflops']:.0f} TFLOP/s, "
        f"{gemms['tokens_per_s_gemm_only']:.0f} tokens/s if a forward were only those matmuls"
    )
    header = f"{'path':<28}{'tokens/s':>12}{'% roofline':>12}{'vs HF pad-8':>13}{'vs HF sorted-32':>17}"
    print(f"{header}{'peak GiB':>10}")
    for row in rows:
        ratio = f"{row['ratio_vs_hf8']:.2f}x" if row["ratio_vs_hf8"] else "-"
        ratio32 = f"{row['ratio_vs_hf32_sorted']:.2f}x" if row["ratio_vs_hf32_sorted"] else "-"
        print(
            f"{row['path']:<28}{row['tokens_per_s']:>12.0f}{row['pct_roofline']:>11.1f}%"
            f"{ratio:>13}{ratio32:>17}{row['peak_memory_gib']:>10.1f}"
        )
    by_path = {row["path"]: row for row in rows}
    if "packed_varlen" in by_path and "packed_varlen_no_hidden" in by_path:
        ratio = by_path["packed_varlen_no_hidden"]["tokens_per_s"] / by_path["packed_varlen"]["tokens_per_s"]
        print(f"hidden states for every request cost {100 * (ratio - 1):.2f}% against asking on none")
    for path, row in by_path.items():
        if path.startswith("packed_varlen_share") and "packed_varlen" in by_path:
            ratio = by_path["packed_varlen"]["tokens_per_s"] / row["tokens_per_s"]
            cost = 100 * (ratio - 1)
            print(f"looking for shared prefixes ({path}) costs {cost:.2f}% on W1 (nothing shared)")
        if path.startswith("packed_varlen_cache") and "packed_varlen" in by_path:
            cost = 100 * (by_path["packed_varlen"]["tokens_per_s"] / row["tokens_per_s"] - 1)
            print(f"a prefix cache ({path}) costs {cost:.2f}% on W1 (no prefix repeats)")
    print(
        f"\ncorrectness (float32 HF reference on {len(checks.get('fp32_subset', []))} requests, "
        f"score scale {checks.get('fp32_score_scale', float('nan')):.3f}):"
    )
    for name, c in checks.get("vs_fp32", {}).items():
        print(
            f"  {name:<26} max|dscore| {c['max_abs_score_diff']:.4f}  hidden rel err max "
            f"{c['hidden_rel_err_max']:.2e} median {c['hidden_rel_err_median']:.2e}  finite {c['all_finite']}"
        )
    labels = {
        "packed_vs_hf8_bf16": "packed vs HF pad-8 (bf16, all requests)",
        "batched_vs_deterministic": "batch drift: packed batches vs the deterministic setting (bf16, all)",
    }
    for key, label in labels.items():
        if key in checks:
            c = checks[key]
            print(
                f"  {label}: max|dscore| {c['max_abs_score_diff']:.4g}  "
                f"hidden rel err max {c['hidden_rel_err_max']:.2e} median {c['hidden_rel_err_median']:.2e}"
            )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    add_options(
        parser, "w1", quick=False, max_batch_tokens=16384, fp32_requests=16, profile_top=12,
        other_whole_last_layer=False,
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=None, help="number of requests (default 512)")
    parser.add_argument("--skip-baselines", action="store_true", help="time the packed path only")
    parser.add_argument("--no-scorer", action="store_true", help="skip the packed path (models/ not needed)")
    parser.add_argument("--no-eager", action="store_true", help="skip the packed path with eager layers")
    parser.add_argument(
        "--no-deterministic", action="store_true", help="skip the pass with the deterministic setting"
    )
    parser.add_argument(
        "--deterministic-tile-rows",
        type=lambda text: [int(part) for part in text.split(",") if part],
        default=[None],
        help="the deterministic setting's tile rows, one Scorer each (default: the setting's own)",
    )
    parser.add_argument(
        "--budgets",
        type=lambda text: [int(part) for part in text.split(",") if part],
        default=[4096, 8192, 32768, 65536],
        help="other token budgets timed (one pass each) with the compiled Scorer; '' for none",
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per path; the best is reported")
    parser.add_argument(
        "--share-prefix-min-tokens",
        type=int,
        default=32,
        help="also time the default path looking for shared prefixes this long (0: not)",
    )
    parser.add_argument(
        "--prefix-cache-mib",
        type=int,
        default=4096,
        help="also time the default path with a prefix cache this large (MiB; 0: not); W1 repeats nothing",
    )
    parser.add_argument(
        "--other-kernels",
        type=lambda text: [part for part in text.split(",") if part],
        default=["flash", "triton"],
        help="attention kernels also timed at the default budget, besides the default's ('' for none)",
    )
    parser.add_argument(
        "--other-fused-mlp",
        type=lambda text: [part for part in text.split(",") if part],
        default=["off"],
        help="fused_mlp settings also timed at the default budget where they change the path ('' for none)",
    )
    return parser.parse_args(argv)


def run_paths(args: argparse.Namespace, model: torch.nn.Module, work: Workload) -> dict[str, dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}
    if not args.skip_baselines:
        runs.update((r["name"], r) for r in hf_runs(model, work, args.repeats))
        torch.cuda.empty_cache()
    why_not = None if args.no_scorer else packed_path.scorer_available()
    if args.no_scorer or why_not:
        print(f"packed path skipped: {why_not or '--no-scorer'}", flush=True)
        return runs
    with tempfile.TemporaryDirectory(dir="/tmp") as workdir:
        try:
            if not args.no_eager:
                runs["packed_eager"] = packed_run(
                    model, work, args.max_batch_tokens, args.repeats, Path(workdir), eager=True
                )
                gc.collect()
                torch.cuda.empty_cache()
            runs["packed_varlen"] = packed_run(
                model,
                work,
                args.max_batch_tokens,
                args.repeats,
                Path(workdir),
                budgets=args.budgets,
                share_min=args.share_prefix_min_tokens,
                cache_mib=args.prefix_cache_mib,
                profile_top=args.profile_top,
                other_kernels=args.other_kernels,
                other_fused_mlp=args.other_fused_mlp,
                whole_last_layer=args.other_whole_last_layer,
            )
            runs.update(runs["packed_varlen"].pop("sweep_runs", {}))
            gc.collect()
            torch.cuda.empty_cache()
            for rows in [] if args.no_deterministic else args.deterministic_tile_rows:
                run = packed_run(
                    model, work, args.max_batch_tokens, args.repeats, Path(workdir), deterministic=True,
                    tile_rows=rows,
                )  # fmt: skip
                runs[run["name"]] = run
                gc.collect()
                torch.cuda.empty_cache()
        except Exception:  # keep the baselines' figures; the traceback says what broke in the packed path
            traceback.print_exc()
            print("packed path FAILED; reporting the baselines only", flush=True)
    gc.collect()  # the Scorer (a second copy of the weights) is gone once packed_run returns
    torch.cuda.empty_cache()
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if pick_device("W1", cpu_allowed=False) is None:
        return 2
    report = report_header(args)
    shapes = W1_QUICK_SHAPES if args.quick else W1_SHAPES
    model = build_model("llama", shapes)
    work = make_lognormal_workload(args.requests or (64 if args.quick else 512), shapes["vocab_size"])
    attn_width = shapes["num_attention_heads"] * (shapes["hidden_size"] // shapes["num_attention_heads"])
    flops = flops_per_token(
        non_embedding_params(model), shapes["num_hidden_layers"], attn_width, work.lengths
    )
    roofline: dict[str, Any] = matmul_tflops()
    roofline["flops_per_token"] = flops
    roofline["tokens_per_s"] = roofline["tflops_median"] * 1e12 / flops["total"]
    roofline["layer_gemms"] = gemm_ceiling(shapes, args.max_batch_tokens)
    print(f"model built; {len(work.lengths)} requests, {work.total_tokens} tokens; {roofline}", flush=True)
    runs = run_paths(args, model, work)
    picks, ref = float32_subset(model, work, args.fp32_requests)
    checks = correctness(runs, picks, ref)
    rows = table(runs, work.total_tokens, roofline["tokens_per_s"])
    print_summary(rows, roofline, checks)
    extras = {name: {k: v for k, v in run.items() if k != "output"} for name, run in runs.items()}
    report.update(
        workload={"requests": len(work.lengths), "tokens": work.total_tokens, "lengths": work.lengths},
        model_shapes=shapes,
        non_embedding_params=non_embedding_params(model),
        roofline=roofline,
        rows=rows,
        runs=extras,
        correctness=checks,
    )
    return write_verdict(report, verdict(checks), report_path("w1", args.json, args.quick), "W1")


if __name__ == "__main__":
    sys.exit(main())

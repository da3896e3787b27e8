"""W3 (one query, many items) and W4 (best of N) with shared prefixes computed once, against today's path
(every prompt packed whole) and against scoring only the distinct tokens, all in one process.

Run on the GPU machine from the repository root:  PYTHONPATH=. python3 bench/w3_w4.py
`--quick` runs tiny models on the CPU (a smoke test of the script, not a measurement).

- W3: W2's model (Qwen3-0.6B shapes); 64 requests of 16 items, a 512-token query and 64-token items, half
  asking for pooled hidden states. "Distinct tokens": each request's query and items as one prompt, the
  work a perfect sharing would leave.
- W4 interleaved (`w4i`): the same requests with each prompt's answers spread over the stream (every
  prompt's first answer, then every second, ...), each path scoring them in one call that the engine cuts.
- W4 interleaved over calls (`w4c`): the interleaved requests as 8 calls (each holding one answer of every
  prompt), as a sampler sends answers as they come; the shared path keeps a prefix cache
  (`--cache-mib`, emptied before each timed pass; `--cache-admit`, default first: every prompt's blocks
  kept at the first call and served to the calls after it; second: kept at the second call).
- W4: W1's model (8B Llama shapes); 256 prompts of 300-1,000 tokens with 8 responses of 50-300 tokens each,
  sent as 2,048 single-item requests, a prompt's 8 one after another, the prompts in random order.
Batches are cut as the worker cuts them: arrival order, at most `--max-batch-tokens` tokens, counted as
each path computes them (today's: every prompt whole; the shared path: a shared prefix once).
Each path is timed as the model step (`Scorer.score_prepared` on requests prepared beforehand, as the
worker's intake prepares them beside the model), as the model step with each batch launched before the one
ahead is finished (as the worker's model thread runs batches that queue), and as `Scorer.score` (preparing
on the same thread first).
The shared path's results are checked against HF float32 on a sample (twice HF's own bf16 error plus 5% of
the score scale) and against today's path on every item (5% of the score scale, or twice HF's own bf16
error where that is wider); the script exits 1 when either check fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from bench import packed_path
from bench.common import (
    W1_SHAPES,
    W2_QUICK_SHAPES,
    W2_SHAPES,
    add_options,
    argument_parser,
    check_sample,
    model_dir,
    pick_device,
    report_header,
    report_path,
    sample_entry,
    timed,
    w2_model_dir,
    write_verdict,
)
from models import BatchPlan, PreparedRequest, Scorer, ScorerConfig
from schemas import ScoreRequest, ScoreResult

VOCAB_LOW = 4  # ids 0..3 are special tokens in the tiny tokenizers
W4_SHAPES = W1_SHAPES
# W1's model at W2's tiny quick sizes (the same head width: 64 / 4 = 16).
TINY_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
W4_QUICK: dict[str, Any] = {
    **W4_SHAPES,
    **{k: W2_QUICK_SHAPES[k] for k in (*TINY_KEYS, "intermediate_size", "vocab_size")},
}


Workload = tuple[list[ScoreRequest], list[ScoreRequest]]  # the requests, and their distinct tokens


def w3_requests(
    rng: np.random.Generator, vocab: int, requests: int, items: int, query: int, item: int
) -> Workload:
    """Multi-item requests; their distinct tokens: each request's query and items as one prompt."""
    out, bare = [], []
    for i in range(requests):
        q = tuple(rng.integers(VOCAB_LOW, vocab, query).tolist())
        its = tuple(tuple(rng.integers(VOCAB_LOW, vocab, item).tolist()) for _ in range(items))
        out.append(ScoreRequest(f"w3-{i}", query=q, items=its, return_pooled_hidden_states=i % 2 == 0))
        bare.append(ScoreRequest(f"w3-{i}", items=(q + tuple(t for it in its for t in it),)))
    return out, bare


def w4_requests(
    rng: np.random.Generator,
    vocab: int,
    prompts: int,
    n: int,
    prompt_len: tuple[int, int],
    response_len: tuple[int, int],
) -> Workload:
    """A prompt's n responses as n single-item requests in a row, the prompts in random order; their
    distinct tokens: each prompt once with all its responses."""
    out, bare = [], []
    for p in rng.permutation(prompts).tolist():
        prompt = tuple(rng.integers(VOCAB_LOW, vocab, int(rng.integers(*prompt_len, endpoint=True))).tolist())
        responses = [
            tuple(rng.integers(VOCAB_LOW, vocab, int(rng.integers(*response_len, endpoint=True))).tolist())
            for _ in range(n)
        ]
        out += [
            ScoreRequest(f"w4-{p}-{r}", items=(prompt + response,), return_pooled_hidden_states=r == 0)
            for r, response in enumerate(responses)
        ]
        bare.append(ScoreRequest(f"w4-{p}", items=(prompt + tuple(t for r in responses for t in r),)))
    return out, bare


def whole_prompts(request: ScoreRequest) -> list[tuple[int, ...]]:
    """The token-id prompts of a request of token ids: query + item for each item."""
    query = tuple(cast(Sequence[int], request.query or ()))
    return [query + tuple(cast(Sequence[int], item)) for item in request.items]


def chunks(requests: Sequence[ScoreRequest], budget: int, scorer: Scorer | None = None) -> list[range]:
    """Arrival-order batches within the token budget as the worker cuts them (models.plan, the project's one
    rule): by the prompts' lengths, or by what `scorer` computes for them (a shared prefix counted once,
    requests sharing one kept together at a cut) when it is given."""
    prepared = [PreparedRequest(r, tuple(whole_prompts(r)), tokenize_s=0.0) for r in requests]
    plan = BatchPlan() if scorer is None else scorer.plan
    return list(plan.runs(prepared, budget))


def time_path(
    scorer: Scorer, requests: Sequence[ScoreRequest], cut: Sequence[range], repeats: int, step_only: bool
) -> tuple[list[ScoreResult], dict[str, float], list[float]]:
    """Best wall time of `repeats` passes after one warm-up pass, three ways: the model step
    (`score_prepared` on requests prepared beforehand, as the worker's intake prepares them beside the
    model), the batches launched ahead, and the whole call (`score`, preparing on the same thread first);
    `step_only`: the model step alone. The model step's results, the best times, and every pass's time of
    the model step (their spread is the figure's noise).
    A scorer's prefix cache is emptied before every pass: each starts as the first call of a stream."""
    cache = scorer.executor.prefix_cache

    def timed_pass(run: Any) -> tuple[Any, float]:
        if cache is not None:
            cache.clear()
        return timed(run)

    if cache is not None:
        cache.clear()
    packed_path.run_scorer(scorer, requests, cut)
    prepared = []
    for chunk in cut:
        batch = [scorer.prepare(requests[i]) for i in chunk]
        refused = [p for p in batch if isinstance(p, ScoreResult)]
        if refused:
            raise RuntimeError(f"a benchmark request was refused: {refused[0].error}")
        prepared.append(batch)

    def covered(results: list[Any]) -> list[ScoreResult]:
        if any(r is None for r in results):
            raise RuntimeError("the batches did not cover every request")
        return cast(list[ScoreResult], results)

    def step() -> list[ScoreResult]:
        per_batch = (scorer.score_prepared(batch) for batch in prepared)
        return covered(packed_path.in_request_order(len(requests), cut, per_batch))

    def overlapped() -> list[ScoreResult]:
        """As the worker's model thread runs queued batches: each launched before the one ahead is
        finished, so the host builds one batch's inputs and results while the device runs another."""
        per_batch = packed_path.launch_ahead(scorer, prepared)
        return covered(packed_path.in_request_order(len(requests), cut, per_batch))

    best = {"step_s": float("inf")} | (
        {} if step_only else {"overlapped_s": float("inf"), "whole_s": float("inf")}
    )
    results: list[ScoreResult] = []
    steps: list[float] = []
    for _ in range(repeats):
        results, elapsed = timed_pass(step)
        steps.append(elapsed)
        best["step_s"] = min(best["step_s"], elapsed)
        if step_only:
            continue
        launched_ahead, elapsed = timed_pass(overlapped)
        best["overlapped_s"] = min(best["overlapped_s"], elapsed)
        # Timed, so checked: the same batches launched ahead score as they do alone (the same kernels on
        # the same inputs; a thousandth of the score scale leaves room for nothing but a broken overlap).
        check = agree(launched_ahead, results, share=1e-3)
        if not check["ok"]:
            raise RuntimeError(f"batches launched ahead disagree with the same batches alone: {check}")
        _, elapsed = timed_pass(lambda: packed_path.run_scorer(scorer, requests, cut))
        best["whole_s"] = min(best["whole_s"], elapsed)
    return results, best, steps


def agree(
    shared: Sequence[ScoreResult], whole: Sequence[ScoreResult], share: float = 0.05, noise: float = 0.0
) -> dict[str, Any]:
    """Every item of the shared path against today's path (the same model, bf16 on both), within `share`
    of the score scale or twice `noise`, whichever is wider. `noise`: how far HF's own bf16 forward is from
    float32 on the sample; two bf16 computations of the same item that sum in other orders (the shared
    path merges two attention passes) may each be that far from float32, on either side."""
    a = np.array([row for r in shared for row in r.scores], dtype=np.float32)
    b = np.array([row for r in whole for row in r.scores], dtype=np.float32)
    scale = max(1.0, float(np.abs(b).max()))
    diff = float(np.abs(a - b).max())
    bound = max(share * scale, 2 * noise)
    ok = all(r.ok for r in shared) and bool(np.isfinite(a).all()) and diff <= bound
    return {"max_abs_score_diff": diff, "bound": bound, "ok": ok}


def sample(
    requests: Sequence[ScoreRequest], results: Sequence[ScoreResult], count: int
) -> list[dict[str, Any]]:
    picks = np.linspace(0, len(requests) - 1, count).round().astype(int).tolist()
    return [sample_entry(whole_prompts(requests[i]), results[i]) for i in sorted(set(picks))]


def interleaved(work: Workload, n: int) -> Workload:
    """W4's requests with each prompt's n answers spread over the stream: every prompt's first answer, then
    every prompt's second, and so on (answers that come back from a sampler in any order)."""
    requests, bare = work
    prompts = len(requests) // n
    return [requests[p * n + r] for r in range(n) for p in range(prompts)], bare


def _other_timings(report: dict[str, Any]) -> str:
    """The batches-overlapped and with-prepare figures of a case's line, where they were timed."""
    if "overlapped" not in report:
        return ""
    overlapped, prepare = report["overlapped"], report["with_prepare"]
    return (
        f"batches overlapped {overlapped['speedup']:.2f}x ({overlapped['shared_items_per_s']:.1f} items/s, "
        f"{100 * overlapped['share_of_distinct']:.0f}% of the distinct tokens); with prepare on the same "
        f"thread {prepare['speedup']:.2f}x ({100 * prepare['share_of_distinct']:.0f}% of the distinct "
        "tokens); "
    )


def run_case(
    name: str,
    model_dir: Path,
    work: Workload,
    args: argparse.Namespace,
    device: str,
    one_call: bool = False,
    calls: int = 0,
    kept: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`one_call`: every path's requests as one `score_prepared` call, the engine cutting the batches (and
    grouping requests that share a prompt across the call), rather than cut beforehand in arrival order
    as the worker's batcher cuts a stream. `calls`: the requests as that many calls of consecutive
    requests (each cut by the engine), the shared path with a prefix cache of `--cache-mib`.
    `kept`: what cases of one run over the same work share, filled by the first: the whole-prompt path's
    Scorer, the distinct tokens' timing (one call in every case but the batcher's cut) and HF's outputs on
    the checked items; the caller drops it after the last case."""
    requests, bare = work
    dtype = "bfloat16" if device == "cuda" else "float32"
    base = {"device": device, "dtype": dtype, "max_batch_tokens": args.max_batch_tokens}
    kept = {} if kept is None else kept
    today = kept.get("today") or Scorer(model_dir, ScorerConfig(**base))
    kept["today"] = today
    cache = {"prefix_cache_mib": args.cache_mib, "prefix_cache_admit": args.cache_admit} if calls else {}
    shared = Scorer(model_dir, ScorerConfig(**base, share_prefix_min_tokens=args.min_tokens, **cache))
    cut = [range(len(requests))] if one_call else chunks(requests, args.max_batch_tokens)
    shared_cut = [range(len(requests))] if one_call else chunks(requests, args.max_batch_tokens, shared)
    if calls:
        size = -(-len(requests) // calls)
        cut = shared_cut = [range(k, min(k + size, len(requests))) for k in range(0, len(requests), size)]
    items = sum(len(r.items) for r in requests)
    whole_tokens = sum(len(p) for r in requests for p in whole_prompts(r))
    whole_results, whole_t, whole_p = time_path(today, requests, cut, args.repeats, args.step_only)
    shared_results, shared_t, shared_p = time_path(shared, requests, shared_cut, args.repeats, args.step_only)
    distinct_tokens = sum(len(r.items[0]) for r in bare)
    bare_cut = [range(len(bare))] if one_call or calls else chunks(bare, args.max_batch_tokens)
    if one_call or calls:
        if "distinct" not in kept:
            kept["distinct"] = time_path(today, bare, bare_cut, args.repeats, args.step_only)[1:]
        distinct_t, distinct_p = kept["distinct"]
    else:
        _, distinct_t, distinct_p = time_path(today, bare, bare_cut, args.repeats, args.step_only)
    del today

    def rates(timing: str) -> dict[str, float]:
        """Items/s of the three paths and the shared path's ratios, by one of time_path's timings."""
        whole, shared_s, distinct = whole_t[timing], shared_t[timing], distinct_t[timing]
        return {
            "today_items_per_s": items / whole,
            "shared_items_per_s": items / shared_s,
            "distinct_items_per_s": items / distinct,
            "speedup": whole / shared_s,
            "share_of_distinct": distinct / shared_s,
        }

    report: dict[str, Any] = {
        "requests": len(requests),
        "items": items,
        "whole_prompt_tokens": whole_tokens,
        "distinct_tokens": distinct_tokens,
        "batches": len(cut),
        "shared_batches": len(shared_cut),
        # The model step: what bounds the worker, whose intake prepares requests beside the model.
        **rates("step_s"),
        "step_passes_s": {"today": whole_p, "shared": shared_p, "distinct": distinct_p},
        "vs_fp32": check_sample(
            model_dir, device, sample(requests, shared_results, args.sample), kept.setdefault("hf", {})
        ),
    }
    if not args.step_only:
        # The model step with batches overlapped, as the worker's model thread runs them when they queue.
        report["overlapped"] = rates("overlapped_s")
        # Scorer.score, preparing on the model's thread first (how this benchmark timed until 2026-12-01).
        report["with_prepare"] = rates("whole_s")
    noise = float(report["vs_fp32"].get("hf_bf16_max_abs_score_diff", 0.0))
    report["agreement"] = agree(shared_results, whole_results, noise=noise)
    prefix_cache = shared.executor.prefix_cache
    if prefix_cache is not None:  # the last timed pass's (the cache is emptied before each)
        stats = prefix_cache.stats
        report["prefix_cache"] = {
            "mib": args.cache_mib,
            "admit": args.cache_admit,
            "bytes": prefix_cache.bytes,
            **vars(stats),
        }
    del shared
    if device == "cuda":
        torch.cuda.empty_cache()
    print(
        f"{name}: {len(requests)} requests, {items} items, {whole_tokens} prompt tokens, "
        f"{distinct_tokens} distinct; batches {len(cut)} whole, {len(shared_cut)} shared; "
        f"items/s today {report['today_items_per_s']:.1f}, shared {report['shared_items_per_s']:.1f} "
        f"({report['speedup']:.2f}x), distinct tokens only {report['distinct_items_per_s']:.1f} "
        f"(shared reaches {100 * report['share_of_distinct']:.0f}% of it); {_other_timings(report)}"
        f"agreement {report['agreement']}, "
        f"vs float32 {'ok' if report['vs_fp32']['ok'] else 'FAILED'} "
        f"(max |dscore| {report['vs_fp32']['max_abs_score_diff']:.3g}, "
        f"bound {report['vs_fp32']['score_bound']:.3g})",
        flush=True,
    )
    return report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    add_options(parser, "w3_w4", quick=False, max_batch_tokens=16384)
    parser.add_argument(
        "--cases",
        default="w3,w4,w4i,w4c",
        help="which of w3, w4, w4i (W4 with each prompt's answers interleaved, scored in one call), w4c (the "
        "same interleaved requests as 8 calls, the shared path with a prefix cache) to run",
    )
    parser.add_argument(
        "--cache-mib", type=int, default=32768, help="prefix_cache_mib of the shared path in w4c"
    )
    parser.add_argument(
        "--cache-admit", choices=("second", "first"), default="first", help="prefix_cache_admit in w4c"
    )
    parser.add_argument(
        "--min-tokens", type=int, default=32, help="share_prefix_min_tokens of the shared path"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per path; the best is reported")
    parser.add_argument(
        "--step-only",
        action="store_true",
        help="time the model step alone (not also the batches launched ahead and the call with prepare): "
        "a third of the passes, for W4's 1.6M-token paths within one device call",
    )
    parser.add_argument("--sample", type=int, default=6, help="requests checked against HF float32 per case")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = pick_device("the shared-prefix benchmark (or --quick)", cpu_allowed=args.quick)
    if device is None:
        return 2
    rng = np.random.default_rng(0)
    report = report_header(args)
    cases = set(args.cases.split(","))
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        if "w3" in cases:
            shapes = W2_QUICK_SHAPES if args.quick else W2_SHAPES
            w3_dir = w2_model_dir(shapes, device, Path(tmp))
            sizes = (4, 4, 40, 8) if args.quick else (64, 16, 512, 64)
            report["w3"] = run_case(
                "W3", w3_dir, w3_requests(rng, shapes["vocab_size"], *sizes), args, device
            )
        if cases & {"w4", "w4i", "w4c"}:
            shapes = W4_QUICK if args.quick else W4_SHAPES
            w4_dir = model_dir("llama", shapes, device, Path(tmp) / "w4-llama")
            spec = (6, 3, (30, 60), (5, 20)) if args.quick else (256, 8, (300, 1000), (50, 300))
            w4 = w4_requests(rng, shapes["vocab_size"], *spec)
        kept: dict[str, Any] = {}  # W4's cases: one model, the same distinct tokens
        if "w4" in cases:
            report["w4"] = run_case("W4", w4_dir, w4, args, device, kept=kept)
        if "w4i" in cases:
            w4i = interleaved(w4, spec[1])
            report["w4i"] = run_case(
                "W4 interleaved, one call", w4_dir, w4i, args, device, one_call=True, kept=kept
            )
        if "w4c" in cases:
            w4c = interleaved(w4, spec[1])
            report["w4c"] = run_case(
                f"W4 interleaved, {spec[1]} calls, prefix cache", w4_dir, w4c, args, device,
                calls=spec[1], kept=kept,
            )  # fmt: skip
        kept.clear()
    failures = [
        f"{name}: {check}"
        for name in ("w3", "w4", "w4i", "w4c")
        if name in report
        for check in ("agreement", "vs_fp32")
        if not report[name][check]["ok"]
    ]
    target = report_path("w3_w4", args.json, args.quick)
    return write_verdict(report, failures, target, "the shared-prefix benchmark")


if __name__ == "__main__":
    sys.exit(main())

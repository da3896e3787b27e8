"""W5, long-context reward scoring: W1's 8B shapes, single-item requests of 8,192-32,768 tokens (log-uniform),
every fourth asking for its pooled hidden state, interleaved with W1's requests in one stream.

Run on the GPU machine from the repository root:  PYTHONPATH=. python3 bench/w5.py [--quick]
`--quick` runs tiny shapes and lengths on the CPU when there is no GPU (a smoke test, not a measurement).

The stream is run as the worker's pipeline runs a backlog (models.plan: the requests that fit cut in arrival
order, at most `--max-batch-tokens` a batch; an item longer than that a batch of its own, never cut, taking
turns with the others: `take_turns`) and scored batch by batch, each batch timed between
device synchronisations. Reported: tokens/s of the whole stream against a roofline whose FLOPs count
attention at each request's own length (the measured bf16 matmul rate over those FLOPs), the long requests'
own tokens/s, peak GPU memory (torch.cuda.max_memory_allocated), and how long each of W1's requests waited
behind long items: the seconds of the long batches scored before it. A sample (the shortest long request
asking for its hidden state, the longest, and W1's requests of spread lengths) is checked against HF float32
(a copy of the Scorer's own model on SDPA): beyond twice HF bf16's own error plus 5% of the score scale, or 2%
of the hidden states' relative error, the run fails. Writes $OUT/w5.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    W1_QUICK_SHAPES,
    W1_SHAPES,
    Workload,
    add_options,
    argument_parser,
    check_sample_with,
    flops_per_token,
    make_lognormal_workload,
    matmul_tflops,
    measure,
    model_dir,
    non_embedding_params,
    pick_device,
    report_header,
    report_path,
    sample_entry,
    spread_picks,
    write_verdict,
)

# The context a long-context reward model is scored at (Skywork-Reward-V2 recommends 16,384 tokens;
# INF-ORM-Llama3.1-70B reads 32,768): W1's model with room for the longest item.
LONG_POSITIONS = 32768
LENGTHS = (8192, 32768)
QUICK_LENGTHS = (96, 384)  # past a quick run's 64-token budget, as the full lengths are past 16,384
HIDDEN_EVERY = 4  # every fourth long request asks for its pooled hidden state


def long_workload(count: int, vocab: int, lengths: tuple[int, int], seed: int = 5) -> Workload:
    """`count` single-item requests, lengths log-uniform in `lengths`, ids uniform in [1, vocab)."""
    gen = torch.Generator().manual_seed(seed)
    low, high = (math.log(n) for n in lengths)
    logs = torch.rand(count, generator=gen, dtype=torch.float64) * (high - low) + low
    sizes = [min(lengths[1], round(math.exp(x))) for x in logs.tolist()]
    return Workload([torch.randint(1, vocab, (n,), generator=gen, dtype=torch.int64) for n in sizes])


def interleave(long: Workload, short: Workload) -> tuple[list[torch.Tensor], list[bool]]:
    """One stream: the long requests spread evenly among the short ones, in order; which entries are long."""
    step = len(short.token_ids) / max(len(long.token_ids), 1)
    before: dict[int, list[int]] = {}  # the long requests placed before each short one (or after the last)
    for k in range(len(long.token_ids)):
        before.setdefault(min(int(k * step), len(short.token_ids)), []).append(k)
    rows: list[torch.Tensor] = []
    is_long: list[bool] = []
    for index in range(len(short.token_ids) + 1):
        for k in before.get(index, []):
            rows.append(long.token_ids[k])
            is_long.append(True)
        if index < len(short.token_ids):
            rows.append(short.token_ids[index])
            is_long.append(False)
    return rows, is_long


def long_model_dir(source: Path, target: Path, positions: int = LONG_POSITIONS) -> Path:
    """`source`'s model with room for `positions` tokens: its weights linked, its config widened."""
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "config.json" and not (target / path.name).exists():
            (target / path.name).symlink_to(path.resolve())
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = max(positions, int(config.get("max_position_embeddings", 0)))
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def stream_requests(rows: Sequence[torch.Tensor], is_long: Sequence[bool]) -> list[Any]:
    """The stream as requests: W1's each asking for its pooled hidden state (as in W1), every fourth long
    one asking too."""
    from schemas import ScoreRequest

    requests, longs = [], 0
    for index, (row, long) in enumerate(zip(rows, is_long, strict=True)):
        hidden = not long or longs % HIDDEN_EVERY == 0
        longs += long
        prefix = "w5" if long else "w1"
        items = (tuple(row.tolist()),)
        requests.append(ScoreRequest(f"{prefix}-{index}", items=items, return_pooled_hidden_states=hidden))
    return requests


def waits_behind_long(
    batch_seconds: Sequence[float], batch_long: Sequence[bool], of_short: Sequence[int]
) -> dict[str, float]:
    """For each of W1's requests (the batch it is in, `of_short`), the seconds of the long batches scored
    before its own: how long it waited behind the long items. Percentiles over W1's requests."""
    before, ahead = 0.0, []
    for seconds, long in zip(batch_seconds, batch_long, strict=True):
        ahead.append(before)
        before += seconds if long else 0.0
    waits = sorted(ahead[b] for b in of_short)
    longs = [s for s, long in zip(batch_seconds, batch_long, strict=True) if long] or [0.0]
    if not waits:
        return {}
    return {
        "p50_s": statistics.median(waits),
        "p90_s": waits[int(0.9 * (len(waits) - 1))],
        "max_s": waits[-1],
        "long_batch_p50_s": statistics.median(longs),
        "long_batch_max_s": max(longs),
    }


def run_stream(
    directory: Path, device: str, rows: Sequence[torch.Tensor], is_long: Sequence[bool], budget: int,
    repeats: int, fp32_requests: int,
) -> dict[str, Any]:  # fmt: skip
    """Score the stream with a Scorer of `budget` tokens a batch (the worker's cut), timed batch by batch;
    the figures and the check of a sample against HF float32."""
    from bench.capabilities import hf_copy
    from models import PreparedRequest, Scorer, ScorerConfig
    from models.plan import take_turns

    scorer = Scorer(str(directory), ScorerConfig(device=device, max_batch_tokens=budget))
    requests = stream_requests(rows, is_long)
    prepared = [scorer.prepare(r) for r in requests]
    refused = [p for p in prepared if not isinstance(p, PreparedRequest)]
    if refused:
        raise RuntimeError(f"{len(refused)} requests refused; first: {refused[0]}")
    # As the worker's pipeline runs a backlog: the requests that fit the budget cut into batches in arrival
    # order, each item over it a batch of its own, the two taking turns (models.plan.take_turns).
    over = [i for i, p in enumerate(prepared) if p.num_tokens > budget]
    fits = [i for i, p in enumerate(prepared) if p.num_tokens <= budget]
    ordinary = [[fits[k] for k in run] for run in scorer.plan.runs([prepared[i] for i in fits], budget)]
    cut = take_turns(ordinary, [[i] for i in over])
    batch_long = [any(is_long[i] for i in run) for run in cut]
    oversized = [run for run in cut if sum(prepared[i].num_tokens for i in run) > budget]
    if any(len(run) != 1 for run in oversized):
        raise RuntimeError("an item longer than the token budget was batched with others")
    seconds_of: list[list[float]] = []

    def one_pass() -> list[Any]:
        results: list[Any] = [None] * len(requests)
        times = []
        for run in cut:
            started = time.perf_counter()
            for index, result in zip(run, scorer.score_prepared([prepared[i] for i in run]), strict=True):
                results[index] = result
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        seconds_of.append(times)
        return results

    # The warm-up scores every batch once: each new batch shape is compiled there, not in the timed passes.
    timing = measure("W5", one_pass, one_pass, repeats)
    results = timing.pop("output")
    bad = [r for r in results if r is None or not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed; first: {bad[0] and bad[0].error}")
    best = min(range(repeats), key=lambda k: sum(seconds_of[1 + k]))
    batch_seconds = seconds_of[1 + best]
    batch_of = {i: b for b, run in enumerate(cut) for i in run}
    short = [batch_of[i] for i in range(len(requests)) if not is_long[i]]
    long_s = [sum(s for s, lg in zip(passes, batch_long, strict=True) if lg) for passes in seconds_of[1:]]
    lengths = [len(r) for r in rows]
    long_tokens = sum(n for n, lg in zip(lengths, is_long, strict=True) if lg)
    picks = _sample_picks(lengths, is_long, requests, fp32_requests)
    sample = [sample_entry([tuple(rows[i].tolist())], results[i]) for i in picks]
    base = scorer.model.model
    check = check_sample_with(functools.partial(hf_copy, base), device, sample)
    waits = waits_behind_long(batch_seconds, batch_long, short)
    return {
        "requests": len(requests), "long_requests": sum(is_long), "tokens": sum(lengths),
        "long_tokens": long_tokens, "batches": len(cut), "long_batches": sum(batch_long),
        "seconds": timing["seconds"], "tokens_per_s": sum(lengths) / timing["best_seconds"],
        "long_seconds": long_s, "long_tokens_per_s": long_tokens / min(long_s),
        "peak_memory_gib": timing["peak_memory_gib"], "waits_behind_long": waits,
        "check": check, "checked_requests": picks,
    }  # fmt: skip


def _sample_picks(
    lengths: Sequence[int], is_long: Sequence[bool], requests: Sequence[Any], count: int
) -> list[int]:
    """The shortest long request asking for its hidden state and the longest long one (both past the
    budget), and W1's requests of spread lengths: `count` in all."""
    longs = [i for i, lg in enumerate(is_long) if lg]
    asking = [i for i in longs if requests[i].return_pooled_hidden_states] or longs
    picked = {min(asking, key=lambda i: lengths[i]), max(longs, key=lambda i: lengths[i])}
    shorts = [i for i, lg in enumerate(is_long) if not lg]
    spread = spread_picks([lengths[i] for i in shorts], max(count - len(picked), 1))
    return sorted(picked | {shorts[k] for k in spread})


def roofline(directory: Path, lengths: Sequence[int], device: str) -> dict[str, Any]:
    """FLOPs per token with attention at each request's own length (common.flops_per_token), and the
    tokens/s the bf16 matmul rate measured now allows at those FLOPs (CUDA only)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        shapes_only = AutoModelForSequenceClassification.from_config(config)
    width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    flops = flops_per_token(non_embedding_params(shapes_only), config.num_hidden_layers, width, lengths)
    out: dict[str, Any] = {"flops_per_token": flops}
    if device == "cuda":
        out["matmul"] = matmul_tflops()
        out["tokens_per_s"] = out["matmul"]["tflops_median"] * 1e12 / flops["total"]
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    add_options(parser, "w5", quick=False, max_batch_tokens=16384, fp32_requests=6)
    parser.add_argument("--long-requests", type=int, default=64, help="long requests (64; quick 8)")
    parser.add_argument("--short-requests", type=int, default=512, help="W1's requests among them (512)")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes; the best is reported")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, device: str, w1_dir: Path, workdir: Path) -> dict[str, Any]:
    """W5 on W1's saved model (`w1_dir`): the stream, its roofline and its check."""
    shapes = W1_QUICK_SHAPES if args.quick else W1_SHAPES
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    long = long_workload(args.long_requests, shapes["vocab_size"], lengths)
    short_max = 128 if args.quick else 2048
    short = make_lognormal_workload(args.short_requests, shapes["vocab_size"], max_len=short_max)
    rows, is_long = interleave(long, short)
    directory = long_model_dir(w1_dir, workdir / "w5-long")
    budget = args.max_batch_tokens
    report = run_stream(directory, device, rows, is_long, budget, args.repeats, args.fp32_requests)
    report["roofline"] = roofline(directory, [len(r) for r in rows], device)
    if "tokens_per_s" in report["roofline"]:
        report["pct_roofline"] = 100 * report["tokens_per_s"] / report["roofline"]["tokens_per_s"]
    report["lengths"] = {"long": long.lengths, "range": list(lengths), "max_batch_tokens": budget}
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = pick_device("W5 (or --quick)", cpu_allowed=args.quick)
    if device is None:
        return 2
    if args.quick:
        args.long_requests, args.short_requests, args.max_batch_tokens = 8, 24, 64
    report = report_header(args)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        w1_dir = model_dir("llama", W1_QUICK_SHAPES if args.quick else W1_SHAPES, device, Path(tmp) / "w1")
        report["w5"] = run(args, device, w1_dir, Path(tmp))
        shutil.rmtree(w1_dir, ignore_errors=True)
    w5 = report["w5"]
    print(
        f"W5: {w5['requests']} requests ({w5['long_requests']} long), {w5['tokens_per_s']:,.0f} tokens/s "
        f"({w5.get('pct_roofline', math.nan):.1f}% of the roofline), long ones "
        f"{w5['long_tokens_per_s']:,.0f}; peak {w5['peak_memory_gib']} GiB; W1's requests waited behind "
        f"long ones {w5['waits_behind_long']}; check {w5['check']}"
    )
    failures = [] if w5["check"]["ok"] else [f"W5 off float32: {w5['check']}"]
    return write_verdict(report, failures, report_path("w5", args.json, args.quick), "W5")


if __name__ == "__main__":
    sys.exit(main())

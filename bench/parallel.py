"""W1 across several GPUs: one model split across N GPUs (tensor parallel) against the same model on one.

The model's random weights are made in memory, each rank its own share (models.tensor_parallel's
RANDOM_WEIGHTS: every tensor from a generator seeded by its name, so every split of the model, and the
model with fewer layers, hold the same values): a 70B-shaped model needs no 140 GB checkpoint on disk.
W1's requests (mixed lengths, token ids, every one asking for its pooled hidden state) run through the
group's engine (models.parallel.start_group, as a worker runs it) and, where the model fits, through one
device; tokens/s of each in this run. Every timed path's scores and hidden states on a spread subset are
checked against the model in float32 on one device (where the whole model cannot be held in float32,
`--check-layers K` checks the first K layers' model, the same weights, split the same way): beyond twice
the one-device run's own error plus 5% of the score scale, the run fails (exit 1).

On the GPU machine, from the repository root (N GPUs visible):
  PYTHONPATH=. python3 bench/parallel.py --tensor-parallel 2 --shapes llama-8b
  PYTHONPATH=. python3 bench/parallel.py --tensor-parallel 2 --shapes llama-70b --no-single --check-layers 4
On a CPU (--quick): tiny shapes, gloo, CPU processes as the ranks, float32: a check of the script and of
the split against the unsplit model, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import (
    W1_QUICK_SHAPES,
    W1_SHAPES,
    add_options,
    argument_parser,
    classifier,
    compare,
    make_lognormal_workload,
    report_header,
    report_path,
    score_bound,
    spread_picks,
    write_verdict,
)
from bench.hf_paths import PathOutput
from bench.packed_path import make_requests

# Llama-3-70B shapes: 80 layers, hidden 8192, 64 heads, 8 key-value heads, MLP 28672.
LLAMA_70B_SHAPES: dict[str, Any] = {
    **W1_SHAPES,
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
}
TINY_SHAPES: dict[str, Any] = {**W1_QUICK_SHAPES, "num_hidden_layers": 2, "vocab_size": 4096}
SHAPES = {"tiny": TINY_SHAPES, "llama-8b": W1_SHAPES, "llama-70b": LLAMA_70B_SHAPES}


def write_random_model(
    target: Path, shapes: dict[str, Any], layers: int | None = None, seed: int = 0
) -> Path:
    """A model directory with a config and no weights: every rank makes its share in memory."""
    from models.tensor_parallel import RANDOM_WEIGHTS

    config, _ = classifier("llama", {**shapes, **({"num_hidden_layers": layers} if layers else {})})
    config.architectures = ["LlamaForSequenceClassification"]
    target.mkdir(parents=True, exist_ok=True)
    data = config.to_dict()
    data[RANDOM_WEIGHTS] = {"seed": seed, "std": 0.02}
    (target / "config.json").write_text(json.dumps(data, indent=1))
    return target


def engine_config(args: argparse.Namespace, device: str, dtype: str, tensor_parallel: int) -> Any:
    from models import ScorerConfig

    return ScorerConfig(
        device=device, dtype=dtype, tensor_parallel=tensor_parallel, max_batch_tokens=args.max_batch_tokens,
        tensor_parallel_timeout_s=600.0,  # a long first batch compiles for minutes on a large model
    )  # fmt: skip


def outputs(results: Sequence[Any]) -> PathOutput:
    scores = np.array([r.scores[0] for r in results], dtype=np.float64)
    hidden = np.stack([r.pooled_hidden_states[0].to_numpy().astype(np.float64) for r in results])
    return PathOutput(scores, hidden)


def timed(score: Any, prepared: list[Any], repeats: int) -> tuple[list[Any], float]:
    """The best of `repeats` passes (after one untimed): the results and the seconds."""
    results = score(prepared)
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        results = score(prepared)
        best = min(best, time.perf_counter() - started)
    return results, best


def single(
    model_dir: Path, args: argparse.Namespace, device: str, dtype: str, prepared: list[Any]
) -> tuple[list[Any], float]:
    """The model whole on one device (the same random weights, cut for a group of one)."""
    from models import Scorer
    from models.tensor_parallel import Shard

    scorer = Scorer(model_dir, engine_config(args, device, dtype, 1), shard=Shard(0, 1))
    try:
        return timed(scorer.score_prepared, [scorer.prepare(p) for p in prepared], args.repeats)
    finally:
        del scorer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def group(
    model_dir: Path, args: argparse.Namespace, device: str, dtype: str, prepared: list[Any]
) -> tuple[list[Any], float, dict[str, Any]]:
    """The model split across the group: results, seconds, and rank 0's memory."""
    from models.parallel import start_group
    from models.warmup import warm_up

    leader = start_group(model_dir, engine_config(args, device, dtype, args.tensor_parallel))
    try:
        if device == "cuda":
            leader.run_everywhere(warm_up)
            torch.cuda.reset_peak_memory_stats()
        results, seconds = timed(leader.score_prepared, [leader.prepare(p) for p in prepared], args.repeats)
        memory = {"rank0_peak_gib": torch.cuda.max_memory_allocated() / 2**30} if device == "cuda" else {}
        return results, seconds, memory
    finally:
        leader.close()


def reference(model_dir: Path, args: argparse.Namespace, device: str, picks: list[Any]) -> PathOutput:
    """float32, one device, the picked requests one at a time."""
    results, _ = single(
        model_dir, argparse.Namespace(**{**vars(args), "repeats": 0}), device, "float32", picks
    )
    return outputs(results)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__)
    add_options(parser, "parallel", quick=False, max_batch_tokens=16384, fp32_requests=8)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes, the best reported (2)")
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--requests", type=int, default=None, help="W1 requests (default 512; quick 24)")
    parser.add_argument("--no-single", action="store_true", help="skip the one-device run (a model too big)")
    parser.add_argument(
        "--check-layers", type=int, default=0,
        help="check the first K layers' model instead of the timed one (0: the timed one itself)",
    )  # fmt: skip
    return parser.parse_args(argv)


def verdict(checks: dict[str, dict[str, Any]], scale: float) -> tuple[list[str], float]:
    """The failures of a run's checks against float32, and the bound: the tensor-parallel scores within
    twice the one-device run's own error (0 where it did not run) plus 5% of the score scale."""
    own = checks.get("one device", {}).get("max_abs_score_diff", 0.0)
    bound = score_bound(own, scale)
    split = checks["tensor parallel"]
    if not split["all_finite"] or split["max_abs_score_diff"] > bound:
        return [
            f"tensor-parallel scores {split['max_abs_score_diff']:.3g} from float32 (bound {bound:.3g})"
        ], bound
    return [], bound


def measure(
    args: argparse.Namespace, scratch: Path, device: str, dtype: str
) -> tuple[dict[str, Any], dict[str, Any], PathOutput, int]:
    """Time the runs; the runs, the outputs checked (by path), float32's, and the tokens."""
    shapes = SHAPES[args.shapes]
    work = make_lognormal_workload(
        args.requests or 512, shapes["vocab_size"], max_len=256 if args.quick else 2048
    )
    prepared = make_requests(work.token_ids)
    picks = spread_picks(work.lengths, args.fp32_requests)
    model_dir = write_random_model(scratch / "model", shapes)
    runs: dict[str, dict[str, Any]] = {}
    if not args.no_single:
        results, seconds = single(model_dir, args, device, dtype, prepared)
        runs["one device"] = {"seconds": seconds, "results": results}
    results, seconds, memory = group(model_dir, args, device, dtype, prepared)
    runs["tensor parallel"] = {"seconds": seconds, "results": results, **memory}
    for run in runs.values():
        run["tokens_per_s"] = work.total_tokens / run["seconds"]
    checked = [prepared[i] for i in picks]
    once = argparse.Namespace(**{**vars(args), "repeats": 0})
    if args.check_layers:  # the timed model is too big for float32: its first layers, split alike
        checked_dir = write_random_model(scratch / "checked", shapes, args.check_layers)
        got = {
            "tensor parallel": outputs(group(checked_dir, once, device, dtype, checked)[0]),
            "one device": outputs(single(checked_dir, once, device, dtype, checked)[0]),
        }
    else:
        checked_dir = model_dir
        got = {name: outputs(run["results"]).rows(picks) for name, run in runs.items()}
    want = reference(checked_dir, args, device, checked)
    return runs, got, want, work.total_tokens


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.shapes, args.requests = "tiny", args.requests or 24
    cuda = torch.cuda.is_available() and not args.quick
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    if cuda and torch.cuda.device_count() < args.tensor_parallel:
        print(f"{args.tensor_parallel} GPUs asked for, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    report = report_header(args)
    with tempfile.TemporaryDirectory() as scratch:
        runs, got, want, tokens = measure(args, Path(scratch), device, dtype)
    checks = {name: compare(value, want) for name, value in got.items()}
    failures, bound = verdict(checks, float(np.abs(want.scores).max()))
    timings = {name: {k: v for k, v in run.items() if k != "results"} for name, run in runs.items()}
    report.update(
        shapes=args.shapes, tensor_parallel=args.tensor_parallel, tokens=tokens, checks=checks,
        score_bound=bound, runs=timings,
    )  # fmt: skip
    for name, run in report["runs"].items():
        print(f"{name:>16}: {run['tokens_per_s']:,.0f} tokens/s ({run['seconds']:.3f} s)")
    if "one device" in runs:
        ratio = runs["tensor parallel"]["tokens_per_s"] / runs["one device"]["tokens_per_s"]
        report["tensor_parallel_over_one_device"] = ratio
        print(f"tensor parallel {args.tensor_parallel} / one device: {ratio:.2f}x")
    for name, values in checks.items():
        print(f"{name:>16}: max |score - float32| {values['max_abs_score_diff']:.3g}, "
              f"smallest hidden-state cosine {values['hidden_min_cosine']:.6f}")  # fmt: skip
    return write_verdict(report, failures, report_path("parallel", args.json, args.quick), "parallel")


if __name__ == "__main__":
    sys.exit(main())

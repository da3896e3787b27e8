"""PNG plots for docs/benchmarks.md from the JSON that bench/w1.py and bench/w2.py write.

    python bench/plots.py --w1 w1.json --w2 w2.json --out docs/img

W1: tokens/s of the compiled packed Scorer against the token budget, with the run's matmul roofline and the
HF baselines of the same run as horizontal lines. W2: the distribution (CDF) of produce-to-result latency in
each latency phase. Needs matplotlib (`pip install matplotlib`); the benchmarks themselves do not.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def w1_budget_plot(report: dict[str, Any], target: Path) -> list[tuple[int, float]]:
    """Tokens/s against max_batch_tokens; returns the plotted (budget, tokens/s) points."""
    plt = _pyplot()
    tokens = report["workload"]["tokens"]
    main_budget = int(report["args"]["max_batch_tokens"])
    points: list[tuple[int, float]] = []
    for name, run in report["runs"].items():
        if name == "packed_varlen":
            points.append((main_budget, tokens / run["best_seconds"]))
        elif name.startswith("packed_varlen@"):
            points.append((int(name.split("@")[1]), tokens / run["best_seconds"]))
    if not points:
        raise ValueError("the W1 report has no packed_varlen runs")
    points.sort()
    figure, axes = plt.subplots(figsize=(7, 4.2))
    axes.plot([b for b, _ in points], [t / 1e3 for _, t in points], "o-", label="score-worker (compiled)")
    roofline = report["roofline"]["tokens_per_s"]
    label = f"matmul roofline ({roofline / 1e3:.1f}k)"
    axes.axhline(roofline / 1e3, color="black", linestyle="--", label=label)
    axes.axhline(0.8 * roofline / 1e3, color="grey", linestyle=":", label="80% of roofline")
    baselines = [row for row in report["rows"] if row["path"].startswith("hf_")]
    for row, color in zip(baselines, ("tab:orange", "tab:green", "tab:red", "tab:purple"), strict=False):
        axes.axhline(row["tokens_per_s"] / 1e3, color=color, linestyle="-.", label=row["path"])
    axes.set_xscale("log", base=2)
    axes.set_xticks([b for b, _ in points], [str(b) for b, _ in points])
    axes.set_xlabel("max_batch_tokens (token budget per forward)")
    axes.set_ylabel("thousand tokens/s")
    env = report["environment"]
    where = f"{env.get('gpu', 'GPU')}, {env['date_utc'][:10]}"
    axes.set_title(f"W1, 8B Llama shapes, {tokens:,} tokens ({where})")
    axes.set_ylim(bottom=0)
    axes.legend(fontsize=8, loc="lower right")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(target, dpi=120)
    plt.close(figure)
    return points


W2_PHASES = (
    ("latency", "half of saturation, fetch wait 100 ms"),
    ("latency_short_fetch", "half of saturation, fetch wait 10 ms"),
    ("one_in_flight", "one request in flight, fetch wait 10 ms"),
    ("one_in_flight_low_latency", "one in flight, fetch wait 2 ms"),
)


def w2_latency_plot(report: dict[str, Any], target: Path) -> dict[str, dict[str, float]]:
    """CDF of each latency phase's produce-to-result times; returns their p50/p99 in ms."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.2))
    summary = {}
    for phase, label in W2_PHASES:
        values = np.sort(np.asarray(report.get(phase, {}).get("latencies_ms", []), dtype=float))
        if values.size == 0:
            continue
        share = np.arange(1, values.size + 1) / values.size
        p50, p99 = np.percentile(values, [50, 99])
        summary[phase] = {"p50_ms": float(p50), "p99_ms": float(p99), "count": int(values.size)}
        axes.plot(values, share, label=f"{label}: p50 {p50:.0f} ms, p99 {p99:.0f} ms")
    if not summary:
        raise ValueError("the W2 report has no latency phase with its latencies")
    axes.set_xscale("log")
    axes.set_xlabel("produce to result consumed (ms)")
    axes.set_ylabel("share of requests")
    env = report["environment"]
    axes.set_title(f"W2 latency through the broker ({env.get('gpu', 'GPU')}, {env['date_utc'][:10]})")
    axes.legend(fontsize=8, loc="lower right")
    axes.grid(alpha=0.3, which="both")
    figure.tight_layout()
    figure.savefig(target, dpi=120)
    plt.close(figure)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--w1", type=Path, help="w1.json from bench/w1.py")
    parser.add_argument("--w2", type=Path, help="w2.json from bench/w2.py")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    if args.w1 is None and args.w2 is None:
        parser.error("give --w1, --w2 or both")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.w1 is not None:
        points = w1_budget_plot(json.loads(args.w1.read_text()), args.out / "w1-token-budget.png")
        print(f"wrote {args.out / 'w1-token-budget.png'}: {[(b, round(t)) for b, t in points]}")
    if args.w2 is not None:
        summary = w2_latency_plot(json.loads(args.w2.read_text()), args.out / "w2-latency.png")
        print(f"wrote {args.out / 'w2-latency.png'}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

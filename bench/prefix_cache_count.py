"""What the prefix cache saves on W4's interleaved answers sent as 8 calls, counted on the CPU: the tokens the
engine's packed rows compute per call, without the cache and with it (admitting blocks at their second
sight, and at their first). A count, not a speed: the model is a tiny random one that only carries the
batches (W4's token lengths: 256 prompts of 300-1,000 tokens, 8 answers of 50-300 each, every prompt's
first answer, then every second, ...); the GPU's speed is bench/w3_w4.py's `w4c`.

Every result with the cache is checked against the same request without it (float32 both; the cached keys
are the same arithmetic in another batch: within 1e-3 of the score scale, far above float32's reordering
noise over 1,300 keys, ~1.6e-4, and far below anything a wrong key or position would move); exits 1 when
one is off. Writes $OUT/prefix_cache_count.json (or --json).

Run from the repository root:  PYTHONPATH=. python3 bench/prefix_cache_count.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import add_options, argument_parser, model_dir, report_header, report_path
from bench.w3_w4 import W4_QUICK, interleaved, w4_requests
from models import Scorer, ScorerConfig, execute

CALLS = 8
PATHS: dict[str, dict[str, Any]] = {
    "no cache": {},
    "cache, second sight": {"prefix_cache_mib": 4096, "prefix_cache_admit": "second"},
    "cache, first sight": {"prefix_cache_mib": 4096, "prefix_cache_admit": "first"},
}
SHARE_OF_SCALE = 1e-3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    add_options(parser, "prefix_cache_count")
    parser.add_argument(
        "--prompts", type=int, default=256, help="W4's prompts to take, each with its 8 answers (256: all)"
    )
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    requests, bare = interleaved(
        w4_requests(rng, W4_QUICK["vocab_size"], args.prompts, CALLS, (300, 1000), (50, 300)), CALLS
    )
    size = len(requests) // CALLS
    calls = [requests[k : k + size] for k in range(0, len(requests), size)]
    report: dict[str, Any] = {
        **report_header(args),
        "prompts": args.prompts,
        "requests": len(requests),
        "calls": CALLS,
        "held_tokens": sum(len(r.items[0]) for r in requests),
        "distinct_tokens": sum(len(r.items[0]) for r in bare),
        "paths": {},
    }
    counted: list[int] = []
    real = execute.pack

    def spy(*pack_args: Any, **kwargs: Any) -> Any:
        packed = real(*pack_args, **kwargs)
        counted.append(int(packed.input_ids.shape[1]))
        return packed

    execute.pack = spy  # type: ignore[assignment]
    scores: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        directory = model_dir("llama", W4_QUICK, "cpu", Path(tmp) / "w4-llama")
        for name, cache in PATHS.items():
            config = ScorerConfig(device="cpu", max_batch_tokens=16384, share_prefix_min_tokens=32, **cache)
            scorer = Scorer(directory, config)
            counted.clear()
            started, per_call, results = time.perf_counter(), [], []
            for call in calls:
                before = sum(counted)
                results += scorer.score(call)
                per_call.append(sum(counted) - before)
            scores[name] = np.array([row for r in results for row in r.scores], dtype=np.float64)
            entry: dict[str, Any] = {"computed_tokens": sum(per_call), "per_call": per_call}
            entry["fewer_than_without"] = report["held_tokens"] / entry["computed_tokens"]
            if scorer.executor.prefix_cache is not None:
                entry["cache"] = {
                    **vars(scorer.executor.prefix_cache.stats),
                    "bytes": scorer.executor.prefix_cache.bytes,
                }
            entry["ok"] = all(r.ok for r in results)
            report["paths"][name] = entry
            fewer, held, distinct = (
                entry["fewer_than_without"],
                report["held_tokens"],
                report["distinct_tokens"],
            )
            seconds = time.perf_counter() - started
            print(f"{name}: {entry['computed_tokens']:,} tokens computed ({fewer:.2f}x fewer than the "
                  f"{held:,} held; {distinct:,} distinct); per call {per_call}; {seconds:.0f} s",
                  flush=True)  # fmt: skip
    scale = max(1.0, float(np.abs(scores["no cache"]).max()))
    failures = [name for name, entry in report["paths"].items() if not entry["ok"]]
    for name in PATHS:
        diff = float(np.abs(scores[name] - scores["no cache"]).max())
        report["paths"][name]["max_abs_score_diff_vs_no_cache"] = diff
        if diff > SHARE_OF_SCALE * scale:
            failures.append(f"{name}: scores {diff:.3g} from the path without the cache")
    report["verdict"] = "ok" if not failures else f"FAILED: {failures}"
    target = report_path("prefix_cache_count", args.json)
    target.write_text(json.dumps(report, indent=2, default=str))
    print(report["verdict"])
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

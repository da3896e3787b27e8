"""L1, small-batch latency: the model step for 1 and 64 requests of 100 tokens on Qwen3-0.6B shapes.

Run on the GPU machine from the repository root:  PYTHONPATH=. python3 bench/l1.py

Times `Scorer.score` (tokens in, results with pooled hidden states out) with eager layers, with compiled
layers, and with compiled layers replayed from CUDA graphs (the default), and HF's own bf16 forward on the
same batch, all in one process; checks every path's scores and
hidden states against a float32 HF reference and exits 1 when they are wrong. Writes $OUT/l1.json.
"""

from __future__ import annotations

import functools
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import hf_paths, packed_path
from bench.common import (
    QWEN3_06B_SHAPES,
    add_options,
    argument_parser,
    build_model,
    call_percentiles,
    compare,
    layer_gemm_ceiling,
    pick_device,
    report_header,
    report_path,
    score_bound,
    write_verdict,
)
from bench.hf_paths import PathOutput
from bench.profiling import kernel_breakdown, print_breakdown

QWEN3_06B = QWEN3_06B_SHAPES
TOKENS = 100
CASES = (1, 64)  # requests of TOKENS tokens in one batch


def hf_forward(model: torch.nn.Module, rows: Sequence[torch.Tensor]) -> PathOutput:
    """HF's own padded forward of all `rows` in one batch."""
    return hf_paths.run_padded(model, rows, [list(range(len(rows)))])


def check(name: str, got: PathOutput, ref: PathOutput, bound: float) -> dict[str, Any]:
    """`got` against float32: its scores within `bound`, every value finite."""
    errors = compare(got, ref)
    ok = errors["all_finite"] and errors["max_abs_score_diff"] <= bound
    score_err, hidden_err = errors["max_abs_score_diff"], errors["hidden_rel_err_max"]
    print(
        f"  {name:<18} max|dscore| {score_err:.4f} (bound {bound:.3f})  hidden rel err max {hidden_err:.2e}"
    )
    return {**errors, "ok": ok}


def projection_floor(tokens: int) -> dict[str, float]:
    """The model's bf16 projections alone at `tokens` rows, every layer: no step of these shapes is faster."""
    shapes = QWEN3_06B
    layer = layer_gemm_ceiling(
        shapes["hidden_size"],
        shapes["num_attention_heads"],
        shapes["num_key_value_heads"],
        shapes["head_dim"],
        shapes["intermediate_size"],
        tokens=tokens,
        repeats=30,
    )
    return {**layer, "ms_all_layers": layer["ms_per_layer"] * shapes["num_hidden_layers"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=100, help="timed calls per path and case")
    add_options(parser, profile_top=8, other_whole_last_layer=False)
    args = parser.parse_args(argv)
    if pick_device("L1", cpu_allowed=False) is None:
        return 2
    report = {**report_header(), "shapes": QWEN3_06B, "tokens": TOKENS}
    model = build_model("qwen3", QWEN3_06B)
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, QWEN3_06B["vocab_size"], (TOKENS,), generator=gen) for _ in range(max(CASES))]
    requests = packed_path.make_requests(rows)
    with tempfile.TemporaryDirectory(dir="/tmp") as workdir:
        model_dir = Path(workdir) / "m"
        packed_path.save_model_dir(model, model_dir)
        scorers = {
            "scorer_eager": packed_path.make_scorer(model_dir, 16384, compile="off", cuda_graphs="off"),
            "scorer_compiled": packed_path.make_scorer(model_dir, 16384, compile="auto", cuda_graphs="off"),
            "scorer_graphs": packed_path.make_scorer(model_dir, 16384),  # the defaults: compiled + graphs
        }
        if args.other_whole_last_layer:
            scorers["scorer_graphs_whole_last_layer"] = packed_path.make_scorer(
                model_dir, 16384, last_layer_pooled_rows=False
            )
    graphed = scorers["scorer_graphs"]
    timings: dict[str, dict[str, Any]] = {}
    outputs: dict[str, PathOutput] = {"hf_bf16": hf_forward(model, rows)}
    for case in CASES:
        timings[f"hf_bf16/{case}"] = call_percentiles(
            lambda m=model, c=case: hf_forward(m, rows[:c]), 10, args.repeats
        )
        for name, scorer in scorers.items():
            timings[f"{name}/{case}"] = call_percentiles(
                lambda s=scorer, c=case: s.score(requests[:c]), 10, args.repeats
            )
        # The model step without the request checks and prompt building that score() also does.
        prepared = [graphed.prepare(r) for r in requests[:case]]
        for name in [name for name in scorers if name.startswith("scorer_graphs")]:
            timings[f"{name}_prepared/{case}"] = call_percentiles(
                lambda s=scorers[name], p=prepared: s.score_prepared(p), 10, args.repeats
            )
    for name, scorer in scorers.items():
        outputs[name] = packed_path.results_to_arrays(scorer.score(requests), QWEN3_06B["hidden_size"])
    # Where the 64-request model step goes on the GPU (kernels replayed from the graph); `prepared` holds
    # the last, largest case.
    report["profile_64"] = kernel_breakdown(
        functools.partial(graphed.score_prepared, prepared), top=args.profile_top
    )
    print_breakdown("scorer_graphs, 64 requests", timings["scorer_graphs_prepared/64"]["p50_ms"] / 1e3,
                    report["profile_64"])  # fmt: skip
    # The floor under the 64-request step: its projections alone, timed here, on this GPU at its clocks now.
    tokens = max(CASES) * TOKENS
    floor = projection_floor(tokens)
    step_ms = timings[f"scorer_graphs_prepared/{max(CASES)}"]["p50_ms"]
    report["projection_floor_64"] = floor
    print(
        f"\n{max(CASES)} requests: the projections alone ({tokens} rows, every layer) take "
        f"{floor['ms_all_layers']:.2f} ms ({floor['tflops']:.0f} TFLOP/s); the step {step_ms:.2f} ms, "
        f"{step_ms - floor['ms_all_layers']:.2f} ms above them"
    )
    counted = graphed.executor.graphs
    graph_counts = {"recorded": counted.recorded, "replays": counted.replays}
    del scorers, graphed, model
    torch.cuda.empty_cache()
    reference = hf_forward(build_model("qwen3", QWEN3_06B, dtype=torch.float32), rows)
    hf_err = float(np.max(np.abs(outputs["hf_bf16"].scores.reshape(-1) - reference.scores.reshape(-1))))
    bound = score_bound(hf_err, float(np.max(np.abs(reference.scores))))
    print(f"\ncorrectness against float32 HF on {len(rows)} requests:")
    checks = {name: check(name, out, reference, bound) for name, out in outputs.items()}
    print(f"\n{'path / requests of 100 tokens':<32}{'p50 ms':>10}{'p90 ms':>10}")
    for key, value in timings.items():
        print(f"{key:<32}{value['p50_ms']:>10.2f}{value['p90_ms']:>10.2f}")
    report.update(timings=timings, correctness=checks, bound=bound, graphs=graph_counts)
    print(f"CUDA graphs recorded {graph_counts['recorded']}, replayed {graph_counts['replays']}")
    failed = [f"{name} is further from float32 than the bound" for name, c in checks.items() if not c["ok"]]
    return write_verdict(report, failed, report_path("l1"), "L1")


if __name__ == "__main__":
    sys.exit(main())

"""A mixture-of-experts reward model on W1's request stream: tokens/s of the packed Scorer against the
roofline of the ACTIVE parameters, HF's own padded forward (sorted batches of 32) as the baseline in the same
process, and the timed results checked against HF float32 on a sample (a figure whose results are wrong is
no figure).

The model has Qwen3-30B-A3B's shapes (hidden 2048, 32 heads of 128, 4 key-value heads, 128 experts of width
768, 8 a token, renormalised) with fewer layers (16 of 48 by default) so that its bfloat16 weights and a
float32 copy for the check fit one H100 one after the other; random weights (HF's init). A token's FLOPs:
2 x the parameters it multiplies (attention, router, its 8 experts: not the other 120) plus causal
attention, as W1 counts it.

Run on the GPU machine from the repository root:  PYTHONPATH=. python3 bench/moe.py [--quick]
(--quick: tiny shapes on the CPU or GPU, a smoke test of the script). Writes $OUT/moe.json; exits 1 when a
check of the timed results fails. `moe_benchmark(...)` is the same run for a script that imports it.
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench import hf_paths, packed_path
from bench.common import (
    add_options,
    argument_parser,
    check_sample,
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

# Qwen3-30B-A3B's shapes but its layer count (the --layers option).
MOE_SHAPES: dict[str, Any] = {
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,  # the dense MLP of mlp_only_layers (none here)
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "rms_norm_eps": 1e-6,
}
MOE_QUICK_SHAPES: dict[str, Any] = {
    **MOE_SHAPES,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 1000,
}
DEFAULT_LAYERS = 16
HF32S = "hf_sdpa_padded32_sorted"
PACKED = "packed"


def active_parameters(model: torch.nn.Module) -> int:
    """The parameters a token multiplies: every non-embedding parameter but the experts it is not routed
    to (of each sparse block's E experts, k take part)."""
    from models.moe import sparse_blocks

    config = model.config.get_text_config()  # type: ignore[operator]
    share = int(config.num_experts_per_tok) / int(config.num_experts)
    idle = 0.0
    for module in model.modules():
        for block in sparse_blocks([module]):
            experts = sum(p.numel() for p in block.experts.parameters())
            idle += experts * (1 - share)
    return non_embedding_params(model) - int(idle)


def _scorer(directory: Path, device: str, max_batch_tokens: int) -> Any:
    if device == "cuda":
        return packed_path.make_scorer(directory, max_batch_tokens)
    from models import Scorer, ScorerConfig

    return Scorer(str(directory), ScorerConfig(device="cpu", max_batch_tokens=max_batch_tokens))


def _packed_run(
    directory: Path, device: str, work: Any, max_batch_tokens: int, repeats: int, picks: list[int]
) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """The Scorer over the stream: its timing, the picked results for the float32 check, active params."""
    from models.plan import token_runs

    scorer = _scorer(directory, device, max_batch_tokens)
    active = active_parameters(scorer.hf_model)
    requests = packed_path.make_requests(work.token_ids)
    chunks = list(token_runs(work.lengths, max_batch_tokens))
    run = measure(
        PACKED,
        lambda s=scorer: packed_path.run_scorer(s, requests, chunks),
        lambda s=scorer: packed_path.run_scorer(s, requests, chunks[:1]),
        repeats,
    )
    results = run.pop("output")
    sample = [sample_entry([work.token_ids[i].tolist()], results[i]) for i in picks]
    run["batches"] = len(chunks)
    run["experts_path"] = ",".join(sorted(scorer.executor.moe_blocks.kernels()))
    run["cuda_graphs"] = scorer.info.cuda_graphs
    del scorer, results
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return run, sample, active


def _hf_run(directory: Path, device: str, work: Any, repeats: int) -> dict[str, Any]:
    """HF's own forward (its default experts implementation) on padded batches of 32 sorted by length."""
    from transformers import AutoModelForSequenceClassification

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForSequenceClassification.from_pretrained(
        directory, dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(device).eval()
    batches = hf_paths.padded_batches(work.lengths, 32, True)
    run = measure(
        HF32S,
        lambda m=model: hf_paths.run_padded(m, work.token_ids, batches),
        lambda m=model: hf_paths.run_padded(m, work.token_ids, batches[:2]),
        repeats,
    )
    run.pop("output")
    run["experts_implementation"] = model.config._experts_implementation
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return run


def moe_benchmark(
    quick: bool = False,
    layers: int = DEFAULT_LAYERS,
    requests: int = 512,
    repeats: int = 3,
    max_batch_tokens: int = 16384,
    fp32_requests: int = 8,
    baseline: bool = True,
    device: str | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The run: (report, failures). A failure is a check of the timed results that did not hold."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    shapes = {**(MOE_QUICK_SHAPES if quick else MOE_SHAPES), "num_hidden_layers": 2 if quick else layers}
    work = make_lognormal_workload(
        16 if quick else requests, shapes["vocab_size"], max_len=256 if quick else 2048
    )
    picks = spread_picks(work.lengths, min(fp32_requests, len(work.lengths)))
    report: dict[str, Any] = {"shapes": shapes, "requests": len(work.lengths), "tokens": work.total_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        directory = model_dir("qwen3_moe", shapes, device, Path(tmp) / "moe")
        packed, sample, active = _packed_run(directory, device, work, max_batch_tokens, repeats, picks)
        runs = {PACKED: packed}
        if baseline:
            runs[HF32S] = _hf_run(directory, device, work, 1 if quick else repeats)
        # HF float32 (its loop over experts, the plainest arithmetic) on the picked requests.
        check = check_sample(directory, device, sample, experts_implementation="eager")
    heads = shapes["num_attention_heads"] * shapes["head_dim"]
    flops = flops_per_token(active, shapes["num_hidden_layers"], heads, work.lengths)
    report.update(active_parameters=active, flops_per_token=flops, vs_fp32=check)
    if device == "cuda":
        rate = matmul_tflops()
        report["matmul"] = rate
        report["roofline_tokens_per_s"] = rate["tflops_median"] * 1e12 / flops["total"]
    for run in runs.values():
        run["tokens_per_s"] = work.total_tokens / run["best_seconds"]
        if "roofline_tokens_per_s" in report:
            run["roofline_share"] = run["tokens_per_s"] / report["roofline_tokens_per_s"]
    if baseline:
        packed["vs_hf_sorted32"] = packed["tokens_per_s"] / runs[HF32S]["tokens_per_s"]
    report["runs"] = runs
    failures = [] if check["ok"] else [f"packed results off HF float32: {check}"]
    return report, failures


def _print(report: dict[str, Any]) -> None:
    for name, run in report["runs"].items():
        share = run.get("roofline_share")
        roofline = "" if share is None else f", {100 * share:.1f}% of the active-parameter roofline"
        print(f"{name}: {run['tokens_per_s']:,.0f} tokens/s{roofline}")
    if "vs_hf_sorted32" in report["runs"][PACKED]:
        print(f"packed / HF sorted-32: {report['runs'][PACKED]['vs_hf_sorted32']:.2f}x")
    check = report["vs_fp32"]
    print(
        f"vs float32: max |score diff| {check['max_abs_score_diff']:.4g} (bound {check['score_bound']:.4g})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    add_options(parser, "moe", quick=False, max_batch_tokens=16384, fp32_requests=8)
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="decoder layers (of 48)")
    parser.add_argument("--requests", type=int, default=512, help="W1's stream length")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes (the best counts)")
    parser.add_argument("--no-baseline", action="store_true", help="skip HF's padded forward")
    args = parser.parse_args(argv)
    device = pick_device("the MoE benchmark", cpu_allowed=args.quick)
    if device is None:
        return 2
    header = report_header(args)
    report, failures = moe_benchmark(
        args.quick, args.layers, args.requests, args.repeats, args.max_batch_tokens, args.fp32_requests,
        baseline=not args.no_baseline, device=device,
    )  # fmt: skip
    _print(report)
    return write_verdict({**header, **report}, failures, report_path("moe", args.json, args.quick), "MoE")


if __name__ == "__main__":
    sys.exit(main())

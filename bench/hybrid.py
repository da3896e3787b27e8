"""Hybrid benchmark: a Qwen3.5-9B-like reward model (Gated DeltaNet layers, full attention every fourth
layer; random weights, bf16) on W1's request stream (512 requests, lognormal lengths) through the Scorer.

Run on the GPU machine from the repository root:  PYTHONPATH=. python3 bench/hybrid.py [--quick]
(`--kind qwen3_next`: Qwen3-Next-like shapes at 8B-class size, sparse MoE blocks.) Prints tokens/s against
a roofline (the matmul rate over 2 FLOPs per active parameter per token plus the full-attention layers'
causal attention FLOPs; the recurrence's own state products, about 1% of a layer's, are not counted),
checks a sample of results against HF float32 item by item, and writes $OUT/hybrid.json. Exits 1 when a
checked result is wrong: a figure whose results are wrong is no figure. `run()` is the same, callable.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench import packed_path
from bench.common import (
    add_options,
    argument_parser,
    check_sample,
    flops_per_token,
    make_lognormal_workload,
    matmul_tflops,
    measure,
    pick_device,
    report_header,
    report_path,
    sample_entry,
    spread_picks,
    write_verdict,
)
from bench.hf_paths import PAD_ID

_LAYOUT = ["linear_attention"] * 3 + ["full_attention"]
# Qwen3.5-9B's text model: 32 layers (8 with full attention: 16 query heads of 256, 4 KV heads, a gated
# output, a quarter of each head rotated), Gated DeltaNet with 16 key heads and 32 value heads of 128.
QWEN3_5_SHAPES: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "layer_types": _LAYOUT * 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "intermediate_size": 12288,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 248320,
    "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
}
# Qwen3-Next's layout at 8B-class size: 48 layers of 2048, 64 experts (8 a token) of 512 and a shared one.
QWEN3_NEXT_SHAPES: dict[str, Any] = {
    **QWEN3_5_SHAPES,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "layer_types": _LAYOUT * 12,
    "num_key_value_heads": 2,
    "intermediate_size": 5120,
    "vocab_size": 151936,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
_QUICK: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": _LAYOUT,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "vocab_size": 1000,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
KINDS = {"qwen3_5_text": QWEN3_5_SHAPES, "qwen3_next": QWEN3_NEXT_SHAPES}


def shapes_of(kind: str, quick: bool) -> dict[str, Any]:
    shapes = {**KINDS[kind], **(_QUICK if quick else {})}
    if kind != "qwen3_next":
        shapes = {k: v for k, v in shapes.items() if "expert" not in k and k not in ("decoder_sparse_step",)}
    return shapes


def model_dir(kind: str, shapes: dict[str, Any], device: str, target: Path) -> Path:
    """A random-weight one-label classifier of `kind` (HF's init, seed 0), saved with a tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model(
        kind, **shapes, num_labels=1, pad_token_id=PAD_ID, initializer_range=0.02, tie_word_embeddings=False
    )
    model_class = AutoModelForSequenceClassification._model_mapping[type(config)]
    return packed_path.random_model_dir(model_class, config, device, target)


def active_parameters(model: torch.nn.Module, config: Any) -> float:
    """Parameters a token's forward multiplies by (2 FLOPs each): all but the input embeddings, a routed
    expert's counted at the share of experts a token takes (num_experts_per_tok / num_experts)."""
    share = getattr(config, "num_experts_per_tok", 0) / max(getattr(config, "num_experts", 0) or 1, 1)
    total = 0.0
    for name, parameter in model.named_parameters():
        if "embed_tokens" in name:
            continue
        routed = ".experts." in name or name.endswith(".experts")
        total += parameter.numel() * (share if routed else 1.0)
    return total


def roofline(scorer: Any, lengths: Sequence[int], tflops: float) -> dict[str, Any]:
    config = scorer.hf_model.config.get_text_config()
    full_layers = sum(kind == "full_attention" for kind in config.layer_types)
    active = active_parameters(scorer.hf_model, config)
    width = config.num_attention_heads * config.head_dim
    flops = flops_per_token(int(active), full_layers, width, lengths)
    return {
        "active_parameters": active,
        "full_attention_layers": full_layers,
        "flops_per_token": flops,
        "matmul_tflops": tflops,
        "tokens_per_s": tflops * 1e12 / flops["total"],
    }


def _timed(
    scorer: Any, token_ids: Sequence[torch.Tensor], chunks: Sequence[Sequence[int]], repeats: int
) -> tuple[list[Any], dict[str, Any]]:
    """The requests through `scorer` in `chunks`, timed (common.measure): the last pass's results and the
    timings."""
    scored = packed_path.make_requests(token_ids)
    timed = measure(
        "packed",
        lambda: packed_path.run_scorer(scorer, scored, chunks),
        lambda: packed_path.run_scorer(scorer, scored, chunks[:1]),
        repeats,
    )
    return timed.pop("output"), timed


def run(
    kind: str = "qwen3_5_text",
    quick: bool = False,
    max_batch_tokens: int = 16384,
    requests: int = 512,
    sample: int = 12,
    repeats: int = 2,
) -> tuple[dict[str, Any], list[str]]:
    """The benchmark: its report and the failures of its checks (empty: the figures stand)."""
    from models import Scorer, ScorerConfig
    from models.linear_attention import hf_torch_functions
    from models.plan import token_runs

    device = pick_device("the hybrid benchmark", cpu_allowed=quick) or "cuda"
    shapes = shapes_of(kind, quick)
    report: dict[str, Any] = {"kind": kind, "shapes": shapes, "device": device}
    count, longest = (12, 300) if quick else (requests, 2048)
    work = make_lognormal_workload(count, shapes["vocab_size"], max_len=longest)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        directory = model_dir(kind, shapes, device, Path(tmp) / kind)
        print(f"  {kind}: model written in {time.perf_counter() - started:.1f} s", flush=True)
        dtype = "bfloat16" if device == "cuda" else "float32"
        config = ScorerConfig(device=device, dtype=dtype, max_batch_tokens=max_batch_tokens)
        started = time.perf_counter()
        scorer = Scorer(str(directory), config)
        print(f"  {kind}: Scorer loaded in {time.perf_counter() - started:.1f} s", flush=True)
        linear = scorer.executor.linear_layers
        report["linear_kernel"] = None if linear is None else linear.kernel
        report["attention"] = scorer.attention
        results, timed = _timed(
            scorer, work.token_ids, list(token_runs(work.lengths, max_batch_tokens)), repeats
        )
        tokens = work.total_tokens
        report["tokens"] = tokens
        report["timing"] = timed
        report["tokens_per_s"] = tokens / timed["best_seconds"]
        if device == "cuda":
            report["roofline"] = roofline(scorer, work.lengths, matmul_tflops()["tflops_median"])
            report["pct_roofline"] = 100.0 * report["tokens_per_s"] / report["roofline"]["tokens_per_s"]
        picks = spread_picks(work.lengths, sample)
        entries = [sample_entry([work.token_ids[i].tolist()], results[i]) for i in picks]
        del scorer
        if device == "cuda":
            torch.cuda.empty_cache()
        # HF's forward on its own torch functions (as the tests' reference): float32 arithmetic throughout,
        # where flash-linear-attention's kernels, which HF's decorators put in their place, may round
        # float32 products to TF32, and autotune afresh for every new length (on an H100 that took 64 s for
        # four requests in float32 and 33 s more in bf16, against seconds for the torch functions).
        with hf_torch_functions():
            report["vs_float32"] = check_sample(directory, device, entries)
    failures = [] if report["vs_float32"]["ok"] else [f"results against float32: {report['vs_float32']}"]
    failures += [] if all(r.ok for r in results) else ["a request was not scored"]
    print(
        f"{kind}: {report['tokens_per_s']:.0f} tokens/s"
        + (f", {report['pct_roofline']:.1f}% of the roofline" if "pct_roofline" in report else "")
        + f"; Gated DeltaNet on {report['linear_kernel']}; float32 check {report['vs_float32']['ok']}",
        flush=True,
    )
    return report, failures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--kind", choices=tuple(KINDS), default="qwen3_5_text")
    add_options(parser, report="hybrid", quick=False, max_batch_tokens=16384, reference_sample=12)
    args = parser.parse_args(argv)
    header = report_header(args)
    report, failures = run(
        args.kind,
        args.quick,
        args.max_batch_tokens,
        sample=args.reference_sample,
        repeats=1 if args.quick else 2,
    )
    report = {**header, **report}
    target = report_path("hybrid", args.json, args.quick)
    return write_verdict(report, failures, target, "hybrid benchmark")


if __name__ == "__main__":
    sys.exit(main())

"""Process rewards and LoRA adapters at W1's shapes (8B reward model, W1's lognormal request lengths): what
they cost against plain scoring, in one process.

- PRM: every item carries 8 step separators; the same requests scored with token_outputs "steps" (the head
  at every separator, per item) against plain LAST pooling. Goal: >= 0.95x plain's tokens/s.
- Adapters: N LoRA adapters of rank 16 on all seven projections of every layer (random factors, PEFT's
  layout on disk), the requests spread over them round-robin in one stream, against the same requests on the
  base model in the same Scorer. Goal: >= 0.85x the base model's tokens/s.

Every timed result set is checked on a subset against HF float32 (the adapters merged into a float32 copy of
the weights, W + s B A); the bound is twice HF bf16's own error on the same items plus 5% of the score scale.
Exit status 1 when a check fails.

Run on the GPU machine from the repository root:  PYTHONPATH=. python3 bench/capabilities.py [--quick]
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from bench.common import (
    W1_QUICK_SHAPES,
    W1_SHAPES,
    add_options,
    argument_parser,
    make_lognormal_workload,
    model_dir,
    pick_device,
    report_header,
    report_path,
    score_bound,
    spread_picks,
    write_verdict,
)
from models import Scorer, ScorerConfig
from schemas import ScoreRequest, TokenOutputs

SEPARATOR = 13  # the step separator's token id (any id of the vocabulary; steps are where it is)
STEPS = 8
RANK = 16
LORA_B_STD = 0.08  # see write_adapters: large enough for the float32 check to see the adapter
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def with_steps(ids: torch.Tensor) -> tuple[int, ...]:
    """The item with STEPS separators in place of tokens, evenly spaced, the last at its end."""
    out = ids.clone()
    out[out == SEPARATOR] = SEPARATOR + 1
    for k in range(1, STEPS + 1):
        out[max(0, len(out) * k // STEPS - 1)] = SEPARATOR
    return tuple(int(t) for t in out)


def shapes_only(directory: Path) -> torch.nn.Module:
    """The saved model's modules on the meta device: their names and sizes, no weights."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(directory))


def write_adapters(model: torch.nn.Module, count: int, root: Path) -> dict[str, Path]:
    """`count` PEFT LoRA directories of rank RANK on every projection, random factors (A ~ N(0, 1/in), B ~
    N(0, LORA_B_STD^2)).

    The factors' values do not change what the adapters cost (the same products run whatever they hold), but
    they decide whether the float32 check can tell an applied adapter from a skipped one: at B ~ N(0, 0.02^2)
    (a trained adapter's size) an 8B random model's scores moved by 0.58 on a 0.69 bf16 bound (H100,
    2026-12-07), so the check could not see the adapter. At LORA_B_STD each projection's delta is about a
    quarter of the random base weight's output (B A x has sqrt(RANK) * LORA_B_STD = 0.32 per unit input
    against the base's 0.02 * sqrt(4096) = 1.28), which moves the scores well past the bound."""
    adapters = {}
    generator = torch.Generator().manual_seed(11)
    layers = [
        (name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS
    ]
    for index in range(count):
        tensors = {}
        for name, module in layers:
            a = torch.randn(RANK, module.in_features, generator=generator) / module.in_features**0.5
            b = torch.randn(module.out_features, RANK, generator=generator) * LORA_B_STD
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.to(torch.bfloat16)
        target = root / f"adapter-{index}"
        target.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(target / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": RANK, "lora_alpha": RANK, "target_modules": list(PROJECTIONS)}
        (target / "adapter_config.json").write_text(json.dumps(config))
        adapters[f"a{index}"] = target
    return adapters


def time_score(
    scorer: Scorer, requests: Sequence[ScoreRequest], repeats: int
) -> tuple[float, list[Any], list[float]]:
    """Best seconds of `repeats` calls scoring `requests` after one untimed call (the batch shapes compiled
    there, not in a timed call), the last call's results, and every timed call's seconds (their spread is
    the figure's noise)."""
    seconds: list[float] = []
    results: list[Any] = scorer.score(requests)
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        results = scorer.score(requests)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return min(seconds), results, seconds


@torch.inference_mode()
def reference_outputs(
    model: Any, prompts: Sequence[tuple[int, ...]], positions: Sequence[Sequence[int]]
) -> np.ndarray:
    """The model's head at `positions` of each prompt (each alone, no padding), stacked [sum P, L]."""
    rows = []
    for prompt, at in zip(prompts, positions, strict=True):
        device = next(model.parameters()).device
        hidden = model.model(input_ids=torch.tensor([prompt], device=device)).last_hidden_state[0]
        rows.append(model.score(hidden[list(at)]).float().cpu().numpy())
    return np.concatenate(rows)


def merged(model: Any, adapter: Path) -> Any:
    """`model` with the adapter's deltas added to its weights (W + B A, lora_alpha / r = 1), in place."""
    from safetensors.torch import load_file

    weights = load_file(str(adapter / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in weights.items():
            if ".lora_A." not in key:
                continue
            name = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            module: Any = model.get_submodule(name)
            b = weights[key.replace(".lora_A.", ".lora_B.")]
            module.weight += (b.float() @ a.float()).to(module.weight.device, module.weight.dtype)
    return model


def hf_copy(base_model: Any, dtype: torch.dtype, adapter: Path | None = None) -> Any:
    """A copy of a Scorer's HF model (never changed by a Scorer: adapters swap forwards around a batch
    only) in `dtype`, on HF's own SDPA attention rather than the packed path's, with `adapter` merged."""
    model: Any = copy.deepcopy(base_model)
    model = model.to(dtype)
    model.set_attn_implementation("sdpa")
    return merged(model, adapter) if adapter is not None else model


def check(
    values: np.ndarray,
    make_model: Callable[[torch.dtype], Any],
    prompts: Sequence[tuple[int, ...]],
    positions: Sequence[Sequence[int]],
) -> dict[str, Any]:
    """`values` [sum P, L] against HF float32 of the model make_model gives, within HF bf16's own error."""
    outputs = []
    for dtype in (torch.float32, torch.bfloat16):  # one copy at a time: an 8B float32 copy is 32 GB
        model = make_model(dtype)
        outputs.append(reference_outputs(model, prompts, positions))
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    reference, half = outputs
    hf_err = float(np.abs(half - reference).max())
    err = float(np.abs(values - reference).max())
    bound = score_bound(hf_err, float(np.abs(reference).max()))
    ok = bool(np.isfinite(values).all() and err <= bound)
    return {"max_abs_diff": err, "hf_bf16_max_abs_diff": hf_err, "bound": bound, "ok": ok}


def prm_case(
    scorer: Scorer, prompts: Sequence[tuple[int, ...]], picks: Sequence[int], repeats: int
) -> dict[str, Any]:
    """PRM steps against plain LAST pooling on one Scorer, the step scores of `picks` checked against HF
    float32 (a copy of the Scorer's model)."""
    tokens = sum(len(p) for p in prompts)
    plain = [ScoreRequest(f"p{i}", items=(p,)) for i, p in enumerate(prompts)]
    steps = [
        ScoreRequest(f"s{i}", items=(p,), token_outputs=TokenOutputs.STEPS, step_separator=SEPARATOR)
        for i, p in enumerate(prompts)
    ]
    plain_s, _, plain_all = time_score(scorer, plain, repeats)
    steps_s, step_results, steps_all = time_score(scorer, steps, repeats)
    if not all(len(r.token_positions[0]) == STEPS for r in step_results):
        raise RuntimeError(f"an item did not get its {STEPS} step scores")
    positions = [step_results[i].token_positions[0] for i in picks]
    values = np.concatenate([step_results[i].token_scores[0].to_numpy() for i in picks])
    make = functools.partial(hf_copy, scorer.model.model)
    prm_check = check(values, make, [prompts[i] for i in picks], positions)
    print(f"PRM: plain {tokens / plain_s:,.0f} tok/s, 8 steps {tokens / steps_s:,.0f} tok/s "
          f"({plain_s / steps_s:.3f}x); check {prm_check}", flush=True)  # fmt: skip
    return {
        "tokens": tokens, "plain_tok_s": tokens / plain_s, "steps_tok_s": tokens / steps_s,
        "ratio": plain_s / steps_s, "check": prm_check, "plain_seconds": plain_all,
        "steps_seconds": steps_all,
    }  # fmt: skip


def adapters_case(
    directory: Path, config: dict[str, Any], prompts: Sequence[tuple[int, ...]], picks: Sequence[int],
    count: int, repeats: int, root: Path,
) -> dict[str, Any]:  # fmt: skip
    """`count` mixed adapters against the base model in one Scorer (ScorerConfig(**config)), the scores of
    the first adapter's requests among `picks` checked against HF float32 with that adapter merged; the
    check also fails when the adapter moved the scores by no more than its bound."""
    tokens = sum(len(p) for p in prompts)
    # A worker process holds one Scorer: the compiled layers' graphs of the Scorers before count against
    # the same recompile limit (its layers' code object is shared) and would not be there.
    adapters = write_adapters(shapes_only(directory), count, root / f"adapters-{count}")
    setting = ",".join(f"{name}={path}" for name, path in adapters.items())
    started = time.perf_counter()
    torch._dynamo.reset()
    scorer = Scorer(directory, ScorerConfig(adapters=setting, **config))
    print(f"  {count} adapters: written and loaded with the model in {time.perf_counter() - started:.1f} s",
          flush=True)  # fmt: skip
    names = list(adapters)
    plain = [ScoreRequest(f"p{i}", items=(p,)) for i, p in enumerate(prompts)]
    mixed = [ScoreRequest(f"m{i}", items=(p,), adapter=names[i % count]) for i, p in enumerate(prompts)]
    started = time.perf_counter()
    base_s, base_results, base_all = time_score(scorer, plain, repeats)
    print(f"  {count} adapters: the base model's calls in {time.perf_counter() - started:.1f} s", flush=True)
    started = time.perf_counter()
    mixed_s, mixed_results, mixed_all = time_score(scorer, mixed, repeats)
    print(f"  {count} adapters: the mixed calls in {time.perf_counter() - started:.1f} s", flush=True)
    started = time.perf_counter()
    # Requests of the first adapter among the float32 picks (the stream's first one at least).
    same = [i for i in picks if i % count == 0] or [0]
    values = np.array([mixed_results[i].scores[0] for i in same], dtype=np.float32)
    make = functools.partial(hf_copy, scorer.model.model, adapter=adapters[names[0]])
    lasts = [(len(prompts[i]) - 1,) for i in same]  # LAST pooling: no pad id in the items
    adapter_check = check(values, make, [prompts[i] for i in same], lasts)
    # The check means something only where the adapter moved the scores by more than its bound.
    effect = max(abs(mixed_results[i].scores[0][0] - base_results[i].scores[0][0]) for i in same)
    adapter_check["adapter_effect"] = effect
    adapter_check["ok"] = adapter_check["ok"] and effect > adapter_check["bound"]
    print(f"  {count} adapters: checked against float32 in {time.perf_counter() - started:.1f} s", flush=True)
    print(f"{count} adapters: base {tokens / base_s:,.0f} tok/s, mixed {tokens / mixed_s:,.0f} tok/s "
          f"({base_s / mixed_s:.3f}x); check {adapter_check}", flush=True)  # fmt: skip
    del scorer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "base_tok_s": tokens / base_s, "mixed_tok_s": tokens / mixed_s, "ratio": base_s / mixed_s,
        "check": adapter_check, "base_seconds": base_all, "mixed_seconds": mixed_all,
    }  # fmt: skip


def stepped_prompts(shapes: dict[str, Any], requests: int, quick: bool) -> list[tuple[int, ...]]:
    """W1's lognormal request lengths (256 tokens at most in a quick run), each with its steps."""
    work = make_lognormal_workload(requests, shapes["vocab_size"], max_len=256 if quick else 2048)
    return [with_steps(ids) for ids in work.token_ids]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    add_options(parser, "capabilities", quick=False, max_batch_tokens=16384, fp32_requests=8)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adapter-counts", default="4,16")
    parser.add_argument("--no-prm", action="store_true", help="only the adapters' part")
    args = parser.parse_args(argv)
    device = pick_device("bench/capabilities.py", cpu_allowed=args.quick)
    if device is None:
        return 2
    shapes = W1_QUICK_SHAPES if args.quick else W1_SHAPES
    report = report_header(args)
    failures: list[str] = []
    prompts = stepped_prompts(shapes, 16 if args.quick else args.requests, args.quick)
    picks = spread_picks([len(p) for p in prompts], args.fp32_requests)
    target = report_path("capabilities", args.json, args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        directory = model_dir("llama", shapes, device, Path(tmp) / "w1")
        config = {"device": device, "max_batch_tokens": args.max_batch_tokens}
        if not args.no_prm:
            scorer = Scorer(directory, ScorerConfig(**config))
            report["prm"] = prm_case(scorer, prompts, picks, args.repeats)
            if not report["prm"]["check"]["ok"]:
                failures.append(f"PRM step scores off float32: {report['prm']['check']}")
            target.write_text(
                json.dumps(report, indent=2, default=str)
            )  # what is done, if a later part fails
            del scorer
            gc.collect()
        for count in (int(c) for c in args.adapter_counts.split(",")):
            case = adapters_case(directory, config, prompts, picks, count, args.repeats, Path(tmp))
            report[f"adapters_{count}"] = case
            if not case["check"]["ok"]:
                failures.append(
                    f"{count} adapters: scores off float32 with the adapter merged: {case['check']}"
                )
            target.write_text(json.dumps(report, indent=2, default=str))
    return write_verdict(report, failures, target, "capabilities")


if __name__ == "__main__":
    sys.exit(main())

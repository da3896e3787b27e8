"""The benchmarks' shared harness: the workloads' models and requests, command-line options, the environment,
CUDA timing, the checks of timed results against float32, and the report with its verdict."""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import hf_paths, packed_path
from bench.hf_paths import PathOutput

# Qwen3-0.6B shapes (the reference's W2 and W3, and L1, the small-batch latency case); random weights from
# the HF initialiser (normal, std 0.02).
QWEN3_06B_SHAPES: dict[str, Any] = {
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}
W2_SHAPES = QWEN3_06B_SHAPES
# W2's model at tiny sizes, for --quick runs (W3's too).
W2_QUICK_SHAPES: dict[str, Any] = {
    **W2_SHAPES,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 1000,
}
# W2's model as saved for the worker: the Qwen3 settings beside the shapes.
W2_SETTINGS: dict[str, Any] = {
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "rms_norm_eps": 1e-6,
}
# Llama-3-8B shapes (the reference's W1, and W4's model); random weights with the HF default init (normal,
# std 0.02).
W1_SHAPES: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}
W1_QUICK_SHAPES: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1536,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}


def classifier(kind: str, shapes: dict[str, Any], **settings: Any) -> tuple[Any, Any]:
    """The config and class of a workload's one-label classifier: "llama" (W1's settings: rope theta
    500,000, norm epsilon 1e-5), "qwen3" or "qwen3_moe" (their defaults, or `settings`; the shapes of a
    mixture of experts carry its routing), padding id hf_paths.PAD_ID."""
    from transformers import (
        LlamaConfig,
        LlamaForSequenceClassification,
        Qwen3Config,
        Qwen3ForSequenceClassification,
        Qwen3MoeConfig,
        Qwen3MoeForSequenceClassification,
    )

    common = {"num_labels": 1, "pad_token_id": hf_paths.PAD_ID, "initializer_range": 0.02}
    if kind == "llama":
        rope = {"rope_type": "default", "rope_theta": 500000.0}
        llama = {"rope_parameters": rope, "rms_norm_eps": 1e-5, **settings}
        return LlamaConfig(**shapes, **common, **llama), LlamaForSequenceClassification
    if kind == "qwen3":
        return Qwen3Config(**shapes, **common, **settings), Qwen3ForSequenceClassification
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(**shapes, **common, **settings), Qwen3MoeForSequenceClassification
    raise ValueError(f"no benchmark model of kind {kind!r}")


def build_model(
    kind: str, shapes: dict[str, Any], device: str = "cuda", dtype: torch.dtype = torch.bfloat16
) -> torch.nn.Module:
    """A random-weight classifier (seed 0, HF's init) built straight on `device` in `dtype` (no 32 GB
    float32 detour for 8B shapes), with SDPA attention: the benchmarks' HF baseline."""
    config, model_class = classifier(kind, shapes)
    torch.manual_seed(0)
    with torch.device(device):
        model: torch.nn.Module = model_class._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def model_dir(kind: str, shapes: dict[str, Any], device: str, target: Path, **settings: Any) -> Path:
    """classifier(kind, shapes, **settings) with random weights (packed_path.random_model_dir), saved with
    a tokenizer at `target`: what a Scorer loads."""
    config, model_class = classifier(kind, shapes, **settings)
    return packed_path.random_model_dir(model_class, config, device, target)


def w2_model_dir(shapes: dict[str, Any], device: str, workdir: Path) -> Path:
    """W2's Qwen3 classifier (W3's too) of `shapes` with random weights, saved with a tokenizer."""
    return model_dir("qwen3", shapes, device, workdir / "w2-qwen3-0.6b-shapes", **W2_SETTINGS)


@dataclass(frozen=True)
class Workload:
    """Token-id requests (one item each) in arrival order."""

    token_ids: list[torch.Tensor]  # each [L] int64 on the CPU

    @property
    def lengths(self) -> list[int]:
        return [int(t.numel()) for t in self.token_ids]

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)


def make_lognormal_workload(
    num_requests: int,
    vocab_size: int,
    *,
    seed: int = 1,
    median: float = 500.0,
    sigma: float = 0.7,
    min_len: int = 32,
    max_len: int = 2048,
) -> Workload:
    """W1's request stream: lengths exp(N(0,1)*sigma + ln median) clipped and truncated, then uniform ids."""
    gen = torch.Generator().manual_seed(seed)
    # Lengths first, then ids, from the one generator: the reference's order, so the stream is reproducible.
    raw = torch.exp(torch.randn(num_requests, generator=gen) * sigma + math.log(median))
    lengths = raw.clamp(min_len, max_len).long().tolist()
    ids = [torch.randint(1, vocab_size, (length,), generator=gen, dtype=torch.int64) for length in lengths]
    return Workload(token_ids=ids)


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters that cost 2 FLOPs per token: everything but the input embedding table."""
    return sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)


def flops_per_token(
    non_embedding: int, layers: int, attn_width: int, lengths: Sequence[int]
) -> dict[str, float]:
    """2 x non-embedding params plus causal attention (4 * layers * width * L / 2 per token)."""
    total = sum(lengths)
    # A token of a length-L row attends to L/2 keys on average (QK^T and AV: 2 + 2 FLOPs per key and dim).
    attention = sum(4.0 * layers * attn_width * (length / 2.0) * length for length in lengths) / total
    dense = 2.0 * non_embedding
    return {"dense": dense, "attention": attention, "total": dense + attention}


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def event_times_ms(run: Callable[[int], Any], warmup: int, repeats: int) -> list[float]:
    """Milliseconds of run(i) for i in range(repeats), timed with CUDA events after `warmup` calls."""
    for i in range(warmup):
        run(i)
    events = [(_event(), _event()) for _ in range(repeats)]
    for i, (start, end) in enumerate(events):
        start.record()
        run(i)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def matmul_tflops(
    size: int = 8192, warmup: int = 5, repeats: int = 30, fp8: bool = False
) -> dict[str, float]:
    """size^3 matmul rate with CUDA events: the arithmetic ceiling the roofline is drawn from. bf16, or with
    `fp8` the FP8 product with the scales the engine uses (per row of each operand, models/fp8.py)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Two input sets, alternated, so no repeat reads operands a previous product left in L2; never zeros.
    pairs = [
        tuple(torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        for _ in range(2)
    ]
    last = {"out": torch.empty(size, size, device="cuda", dtype=torch.bfloat16)}
    if fp8:
        from models.fp8 import quantize_rows

        # Per row of A, per column of B (B's rows are its transpose's columns).
        quantized = [(*quantize_rows(a), *quantize_rows(b)) for a, b in pairs]
        operands = [(a, a_scale, b.t(), b_scale.reshape(1, -1)) for a, a_scale, b, b_scale in quantized]

        def run(i: int) -> None:
            a, a_scale, b_t, b_scale = operands[i % 2]
            last["out"] = torch._scaled_mm(a, b_t, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)

    else:

        def run(i: int) -> None:
            torch.mm(*pairs[i % 2], out=last["out"])

    millis = event_times_ms(run, warmup, repeats)
    if not torch.isfinite(last["out"]).all():
        raise RuntimeError("matmul roofline produced non-finite values")
    flops = 2.0 * size**3
    median_ms = statistics.median(millis)
    return {
        "size": float(size),
        "median_ms": median_ms,
        "tflops_median": flops / (median_ms * 1e-3) / 1e12,
        "tflops_best": flops / (min(millis) * 1e-3) / 1e12,
        "tflops_worst": flops / (max(millis) * 1e-3) / 1e12,
    }


def gpu_ms(fn: Callable[[], Any], repeats: int = 30, warmup: int = 5) -> float:
    """Mean GPU milliseconds of a call to fn over `repeats` calls after warm-up (CUDA events)."""
    for _ in range(warmup):
        fn()
    start, end = _event(), _event()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / repeats


def graph_ms(fn: Callable[[], Any], repeats: int = 30) -> float:
    """Mean GPU milliseconds of fn's kernels replayed from a CUDA graph, `repeats` replays: what a call
    costs inside the engine's graphs, without the host's launch cost that `gpu_ms` includes when the
    kernels are shorter than their launches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and warms up outside the graph, as the engine's warm-up does
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return gpu_ms(graph.replay, repeats)


def call_percentiles(run: Callable[[], Any], warmup: int, repeats: int) -> dict[str, float]:
    """Milliseconds per call (synchronised on CUDA), p50 and p90 over `repeats` calls after `warmup`."""
    for _ in range(warmup):
        run()
    _synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        _synchronize()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return {"p50_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))]}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run fn between two device synchronisations (none on the CPU); return its value and the wall seconds."""
    _synchronize()
    start = time.perf_counter()
    value = fn()
    _synchronize()
    return value, time.perf_counter() - start


def _nvidia_smi() -> dict[str, str]:
    query = "name,driver_version,memory.total,clocks.max.sm"
    try:
        proc = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": str(exc)}
    fields = [f.strip() for f in proc.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(query.split(","), fields, strict=False))


def environment() -> dict[str, Any]:
    """What ran the benchmark: versions, GPU, driver and the date."""
    import transformers

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_sms"] = props.multi_processor_count
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["nvidia_smi"] = _nvidia_smi()
    return info


def relative_errors(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per-row ||v - r|| / ||r|| in float64."""
    diff = np.linalg.norm(values.astype(np.float64) - reference.astype(np.float64), axis=-1)
    return np.asarray(diff / np.maximum(np.linalg.norm(reference.astype(np.float64), axis=-1), 1e-30))


def measure(name: str, run: Callable[[], Any], warmup: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Warm up, then time `repeats` full passes (between device synchronisations, GPU clocks sampled); keeps
    the last pass's output for the checks against float32. Peak GPU memory is None on the CPU."""
    _, warm_s = timed(warmup)
    print(f"  {name}: warm-up {warm_s:.2f} s", flush=True)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    output = None
    gpu = []
    for _ in range(repeats):
        with GpuSampler() as sampler:
            output, elapsed = timed(run)
        seconds.append(elapsed)
        gpu.append(sampler.summary())
        print(f"  {name}: pass {len(seconds)} {elapsed:.2f} s; GPU {gpu[-1]}", flush=True)
    return {
        "name": name,
        "seconds": seconds,
        "best_seconds": min(seconds),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "gpu_samples": gpu,
        "output": output,
    }


# The checks of timed results against float32: a figure whose results are wrong is no figure.


def spread_picks(lengths: Sequence[int], count: int) -> list[int]:
    """Indices of `count` requests spread evenly over the length range (shortest to longest): the subset
    checked against the float32 reference."""
    by_length = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return sorted({by_length[round(k * (len(by_length) - 1) / max(count - 1, 1))] for k in range(count)})


@torch.inference_mode()
def float32_reference(
    model: torch.nn.Module,
    rows: Sequence[torch.Tensor],
    variant: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    variant_rows: int | None = None,
) -> list[PathOutput]:
    """HF float32 scores and hidden states, one request per forward, from a float32 copy of `model`; with
    `variant`, also from variant(that copy) (the float32 model changed as the timed path is, e.g. with the
    same FP8 projections), on the first `variant_rows` rows (all by default). The copy is freed before this
    returns."""
    reference = copy.deepcopy(model).to(torch.float32)
    outputs = [hf_paths.run_reference(reference, rows)]
    if variant is not None:
        outputs.append(hf_paths.run_reference(variant(reference), rows[:variant_rows]))
    del reference
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outputs


ORDER_SEED = 256  # the pairs' draw: the same requests in every run of a workload


def order_pairs(count: int, pairs: int, seed: int = ORDER_SEED) -> list[int]:
    """`pairs` disjoint pairs of `count` requests, drawn with a fixed seed: 2 * pairs request indices (fewer
    where there are fewer requests), each pair two consecutive entries."""
    picked = np.random.default_rng(seed).permutation(count)[: 2 * min(pairs, count // 2)]
    return [int(i) for i in picked]


def order_kept(scores: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """How a reward user sees a path's rounding: of the pairs (rows 0-1, 2-3, ...), the share whose order
    by score (the first label's) is the reference's. Pairs the reference scores alike are left out (no order
    to keep)."""
    got, ref = np.asarray(scores)[:, 0], np.asarray(reference)[:, 0]
    ref_order = np.sign(ref[0::2] - ref[1::2])
    ordered = ref_order != 0
    kept = np.sign(got[0::2] - got[1::2])[ordered] == ref_order[ordered]
    return {"pairs": int(ordered.sum()), "share": float(kept.mean()) if kept.size else math.nan}


def compare(values: PathOutput, reference: PathOutput) -> dict[str, float]:
    """Max |score difference|, the pooled hidden states' relative error (max and median over requests) and
    their smallest cosine; a run whose requests asked for no hidden states (width 0) is compared on its
    scores alone (NaN for the rest)."""
    scores = {"max_abs_score_diff": float(np.max(np.abs(values.scores - reference.scores)))}
    if values.hidden.shape[1] == 0:
        return {
            **scores,
            "hidden_rel_err_max": math.nan,
            "hidden_rel_err_median": math.nan,
            "hidden_min_cosine": math.nan,
            "all_finite": bool(np.isfinite(values.scores).all()),
        }
    hidden = values.hidden.astype(np.float64)
    ref = reference.hidden.astype(np.float64)
    cosine = (hidden * ref).sum(1) / np.maximum(
        np.linalg.norm(hidden, axis=1) * np.linalg.norm(ref, axis=1), 1e-30
    )
    rel = relative_errors(values.hidden, reference.hidden)
    return {
        **scores,
        "hidden_rel_err_max": float(np.max(rel)),
        "hidden_rel_err_median": float(np.median(rel)),
        "hidden_min_cosine": float(np.min(cosine)),
        "all_finite": bool(np.isfinite(values.scores).all() and np.isfinite(values.hidden).all()),
    }


def score_bound(hf_error: float, score_scale: float, share: float = 0.05) -> float:
    """How far a timed path's scores may be from float32: twice HF's own error in the same dtype against
    the same reference, plus `share` of the score scale (at least 1)."""
    return 2 * hf_error + share * max(1.0, score_scale)


def sample_entry(prompts: Sequence[Sequence[int]], result: Any) -> dict[str, Any]:
    """A result as check_sample takes it: its prompts (token ids, one per item), scores and hidden states."""
    states = result.pooled_hidden_states
    return {
        "items": [list(prompt) for prompt in prompts],
        "scores": [list(row) for row in result.scores],
        "hidden": None if states is None else [s.to_numpy().astype(np.float32) for s in states],
    }


def check_sample(
    model_dir: Path,
    device: str,
    sample: Sequence[dict[str, Any]],
    references: dict[Any, PathOutput] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Results (sample_entry) against HF float32 loaded from `model_dir` (check_sample_with). `options`:
    from_pretrained's options for both HF models (e.g. the experts implementation of a mixture of experts).
    `references`: HF's outputs kept across checks of one model on the same items (check_sample_with)."""
    from transformers import AutoModelForSequenceClassification

    def load(dtype: torch.dtype) -> torch.nn.Module:
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype, **options)
        return model.to(device).eval()  # type: ignore[no-any-return]

    return check_sample_with(load, device, sample, references)


def check_sample_with(
    load: Callable[[torch.dtype], torch.nn.Module],
    device: str,
    sample: Sequence[dict[str, Any]],
    references: dict[Any, PathOutput] | None = None,
) -> dict[str, Any]:
    """Results (sample_entry) against HF float32, item by item, the model of each dtype from load(dtype),
    one at a time. The bound is twice HF's own bf16 error on the same items plus 5% of the score scale (2%
    for the hidden states' relative error); a non-finite value or a missing sample fails too.
    `references`: where given, HF's outputs by dtype and items, reused when a later check of the same
    model (the caller's promise) has the same items: two paths checked on one sample load HF once."""
    rows = [torch.tensor(item) for entry in sample for item in entry["items"]]
    scores = np.array([row for entry in sample for row in entry["scores"]], dtype=np.float32)
    # Items of the requests that asked for hidden states, as indices into `rows`, and their states.
    owners = [k for k, entry in enumerate(sample) for _ in entry["items"]]
    hidden_rows = [r for r, k in enumerate(owners) if sample[k]["hidden"] is not None]
    hidden = np.array([h for entry in sample if entry["hidden"] is not None for h in entry["hidden"]])
    half = torch.bfloat16 if device == "cuda" else torch.float32
    outputs = {}
    items = tuple(tuple(int(t) for t in row.tolist()) for row in rows)
    for dtype in (torch.float32, half):
        kept = None if references is None else references.get((dtype, items))
        if kept is not None:
            outputs[dtype] = kept
            continue
        started = time.perf_counter()
        model = load(dtype)
        loaded = time.perf_counter()
        outputs[dtype] = hf_paths.run_reference(model, rows)
        print(f"  reference {dtype}: loaded in {loaded - started:.1f} s, {len(rows)} items in "
              f"{time.perf_counter() - loaded:.1f} s", flush=True)  # fmt: skip
        if references is not None:
            references[(dtype, items)] = outputs[dtype]
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    reference, hf_half = outputs[torch.float32], outputs[half]
    scale = float(np.abs(reference.scores).max())
    hf_err = float(np.abs(hf_half.scores - reference.scores).max())
    err = float(np.abs(scores - reference.scores).max())
    hidden_err = float(relative_errors(hidden, reference.hidden[hidden_rows]).max()) if hidden_rows else 0.0
    hf_hidden_err = float(relative_errors(hf_half.hidden, reference.hidden).max())
    bound, hidden_bound = score_bound(hf_err, scale), 2 * hf_hidden_err + 0.02
    finite = bool(np.isfinite(scores).all() and np.isfinite(hidden).all())
    return {
        "requests": len(sample),
        "items": len(rows),
        "hidden_items": len(hidden_rows),
        "max_abs_score_diff": err,
        "hf_bf16_max_abs_score_diff": hf_err,
        "score_bound": bound,
        "hidden_rel_err_max": hidden_err,
        "hf_bf16_hidden_rel_err_max": hf_hidden_err,
        "hidden_bound": hidden_bound,
        "ok": finite and len(sample) > 0 and err <= bound and hidden_err <= hidden_bound,
    }


# Command line, device and report.

# Options several benchmarks take, with the same meaning in each; a script gives its own default.
_OPTIONS: dict[str, dict[str, Any]] = {
    "quick": {
        "action": "store_true",
        "help": "tiny shapes and few requests: a smoke test, not a measurement",
    },
    "max_batch_tokens": {"type": int, "help": "the token budget batches are cut at ({default})"},
    "fp32_requests": {"type": int, "help": "requests checked against the float32 reference ({default})"},
    "profile_top": {"type": int, "help": "kernels listed in the profile ({default})"},
    "other_whole_last_layer": {
        "action": "store_true",
        "help": "also time the default path with the whole last layer (q/o projections and MLP at every row)",
    },
    "reference_sample": {"type": int, "help": "results checked against HF float32 ({default})"},
    # Its choices are worker.apache_kafka.LOCAL_BROKERS, read when a script asks for the option.
    "broker": {
        "help": "the broker the benchmark starts: embedded (the default: the GPU machine has no Java) or "
        "kafka (Apache Kafka from its jars)",
    },
}


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM (a worker's or gateway's graceful stop), then SIGKILL after `timeout_s`."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser, its module docstring as the description."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_options(parser: argparse.ArgumentParser, report: str | None = None, **defaults: Any) -> None:
    """The shared options named in `defaults` (_OPTIONS), each with the default given; with `report`, the
    --json option for a report named `report`.json by default."""
    for name, default in defaults.items():
        spec = dict(_OPTIONS[name])
        if name == "broker":
            from worker.apache_kafka import LOCAL_BROKERS  # the broker benchmarks' import, not the others'

            spec["choices"] = LOCAL_BROKERS
        text = spec.pop("help").format(default=default)
        parser.add_argument(f"--{name.replace('_', '-')}", default=default, help=text, **spec)
    if report is not None:
        parser.add_argument(
            "--json", type=Path, default=None, help=f"output file (default $OUT/{report}.json)"
        )


def pick_device(what: str, cpu_allowed: bool) -> str | None:
    """ "cuda" where there is a GPU; otherwise "cpu" where `cpu_allowed` (a smoke test of the script), or None
    after saying that `what` needs a GPU."""
    if torch.cuda.is_available():
        return "cuda"
    if cpu_allowed:
        return "cpu"
    print(f"{what} needs a CUDA GPU", file=sys.stderr)
    return None


def report_header(args: argparse.Namespace | None = None) -> dict[str, Any]:
    """A report's first entries: what ran it (printed too) and the arguments it was given."""
    env = environment()
    print(json.dumps(env), flush=True)
    report: dict[str, Any] = {"environment": env}
    if args is not None:
        report["args"] = {k: str(v) for k, v in vars(args).items()}
    return report


def out_dir() -> Path | None:
    """$OUT on the device machine (results come back from there); None elsewhere."""
    value = os.environ.get("OUT")
    return Path(value) if value else None


def report_path(name: str, chosen: Path | None = None, quick: bool = False) -> Path:
    """Where a report goes: `chosen` (--json), else `name`.json (`name`-quick.json for a smoke run) in $OUT
    or the current directory."""
    return chosen or (out_dir() or Path(".")) / f"{name}{'-quick' if quick else ''}.json"


def write_verdict(report: dict[str, Any], failures: list[str], target: Path, what: str) -> int:
    """Write the report with its verdict; the exit status: 1 when a check of the timed results failed (a
    figure whose results were wrong is no figure)."""
    report["verdict"] = failures or "ok"
    target.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {target}")
    for failure in failures:
        print(f"{what} FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def layer_gemm_ceiling(
    hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int, tokens: int = 16384, repeats: int = 10
) -> dict[str, float]:
    """A decoder layer's seven projections at M=tokens, timed alone: what the matmuls allow a packed batch."""
    # (in, out) of q, k, v, o, gate, up, down: F.linear with weight [out, in], as the HF layers call it.
    shapes = [
        (hidden, heads * head_dim),
        (hidden, kv_heads * head_dim),
        (hidden, kv_heads * head_dim),
        (heads * head_dim, hidden),
        (hidden, mlp),
        (hidden, mlp),
        (mlp, hidden),
    ]
    gen = torch.Generator(device="cuda").manual_seed(1)
    operands = [
        (
            torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen),
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02,
        )
        for k, n in shapes
    ]
    # The products must be products: the first against float32, within bf16's rounding.
    x, w = operands[0]
    exact = x.float() @ w.float().t()
    error = float(((torch.nn.functional.linear(x, w).float() - exact).norm() / exact.norm()).item())
    if not error < 0.01:
        raise RuntimeError(f"layer_gemm_ceiling: product off float32 by {error:.3g}")

    def layer() -> None:
        for x, w in operands:
            torch.nn.functional.linear(x, w)

    median_ms = statistics.median(event_times_ms(lambda _: layer(), 3, repeats))
    flops = 2.0 * tokens * sum(k * n for k, n in shapes)
    return {"tokens": float(tokens), "ms_per_layer": median_ms, "tflops": flops / (median_ms * 1e-3) / 1e12}


class GpuSampler:
    """Samples SM clock, power and temperature through NVML on a thread while a timed pass runs."""

    def __init__(self, period_s: float = 0.25) -> None:
        self._period = period_s
        self._samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle: Any = None

    def __enter__(self) -> GpuSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # NVML is a diagnostic: without it the pass is still timed, only not annotated
            return self
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        import pynvml

        while not self._stop.wait(self._period):
            clock = pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_SM)
            power = pynvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
            temp = pynvml.nvmlDeviceGetTemperature(self._handle, pynvml.NVML_TEMPERATURE_GPU)
            self._samples.append((float(clock), power, float(temp)))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, float]:
        if not self._samples:
            return {}
        clocks, power, temp = (np.array(column) for column in zip(*self._samples, strict=True))
        return {
            "sm_clock_mhz_median": float(np.median(clocks)),
            "sm_clock_mhz_min": float(clocks.min()),
            "power_w_median": float(np.median(power)),
            "power_w_max": float(power.max()),
            "temp_c_max": float(temp.max()),
        }

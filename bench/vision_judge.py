"""Image-text judges, packed against padded: images/s and tokens/s of a Qwen2.5-VL-3B-like judge (random
weights) on the packed path (models/vision_packed.py) and on HF's padded forward (packed_images off), each
checked against HF float32 on a sample.

Half the requests carry one photograph-sized PNG (640 x 480, resized by the processor to 644 x 476: 391
image tokens) before a text query and item, half are text alone; the batch mixes them. --quick runs the tiny
judge on the CPU: a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import (
    add_options,
    argument_parser,
    measure,
    pick_device,
    relative_errors,
    report_header,
    report_path,
    score_bound,
    write_verdict,
)
from bench.vision import workload
from models import Scorer, ScorerConfig
from models.loading import quiet_progress_bars
from models.prepare import PreparedRequest
from models.tiny_vision import write_tiny_qwen_vl_judge
from models.vision import load_vision
from schemas import ScoreRequest

# Qwen2.5-VL-3B's shapes: the text model (36 layers, 16 heads of 128 over 2 key-value heads, M-RoPE sections
# 16 + 24 + 24) and its vision tower (32 blocks of width 1280, windows of 112 pixels, four full blocks),
# 14-pixel patches merged 2 x 2. The vocabulary stays the tiny tokenizer's (a judge reads label columns).
QWEN2_5_VL_3B: dict[str, Any] = {
    "text": {
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    },
    "vision": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "out_hidden_size": 2048,
        "initializer_range": 0.02,
    },
    "patch_size": 14,
    "max_pixels": 1024 * 28 * 28,
}  # fmt: skip
LABELS = (7, 11)


def judge_config(target: Path, shapes: dict[str, Any]) -> Any:
    """The config of the tiny judge written at `target`, its text model and vision tower given `shapes`."""
    from transformers import AutoConfig

    fields = json.loads((target / "config.json").read_text())
    for part in ("text", "vision"):
        fields[f"{part}_config"].update(shapes[part])
    # The tiny judge's per-layer list is sized to its own layer count; the text config derives it again.
    fields["text_config"].pop("layer_types", None)
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def write_judge(target: Path, shapes: dict[str, Any] | None, device: str, dtype: torch.dtype) -> Path:
    """The tiny Qwen2.5-VL judge's files (tokenizer, chat template, processor), then, with `shapes`, random
    weights of those shapes (seed 0) built on `device` in `dtype` and its image processor's patch size."""
    from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    write_tiny_qwen_vl_judge(target, 0, "qwen2_5_vl")
    if shapes is None:
        return target
    config = judge_config(target, shapes)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    with quiet_progress_bars():
        model.save_pretrained(str(target))
    del model
    patch = int(shapes["patch_size"])
    Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=(2 * patch) ** 2,
        max_pixels=int(shapes["max_pixels"]),
    ).save_pretrained(str(target))  # fmt: skip
    return target


@torch.inference_mode()
def hf_alone(model_dir: Path, device: str, dtype: torch.dtype, requests: list[ScoreRequest]) -> Any:
    """HF's forward on each request alone (its processor's inputs): label logits [N, L] at the last token,
    final-norm states there [N, H]."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    vision = load_vision(model_dir, "qwen2_5_vl", AutoTokenizer.from_pretrained(str(model_dir)))
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    scores, hidden = [], []
    for request in requests:
        images = [Image.open(io.BytesIO(data)).convert("RGB") for data in request.images or ()]
        text = vision.placeholders(len(images)) + f"{request.query}{request.items[0]}"
        inputs = vision.processor(text=[text], images=[images] if images else None, return_tensors="pt")
        inputs = inputs.to(device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        out = model(**inputs, output_hidden_states=True)
        scores.append(out.logits[0, -1, list(LABELS)].float().cpu().numpy())
        hidden.append(out.hidden_states[-1][0, -1].float().cpu().numpy())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return np.stack(scores), np.stack(hidden)


def time_path(
    model_dir: Path, device: str, requests: list[ScoreRequest], packed: bool
) -> tuple[dict[str, Any], list[Any]]:
    """One path's scorer timed on the prepared requests (the host's share apart); the figures and the last
    pass's results."""
    scorer = Scorer(model_dir, ScorerConfig(device=device, packed_images=packed))
    prepared = [scorer.prepare(request) for request in requests]
    ready = [p for p in prepared if isinstance(p, PreparedRequest)]
    if len(ready) != len(prepared):
        raise SystemExit(f"bench/vision_judge.py: {len(prepared) - len(ready)} requests were refused")
    images = sum(len(r.images or ()) for r in requests)
    tokens = sum(p.num_tokens for p in ready)
    timed = measure(
        "packed" if packed else "padded",
        lambda: scorer.score_prepared(prepared),
        lambda: scorer.score_prepared(prepared[:4]),
        3,
    )
    best, results = timed["best_seconds"], timed.pop("output")
    print(f"{'packed' if packed else 'padded'}: {images / best:.1f} images/s, {tokens / best:.0f} tokens/s "
          f"({scorer.info.attention})", flush=True)  # fmt: skip
    figures = {
        "images": images, "prompt_tokens": tokens, "images_per_s": images / best,
        "tokens_per_s": tokens / best, "timed": timed, "info": str(scorer.info),
    }  # fmt: skip
    return figures, results


def check(reference: Any, hf_half: Any, results: list[Any]) -> dict[str, Any]:
    """Timed results against HF float32: scores within twice HF's own error in the timed dtype plus 5% of
    the score scale, hidden states within twice HF's relative error plus 2%."""
    (want, want_hidden), (half, half_hidden) = reference, hf_half
    got = np.array([r.scores[0] for r in results], dtype=np.float32)
    got_hidden = np.stack([r.pooled_hidden_states[0].to_numpy().astype(np.float32) for r in results])
    hf_err = float(np.abs(half - want).max())
    hf_hidden_err = float(relative_errors(half_hidden, want_hidden).max())
    err = float(np.abs(got - want).max())
    hidden_err = float(relative_errors(got_hidden, want_hidden).max())
    bound, hidden_bound = score_bound(hf_err, float(np.abs(want).max())), 2 * hf_hidden_err + 0.02
    finite = bool(np.isfinite(got).all() and np.isfinite(got_hidden).all())
    return {
        "max_abs_score_diff": err, "hf_half_max_abs_score_diff": hf_err, "score_bound": bound,
        "hidden_rel_err_max": hidden_err, "hidden_bound": hidden_bound,
        "ok": finite and err <= bound and hidden_err <= hidden_bound,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    add_options(parser, report="vision_judge", quick=False, reference_sample=4)
    parser.add_argument("--requests", type=int, default=64, help="requests per pass, half with an image")
    args = parser.parse_args(argv)
    device = pick_device("bench/vision_judge.py", cpu_allowed=args.quick)
    if device is None:
        return 2
    report = report_header(args)
    count = 8 if args.quick else args.requests
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    failures = []
    with tempfile.TemporaryDirectory() as workdir:
        started = time.perf_counter()
        shapes = None if args.quick else QWEN2_5_VL_3B
        model_dir = write_judge(Path(workdir) / "qwen2_5_vl", shapes, device, dtype)
        report["model_written_s"] = time.perf_counter() - started
        requests = workload(count, (64, 48) if args.quick else (640, 480), label_token_ids=LABELS)
        picks = list(range(min(count, 2 * args.reference_sample)))  # image requests even, text-only odd
        sample = [requests[i] for i in picks]
        reference = hf_alone(model_dir, device, torch.float32, sample)
        hf_half = hf_alone(model_dir, device, dtype, sample)
        for packed in (True, False):
            name = "packed" if packed else "padded"
            figures, results = time_path(model_dir, device, requests, packed)
            if device == "cuda":
                torch.cuda.empty_cache()  # the scorer is gone: the other path's needs the memory
            figures["vs_fp32"] = check(reference, hf_half, [results[i] for i in picks])
            report[name] = figures
            if not figures["vs_fp32"]["ok"]:
                failures.append(f"{name} results off float32: {figures['vs_fp32']}")
    report["packed_speedup"] = report["packed"]["images_per_s"] / report["padded"]["images_per_s"]
    print(f"packed / padded: {report['packed_speedup']:.2f}x", flush=True)
    target = report_path("vision_judge", args.json, args.quick)
    return write_verdict(report, failures, target, "bench/vision_judge.py")


if __name__ == "__main__":
    raise SystemExit(main())

"""Image-text batches: images/s and tokens/s of a Gemma-3-4B-like classifier (random weights), checked
against HF float32 on a sample.

Half the requests carry one photograph-sized PNG (640 x 480, resized by the processor to 896 x 896: 256
image tokens) before a text query and item, half are text alone; the batch mixes them. The host's share
(decoding, the processor) is timed apart from the scorer's (the vision tower and the text model on padded
batches). --quick runs the tiny model on the CPU: a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import io
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
from models import Scorer, ScorerConfig
from models.prepare import PreparedRequest
from models.tiny_vision import write_tiny_vision_model
from models.vision import load_vision
from schemas import ScoreRequest

# Gemma 3 4B's shapes: the text model (34 layers, 5 local to 1 global, head_dim 256, 262,208 tokens) and
# SigLIP-so400m's tower at 896 pixels (4,096 patches pooled into 256 tokens).
GEMMA3_4B: dict[str, Any] = {
    "text": {
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 4,
        "vocab_size": 262208, "max_position_embeddings": 131072, "initializer_range": 0.02,
    },
    "vision": {
        "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
        "image_size": 896, "patch_size": 14,
    },
    "tokens_per_image": 256,
    "image_size": 896,
}  # fmt: skip
_QUERY = "Look at the picture and the answer below. Is the answer helpful, honest and correct? "
_ITEMS = ("It shows a dog on a mat.", "A city street at night with buses and cars.", "Two birds in a tree.")


def picture(seed: int, size: tuple[int, int]) -> bytes:
    """A random picture (smooth noise, so PNG compresses it like a photograph more than like static)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = rng.random((size[1] // 16 + 1, size[0] // 16 + 1, 3))
    pixels = np.kron(coarse, np.ones((16, 16, 1)))[: size[1], : size[0]]
    buffer = io.BytesIO()
    Image.fromarray((pixels * 255).astype(np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def workload(count: int, size: tuple[int, int], **fields: Any) -> list[ScoreRequest]:
    """`count` requests: even ones with one picture, odd ones text alone; pooled hidden states asked;
    `fields`: more request fields (a judge's label_token_ids)."""
    return [
        ScoreRequest(
            f"v{i}", items=(_ITEMS[i % len(_ITEMS)],), query=_QUERY,
            images=(picture(i, size),) if i % 2 == 0 else None, return_pooled_hidden_states=True, **fields,
        )
        for i in range(count)
    ]  # fmt: skip


@torch.inference_mode()
def hf_alone(model_dir: Path, device: str, dtype: torch.dtype, requests: list[ScoreRequest]) -> Any:
    """HF's forward on each request alone (its processor's inputs): scores [N, L], pooled states [N, H]."""
    from PIL import Image
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # The worker's processor (Pillow's resize, whether or not torchvision is installed): the check is of
    # the model's arithmetic on the same inputs.
    processor = load_vision(model_dir, "gemma3", AutoTokenizer.from_pretrained(str(model_dir))).processor
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    scores, hidden = [], []
    for request in requests:
        images = [Image.open(io.BytesIO(data)).convert("RGB") for data in request.images or ()]
        marks = processor.boi_token * len(images)
        text = marks + f"{request.query}{request.items[0]}"
        inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt").to(device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        out = model(**inputs, output_hidden_states=True)
        scores.append(out.logits[0].float().cpu().numpy())
        hidden.append(out.hidden_states[-1][0, -1].float().cpu().numpy())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return np.stack(scores), np.stack(hidden)


def check(model_dir: Path, device: str, requests: list[ScoreRequest], results: list[Any]) -> dict[str, Any]:
    """The timed results of `requests` against HF float32: scores within twice HF's own error in the
    timed dtype plus 5% of the score scale, hidden states within twice HF's relative error plus 2%."""
    got = np.array([r.scores[0] for r in results], dtype=np.float32)
    got_hidden = np.stack([r.pooled_hidden_states[0].to_numpy().astype(np.float32) for r in results])
    reference, reference_hidden = hf_alone(model_dir, device, torch.float32, requests)
    half = torch.bfloat16 if device == "cuda" else torch.float32
    hf_half, hf_half_hidden = hf_alone(model_dir, device, half, requests)
    hf_err = float(np.abs(hf_half - reference).max())
    hf_hidden_err = float(relative_errors(hf_half_hidden, reference_hidden).max())
    err = float(np.abs(got - reference).max())
    hidden_err = float(relative_errors(got_hidden, reference_hidden).max())
    bound = score_bound(hf_err, float(np.abs(reference).max()))
    hidden_bound = 2 * hf_hidden_err + 0.02
    finite = bool(np.isfinite(got).all() and np.isfinite(got_hidden).all())
    return {
        "requests": len(requests), "with_images": sum(r.images is not None for r in requests),
        "max_abs_score_diff": err, "hf_half_max_abs_score_diff": hf_err, "score_bound": bound,
        "hidden_rel_err_max": hidden_err, "hf_half_hidden_rel_err_max": hf_hidden_err,
        "hidden_bound": hidden_bound, "ok": finite and err <= bound and hidden_err <= hidden_bound,
    }  # fmt: skip


def time_scorer(
    model_dir: Path, device: str, requests: list[ScoreRequest]
) -> tuple[dict[str, Any], list[Any]]:
    """The host's share (prepare: decode and process) and the scorer's, timed apart; the figures and the
    last pass's results. The scorer is freed on return (the float32 reference needs the memory)."""
    scorer = Scorer(model_dir, ScorerConfig(device=device))
    started = time.perf_counter()
    prepared = [scorer.prepare(request) for request in requests]
    prepare_s = time.perf_counter() - started
    ready = [p for p in prepared if isinstance(p, PreparedRequest)]
    if len(ready) != len(prepared):
        raise SystemExit(f"bench/vision.py: {len(prepared) - len(ready)} requests were refused")
    images = sum(len(r.images or ()) for r in requests)
    tokens = sum(p.num_tokens for p in ready)
    timed = measure(
        "scorer", lambda: scorer.score_prepared(prepared), lambda: scorer.score_prepared(prepared[:4]), 3
    )
    best, results = timed["best_seconds"], timed.pop("output")
    print(f"{images / best:.1f} images/s, {tokens / best:.0f} tokens/s on the model; the host prepares "
          f"{images / prepare_s:.1f} images/s", flush=True)  # fmt: skip
    figures = {
        "requests": len(requests), "images": images, "prompt_tokens": tokens, "prepare_s": prepare_s,
        "images_per_s_host": images / prepare_s, "images_per_s": images / best, "tokens_per_s": tokens / best,
        "timed": timed, "info": str(scorer.info),
    }  # fmt: skip
    return figures, results


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    add_options(parser, report="vision", quick=False, reference_sample=4)
    parser.add_argument("--requests", type=int, default=128, help="requests per pass, half with an image")
    args = parser.parse_args(argv)
    device = pick_device("bench/vision.py", cpu_allowed=args.quick)
    if device is None:
        return 2
    report = report_header(args)
    count = 8 if args.quick else args.requests
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as workdir:
        started = time.perf_counter()
        shapes = None if args.quick else GEMMA3_4B
        model_dir = write_tiny_vision_model(
            Path(workdir) / "gemma3", shapes=shapes, device=device, dtype=dtype
        )
        report["model_written_s"] = time.perf_counter() - started
        if device == "cuda":
            torch.cuda.empty_cache()
        requests = workload(count, (64, 48) if args.quick else (640, 480))
        figures, results = time_scorer(model_dir, device, requests)
        report.update(figures)
        if device == "cuda":
            torch.cuda.empty_cache()
        # A sample of both kinds: image requests are the even ones, text-only the odd ones.
        picks = list(range(min(count, 2 * args.reference_sample)))
        report["vs_fp32"] = check(
            model_dir, device, [requests[i] for i in picks], [results[i] for i in picks]
        )
    failures = [] if report["vs_fp32"]["ok"] else [f"results off float32: {report['vs_fp32']}"]
    return write_verdict(report, failures, report_path("vision", args.json, args.quick), "bench/vision.py")


if __name__ == "__main__":
    raise SystemExit(main())

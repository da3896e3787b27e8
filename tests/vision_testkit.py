"""Image-text test helpers: pictures as files, the contract's prompt texts, and HF float32 on each item."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from schemas import ChatMessage, ContentPart, ScoreRequest


def load_reference(model_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """HF's model (eager attention: plain matmuls, independent of the SDPA path under test) and its
    processor from the directory's own files, with the Pillow image processor the worker uses (where
    torchvision is installed, Gemma3Processor.from_pretrained would take its backend, whose resize rounds
    pixels otherwise: a difference of inputs, not of the model)."""
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
    )

    model = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), attn_implementation="eager", dtype=dtype
    ).eval()
    settings = json.loads((model_dir / "processor_config.json").read_text())
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil.from_pretrained(str(model_dir)),
        tokenizer=AutoTokenizer.from_pretrained(str(model_dir)),
        image_seq_length=settings["image_seq_length"],
    )
    return model, processor


def encoded(fmt: str, seed: int, size: tuple[int, int] = (20, 30)) -> bytes:
    """A random RGB picture of `size` (width, height) as a file of `fmt` (lossless where it can be)."""
    rng = np.random.default_rng(seed)
    pixels = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buffer.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_claiming(width: int, height: int) -> bytes:
    """A small, valid PNG header that claims a canvas of width x height (a decompression bomb's shape)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


def item_texts(request: ScoreRequest, processor: Any, mark: str | None = None) -> tuple[list[str], bool]:
    """Each item's prompt text as the contract defines it (schemas/README.md, Images), and whether the
    tokenizer adds its special tokens; `mark` places an image (Gemma 3's begin mark by default)."""
    if request.messages is not None:
        turns = [m.as_template_turn() for m in request.messages]
        texts = [
            processor.tokenizer.apply_chat_template(
                [*turns, {"role": "assistant", "content": item}], tokenize=False
            )
            for item in request.items
        ]
        return texts, False
    marks = (processor.boi_token if mark is None else mark) * len(request.images or ())
    return [marks + f"{request.query or ''}{item}" for item in request.items], True


def hf_alone(
    reference: tuple[Any, Any],
    request: ScoreRequest,
    *,
    bidirectional: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """HF float32 on each item alone: the processor's ids, token types and pixel values, the model's own
    forward. Returns (scores [N, L], pooled hidden states [N, H], longest prompt)."""
    model, processor = reference
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in request.images or ()]
    texts, specials = item_texts(request, processor)
    scores, hidden, longest = [], [], 0
    for text in texts:
        inputs = processor(
            text=[text], images=[images] if images else None, add_special_tokens=specials, return_tensors="pt"
        )
        types = inputs.get("token_type_ids")
        if types is not None and not bidirectional:
            types = torch.zeros_like(types)
        with torch.inference_mode():
            out = model(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                pixel_values=None if "pixel_values" not in inputs else inputs["pixel_values"].to(dtype),
                token_type_ids=types,
                output_hidden_states=True,
            )
        scores.append(out.logits[0].float().numpy())
        hidden.append(out.hidden_states[-1][0, -1].float().numpy())
        longest = max(longest, int(inputs["input_ids"].shape[1]))
    return np.stack(scores), np.stack(hidden), longest


def image_and_text_requests() -> list[ScoreRequest]:
    chat = ChatMessage(
        "user", (ContentPart("image"), ContentPart("text", "Which fits? "), ContentPart("image"))
    )
    return [
        ScoreRequest(
            "picture-query", items=("a cat", " a dog on a mat"), query="Which animal? ",
            images=(encoded("PNG", 1),), return_pooled_hidden_states=True,
        ),
        ScoreRequest("text-only", items=("The quick brown fox", "jumps"), return_pooled_hidden_states=True),
        ScoreRequest(
            "chat-two-images", items=("the left one", "neither"),
            messages=(ChatMessage("system", "Judge."), chat),
            images=(encoded("JPEG", 2, (40, 12)), encoded("WEBP", 3, (16, 16))),
            return_pooled_hidden_states=True,
        ),
        ScoreRequest("text-chat", items=("yes",), messages=(ChatMessage("user", "Is it fine?"),),
                     return_pooled_hidden_states=True),
    ]  # fmt: skip


# Qwen2.5-VL's and Qwen3-VL's image judges: token ids of the label words (any of the tiny vocabulary), and
# the text that places an image.
JUDGE_LABELS = (7, 11, 30)
MARK_QWEN = "<|vision_start|><|image_pad|><|vision_end|>"


def load_judge_reference(judge_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """HF's generation model, or its classifier where the directory holds one (eager attention: plain
    matmuls, independent of the SDPA path under test), and its processor (HF's, without the video half that
    needs torchvision) from the directory's own files."""
    from transformers import (
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        Qwen2VLImageProcessorPil,
    )

    from models import qwen_vl

    config = json.loads((judge_dir / "config.json").read_text())
    classifier = any(arch.endswith("ForSequenceClassification") for arch in config["architectures"])
    auto: Any = AutoModelForSequenceClassification if classifier else AutoModelForImageTextToText
    model = auto.from_pretrained(str(judge_dir), attn_implementation="eager", dtype=dtype).eval()
    kind = "Qwen2_5_VL" if model.config.model_type == "qwen2_5_vl" else "Qwen3VL"  # Qwen3.5: Qwen3-VL's
    processor = getattr(qwen_vl, f"Image{kind}Processor")(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(judge_dir)),
        tokenizer=AutoTokenizer.from_pretrained(str(judge_dir)),
    )
    return model, processor


def value_head_of(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The directory's TRL value head (weight [1, H], bias [1]), from its checkpoint or the
    value_head.safetensors beside it; None without one."""
    from safetensors.torch import load_file

    for name in ("value_head.safetensors", "model.safetensors"):
        if (model_dir / name).is_file():
            tensors = load_file(str(model_dir / name))
            if "v_head.summary.weight" in tensors:
                return tensors["v_head.summary.weight"], tensors["v_head.summary.bias"]
    return None


def judge_alone(
    reference: tuple[Any, Any],
    request: ScoreRequest,
    dtype: torch.dtype = torch.float32,
    value_head: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """HF on each item alone, unpadded (in the reference's `dtype`): the processor's ids, token types, pixel
    values and grids, the model's own forward (its M-RoPE positions from them; a hybrid's Gated DeltaNet
    layers in HF's own torch functions). Returns (the scores: a judge's label-token logits at the last token,
    with apply_softmax their softmax; a classifier's logits; with `value_head`, that head on the last token's
    final-norm state, as TRL applies it; the final-norm hidden states at the last token [N, H]; the longest
    prompt)."""
    from models.linear_attention import hf_torch_functions

    model, processor = reference
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in request.images or ()]
    texts, specials = item_texts(request, processor, MARK_QWEN)
    scores, hidden, longest = [], [], 0
    for text in texts:
        inputs = processor(
            text=[text], images=[images] if images else None, add_special_tokens=specials, return_tensors="pt"
        )
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        with torch.inference_mode(), hf_torch_functions():
            out = model(**inputs, output_hidden_states=True)
        score, last = _scored(out, request, value_head)
        scores.append(score)
        hidden.append(last)
        longest = max(longest, int(inputs["input_ids"].shape[1]))
    return np.stack(scores), np.stack(hidden), longest


def _scored(
    out: Any, request: ScoreRequest, value_head: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[np.ndarray, np.ndarray]:
    """One item's scores from HF's output (judge_alone says which) and its final-norm state at the last
    token."""
    last = out.hidden_states[-1][0, -1]
    if value_head is not None:
        weight, bias = value_head
        score = (last.float() @ weight.T.float() + bias.float()).double().numpy()
    elif out.logits.dim() == 2:  # a classifier's logits at its pooled token
        score = out.logits[0].double().numpy()
    else:
        logits = out.logits[0, -1, list(request.label_token_ids or ())].double()
        score = (logits.softmax(-1) if request.apply_softmax else logits).numpy()
    return score, last.float().numpy()


def judge_requests() -> list[ScoreRequest]:
    chat = ChatMessage(
        "user", (ContentPart("image"), ContentPart("text", "Which fits? "), ContentPart("image"))
    )
    return [
        ScoreRequest(
            "picture-query", items=("a cat", " a dog on a mat"), query="Which animal? ",
            images=(encoded("PNG", 1),), label_token_ids=JUDGE_LABELS, return_pooled_hidden_states=True,
        ),
        ScoreRequest("text-only", items=("The quick brown fox", "jumps"), label_token_ids=JUDGE_LABELS,
                     return_pooled_hidden_states=True),
        ScoreRequest(
            "chat-two-images", items=("the left one", "neither"),
            messages=(ChatMessage("system", "Judge."), chat),
            # Other shapes, other grids: 40 x 12 and 64 x 48 pixels resize to different patch grids.
            images=(encoded("JPEG", 2, (40, 12)), encoded("WEBP", 3, (64, 48))),
            label_token_ids=JUDGE_LABELS, apply_softmax=True, return_pooled_hidden_states=True,
        ),
        ScoreRequest("text-chat", items=("yes",), messages=(ChatMessage("user", "Is it fine?"),),
                     label_token_ids=JUDGE_LABELS[:2], apply_softmax=True),
    ]  # fmt: skip


# Token ids sent as they are: one-token prompts (any ids of the tiny vocabulary but its image marks).
ONE_TOKEN_ITEMS = ((9,), (12,))


def mixed_judge_requests() -> list[ScoreRequest]:
    """Five images of five shapes (so five patch grids, 2 to 24 tokens each) over three requests, a
    request of three items, text-only and token-id requests of one-token items, in one batch."""
    chat = ChatMessage(
        "user", (ContentPart("text", "Is it "), ContentPart("image"), ContentPart("text", "?"))
    )
    return [
        ScoreRequest(
            "tall-image-three-items", items=("a cat", " a dog on a mat", "z"), query="Which? ",
            images=(encoded("PNG", 4, (12, 40)),), label_token_ids=JUDGE_LABELS,
            return_pooled_hidden_states=True,
        ),
        ScoreRequest("text-only", items=("The quick brown fox", "jumps"), label_token_ids=JUDGE_LABELS,
                     return_pooled_hidden_states=True),
        ScoreRequest(
            "two-images", items=("the left one",), query="Compare. ",
            images=(encoded("JPEG", 5, (64, 48)), encoded("PNG", 6, (16, 16))),
            label_token_ids=JUDGE_LABELS, return_pooled_hidden_states=True,
        ),
        ScoreRequest("one-token-items", items=ONE_TOKEN_ITEMS, label_token_ids=JUDGE_LABELS,
                     return_pooled_hidden_states=True),
        ScoreRequest(
            "chat-wide-image", items=("yes", "no"), messages=(chat,),
            images=(encoded("WEBP", 7, (40, 12)),), label_token_ids=JUDGE_LABELS[:2], apply_softmax=True,
            return_pooled_hidden_states=True,
        ),
    ]  # fmt: skip


def token_judge_alone(
    reference: tuple[Any, Any],
    request: ScoreRequest,
    dtype: torch.dtype = torch.float32,
    value_head: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """judge_alone, and for a request of token-id items HF's forward of each item's ids as they are sent
    (the scores as judge_alone reads them, the final-norm state at the last token, the longest item)."""
    from models.linear_attention import hf_torch_functions

    if request.items and not isinstance(request.items[0], tuple):
        return judge_alone(reference, request, dtype, value_head=value_head)
    model, _ = reference
    scores, hidden = [], []
    for item in request.items:
        with torch.inference_mode(), hf_torch_functions():
            out = model(input_ids=torch.tensor([item]), output_hidden_states=True)
        score, last = _scored(out, request, value_head)
        scores.append(score)
        hidden.append(last)
    return np.stack(scores), np.stack(hidden), max(len(item) for item in request.items)

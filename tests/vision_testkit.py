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

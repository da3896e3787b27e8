"""A tiny random-weight Gemma 3 image-text classifier with its processor, built locally (tests, demos)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

from models.loading import quiet_progress_bars
from models.tiny import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    _fill_zero_initialised,
    tiny_config,
    train_tokenizer,
)

# Gemma 3's image marks: the processor expands each begin-of-image mark into the begin mark, the soft
# tokens the vision tower's features replace, and the end mark.
IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
IMAGE_SIZE = 32  # pixels a side the image processor resizes to
PATCH_SIZE = 8  # a 4 x 4 grid of patches, pooled 2 x 2 into ...
TOKENS_PER_IMAGE = 4  # ... 4 soft tokens per image
# The decoders' chat template, reading content parts too: an image part becomes the begin-of-image mark, as
# Gemma 3's own template renders it.
VISION_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def gemma3_vision_config(
    vocab_size: int, image_ids: dict[str, int | None], num_labels: int, shapes: dict[str, Any] | None = None
) -> Any:
    """Gemma 3's image-text config around the tiny text config (local and global layers, soft caps off);
    `shapes` overrides its "text" and "vision" fields, "tokens_per_image" and "image_size"."""
    from transformers import Gemma3Config

    shapes = shapes or {}
    text = {**tiny_config("gemma3_text", vocab_size, num_labels).to_dict(), **shapes.get("text", {})}
    for key in (
        "architectures",
        "_name_or_path",
        "transformers_version",
        "model_type",
        "id2label",
        "label2id",
    ):
        text.pop(key, None)
    vision = {
        "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE,
        "num_channels": 3, **shapes.get("vision", {}),
    }  # fmt: skip
    fields: dict[str, Any] = {
        "text_config": text, "vision_config": vision,
        "mm_tokens_per_image": shapes.get("tokens_per_image", TOKENS_PER_IMAGE),
        "boi_token_index": image_ids["boi_token"], "eoi_token_index": image_ids["eoi_token"],
        "image_token_index": image_ids["image_token"], "num_labels": num_labels,
        "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    }  # fmt: skip
    config = Gemma3Config(**fields)
    config.architectures = ["Gemma3ForSequenceClassification"]
    return config


def write_tiny_vision_model(
    path: str | Path,
    seed: int = 0,
    num_labels: int = 1,
    *,
    shapes: dict[str, Any] | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random-weight Gemma3ForSequenceClassification (safetensors), its tokenizer with the image
    marks and a chat template that places image parts, and its processor's files; deterministic from
    `seed`. `shapes` (gemma3_vision_config's) make it a larger model, built on `device` in `dtype` (the
    benchmarks' Gemma-3-4B-like one)."""
    shapes = shapes or {}
    from transformers import Gemma3ImageProcessorPil

    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed, architecture="gemma3_text")
    tokenizer.add_special_tokens(list(IMAGE_TOKENS.values()))  # ids after the trained vocabulary
    image_ids = {name: tokenizer.token_to_id(text) for name, text in IMAGE_TOKENS.items()}
    config = gemma3_vision_config(tokenizer.get_vocab_size(), image_ids, num_labels, shapes)
    with torch.random.fork_rng(devices=[]), torch.device(device):  # seeded, the caller's RNG state kept
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    _fill_zero_initialised(model, seed)
    # HF starts the projector's matrix at zero, which would make every image's features zero: the model
    # would score the text alone. Unit-scale random features make each image change the scores.
    projection = model.model.multi_modal_projector.mm_input_projection_weight
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        projection.copy_(torch.randn(projection.shape, generator=generator) / projection.shape[0] ** 0.5)
    with quiet_progress_bars():
        model.save_pretrained(str(target))
    # The text models' special tokens, by the names the tokenizer gives their roles.
    specials = dict(zip(("pad_token", "unk_token", "bos_token", "eos_token"), SPECIAL_TOKENS, strict=True))
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        **specials,
        model_max_length=config.text_config.max_position_embeddings,
        chat_template=VISION_CHAT_TEMPLATE,
        extra_special_tokens=IMAGE_TOKENS,
    )
    fast.save_pretrained(str(target))
    size = shapes.get("image_size", IMAGE_SIZE)
    Gemma3ImageProcessorPil(size={"height": size, "width": size}).save_pretrained(str(target))
    tokens = shapes.get("tokens_per_image", TOKENS_PER_IMAGE)
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": tokens}
    (target / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    config_path = target / "config.json"
    saved = json.loads(config_path.read_text())
    saved["architectures"] = ["Gemma3ForSequenceClassification"]
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return target

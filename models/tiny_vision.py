"""Tiny random-weight image-text models (Gemma 3, the Qwens) with their processors, built locally."""

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
    _hybrid_fields,
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


# Qwen2.5-VL's image marks: the processor expands each image pad between the begin and end marks into the
# image's merged patches (one token per 2 x 2 patches), whose positions are 3-D (M-RoPE).
QWEN_VL_TOKENS = {
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}
QWEN_PATCH = 4  # pixels a patch side; merged 2 x 2, so images are resized to multiples of 8 pixels
# At most 96 patches, 24 image tokens an image; images of other shapes get other grids.
QWEN_MAX_PIXELS = 32 * 48
QWEN_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_vl_config(architecture: str, vocab_size: int, image_ids: dict[str, int]) -> Any:
    """Qwen2.5-VL's or Qwen3-VL's config at a tiny size: head_dim 16 split 2 + 3 + 3 among M-RoPE's time,
    height and width (Qwen3-VL interleaves them); Qwen2.5-VL's vision tower of one windowed and one
    full-attention block (window 2 x 2 merged patches), Qwen3-VL's of two blocks, the first one's features
    also added to the text model's first layer (deep-stack), learned positions on a 4 x 4 grid."""
    from transformers import AutoConfig

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = {
        "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "initializer_range": 0.1, "tie_word_embeddings": False,
        "rope_parameters": rope, "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    }  # fmt: skip
    vision: dict[str, Any] = {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
        "patch_size": QWEN_PATCH, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 32,
        "initializer_range": 0.1,
    }  # fmt: skip
    if architecture == "qwen2_5_vl":
        vision.update(window_size=16, fullatt_block_indexes=[1])
    elif architecture == "qwen3_vl":
        rope["mrope_interleaved"] = True
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
    else:
        # Qwen3.5: the hybrid text model (models/tiny.py's Gated DeltaNet layers, full attention every fourth
        # layer) whose rotary covers half of head_dim 32, its 8 frequencies split 2 + 3 + 3 interleaved.
        rope.update(mrope_interleaved=True, partial_rotary_factor=0.5)
        text.update({**_hybrid_fields("qwen3_5_text"), "head_dim": 32, "rope_parameters": rope})
        vision.update(num_position_embeddings=16)
    config = AutoConfig.for_model(
        architecture, text_config=text, vision_config=vision, tie_word_embeddings=False,
        **{f"{name}_id": image_ids[name] for name in QWEN_VL_TOKENS},
    )  # fmt: skip
    config.architectures = [QWEN_VL_CLASSES[architecture]]
    return config


QWEN_VL_CLASSES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
}


def write_tiny_qwen_vl_judge(
    path: str | Path, seed: int = 0, architecture: str = "qwen2_5_vl", *, num_labels: int | None = None
) -> Path:
    """Write a random-weight Qwen2.5-VL, Qwen3-VL or Qwen3.5 generation model (a judge: scored on label
    tokens) or, with `num_labels`, Qwen3.5's image-text classifier; its tokenizer with the vision marks and
    a chat template that places image parts, and its image processor (4-pixel patches, at most
    QWEN_MAX_PIXELS); deterministic from `seed`."""
    from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed, architecture="qwen2")
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>", *QWEN_VL_TOKENS.values()])
    image_ids = {name: int(tokenizer.token_to_id(text) or 0) for name, text in QWEN_VL_TOKENS.items()}
    config = qwen_vl_config(architecture, tokenizer.get_vocab_size(), image_ids)
    auto: Any = AutoModelForImageTextToText
    if num_labels is not None:
        config.num_labels, auto = num_labels, AutoModelForSequenceClassification
        config.architectures = [
            QWEN_VL_CLASSES[architecture].replace("ConditionalGeneration", "SequenceClassification")
        ]
    with torch.random.fork_rng(devices=[]):  # seeded, the caller's RNG state kept
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
    _fill_zero_initialised(model, seed)
    with quiet_progress_bars():
        model.save_pretrained(str(target))
    specials = dict(zip(("pad_token", "unk_token", "bos_token", "eos_token"), SPECIAL_TOKENS, strict=True))
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, **specials, model_max_length=512, chat_template=QWEN_VL_CHAT_TEMPLATE
    )
    fast.save_pretrained(str(target))
    Qwen2VLImageProcessorPil(
        patch_size=QWEN_PATCH, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=QWEN_MAX_PIXELS
    ).save_pretrained(str(target))
    # Qwen3.5 ships Qwen3-VL's processor.
    processor = {"qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(architecture, "Qwen3VLProcessor")
    (target / "processor_config.json").write_text(json.dumps({"processor_class": processor}) + "\n")
    return target


def add_value_head(model_dir: str | Path, seed: int = 0, *, beside: bool = False) -> Path:
    """Give a tiny checkpoint a random value head, `v_head.summary.weight` [1, H] and its bias: in its own
    safetensors file (TRL's tensors in a checkpoint, as AutoModelForCausalLMWithValueHead saves them) or,
    `beside`, in value_head.safetensors next to the model's files (Skywork-VL-Reward's and LLaMA-Factory's
    layout); so it is a reward model scored by that head."""
    from safetensors.torch import load_file, save_file

    target = Path(model_dir)
    config = json.loads((target / "config.json").read_text())
    hidden = int((config.get("text_config") or config)["hidden_size"])
    generator = torch.Generator().manual_seed(seed)
    head = {
        "v_head.summary.weight": torch.randn(1, hidden, generator=generator) / hidden**0.5,
        "v_head.summary.bias": torch.randn(1, generator=generator),
    }
    if beside:
        save_file(head, str(target / "value_head.safetensors"), metadata={"format": "pt"})
    else:
        weights = load_file(str(target / "model.safetensors"))
        save_file({**weights, **head}, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target

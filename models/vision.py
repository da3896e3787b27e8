"""Vision-language models: the declared families, their processor, and prompts that hold images."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from models.errors import ModelLoadError
from models.images import ImageError, decode_image
from schemas import MAX_IMAGE_PIXELS, ErrorCode


@dataclass(frozen=True)
class VisionFamily:
    """What one family of image-text models needs beside its weights: transformers' classes of its processor
    (built from the directory's own files, never a hub) and where its prompts mark an image."""

    processor: str
    # The Pillow backend: the same pixel values wherever torchvision is or is not installed.
    image_processor: str
    # The processor's attribute holding the text that marks an image's place (expanded to its tokens).
    placeholder: str


# Families whose image-text classifier runs here, checked against HF float32 (tests/models/test_vision.py).
VISION_FAMILIES = {
    "gemma3": VisionFamily("Gemma3Processor", "Gemma3ImageProcessorPil", "boi_token"),
}
# Families refused at start-up, each with its reason: scoring them wrong would be worse than not at all.
REFUSED_VISION = {
    "qwen2_5_vl": "its 3-D multimodal rotary positions (M-RoPE) are not computed by this worker yet",
    "qwen3_vl": "its 3-D multimodal rotary positions (M-RoPE) are not computed by this worker yet",
    "qwen2_vl": "its 3-D multimodal rotary positions (M-RoPE) are not computed by this worker yet",
}


def check_vision_type(model_type: object) -> None:
    """ModelLoadError for a vision-language family this worker knows it cannot score."""
    reason = REFUSED_VISION.get(str(model_type))
    if reason is not None:
        raise ModelLoadError(
            f"model type {model_type!r} (a vision-language model) is not supported: {reason}; supported "
            f"vision-language types: {', '.join(VISION_FAMILIES)}"
        )


def plain_attention(model_type: str) -> str:
    """HF's attention for a model on the plain path: eager, except an image-text model's, whose vision tower
    would hold [images, heads, patches, patches] of scores in eager (16 GB for 32 of Gemma 3's images);
    SDPA takes the same masks (the image blocks' both-ways attention included)."""
    return "sdpa" if model_type in VISION_FAMILIES else "eager"


@dataclass(frozen=True)
class ImagePrompts:
    """A request's prompts with its images' tokens in place: token ids, token types (1 at image tokens),
    and each prompt's pixel values [images, 3, H, W] in the order its image tokens come."""

    prompts: tuple[tuple[int, ...], ...]
    token_types: tuple[tuple[int, ...], ...]
    pixel_values: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class VisionPrompts:
    """Turns a request's texts and images into prompts with the model's own processor."""

    processor: Any
    placeholder: str
    # The token the vision features replace, and its text: a prompt holds it only where the processor put
    # it for an image (one more, and the model's count of features and tokens would not match).
    image_token_id: int
    image_token: str
    max_pixels: int = MAX_IMAGE_PIXELS

    def check_text_only(self, prompts: Sequence[tuple[int, ...]]) -> None:
        """ImageError when a prompt of a text request without images holds the image token."""
        if any(self.image_token_id in prompt for prompt in prompts):
            raise ImageError(ErrorCode.INVALID_REQUEST, self._typed_token_sentence())

    def _typed_token_sentence(self) -> str:
        return (
            f"the prompt holds the model's image token ({self.image_token!r}, id {self.image_token_id}) "
            f"outside an image; send images in images, and text and token ids without that token."
        )

    def placeholders(self, count: int) -> str:
        """The text that places `count` images, one after the other."""
        return self.placeholder * count

    def encode(self, images: Sequence[bytes], texts: Sequence[str], special_tokens: bool) -> ImagePrompts:
        """Decode the images (ImageError for a bad one) and let the processor expand each text's image marks
        into image tokens and turn the images into pixel values. Every text holds every image."""
        if any(self.image_token in text for text in texts):
            raise ImageError(ErrorCode.INVALID_REQUEST, self._typed_token_sentence())
        decoded = [
            decode_image(data, f"images[{index}]", self.max_pixels) for index, data in enumerate(images)
        ]
        prompts, types, pixels = [], [], None
        for text in texts:
            # The processor expands a mark only together with its image (it may crop one into several), so
            # each text goes with the images: a request's items repeat the resize, which costs far less than
            # the vision tower that runs once per prompt.
            encoded = self._process(text, decoded, special_tokens)
            prompts.append(tuple(int(token) for token in encoded["input_ids"][0]))
            types.append(tuple(int(kind) for kind in encoded["token_type_ids"][0]))
            if pixels is None:
                pixels = np.ascontiguousarray(encoded["pixel_values"], dtype=np.float32)
        return ImagePrompts(
            tuple(prompts), tuple(types), (_NO_IMAGES if pixels is None else pixels,) * len(texts)
        )

    def _process(self, text: str, images: list[Any], special_tokens: bool) -> Any:
        try:
            return self.processor(
                text=[text], images=[images], add_special_tokens=special_tokens, return_tensors="np"
            )
        except ValueError as exc:  # a text whose marks do not match its images, an image it cannot resize
            raise ImageError(
                ErrorCode.INVALID_REQUEST,
                f"the model's processor refused the request's images and text ({str(exc)[:200]}); send the "
                f"images without their placeholder text in the query, items or messages.",
            ) from None


def load_vision(model_dir: Path, model_type: str, tokenizer: Any) -> VisionPrompts:
    """The processor of a vision-language directory, from its own files (preprocessor_config.json for the
    image processor, processor_config.json for the image token count) and the loaded tokenizer."""
    import transformers

    family = VISION_FAMILIES[model_type]
    if tokenizer is None:
        raise ModelLoadError(
            f"{str(model_dir)!r} is a vision-language model without a tokenizer: its processor places image "
            "tokens in text, so the directory needs its tokenizer files"
        )
    try:
        image_processor = getattr(transformers, family.image_processor).from_pretrained(str(model_dir))
        settings_path = model_dir / "processor_config.json"
        settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
        settings.pop("processor_class", None)
        processor = getattr(transformers, family.processor)(
            image_processor=image_processor, tokenizer=tokenizer, **settings
        )
    except (
        Exception
    ) as exc:  # a missing or unreadable preprocessor_config.json, tokenizer without image tokens
        raise ModelLoadError(
            f"cannot build the image processor of {str(model_dir)!r} ({type(exc).__name__}: {exc}); a "
            "vision-language directory needs its preprocessor_config.json and a tokenizer with image tokens"
        ) from exc
    image_token = str(tokenizer.image_token)
    image_token_id = int(tokenizer.convert_tokens_to_ids(image_token))
    return VisionPrompts(processor, str(getattr(processor, family.placeholder)), image_token_id, image_token)


class _WithImages(Protocol):
    @property
    def prompts(self) -> tuple[tuple[int, ...], ...]: ...

    @property
    def pixel_values(self) -> tuple[np.ndarray, ...] | None: ...


_NO_IMAGES = np.zeros((0, 3, 1, 1), dtype=np.float32)


def batch_images(batch: Sequence[_WithImages]) -> list[np.ndarray] | None:
    """Each prompt's pixel values across a batch of prepared requests (none for a text-only prompt), or None
    when no request of the batch has images."""
    if all(p.pixel_values is None for p in batch):
        return None
    return [pixels for p in batch for pixels in (p.pixel_values or (_NO_IMAGES,) * len(p.prompts))]

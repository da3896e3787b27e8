"""Vision-language models: the declared families, their processor, and prompts that hold images."""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from models.errors import ModelLoadError
from models.images import ImageError, decode_image
from schemas import MAX_IMAGE_PIXELS, ErrorCode


@dataclass(frozen=True)
class VisionFamily:
    """What one family of image-text models needs beside its weights: transformers' classes of its processor
    (built from the directory's own files, never a hub), where its prompts mark an image, and what its
    forward takes beside the ids."""

    # Module-qualified classes: the processor, and its image processor's Pillow backend (the same pixel
    # values wherever torchvision is or is not installed).
    processor: str
    image_processor: str
    # The text that marks an image's place (expanded to its tokens), from the processor's attributes.
    placeholder: str
    # The processor's token types (1 at image tokens), under the name the model's forward takes them by.
    token_types: str = "token_type_ids"
    # The processor's per-image patch grid, which the forward needs beside the pixel values, if any.
    grid: str | None = None
    # Served as a judge (its *ForConditionalGeneration scored on label tokens).
    judge: bool = False
    # Served as a classifier (its *ForSequenceClassification, which takes the pixel values).
    classifier: bool = True


# The Qwens' image-text judges: each image's pad between its begin and end marks, modality token types and
# patch grids beside the pixel values; transformers has no classifier for Qwen2.5-VL or Qwen3-VL.
_QWEN_JUDGE = VisionFamily(
    "models.qwen_vl.ImageQwen2_5_VLProcessor",
    "transformers.Qwen2VLImageProcessorPil",
    "<|vision_start|>{image_token}<|vision_end|>",
    token_types="mm_token_type_ids",
    grid="image_grid_thw",
    judge=True,
    classifier=False,
)
_QWEN3_VL = replace(_QWEN_JUDGE, processor="models.qwen_vl.ImageQwen3VLProcessor")

# Families whose image-text models run here, checked against HF float32 (tests/models/test_vision.py,
# test_vision_judge.py, test_vision_heads.py). The Qwens' forwards derive their 3-D rotary positions (M-RoPE)
# from the token types, each image's grid and the attention mask of the padded batch (packed, Qwen2.5-VL's
# and Qwen3-VL's come from HF's rope index per item: models/vision_packed.py).
VISION_FAMILIES = {
    "gemma3": VisionFamily(
        "transformers.Gemma3Processor", "transformers.Gemma3ImageProcessorPil", "{boi_token}"
    ),
    "qwen2_5_vl": _QWEN_JUDGE,
    "qwen3_vl": _QWEN3_VL,
    # Qwen3.5: Qwen3-VL's processor and vision tower before the hybrid text model (Gated DeltaNet layers,
    # causal, so a right-padded row's real tokens never see its padding). transformers has its classifier
    # too (Qwen3_5ForSequenceClassification passes the pixel values to the whole model).
    "qwen3_5": replace(_QWEN3_VL, classifier=True),
}
# Families refused at start-up, each with its reason: scoring them wrong would be worse than not at all.
REFUSED_VISION = {
    "qwen2_vl": "its 3-D multimodal rotary positions (M-RoPE) are not checked in this worker yet",
}


def check_vision_type(model_type: object, judge: bool) -> None:
    """ModelLoadError for a vision-language family this worker knows it cannot score, or one declared as a
    classifier that is served as a judge only."""
    reason = REFUSED_VISION.get(str(model_type))
    if reason is not None:
        raise ModelLoadError(
            f"model type {model_type!r} (a vision-language model) is not supported: {reason}; supported "
            f"vision-language types: {', '.join(VISION_FAMILIES)}"
        )
    family = VISION_FAMILIES.get(str(model_type))
    if family is not None and not family.classifier and not judge:
        raise ModelLoadError(
            f"model type {model_type!r} is served as a judge only: its *ForConditionalGeneration scored on "
            "label_token_ids (transformers has no sequence classifier for it)"
        )


def is_vision_judge(model_type: object, architectures: Sequence[str]) -> bool:
    """An image-text family served as a judge, declared as its *ForConditionalGeneration."""
    family = VISION_FAMILIES.get(str(model_type))
    judge = family is not None and family.judge
    return judge and any(arch.endswith("ForConditionalGeneration") for arch in architectures)


def plain_attention(model_type: str) -> str:
    """HF's attention for a model on the plain path: eager, except an image-text model's, whose vision tower
    would hold [images, heads, patches, patches] of scores in eager (16 GB for 32 of Gemma 3's images);
    SDPA takes the same masks (the image blocks' both-ways attention included)."""
    return "sdpa" if model_type in VISION_FAMILIES else "eager"


@dataclass(frozen=True)
class ImageInputs:
    """One prompt's images as its model's forward takes them: pixel values in the order its image tokens
    come ([images, 3, H, W]; the Qwens: [patches, channels x patch volume]) and, where the family has one,
    each image's patch grid [images, 3] (time, height, width)."""

    pixel_values: np.ndarray
    grid: np.ndarray | None = None


@dataclass(frozen=True)
class ImagePrompts:
    """A request's prompts with its images' tokens in place: token ids, token types (1 at image tokens),
    and each prompt's images."""

    prompts: tuple[tuple[int, ...], ...]
    token_types: tuple[tuple[int, ...], ...]
    pixel_values: tuple[ImageInputs, ...]


@dataclass(frozen=True)
class VisionPrompts:
    """Turns a request's texts and images into prompts with the model's own processor."""

    processor: Any
    placeholder: str
    family: VisionFamily
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
        # The image tokens the marks of its images hold (Qwen2.5-VL's mark is one; Gemma 3's holds none):
        # any other is typed text.
        expected = self.placeholders(len(images)).count(self.image_token)
        if any(text.count(self.image_token) != expected for text in texts):
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
            types.append(tuple(int(kind) for kind in encoded[self.family.token_types][0]))
            if pixels is None and "pixel_values" in encoded:
                grid = None if self.family.grid is None else np.asarray(encoded[self.family.grid], np.int64)
                pixels = ImageInputs(np.ascontiguousarray(encoded["pixel_values"], dtype=np.float32), grid)
        return ImagePrompts(
            tuple(prompts), tuple(types), (_NO_IMAGES if pixels is None else pixels,) * len(texts)
        )

    def forward_images(self, images: Sequence[ImageInputs]) -> dict[str, np.ndarray]:
        """A padded batch's images as the forward takes them: every prompt's pixel values (and grids) in
        row order, the prompts without images skipped; empty when no prompt has any."""
        held = [one for one in images if len(one.pixel_values)]
        if not held:
            return {}
        out = {"pixel_values": np.concatenate([one.pixel_values for one in held])}
        if self.family.grid is not None:
            out[self.family.grid] = np.concatenate([one.grid for one in held if one.grid is not None])
        return out

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
    family = VISION_FAMILIES[model_type]
    if tokenizer is None:
        raise ModelLoadError(
            f"{str(model_dir)!r} is a vision-language model without a tokenizer: its processor places image "
            "tokens in text, so the directory needs its tokenizer files"
        )
    try:
        image_processor = _class(family.image_processor).from_pretrained(str(model_dir))
        settings_path = model_dir / "processor_config.json"
        settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
        settings.pop("processor_class", None)
        processor = _class(family.processor)(image_processor=image_processor, tokenizer=tokenizer, **settings)
    except (
        Exception
    ) as exc:  # a missing or unreadable preprocessor_config.json, tokenizer without image tokens
        raise ModelLoadError(
            f"cannot build the image processor of {str(model_dir)!r} ({type(exc).__name__}: {exc}); a "
            "vision-language directory needs its preprocessor_config.json and a tokenizer with image tokens"
        ) from exc
    # Gemma 3's tokenizer names its soft token (its processor's image_token is the begin mark); Qwen's
    # tokenizers may name none, and its processor's image_token is the pad the features replace.
    image_token = str(getattr(tokenizer, "image_token", None) or processor.image_token)
    image_token_id = int(tokenizer.convert_tokens_to_ids(image_token))
    marks = {name: str(getattr(processor, name, "")) for name in ("boi_token", "image_token")}
    return VisionPrompts(processor, family.placeholder.format(**marks), family, image_token_id, image_token)


def _class(qualified: str) -> Any:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


class _WithImages(Protocol):
    @property
    def prompts(self) -> tuple[tuple[int, ...], ...]: ...

    @property
    def pixel_values(self) -> tuple[ImageInputs, ...] | None: ...


_NO_IMAGES = ImageInputs(np.zeros((0, 3, 1, 1), dtype=np.float32))


def batch_images(batch: Sequence[_WithImages]) -> list[ImageInputs] | None:
    """Each prompt's pixel values across a batch of prepared requests (none for a text-only prompt), or None
    when no request of the batch has images."""
    if all(p.pixel_values is None for p in batch):
        return None
    return [pixels for p in batch for pixels in (p.pixel_values or (_NO_IMAGES,) * len(p.prompts))]

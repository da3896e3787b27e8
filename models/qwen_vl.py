"""The Qwen VL processors (Qwen3.5 ships Qwen3-VL's) for images alone: their video half needs torchvision."""

from __future__ import annotations

from typing import Any

from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor


class ImageQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """HF's Qwen2_5_VLProcessor without a video processor (the worker scores no videos): transformers takes a
    processor's parts from its constructor's arguments, and a video processor cannot be built without
    torchvision. Images, their pads' expansion and the token types are HF's own code."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
    ) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)  # type: ignore[no-untyped-call]


class ImageQwen3VLProcessor(Qwen3VLProcessor):
    """HF's Qwen3VLProcessor without a video processor, as ImageQwen2_5_VLProcessor."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
    ) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)  # type: ignore[no-untyped-call]

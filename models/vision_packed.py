"""Image-text judges on the packed path: the vision tower once over a batch's images, its features at the
image tokens of the packed row, and each item's 3-D rotary positions (M-RoPE) from HF's own rope index."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from models.errors import ModelLoadError
from models.packing import Pooling, pack, pool
from models.vision import ImageInputs, VisionPrompts

if TYPE_CHECKING:
    from models.config import ScorerConfig
    from models.linear_attention import PackedLinearAttention
    from models.prepare import Prompt

# Image-text families whose packed forward is checked against HF float32 (tests/models/test_vision_judge.py).
# Their text models attend causally throughout, image tokens included, so the packed row's causal attention
# per item (cu_seqlens) is theirs. Qwen3.5's text model mixes that attention with Gated DeltaNet layers, which
# run the project's packed layer (models/linear_attention.py: state and convolution window restart at each
# item). Gemma 3 is not among them: its text model attends both ways inside each
# image's block of soft tokens, a mask per block the varlen kernels do not take; it stays on the padded path.
PACKED_VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
# The vision tower's attention: HF's SDPA over each image's patches (packed attention is for the text model,
# whose calls carry the row's bounds; the tower's calls carry none).
TOWER_ATTENTION = "sdpa"


class _Loaded(Protocol):
    """What the packed forward reads of models.loading._Loaded (which imports this module)."""

    @property
    def base(self) -> torch.nn.Module: ...
    @property
    def vision(self) -> VisionPrompts | None: ...
    @property
    def packable(self) -> bool: ...
    @property
    def pad_token_id(self) -> int | None: ...
    @property
    def name(self) -> str: ...


def packs_images(model_type: str, packed_images: bool) -> bool:
    """Whether an image-text model of `model_type` runs on the packed path (`packed_images`: the setting)."""
    return packed_images and model_type in PACKED_VISION_FAMILIES


def attention_implementations(text: str) -> dict[str, str]:
    """transformers' attention choice per sub-model: the packed attention `text` for the text model, SDPA for
    the vision tower."""
    return {"": text, "text_config": text, "vision_config": TOWER_ATTENTION}


class PackedImages:
    """The packed forward of an image-text judge: the items of a batch in one row, the images' features in
    place of their tokens' embeddings, positions per item on three axes, attention causal per item.

    Every step is HF's own code, called part by part as its model's forward calls it: the vision tower
    (`get_image_features`, once over all the batch's images, each of a request's images once however many
    items hold it), the placement of its features
    (`get_placeholder_mask`, then a masked scatter in token order, which is the images' order), each
    item's positions (`get_rope_index` on that item alone, from its ids, token types and image grids) and
    the text model (whose own forward adds Qwen3-VL's deep-stack features to its first layers' outputs at
    the image tokens). Only the text model's attention is ours, through the attention interface, and a
    hybrid text model's Gated DeltaNet layers (`linear`, swapped in around the text model's forward)."""

    def __init__(
        self,
        loaded: _Loaded,
        device: torch.device,
        dtype: torch.dtype,
        attention: str,
        pooling: Pooling,
        linear: PackedLinearAttention | None = None,
    ) -> None:
        self._base: Any = loaded.base
        assert loaded.vision is not None
        self._vision = loaded.vision
        self._pad = loaded.pad_token_id
        self.device, self.dtype, self.pooling = device, dtype, pooling
        self._linear = linear
        # The varlen kernel reads the bounds on the device; the exact path loops over items on the host.
        self._bounds_on_device = attention == "varlen"

    @classmethod
    def of(
        cls,
        loaded: _Loaded,
        config: ScorerConfig,
        device: torch.device,
        dtype: torch.dtype,
        attention: str,
        pooling: Pooling,
        linear: PackedLinearAttention | None = None,
    ) -> PackedImages | None:
        """The packed forward of a packed image-text model (`linear`: its text model's Gated DeltaNet layers,
        None without), None for any other; ModelLoadError for settings it does not take."""
        if loaded.vision is None or not loaded.packable:
            return None
        if config.adapter_dirs:
            raise ModelLoadError(
                f"{loaded.name}: LoRA adapters are not served on the packed path of image-text models; set "
                "packed_images to false (HF's own forward on padded batches) to serve them"
            )
        return cls(loaded, device, dtype, attention, pooling, linear)

    @torch.inference_mode()
    def pooled(
        self,
        prompts: list[Prompt],
        token_types: list[Prompt] | None,
        positions: Sequence[Sequence[int]] | None,
        images: Sequence[ImageInputs] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each prompt's pooled final-norm state [N, H] (float32 for MEAN) and the rows at `positions`
        [M, H], as the packed path of text models pools them."""
        packed = pack(prompts, self.device, self.pooling, self._pad, read_at=positions)
        types = token_types if token_types is not None else [(0,) * len(p) for p in prompts]
        rope = self.rope_positions(prompts, types, images)
        cu_seqlens = packed.cu_seqlens if self._bounds_on_device else packed.host_cu_seqlens
        hidden = self.forward(packed.input_ids, rope, cu_seqlens, packed.max_length, images)
        at = None if packed.position_rows is None else hidden.index_select(0, packed.position_rows)
        return pool(hidden, packed), at

    def rope_positions(
        self,
        prompts: Sequence[Prompt],
        token_types: Sequence[Prompt],
        images: Sequence[ImageInputs] | None,
    ) -> torch.Tensor:
        """The packed row's positions [3, 1, T] (time, row, column): each item's from HF's rope index on the
        item alone, so each restarts at 0 as the item would alone. An item without images counts 0, 1, 2,
        ... on all three axes, as HF's text model expands its 1-D positions."""
        rows = []
        for index, prompt in enumerate(prompts):
            held = None if images is None else images[index]
            if held is None or held.grid is None or not len(held.pixel_values):
                rows.append(torch.arange(len(prompt)).view(1, 1, -1).expand(3, 1, -1))
                continue
            item, _ = self._base.get_rope_index(
                torch.tensor([prompt], dtype=torch.long),
                mm_token_type_ids=torch.tensor([token_types[index]], dtype=torch.long),
                image_grid_thw=torch.from_numpy(held.grid),
            )
            rows.append(item)
        return torch.cat(rows, dim=2).to(self.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        rope: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_length: int,
        images: Sequence[ImageInputs] | None,
    ) -> torch.Tensor:
        """The text model on the packed row [1, T] with the images' features in place: its final-norm
        hidden states [T, H]."""
        base = self._base
        embeds = base.get_input_embeddings()(input_ids)
        extra: dict[str, Any] = {}
        distinct, order = _distinct_images(images)
        pixels = self._pixels(distinct)
        if pixels is not None:
            features = base.get_image_features(*pixels, return_dict=True)
            sizes = (pixels[1].prod(-1) // base.visual.spatial_merge_size**2).tolist()
            placed = _in_order(features.pooler_output, sizes, order).to(embeds.device, embeds.dtype)
            mask, _ = base.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=placed)
            embeds = embeds.masked_scatter(mask, placed)
            deepstack = getattr(features, "deepstack_features", None)
            if deepstack is not None:  # Qwen3-VL: the tower's intermediate features, one set per first layer
                extra["visual_pos_masks"] = mask[..., 0]
                extra["deepstack_visual_embeds"] = [_in_order(layer, sizes, order) for layer in deepstack]
        with self._linear or contextlib.nullcontext():
            output = base.language_model(
                input_ids=None,
                inputs_embeds=embeds,
                position_ids=rope,
                use_cache=False,
                **extra,
                # Reach our attention function (and Gated DeltaNet layers) through HF's **kwargs plumbing
                # (see models/attention.py).
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens,
                max_length_q=max_length,
                max_length_k=max_length,
            )
        hidden: torch.Tensor = output.last_hidden_state[0]
        return hidden

    def _pixels(self, images: Sequence[ImageInputs] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The batch's pixel values (in the model's dtype) and image grids, prompt after prompt, or None
        when no prompt holds an image."""
        arrays = self._vision.forward_images(images) if images is not None else {}
        grid = self._vision.family.grid
        if "pixel_values" not in arrays or grid is None:
            return None
        pixels = torch.from_numpy(arrays["pixel_values"]).to(self.device, self.dtype)
        return pixels, torch.from_numpy(arrays[grid]).to(self.device)


def _distinct_images(images: Sequence[ImageInputs] | None) -> tuple[list[ImageInputs], list[int]]:
    """The batch's image sets, each once (a request's items share one: models/vision.py's encode), and the
    images the row's image tokens take, in order: indices into the distinct sets' images, set after set."""
    distinct: list[ImageInputs] = []
    first_image: dict[int, int] = {}  # id of a set -> the index of its first image among the distinct ones
    count, order = 0, list[int]()
    for held in images or ():
        if held.grid is None or not len(held.pixel_values):
            continue
        if id(held) not in first_image:
            first_image[id(held)] = count
            distinct.append(held)
            count += len(held.grid)
        start = first_image[id(held)]
        order.extend(range(start, start + len(held.grid)))
    return distinct, order


def _in_order(
    features: torch.Tensor | Sequence[torch.Tensor], sizes: list[int], order: list[int]
) -> torch.Tensor:
    """Per-image features of the distinct images (whole [tokens, H], as transformers 5.17 hands Qwen3-VL's
    deep stack, or split per image, as the pooled features and 5.25's deep stack come) in the row's order
    of image tokens [tokens, H]."""
    per_image = torch.split(features, sizes) if isinstance(features, torch.Tensor) else tuple(features)
    return torch.cat([per_image[index] for index in order], dim=0)

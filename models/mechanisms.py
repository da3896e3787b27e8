"""The model's own mechanisms that the packed forward runs in its own way, each found in the loaded model and
checked against the settings at start-up: sparse mixture-of-experts blocks (models/moe.py) and Gated
DeltaNet layers (models/linear_attention.py)."""

from __future__ import annotations

import logging

import torch

from models.config import ScorerConfig
from models.errors import ModelLoadError
from models.layers import decoder_layers
from models.linear_attention import PackedLinearAttention, is_hybrid
from models.loading import LoadedModel
from models.moe import MoeBlocks, unsupported

log = logging.getLogger(__name__)


def moe_blocks(loaded: LoadedModel) -> MoeBlocks | None:
    """The model's sparse mixture-of-experts blocks with the packed forward, or None where it has none (or
    runs padded, HF's own forward); ModelLoadError where a block cannot take it."""
    if not loaded.packable:
        return None
    blocks = MoeBlocks.of(decoder_layers(loaded.base))
    if blocks is None:
        return None
    why = unsupported(blocks.blocks)
    if why is not None:
        raise ModelLoadError(f"{loaded.name}: {why}")
    log.info("%s: %d mixture-of-experts blocks run as grouped expert products", loaded.name, len(blocks))
    return blocks


def linear_layers(
    loaded: LoadedModel, config: ScorerConfig, device: torch.device, attention: str
) -> PackedLinearAttention | None:
    """The packed forward of the model's Gated DeltaNet layers, or None without such layers; settings the
    family cannot serve are refused (ModelLoadError) or turned off, each with its reason in the log."""
    refused = {
        "quantization='fp8'": config.quantization == "fp8",
        "adapters": bool(config.adapter_dirs),
        "prefix_cache_mib": bool(config.prefix_cache_mib),
        "tensor_parallel": config.tensor_parallel > 1,
    }
    if not loaded.packable:
        # Qwen3.5's image-text model: HF's own layers on the padded batch, whose projections the FP8 and
        # LoRA swaps were never checked against.
        if is_hybrid(loaded.model.config.get_text_config()):
            _refuse(loaded, {key: refused[key] for key in ("quantization='fp8'", "adapters")})
        return None
    linear = PackedLinearAttention.of(loaded.base, device)
    if linear is None:
        return None
    _refuse(loaded, refused)
    turned_off = [
        name
        for name, on in (
            ("compiled layers", config.resolve_compile(attention, device)),
            ("CUDA graphs", config.resolve_graphs(device, attention)),
            ("the last layer at the pooled rows", config.last_layer_pooled_rows),
        )
        if on
    ]
    if turned_off:
        log.info(
            "%s: %s stay off (the Gated DeltaNet layers read their sequence bounds on the host)",
            loaded.name, ", ".join(turned_off),
        )  # fmt: skip
    log.info(
        "%s: %d Gated DeltaNet layers run packed on the %s kernels", loaded.name, len(linear), linear.kernel
    )
    return linear


def _refuse(loaded: LoadedModel, settings: dict[str, bool]) -> None:
    """ModelLoadError for the first of `settings` asked for, which the Gated DeltaNet layers do not take."""
    for setting, asked in settings.items():
        if asked:
            raise ModelLoadError(
                f"{setting}: {loaded.name}'s Gated DeltaNet layers are not served with it (their "
                "projections, recurrent state and sharding have no path of their own there yet)"
            )

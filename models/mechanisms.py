"""The model's own mechanisms that the packed forward runs in its own way, each found in the loaded model and
checked against the settings at start-up: sparse mixture-of-experts blocks (models/moe.py), Gated DeltaNet
layers (models/linear_attention.py), and the prefix cache over its layers (models/prefix_cache.py)."""

from __future__ import annotations

import logging

import torch

from models.config import ScorerConfig
from models.errors import ModelLoadError
from models.layers import decoder_layers, is_causal_decoder, transformer_layers
from models.linear_attention import PackedLinearAttention, is_hybrid
from models.linear_cache import CachedStates
from models.loading import LoadedModel
from models.moe import MoeBlocks, unsupported
from models.packing import Pooling
from models.prefix_cache import CacheLayout, PrefixCache

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
        "tensor_parallel": config.tensor_parallel > 1,
        # Qwen3.5's image-text model serves no adapters on either path (the packed image forward takes none,
        # and HF's layers of the padded batch were never checked with them).
        "adapters": loaded.vision is not None and bool(config.adapter_dirs),
    }
    if not loaded.packable:
        # Qwen3.5's image-text model with packed_images off: HF's own layers on the padded batch, whose
        # projections the FP8 and LoRA swaps were never checked against.
        if is_hybrid(loaded.model.config.get_text_config()):
            padded = {
                "quantization='fp8'": refused["quantization='fp8'"],
                "adapters": bool(config.adapter_dirs),
            }
            _refuse(loaded, padded)
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
                f"{setting}: {loaded.name}'s Gated DeltaNet layers are not served with it (no path of theirs "
                "takes it yet: FP8 projections, sharded layers, LoRA on HF's own layers of a padded batch)"
            )


def prefix_cache(
    loaded: LoadedModel, config: ScorerConfig, pooling: Pooling, linear: PackedLinearAttention | None
) -> tuple[PrefixCache | None, CacheLayout]:
    """The prefix cache where `prefix_cache_mib` asks for one (None: off), and which layers it keeps what
    of (a hybrid's Gated DeltaNet layers keep states, the others keys and values); ModelLoadError where it
    cannot serve."""
    layers = transformer_layers(loaded.base)
    states = None if linear is None else CachedStates(tuple(linear.layer_numbers), linear.conv_width)
    gated = () if states is None else states.layers
    layout = CacheLayout(tuple(n for n in range(len(layers or ())) if n not in gated), states)
    mib = config.prefix_cache_mib
    if not mib:
        return None, layout
    why = _cache_refusal(loaded, config, pooling)
    if why is None and states is not None:
        why = states.refusal(config.prefix_cache_block_tokens)
    if why is not None:
        raise ModelLoadError(f"prefix_cache_mib: {why}")
    log.info(
        "%s: a prefix cache of %d MiB, blocks of %d tokens, kept at their %s sight",
        loaded.name, mib, config.prefix_cache_block_tokens, config.prefix_cache_admit,
    )  # fmt: skip
    cache = PrefixCache(
        config.prefix_cache_block_tokens, mib << 20, admit_first_sight=config.prefix_cache_admit == "first"
    )
    return cache, layout


def _cache_refusal(loaded: LoadedModel, config: ScorerConfig, pooling: Pooling) -> str | None:
    """Why the prefix cache cannot serve this model and these settings (None: it can)."""
    name = loaded.name
    layers = transformer_layers(loaded.base)
    if not (loaded.packable and is_causal_decoder(loaded)) or layers is None:
        return f"{name} is not a causal decoder on the packed path (where a prefix has states of its own)"
    if loaded.vision is not None:
        return f"{name} is an image-text model, whose packed forward (models/vision_packed.py) keeps no cache"
    if pooling == "mean":
        return "mean pooling reads every row of a prompt, and the cache holds no rows, only keys and values"
    if config.deterministic:
        return "the deterministic setting runs every item alone, from its first token"
    if config.tensor_parallel > 1:
        return "under tensor parallelism each rank holds a share of the heads; the cache serves one device"
    # Each layer's attention (or Gated DeltaNet) module: the child whose name says attention.
    modules = [
        child
        for layer in layers
        for child_name, child in layer.named_children()
        if "attn" in child_name or "attention" in child_name
    ]
    numbers = [getattr(m, "layer_idx", None) for m in modules]
    shapes = {
        (getattr(m, "num_key_value_groups", None), m.head_dim) for m in modules if hasattr(m, "head_dim")
    }
    if sorted(n for n in numbers if isinstance(n, int)) != list(range(len(layers))):
        return f"{name}'s attention modules do not number their layers (layer_idx)"
    if len(shapes) > 1:
        # Gemma 4's global layers: wider heads, fewer of them, than its sliding ones.
        return (
            f"{name}'s layers hold keys of different shapes (key-value heads and head widths per layer), "
            "and the cache keeps every layer's keys in one pool of one shape"
        )
    return None

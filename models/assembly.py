"""How a Scorer's parts are chosen at start-up from its settings and the loaded model: which loader reads
the weights (whole, a tensor-parallel share, or FP8 layer by layer), the prompt builder, and the shortest
prefix that batches compute once."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from models.compare import RewardRule
from models.config import ScorerConfig
from models.heads import NamedHeads
from models.layers import is_causal_decoder
from models.loading import LoadedModel, load_model
from models.prepare import PairTemplate, PromptBuilder

if TYPE_CHECKING:
    from models.tensor_parallel import Shard

log = logging.getLogger(__name__)


def load(
    model_dir: Path,
    model_config: dict[str, object],
    config: ScorerConfig,
    device: torch.device,
    dtype: torch.dtype,
    implementation: str,
    shard: Shard | None,
) -> LoadedModel:
    """The model as the settings ask: a tensor-parallel share or FP8 read layer by layer go through the
    sharded loader (the whole model is the share of a group of one), everything else through HF's."""
    fp8_by_layer = fp8_layer_by_layer(config, device, dtype, model_dir, model_config)
    if shard is None and not fp8_by_layer:
        return load_model(
            model_dir,
            device=device,
            dtype=dtype,
            attn_implementation=implementation,
            trust_remote_code=config.trust_remote_code,
            allow_pickle_weights=config.allow_pickle_weights,
            packed_images=config.packed_images,
        )
    from models.tensor_parallel import Shard, load_sharded

    quantize = fp8_by_layer or (shard is not None and fp8_runs(config, device, dtype))
    loaded, _ = load_sharded(
        model_dir, device=device, dtype=dtype, attn_implementation=implementation,
        shard=shard or Shard(0, 1), trust_remote_code=config.trust_remote_code,
        quantize=config.fp8_selection if quantize else None,
    )  # fmt: skip
    return loaded


def fp8_runs(config: ScorerConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """FP8 projections asked for, on a device and dtype where they run (elsewhere the Executor refuses
    them with its reason)."""
    from models.fp8 import fp8_supported

    if config.quantization != "fp8" or fp8_supported(device) is not None:
        return False
    return not (device.type == "cuda" and dtype != torch.bfloat16)


def fp8_layer_by_layer(
    config: ScorerConfig,
    device: torch.device,
    dtype: torch.dtype,
    model_dir: Path,
    model_config: dict[str, object],
) -> bool:
    """FP8 on a decoder classifier with safetensors weights: loaded layer by layer, each quantized as it
    is read, so that the model's dtype never holds more than one layer (a 70B model's FP8 weights fit
    one GPU; its bfloat16 ones do not). Pickle-only weights keep HF's own loading."""
    from models.tensor_parallel import splittable

    return (
        fp8_runs(config, device, dtype)
        and splittable(model_config, config.trust_remote_code)
        and any(model_dir.glob("*.safetensors"))
    )


def reward_rule(model: LoadedModel, head_width: int) -> RewardRule:
    """Which scores a comparison reads as rewards: a judge's label columns (each request's own), else the
    head's `head_width` columns, separate sigmoids where the checkpoint says it was trained so."""
    if model.judge:
        return RewardRule(width=None)
    problem = getattr(model.model.config, "problem_type", None)
    return RewardRule(width=head_width, independent=problem == "multi_label_classification")


def prompt_builder(
    model: LoadedModel, config: ScorerConfig, named_heads: NamedHeads | None, rule: RewardRule | None = None
) -> PromptBuilder:
    """The tokenizing and validating step for this model and the settings' request limits."""
    limit = model.max_position_embeddings
    if config.max_item_tokens is not None:
        limit = min(limit, config.max_item_tokens)
    template = PairTemplate.from_tokenizer(model.tokenizer) if model.encoder else None
    return PromptBuilder(
        model.tokenizer,
        model.vocab_size,
        limit,
        template,
        judge=model.judge,
        max_request_items=config.max_request_items,
        max_request_tokens=config.max_request_tokens,
        step_separator=model.step_separator,
        adapters=tuple(config.adapter_dirs),
        heads=tuple(named_heads.widths.items()) if named_heads is not None else (),
        vision=model.vision,
        reward_rule=rule,
    )


def shared_prefix_tokens(model: LoadedModel, config: ScorerConfig, name: str) -> int:
    """The shortest prefix batches compute once: the setting on a packed causal decoder that is not
    deterministic (where every item runs alone), else 0 (nothing shared)."""
    tokens = config.share_prefix_min_tokens
    if not (tokens and model.packable):
        return 0
    if model.vision is not None:
        log.info("%s reads images: its prompts are computed whole (not yet shared on its path)", name)
        return 0
    if not is_causal_decoder(model):
        log.info("%s is an encoder: its prompts are computed whole", name)
        return 0
    if config.deterministic:
        return 0
    log.info("prefixes of %d tokens or more that prompts of a batch share are computed once", tokens)
    return tokens

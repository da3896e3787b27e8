"""The decoder families the engine runs, one declared entry each: what loads, its quirks, which paths take it.

The engine runs transformers' own decoder layers with its attention in place (models/attention.py), so a
family's arithmetic is HF's; what differs between families, and what this table declares, is which of the
engine's own moves stay exact on it: the fused MLP kernel (an MLP of the form down(silu(gate) * up)),
tensor parallelism (a norm over a whole projection cannot be cut by heads alone), and the config values a
family's HF code does not serve packed. Quirks a config states for itself are read from it where they act:
soft caps (models/engine.py, loading's final_softcap), windows (models.layers.sliding_window), per-layer key
shapes (the prefix cache's refusal, models/mechanisms.py). Adding a family is one `Family(...)` entry in
FAMILIES, the tiny model's config (models/tiny.py) and its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from models.errors import ModelLoadError

Layout = Literal["separate", "fused"]
Norms = Literal["pre", "sandwich", "post"]
QkNorm = Literal["head", "projection"]
ConfigCheck = Callable[[dict[str, Any]], str | None]


@dataclass(frozen=True)
class Family:
    """A decoder family by its config.json model_type.

    `classifier`: transformers has its *ForSequenceClassification (else it loads only as a judge).
    `mlp`: the MLP class and its layout where its forward is down(silu(gate(x)) * up(x)) (the fused MLP
    kernel's form): "separate" gate_proj/up_proj, or "fused" gate_up_proj (gate rows, then up rows); None:
    another MLP.
    `norms`: where a layer normalises: before each sublayer ("pre"), before and after ("sandwich"), or only
    after ("post", OLMo 2: the sublayer's output, before the residual sum).
    `qk_norm`: queries and keys normalised per head ("head") or over the whole projection ("projection":
    tensor parallelism sums each rank's squares across the group, models/tensor_parallel.py).
    `norm_adds_one`: its RMSNorms scale by (1 + weight), so a neutral weight is zero (Gemma 2 and 3).
    `tensor_parallel`: why tensor parallelism cannot split it (None: it can).
    `sharded_load`: why the layer-by-layer loader (tensor parallelism, and FP8 weights read layer by layer)
    cannot take it at any group size (None: it can), e.g. layers whose kind its surgery does not know.
    `check`: a config this family's entry does not serve (a sentence saying why), or None.
    """

    model_type: str
    classifier: bool = True
    mlp: tuple[str, Layout] | None = None
    norms: Norms = "pre"
    qk_norm: QkNorm | None = None
    norm_adds_one: bool = False
    tensor_parallel: str | None = None
    sharded_load: str | None = None
    check: ConfigCheck | None = None


def _gemma4_check(config: dict[str, Any]) -> str | None:
    """Gemma 4's text model runs packed where its tokens attend causally; its other features (per-layer
    inputs, layers that reuse an earlier layer's keys and values, keys equal to values, mixture-of-experts
    blocks, per-layer head widths) are its own HF code around our attention, and are tested as such."""
    if config.get("use_bidirectional_attention") == "all":
        return (
            "use_bidirectional_attention='all' makes every token attend to the whole prompt; the packed "
            "engine's sequences are causal"
        )
    return None


_LINEAR_SPLIT = "its Gated DeltaNet layers have no sharded form"

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama", mlp=("LlamaMLP", "separate")),
        Family("mistral", mlp=("MistralMLP", "separate")),
        Family("qwen2", mlp=("Qwen2MLP", "separate")),
        Family("qwen3", mlp=("Qwen3MLP", "separate"), qk_norm="head"),
        Family("gemma2", norms="sandwich", norm_adds_one=True),
        Family("gemma3_text", norms="sandwich", qk_norm="head", norm_adds_one=True),
        Family("phi3", mlp=("Phi3MLP", "fused")),
        # Sparse blocks of routed experts (models/moe.py) among dense layers; the fused MLP kernel is for
        # dense gated MLPs, so none is declared.
        Family("qwen3_moe", qk_norm="head"),
        # Some layers without rotary positions (no_rope_layers); HF's attention skips it there.
        Family("smollm3", mlp=("SmolLM3MLP", "separate")),
        Family(
            "olmo2",
            mlp=("Olmo2MLP", "separate"),
            norms="post",
            qk_norm="projection",
        ),
        # OLMo 2's layout with sliding-window layers (layer_types).
        Family(
            "olmo3",
            mlp=("Olmo3MLP", "separate"),
            norms="post",
            qk_norm="projection",
        ),
        # Partial rotary on interleaved pairs, norms after each sublayer too, one gate_up projection.
        Family("glm4", mlp=("Glm4MLP", "fused"), norms="sandwich"),
        # Hybrids: Gated DeltaNet layers (models/linear_attention.py) between full-attention ones, whose
        # RMSNorms scale by (1 + weight); Qwen3-Next's MLPs are sparse blocks with a shared expert.
        Family("qwen3_5_text", qk_norm="head", norm_adds_one=True, sharded_load=_LINEAR_SPLIT),
        Family("qwen3_next", qk_norm="head", norm_adds_one=True, sharded_load=_LINEAR_SPLIT),
        # Judges only: transformers has no Gemma 4 classifier. Its sliding layers, per-layer inputs and
        # shared key-value layers are HF's code; checked by _gemma4_check.
        Family(
            "gemma4_text",
            classifier=False,
            norms="sandwich",
            qk_norm="head",
            tensor_parallel="transformers has no Gemma 4 classifier, and judges run on one device",
            check=_gemma4_check,
        ),
    )
}

# Model types near a family here that are not served, and what to do instead.
UNSERVED = {
    "gemma4": (
        "Gemma 4's multimodal wrapper, Gemma4ForConditionalGeneration; a text judge loads as its language "
        "model alone: model_type 'gemma4_text', Gemma4ForCausalLM"
    ),
}

# Every decoder model type, and those with a classifier (the others are judges only).
DECODER_MODEL_TYPES = tuple(FAMILIES)
CLASSIFIER_MODEL_TYPES = tuple(name for name, family in FAMILIES.items() if family.classifier)
# The MLP classes the fused kernel may take, by class name: their layout.
GATED_SILU_MLPS: dict[str, Layout] = {
    family.mlp[0]: family.mlp[1] for family in FAMILIES.values() if family.mlp is not None
}


def family(model_type: object) -> Family | None:
    """The declared family of `model_type`, or None (an encoder, or a type not served)."""
    return FAMILIES.get(str(model_type))


def check_config(config: dict[str, Any]) -> None:
    """ModelLoadError where the family's entry refuses this config (its sentence says why)."""
    declared = family(config.get("model_type"))
    why = declared.check(config) if declared is not None and declared.check is not None else None
    if why is not None:
        raise ModelLoadError(f"{config.get('model_type')}: {why}")


def tensor_parallel_refusal(model_type: object, world: int) -> str | None:
    """Why tensor parallelism over `world` ranks cannot split this family (None: it can). A group of one
    (FP8 weights loaded layer by layer through the same loader) cuts nothing, so every family takes it
    whose layers that loader knows."""
    declared = family(model_type)
    if declared is None:
        return None
    if declared.sharded_load is not None:
        return declared.sharded_load
    return None if world <= 1 else declared.tensor_parallel

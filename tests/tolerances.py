"""Float comparison bounds of the test suite, derived from the arithmetic in one place.

A bound here is a worst case of IEEE round-to-nearest arithmetic, never what one machine's run printed. The
facts it rests on (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., chapters 2 and 3):

- Unit roundoff u (UNIT_ROUNDOFF), half the machine epsilon: one rounding to a format moves a value x by at
  most u * |x| in the normal range. float32: u = 2^-24 = 5.96e-8 (eps32 = 2^-23 = 1.19e-7); float16:
  2^-11 = 4.88e-4; bfloat16: 2^-8 = 3.91e-3; FP8 e4m3: 2^-4 (a relative step, eps, of 2^-3); float64: 2^-53.
- A sum or dot product of n terms, in any order at all (sequential, pairwise, blocked, in SIMD lanes, split
  across threads: whatever a BLAS, oneDNN, SDPA or a Triton tile picks on a given CPU with a given thread
  count), is within gamma(n) = n * u / (1 - n * u) of the exact sum, relative to the sum of the terms'
  absolute values (its magnitude). sqrt(n) * u is the typical error of random rounding, not a bound: an
  order that one machine takes may exceed it.
- Two computations of one value in two orders are each within that of the exact value, so within twice that
  of each other (implementations=2); against a float64 reference only the lower precision's error counts
  (implementations=1: float64's own gamma is 2^29 times smaller than float32's).
- Sums in series (a projection feeding a norm feeding the next projection) add their relative errors to
  first order: a chain of sums of lengths n1, n2, ... is within gamma(n1 + n2 + ...) of its exact value at
  the scale of its terms. The chain's total is its accumulation length.
- exp, exp2, log2, tanh in float32 (numpy's, SLEEF's, PyTorch's exp_u20, CUDA's ex2.approx) are within
  FUNCTION_ULPS units in the last place of the exact value: 2 * FUNCTION_ULPS * u relative.
- NVIDIA's tensor cores multiply exactly but add their float32 sums with truncation rather than rounding to
  nearest: up to one unit in the last place (2u) an addition, so their sums are bounded as sums of twice
  as many terms (accumulation=TENSOR_CORES).

Two kinds of comparison rest on one assumption more, stated where they are used. A whole forward pass
(forward_bound) takes each sum's terms at the scale of the values compared: a strict componentwise worst
case through a random-weight network (a first-order analysis in float64 of the tiny models, every
projection's terms at |W| |x|, carried through the norms' 1 / rms) comes to 5e-3 - 3e-2, as much as a
packing or mask bug moves a score, so it could not tell one from the other. And FP8 (e4m3) results that
two paths round differently: a priori every element may flip to its neighbouring value, so how far flips
carry is measured on the same inputs, as models/selfcheck.py measures it (models.fp8.jittered).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.families import family

UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float8_e4m3fn: 2.0**-4,
}
# float16's subnormals (below 2^-14) are spaced 2^-24 apart: a rounding there moves a value by up to 2^-25.
FLOAT16_SUBNORMAL_HALF_STEP = 2.0**-25
# The elementary functions' error, in units in the last place (one ulp is at most 2u relative).
FUNCTION_ULPS = 4
# Units of u an addition may cost: 1 rounding to nearest (CPUs, the Triton interpreter), 2 truncating
# (tensor cores' float32 accumulation).
ROUNDING = 1
TENSOR_CORES = 2
# The online-softmax kernels rescale their running sums at most once per key block of this many keys (the
# Triton kernel's BLOCK_N; SDPA's CPU flash kernel takes longer blocks, so fewer rescales).
KEY_BLOCK = 32


def unit_roundoff(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF[dtype]


def gamma(length: int, dtype: torch.dtype = torch.float32) -> float:
    """gamma(n) = n u / (1 - n u): the relative error bound of a sum of `length` terms in `dtype`."""
    nu = length * unit_roundoff(dtype)
    assert nu < 0.5, f"{length} terms are too many for {dtype} to bound"
    return nu / (1.0 - nu)


def sum_bound(dtype: torch.dtype, length: int, magnitude: Any, *, implementations: int = 1) -> Any:
    """How far a sum or dot product of `length` terms whose absolute values add up to `magnitude` (a float,
    or an array of them, one per sum) may be from the exact sum (implementations=1) or from the same sum in
    another order (implementations=2)."""
    return implementations * gamma(length, dtype) * magnitude


def forward_bound(dtype: torch.dtype, *, length: int, magnitude: float, implementations: int = 2) -> float:
    """A network's output computed twice in `dtype` (or once against float64: implementations=1): the
    network is a chain of sums of total accumulation `length` (its layers' projections, norms, attention
    scores and softmax-weighted sums in series: see forward_length), each within gamma of its terms'
    magnitudes, and the norms keep every layer's terms at the scale of the output: `magnitude`, the
    largest |value| compared (at least the unit scale of the final norm's outputs where the callers say
    so). That scale is the assumption the module's docstring names."""
    return sum_bound(dtype, length, magnitude, implementations=implementations)


def half_forward_bound(
    dtype: torch.dtype,
    *,
    sums: Sequence[int],
    magnitude: float,
    accumulation: int = ROUNDING,
    implementations: int = 2,
) -> float:
    """forward_bound for a network stored in a half-precision `dtype` whose sums accumulate in float32 (GPU
    tensor cores, oneDNN's bfloat16 matmuls, the norms' float32 upcasts): each of the sums in series (their
    lengths `sums`) within float32's gamma of its terms, and its result rounded once to `dtype` (u_d):
    implementations * (len(sums) * u_d + gamma(sum of the lengths)) * magnitude."""
    per_computation = len(sums) * unit_roundoff(dtype) + gamma(accumulation * sum(sums), torch.float32)
    return implementations * per_computation * magnitude


# The layer_types entry of a Gated DeltaNet layer (hybrid decoders: models/linear_attention.py).
LINEAR_LAYER = "linear_attention"
# Post-norm encoders (LayerNorm after attention and after the MLP); ModernBERT normalises before them.
_POST_NORM_ENCODERS = ("bert", "roberta", "xlm-roberta", "deberta-v2")


def forward_sums(model_dir: str | Path, longest: int, *, mean_pooled: bool = False) -> list[int]:
    """The sums in series of a model's forward, from the embeddings to the scores, for prompts of up to
    `longest` tokens, read off its config: each sum's number of terms.

    A decoder layer: its norm (hidden_size squares), the q/k/v projections (hidden_size terms), the q/k
    norms where the model has them (head_dim), the scores (head_dim), the softmax-weighted sum over the keys
    (`longest`), the output projection (heads * head_dim), the norms after attention and before the MLP
    (hidden_size each, two more for Gemma's post-sublayer norms), gate/up (hidden_size) and down
    (intermediate_size); then the final norm and the head (hidden_size each). Encoders: the same sums with a
    LayerNorm (mean, then variance: two sums of hidden_size) where they normalise, DeBERTa's two
    relative-position score terms (head_dim each), and a pooler or dense layer before the classifier. Mean
    pooling adds a sum over the tokens. The pooled hidden states lie on this chain, a sum or two before its
    end."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "vision_config" in config:  # an image-text model: its vision tower's sums come before the text's
        vision = _vision_sums(config) if "mm_tokens_per_image" in config else _qwen_vision_sums(model_dir)
        text = config["text_config"]
        # Qwen's image-text models run their text family's decoder (Qwen3-VL's with Qwen3's q/k norms).
        text = {**text, "model_type": _TEXT_FAMILIES.get(text["model_type"], text["model_type"])}
        return vision + _config_sums(text, longest, mean_pooled)
    return _config_sums(config, longest, mean_pooled)


_TEXT_FAMILIES = {"qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}


def _vision_sums(config: dict[str, Any]) -> list[int]:
    """The sums in series from an image's pixels to its features among the text's embeddings (SigLIP and
    Gemma 3's projector): the patch embedding (channels * patch^2 terms), then per layer a LayerNorm (two
    sums of the width), the q/k/v projections, the scores (head_dim), the weighted sum over the patches,
    the output projection, a LayerNorm, the MLP's two projections; the final LayerNorm; the projector's
    average pool (the patches pooled into a token), its RMS norm and its projection (the vision width)."""
    vision = config["vision_config"]
    width, inner = vision["hidden_size"], vision["intermediate_size"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    head_dim = width // vision["num_attention_heads"]
    layer = [width, width, width, head_dim, patches, width, width, width, width, inner]
    pooled = patches // config["mm_tokens_per_image"]
    ends = [width, width, pooled, width, width]
    return [vision["num_channels"] * vision["patch_size"] ** 2, *vision["num_hidden_layers"] * layer, *ends]


def _qwen_vision_sums(model_dir: str | Path) -> list[int]:
    """Qwen2.5-VL's and Qwen3-VL's vision towers (Qwen3.5's is Qwen3-VL's), pixels to features: the patch
    embedding (channels * time * patch^2 terms; Qwen3-VL's learned positions add a bilinear mix of 4), then
    per block a norm (Qwen2.5-VL RMS, one sum of the width; Qwen3-VL LayerNorm, two), the q/k/v
    projections, the scores (head_dim), the weighted sum over at most all of an image's patches (the image
    processor's pixel limit over a patch's area), the output projection, a norm, the MLP (Qwen2.5-VL
    gate/up and down, Qwen3-VL two layers); the merger's norm and its two projections (merge^2 patches'
    widths, then that width again)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    vision = config["vision_config"]
    processor = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    width, inner, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    patches = processor["size"]["longest_edge"] // patch**2
    head_dim = width // vision["num_heads"]
    qwen3 = config["model_type"] in ("qwen3_vl", "qwen3_5")  # Qwen3.5's tower is Qwen3-VL's
    norm = [width] * (2 if qwen3 else 1)
    layer = [*norm, width, head_dim, patches, width, *norm, width, inner]
    merged = width * vision["spatial_merge_size"] ** 2
    embedding = [vision["in_channels"] * vision["temporal_patch_size"] * patch**2]
    if qwen3:
        embedding.append(4)
    return [*embedding, *vision["depth"] * layer, *norm, merged, merged]


def _config_sums(config: dict[str, Any], longest: int, mean_pooled: bool) -> list[int]:
    kind = config["model_type"]
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    # Gemma 4's global layers have heads of their own width: the widest bounds every layer.
    overrides = (config.get("per_layer_config") or {}).values()
    head_dim = max([head_dim, *(int(layer.get("head_dim") or 0) for layer in overrides)])
    attention = [head_dim, longest, heads * head_dim]  # scores, weighted sum, output projection
    layer_norm = [hidden, hidden]
    if kind in _POST_NORM_ENCODERS:
        relative = [head_dim, head_dim] if kind == "deberta-v2" else []
        layer = [hidden, *attention, *relative, *layer_norm, hidden, inner, *layer_norm]
        ends = [*layer_norm, hidden, hidden]  # embedding LayerNorm; pooler (or dense) and classifier
    elif LINEAR_LAYER in config.get("layer_types", ()):
        return _hybrid_sums(config, longest, mean_pooled)
    elif kind == "modernbert":
        layer = [*layer_norm, hidden, *attention, *layer_norm, hidden, inner]
        # The embedding and final norms, the head's dense layer and norm, the classifier.
        ends = [*layer_norm, *layer_norm, hidden, *layer_norm, hidden]
        mean_pooled = mean_pooled or config.get("classifier_pooling") == "mean"
    else:
        layer = _decoder_layer_sums(config, head_dim, attention)
        ends = [hidden, hidden]  # the final norm and the head
        if config.get("num_experts") and "num_experts_per_tok" in config:  # Qwen3-MoE's sparse blocks
            return (
                _sparse_layers(config, layer[:-2])  # the layer's sums before its MLP
                + ends
                + ([longest] if mean_pooled else [])
            )
    return config["num_hidden_layers"] * layer + ends + ([longest] if mean_pooled else [])


def _decoder_layer_sums(config: dict[str, Any], head_dim: int, attention: list[int]) -> list[int]:
    """A decoder layer's sums, by its family's declared quirks (models/families.py): two norms, or four
    where it normalises before and after each sublayer; q/k norms per head (head_dim squares) or over the
    whole projection (heads * head_dim); Gemma 4's value norm (head_dim), per-layer input (its gate over
    hidden_size, its projection over hidden_size_per_layer_input, a norm) and expert blocks."""
    hidden, inner, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    declared = family(config["model_type"])
    norms = [hidden] * (4 if declared is not None and declared.norms == "sandwich" else 2)
    qk_norm = declared.qk_norm if declared is not None else None
    if qk_norm == "head":
        norms.append(head_dim)
    elif qk_norm == "projection":
        norms.append(heads * head_dim)
    extra: list[int] = []
    if config["model_type"] == "gemma4_text":
        extra.append(head_dim)  # the value norm
        per_layer = config.get("hidden_size_per_layer_input") or 0
        if per_layer:
            extra += [hidden, per_layer, hidden]
        if config.get("enable_moe_block"):
            # The router (hidden), the experts' gate/up (hidden) and down (moe_intermediate_size), the sum of
            # the top-k experts, and the three norms around them.
            experts = [hidden, hidden, config["moe_intermediate_size"], config["top_k_experts"]]
            extra += [*experts, hidden, hidden, hidden]
    return [*norms, hidden, *attention, hidden, inner, *extra]


def _sparse_layers(config: dict[str, Any], before_mlp: list[int]) -> list[int]:
    """A mixture-of-experts decoder's layers (forward_sums): a sparse block's router logits (hidden_size),
    its softmax's sum (num_experts) and renormalisation (num_experts_per_tok), an expert's gate/up
    (hidden_size) and down (moe_intermediate_size), the weighted sum over the chosen experts
    (num_experts_per_tok); a dense layer's MLP (mlp_only_layers) as a dense decoder's."""
    hidden, top_k = config["hidden_size"], config["num_experts_per_tok"]
    sparse = [hidden, config["num_experts"], top_k, hidden, config["moe_intermediate_size"], top_k]
    dense = [hidden, config["intermediate_size"]]
    step, only = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    sums: list[int] = []
    for index in range(config["num_hidden_layers"]):
        is_sparse = index not in only and (index + 1) % step == 0
        sums += [*before_mlp, *(sparse if is_sparse else dense)]
    return sums


def _hybrid_sums(config: dict[str, Any], longest: int, mean_pooled: bool) -> list[int]:
    """forward_sums of a hybrid decoder (Qwen3.5, Qwen3-Next): full-attention layers (q/k norms, a gated
    output: a product, no sum) and Gated DeltaNet layers. A Gated DeltaNet layer's sums in series: its norm
    and in-projections (hidden_size each), the causal convolution (its kernel width), the q/k l2 norms
    (key head dim), the recurrence (the state is a decayed sum over the `longest` tokens of rank-one terms,
    each correction reading the state through a key: key head dim; the chunked form's triangular solve
    sums a chunk's earlier corrections, 64 terms), the output's read of the state (key head dim), the gated
    RMS norm (value head dim) and the output projection (value heads * value head dim). The MLP: a dense
    one (hidden_size, intermediate_size) or Qwen3-Next's sparse block (the router over hidden_size, its
    softmax over the experts, an expert's or the shared expert's projections, the top-k weighted sum)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    k_dim, v_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    if config.get("num_experts"):
        inner = max(config["moe_intermediate_size"], config["shared_expert_intermediate_size"])
        mlp = [hidden, config["num_experts"], hidden, inner, config["num_experts_per_tok"] + 1]
    else:
        mlp = [hidden, config["intermediate_size"]]
    full = [hidden, hidden, head_dim, head_dim, longest, heads * head_dim, hidden, *mlp]
    linear = [
        hidden, hidden, config["linear_conv_kernel_dim"], k_dim, longest, k_dim, 64, k_dim, v_dim,
        config["linear_num_value_heads"] * v_dim, hidden, *mlp,
    ]  # fmt: skip
    layers = [full if kind == "full_attention" else linear for kind in config["layer_types"]]
    ends = [hidden, hidden]  # the final norm and the head
    return [n for layer in layers for n in layer] + ends + ([longest] if mean_pooled else [])


def forward_length(model_dir: str | Path, longest: int, *, mean_pooled: bool = False) -> int:
    """The accumulation length of a model's forward (forward_bound): the terms of all its sums in series
    (forward_sums) together."""
    return sum(forward_sums(model_dir, longest, mean_pooled=mean_pooled))


def forward_atol(
    model_dir: str | Path,
    expected: Any,
    *,
    longest: int,
    implementations: int = 2,
    mean_pooled: bool = False,
) -> float:
    """forward_bound for float32 results of the model in `model_dir` on prompts of up to `longest` tokens:
    its forward_length, at the scale of `expected` and at least 1 (the final norm leaves the hidden states
    at rms 1, with the tiny models' weights 1 +- 0.1, so the terms of the last sums are of unit scale
    whatever a score's value). Against another float32 computation (2, the default) or a float64 one (1)."""
    magnitude = max(1.0, float(np.abs(np.asarray(expected, dtype=np.float64)).max(initial=0.0)))
    length = forward_length(model_dir, longest, mean_pooled=mean_pooled)
    return forward_bound(torch.float32, length=length, magnitude=magnitude, implementations=implementations)


def assert_forward_close(
    actual: Any,
    expected: Any,
    model_dir: str | Path,
    *,
    longest: int,
    implementations: int = 2,
    mean_pooled: bool = False,
) -> None:
    """actual within forward_atol of expected, element by element."""
    atol = forward_atol(
        model_dir, expected, longest=longest, implementations=implementations, mean_pooled=mean_pooled
    )
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=0)


def rounding_bound(dtype: torch.dtype, magnitude: Any) -> Any:
    """How far one rounding to `dtype` moves a value of absolute value `magnitude` (normal range)."""
    return unit_roundoff(dtype) * magnitude


def rounded_pair_tolerances(dtype: torch.dtype, difference: float) -> tuple[float, float]:
    """(atol, rtol) for np.testing.assert_allclose(a, b) where a and b are two values at most `difference`
    apart, each then rounded to `dtype`: a rounding moves x by at most u |x| (float16's subnormals by
    2^-25), and |x| <= |b| / (1 - u), so |a - b| <= difference (1 + u) + 2 half-steps + 2u / (1 - u) |b|."""
    u = unit_roundoff(dtype)
    subnormal = 2 * FLOAT16_SUBNORMAL_HALF_STEP if dtype == torch.float16 else 0.0
    return difference * (1 + u) + subnormal, 2 * u / (1 - u)


def key_blocks(keys: int) -> int:
    """The most rescales an online softmax over `keys` keys performs (one per KEY_BLOCK keys)."""
    return max(1, math.ceil(keys / KEY_BLOCK))


def softmax_weight_error(
    dtype: torch.dtype,
    *,
    head_dim: int,
    keys: int,
    score_magnitude: Any,
    softcap: float | None = None,
    accumulation: int = ROUNDING,
) -> Any:
    """The relative error of every weight exp(s_j - max) of an attention row computed in `dtype` (float32
    accumulation), online over key blocks, against exact arithmetic:

    - each score is a dot of head_dim terms times the scale (two more roundings: the product and, in the
      base-2 kernels, the rounded scale * log2(e)): off by at most gamma(head_dim + 2) * S, with S =
      score_magnitude, the largest sum of |q_i k_i| * |scale| over the keys the row sees; the weight
      exp(s - max) moves by that much relatively (in base 2 the log2(e) factor cancels against ln 2);
    - a softcap (tanh(s / cap) * cap, slope at most 1) passes that on and adds its own roundings: tanh's
      FUNCTION_ULPS and two products, at most (2 * FUNCTION_ULPS + 2) u * cap;
    - subtracting the running maximum rounds the exponent by u * |s - max| <= 2u * S, and the rescales'
      own subtractions add up to at most the whole rise of the maximum, 2S, again: 4u * S in all;
    - exp within FUNCTION_ULPS; each rescale of the running sums by exp(old max - new max) and its product:
      (2 * FUNCTION_ULPS + 1) u per key block.
    """
    u = unit_roundoff(dtype)
    score = gamma(accumulation * head_dim + 2, dtype) * score_magnitude + 4 * u * score_magnitude
    if softcap is not None:
        score = score + (2 * FUNCTION_ULPS + 2) * u * softcap
    blocks = key_blocks(keys)
    return score + 2 * FUNCTION_ULPS * u + (2 * FUNCTION_ULPS + 1) * u * blocks


def attention_bound(
    dtype: torch.dtype,
    *,
    head_dim: int,
    keys: int,
    score_magnitude: Any,
    value_magnitude: Any,
    stored: torch.dtype | None = None,
    value_max: Any = 0.0,
    softcap: float | None = None,
    accumulation: int = ROUNDING,
    implementations: int = 1,
) -> Any:
    """How far one attention output element softmax(q k^T scale) v, computed in `dtype` with float32
    accumulation (online over key blocks or in one pass), may be from the exact one (implementations=1: a
    float64 reference) or from another such computation (2).

    With the weights' relative error e (softmax_weight_error) and M = value_magnitude, the softmax-weighted
    sum of |v_j| (M >= |out|): out = sum w v / sum w moves by at most e * sum p |v - out| <= 2e * M; the
    weighted sum and the normaliser, `keys` terms plus one per block, by gamma(keys + blocks) of their
    magnitudes, together 2 gamma * M; the division by u * M. `stored` (float16): the weights are rounded to
    it before the weighted sum (u_s * M, plus float16's subnormal half step times `keys` * `value_max` for
    the weights below 2^-14; the normaliser keeps the float32 weights) and so is the output (u_s * M).
    `accumulation`: ROUNDING, or TENSOR_CORES for the GPU's kernels.
    """
    u = unit_roundoff(dtype)
    weights = softmax_weight_error(
        dtype,
        head_dim=head_dim,
        keys=keys,
        score_magnitude=score_magnitude,
        softcap=softcap,
        accumulation=accumulation,
    )
    sums = gamma(accumulation * (keys + key_blocks(keys)), dtype)
    bound = (2 * weights + 2 * sums + u) * value_magnitude
    if stored is not None and stored != dtype:
        subnormal = keys * FLOAT16_SUBNORMAL_HALF_STEP * value_max if stored == torch.float16 else 0.0
        bound = bound + 2 * unit_roundoff(stored) * value_magnitude + subnormal
    return implementations * bound


def lse_bound(
    dtype: torch.dtype,
    *,
    head_dim: int,
    keys: int,
    score_magnitude: Any,
    lse_magnitude: Any,
    accumulation: int = ROUNDING,
    implementations: int = 1,
) -> Any:
    """How far a row's log-sum-exp of scores (natural log), computed as above, may be from the exact one: the
    weights' relative error and the normaliser's gamma(keys + blocks) move log(sum w) by at most their sum;
    log2 of the normaliser (between 1 and `keys`) adds FUNCTION_ULPS of at most log2(keys); adding the
    maximum and dividing by log2(e), two roundings of |lse| = lse_magnitude (and the rounded 1 / log2(e))."""
    u = unit_roundoff(dtype)
    weights = softmax_weight_error(
        dtype, head_dim=head_dim, keys=keys, score_magnitude=score_magnitude, accumulation=accumulation
    )
    sums = gamma(accumulation * (keys + key_blocks(keys)), dtype)
    log = 2 * FUNCTION_ULPS * u * math.log2(max(keys, 2)) / math.log2(math.e)
    return implementations * (weights + sums + log + 3 * u * lse_magnitude)


def merged_attention_bound(
    dtype: torch.dtype,
    *,
    head_dim: int,
    keys: int,
    score_magnitude: Any,
    value_max: Any,
    stored: torch.dtype | None = None,
    accumulation: int = ROUNDING,
    implementations: int = 1,
) -> Any:
    """Attention whose keys are split into two passes, each with its log-sum-exp, merged as first +
    sigmoid(lse2 - lse1) * (second - first) (models.attention.merge_passes), against exact arithmetic:
    each pass within attention_bound (at the values' largest |v|, `value_max`); each pass's share
    sigmoid(+-(lse2 - lse1)) moves by at most w (1 - w) (|dlse1| + |dlse2|) <= lse_bound / 2, plus the
    sigmoid's roundings (the subtraction, u |lse2 - lse1| <= 2u |lse|, with |lse| <= S + ln(keys); exp,
    the add and the division, (2 FUNCTION_ULPS + 2) u), times |second - first| <= 2 value_max; the lerp's
    three roundings, 3u value_max. `keys`: the most keys either pass (or the whole) sees. `stored`: the
    passes' outputs are rounded to it (in attention_bound) and so is the merged one (u_s value_max)."""
    u = unit_roundoff(dtype)
    out = attention_bound(
        dtype,
        head_dim=head_dim,
        keys=keys,
        score_magnitude=score_magnitude,
        value_magnitude=value_max,
        stored=stored,
        accumulation=accumulation,
    )
    lse_magnitude = score_magnitude + math.log(max(keys, 1))
    lse = lse_bound(
        dtype,
        head_dim=head_dim,
        keys=keys,
        score_magnitude=score_magnitude,
        lse_magnitude=lse_magnitude,
        accumulation=accumulation,
    )
    share = lse / 2 + 2 * u * lse_magnitude + (2 * FUNCTION_ULPS + 2) * u
    merged = 3 * u * value_max + (unit_roundoff(stored) * value_max if stored is not None else 0.0)
    return implementations * (out + 2 * share * value_max + merged)


# The largest slope of silu(g) = g sigmoid(g) (1.0998 at g = 2.4): how far an error in g moves it.
SILU_SLOPE = 1.1


def gated_silu_bound(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, accumulation: int = ROUNDING
) -> torch.Tensor:
    """How far one float32-accumulated computation of silu(x gate^T) * (x up^T) may be from the exact, per
    element: each product a sum of H terms within gamma(H) of its magnitude sum |x||w|; silu carries its
    argument's error with slope at most SILU_SLOPE and adds sigmoid's roundings (exp, the add and the
    division) and its product, (2 FUNCTION_ULPS + 3) u of |silu|; the final product one more u."""
    u, length = unit_roundoff(torch.float32), x.shape[-1]
    x64, gate64, up64 = x.double(), gate.double(), up.double()
    g, v = x64 @ gate64.t(), x64 @ up64.t()
    g_error = gamma(accumulation * length) * (x64.abs() @ gate64.abs().t())
    v_error = gamma(accumulation * length) * (x64.abs() @ up64.abs().t())
    silu = torch.nn.functional.silu(g)
    silu_error = SILU_SLOPE * g_error + (2 * FUNCTION_ULPS + 3) * u * silu.abs()
    return v.abs() * silu_error + silu.abs() * v_error + u * (silu * v).abs()


def softmax_bound(dtype: torch.dtype, *, labels: int, logit_error: float, implementations: int = 2) -> float:
    """How far two computations in `dtype` of the softmax over `labels` logits that differ by at most
    `logit_error` may be apart: the exact softmax moves by at most p_i (|dz_i| + sum_j p_j |dz_j|) <= 2 *
    logit_error (p_i <= 1); each computation's own roundings, relative to p_i <= 1: the max's subtraction
    (u |z - max| p_i <= u / e), exp in the term and in its share of the normaliser (2 FUNCTION_ULPS each),
    the normaliser's gamma(labels), its reciprocal and the product (2u)."""
    u = unit_roundoff(dtype)
    own = (4 * FUNCTION_ULPS + 3) * u + gamma(labels, dtype)
    return 2 * logit_error + implementations * own


def cosine_gap(elementwise: Any, dims: int, norm: Any) -> Any:
    """The most 1 - cos(a, b) can be for vectors of `dims` elements that differ by at most `elementwise` in
    each, |b| >= norm: the angle's sine is at most r = sqrt(dims) * elementwise / norm, so 1 - cos <=
    1 - sqrt(1 - r^2) <= r^2 (r < 1)."""
    r = math.sqrt(dims) * np.asarray(elementwise, dtype=np.float64) / np.asarray(norm, dtype=np.float64)
    return np.where(r < 1, r * r, 2.0)


# FP8 e4m3 (float8_e4m3fn): 3 stored mantissa bits, a relative step of 2^-3 between neighbours, so one
# rounding moves a normal value by at most u = 2^-4 of it; values below 2^-6 are subnormal, 2^-9 apart, so a
# rounding there moves them by at most 2^-10 (in the scaled units of models.fp8.quantize_rows).
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10


def e4m3_rounding(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """How far models.fp8.quantize_rows' rounding may move each element of `values` (rows scaled by `scale`,
    [R, 1]): u_e4m3 |x| for the normal range, plus the subnormal half step times the row's scale; the
    float32 division and dequantizing product add 2u32 |x|."""
    u = unit_roundoff(torch.float8_e4m3fn) + 2 * unit_roundoff(torch.float32)
    return u * values.double().abs() + E4M3_SUBNORMAL_HALF_STEP * scale.double()


def assert_within(actual: Any, expected: Any, bound: Any, what: str = "") -> None:
    """|actual - expected| <= bound element by element (bound: a float or an array that broadcasts), in
    float64; NaN anywhere fails. The message names the element furthest past its bound."""
    got = _float64(actual)
    want = _float64(expected)
    limit = np.broadcast_to(_float64(bound), np.broadcast_shapes(got.shape, want.shape))
    difference = np.abs(got - want)
    ok = difference <= limit
    if bool(ok.all()):
        return
    ratio = np.where(ok, 0.0, np.nan_to_num(difference / np.maximum(limit, 1e-300), nan=np.inf))
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.ndim else ()
    raise AssertionError(
        f"{what or 'values'}: {int((~ok).sum())} of {ok.size} elements past their bound; the worst at "
        f"{tuple(int(i) for i in worst)}: |{got[worst]!r} - {want[worst]!r}| = {difference[worst]:.3e} > "
        f"{limit[worst]:.3e}"
    )


def _float64(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).cpu().numpy()
    return np.asarray(value, dtype=np.float64)


_HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def assert_scored_alike(got: Any, want: Any, scorer: Any, requests: Sequence[Any]) -> None:
    """Two results (schemas.ScoreResult) of one request from two float32 computations (another path,
    batch, packing or graph of `scorer`'s model): every score and pooled-state element within forward_atol
    for the model in the directory `scorer` loaded and the longest prompt of `requests` as `scorer`
    prepares them (a mean pooling adds its sum over the tokens); a softmax over the labels moves by at most
    softmax_bound of that; states asked in float16 or bfloat16 are rounded once more on each side
    (rounded_pair_tolerances)."""
    assert len(got.scores) == len(want.scores)
    if not want.scores:
        return
    model_dir = Path(scorer.hf_model.name_or_path)
    longest = max(len(p) for request in requests for p in scorer.prepare(request).prompts)
    mean = scorer.pooling == "mean"
    scores = np.asarray(want.scores, dtype=np.float64)
    atol = forward_atol(model_dir, scores, longest=longest, mean_pooled=mean)
    if any(getattr(request, "apply_softmax", False) for request in requests):
        atol = softmax_bound(torch.float32, labels=scores.shape[1], logit_error=atol)
    np.testing.assert_allclose(np.asarray(got.scores, dtype=np.float64), scores, atol=atol, rtol=0)
    if want.pooled_hidden_states is None:
        assert got.pooled_hidden_states is None
        return
    assert got.pooled_hidden_states is not None
    for got_state, want_state in zip(got.pooled_hidden_states, want.pooled_hidden_states, strict=True):
        assert (got_state.dtype, got_state.shape) == (want_state.dtype, want_state.shape)
        expected = want_state.to_numpy().astype(np.float64)
        bound = forward_atol(model_dir, expected, longest=longest, mean_pooled=mean)
        half = _HALF_DTYPES.get(want_state.dtype)
        state_atol, state_rtol = (bound, 0.0) if half is None else rounded_pair_tolerances(half, bound)
        np.testing.assert_allclose(
            got_state.to_numpy().astype(np.float64), expected, atol=state_atol, rtol=state_rtol
        )

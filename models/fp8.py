"""FP8 (e4m3) projections for the transformer layers: weights quantized once per output channel, activations
per token on every call, multiplied by `torch._scaled_mm` with both scales applied in the product.

The scales are per row of each operand, so a token's output depends on that token's row alone: packing,
batch-mates and padding change nothing (the property the packed engine relies on). Only the projections of
the layers are quantized (decoders' and encoders' alike); the embeddings, the norms, attention itself and
the task head keep the model's dtype. Hopper and Ada GPUs (compute capability 8.9 and later) run it on
their FP8 tensor cores; torch's CPU build runs the same kernel path in bfloat16, slowly, which is what
the CPU tests check. A float32 model (the CPU's default, or a float32 reference holding the same
projections) multiplies the dequantized operands in float32: the same e4m3 values and scales.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # a type only: importing the settings (pydantic) here would cost every loader its memory
    from models.settings import Fp8Projections

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# cuBLASLt's FP8 kernels need both matrix dimensions of the weight to be multiples of 16.
_ALIGNMENT = 16
# A row of zeros still needs a finite scale; any positive value gives exact zeros.
_MIN_SCALE = 1e-12
FP8_MIN_CAPABILITY = (8, 9)


def fp8_supported(device: torch.device) -> str | None:
    """Why FP8 projections cannot run on `device`, or None when they can."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 projections run on CUDA or the CPU, not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return (
            f"FP8 projections need a GPU of compute capability 8.9 or later (Ada, Hopper); this one has "
            f"{capability[0]}.{capability[1]}"
        )
    return None


@functools.cache
def cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes a scale per row and per column (2.13 does; 2.11 takes
    one scale per tensor and raises otherwise)."""
    ones = torch.ones(16, 16).to(FP8_DTYPE)
    try:
        torch._scaled_mm(
            ones, ones.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except RuntimeError:
        return False
    return True


def quantize_rows(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`matrix` [R, C] as e4m3 values and a float32 scale per row [R, 1]: row r is values[r] * scale[r]."""
    wide = matrix.float()
    scale = (wide.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    values = (wide / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # e4m3fn has no infinity: clamp first
    return values, scale


class Fp8Linear(nn.Module):
    """An `nn.Linear` whose product runs in FP8: weight scaled per output channel (once, here), input per
    token (each call), output in the input's dtype.

    A float32 input (a float32 reference model holding the same projections) is multiplied as the
    dequantized operands in float32: the same e4m3 values and scales, with no rounding of the product, which
    FP8 kernels cannot give in float32 (row-wise scaled FP8 products return bfloat16 on CUDA). On a CPU
    whose torch has no row-wise scaled FP8 product, a half-precision input takes that float32 product too,
    rounded once to its dtype: what the kernel computes, in another summation order.
    `jitter` (0 normally) moves every input element by that relative amount, up and down alternately,
    before it is rounded: how much that moves a model's results is how sensitive it is to FP8 rounding."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    jitter: float = 0.0

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight", weight)  # [out, in]; its transpose is the column-major operand
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())  # [1, out]
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # Decided here, not per call: a plain flag is a constant to torch.compile.
        self.dequantize_on_cpu = not cpu_scaled_mm_takes_row_scales()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.jitter:
            signs = torch.ones(self.in_features, device=x.device, dtype=torch.float32)
            signs[1::2] = -1.0
            rows = rows.float() * (1.0 + self.jitter * signs)
        values, scale = quantize_rows(rows)
        if x.dtype == torch.float32 or (self.dequantize_on_cpu and x.device.type == "cpu"):
            out = (values.float() * scale) @ (self.weight.float() * self.weight_scale.t()).t()
            out = out.to(x.dtype)
        else:
            out = torch._scaled_mm(
                values, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=x.dtype
            )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3"


@contextlib.contextmanager
def jittered(model: nn.Module, amount: float) -> Iterator[int]:
    """Every `Fp8Linear` of `model` moves its inputs by `amount` (relative) before rounding, inside the
    block; yields how many projections that touched (0: the model has none)."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for layer in layers:
        layer.jitter = amount
    try:
        yield len(layers)
    finally:
        for layer in layers:
            del layer.jitter  # back to the class's 0.0, as compiled layers saw it before


def quantizable(linear: nn.Linear) -> bool:
    """Whether the FP8 kernels take this projection's shape."""
    return linear.in_features % _ALIGNMENT == 0 and linear.out_features % _ALIGNMENT == 0


def projection_part(name: str) -> Fp8Projections:
    """The part of its layer a projection belongs to, by its path inside the layer: "attention" where a
    module on the path is named for attention (Llama's `self_attn.q_proj`, BERT's `attention.output.dense`,
    Phi-3's `self_attn.qkv_proj`), else "mlp" (`mlp.down_proj`, BERT's `intermediate.dense` and
    `output.dense`)."""
    lowered = name.lower()
    return "attention" if "attn" in lowered or "attention" in lowered else "mlp"


@dataclass(frozen=True)
class Fp8Selection:
    """Which projections of the transformer layers run in FP8: the parts named by `projections` ("all",
    "attention" or "mlp"), in every layer but those of `keep_layers` (0 the first, -1 the last), which keep
    the model's dtype whole. The rest keep the model's dtype: where FP8's rounding costs too much accuracy,
    the projections that carry it stay in bfloat16 (docs/models.md, FP8 projections)."""

    projections: Fp8Projections = "all"
    keep_layers: tuple[int, ...] = ()

    def kept_layers(self, count: int) -> frozenset[int]:
        """`keep_layers` as indices of a model of `count` layers; ValueError for one it does not have."""
        wrong = [k for k in self.keep_layers if not -count <= k < count]
        if wrong:
            raise ValueError(
                f"fp8_keep_layers {wrong}: the model has {count} layers (0..{count - 1}, or -1..-{count})"
            )
        return frozenset(k % count for k in self.keep_layers)

    def quantizes(self, name: str) -> bool:
        """Whether a projection at this path inside its layer runs in FP8 (its layer not kept)."""
        return self.projections == "all" or projection_part(name) == self.projections


ALL_PROJECTIONS = Fp8Selection()


def quantize_layers(
    layers: nn.ModuleList,
    selection: Fp8Selection = ALL_PROJECTIONS,
    numbers: Sequence[int] | None = None,
    count: int | None = None,
) -> tuple[int, int]:
    """Replace the `nn.Linear`s inside `layers` that `selection` picks with `Fp8Linear`s, in place. Layer k
    of `layers` is layer numbers[k] of a model of `count` layers (default: `layers` is the model's whole
    list), which is what `selection.keep_layers` counts in. Projections of a shape the kernels do not take
    keep the model's dtype. Returns (replaced, kept): kept counts those of a shape the kernels do not take,
    not the ones the selection leaves out."""
    skipped = selection.kept_layers(len(layers) if count is None else count)
    replaced = kept = 0
    for number, layer in zip(range(len(layers)) if numbers is None else numbers, layers, strict=True):
        if number in skipped:
            continue
        for path, parent in list(layer.named_modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, Fp8Linear):  # quantized already, as its layer was loaded
                    replaced += 1
                    continue
                if type(child) is not nn.Linear or not selection.quantizes(f"{path}.{name}"):
                    continue
                if quantizable(child):
                    setattr(parent, name, Fp8Linear(child))
                    replaced += 1
                else:
                    kept += 1
    return replaced, kept

"""SiLU-gated MLPs with the gate and up products and the activation in one Triton kernel.

A Llama-style MLP computes down(silu(x @ gate^T) * (x @ up^T)). HF runs the two products as cuBLAS matmuls
that write [T, I] each, then the activation reads both and writes [T, I] again: on W1's 8B shapes that
activation alone is about 3% of the model step, all of it memory traffic. Here one kernel computes a tile of
both products from the same tile of x, applies silu(gate) * up to the float32 accumulators and writes only the
product: nothing of [T, 2I] ever reaches memory. On the H200 at 16,384 tokens it ran 1.05x as fast as the
two cuBLAS products and inductor's fused activation together at the 8B shapes and 1.10x at 1.5B-3B shapes
(W1 end to end: +1.2%); at hidden size 1024 (Qwen3-0.6B) 0.9x to par, so `fused_mlp="auto"` takes it only
from MIN_HIDDEN on (docs/notes/benchmarks-history.md, "What the retired probes found"). The gate and up
results are not rounded to the model's dtype before the activation, so the product is, if anything, closer
to float32 than HF's.

Which MLPs: the HF classes whose forward is exactly that (GATED_SILU_MLPS: Llama, Mistral, Qwen2, Qwen3,
with separate gate and up projections; Phi-3 with one gate_up projection whose halves are gate and up), with
a SiLU activation, unbiased plain `nn.Linear` gate and up projections (FP8 ones are not: they keep their own
path) and widths whose rows are 16-byte aligned, as the kernel's tensor-memory descriptors need. The
swap (FusedMlps) holds only while the engine runs its packed forward, as the compiled layers do, so HF's own
forward (the self-check's reference, the plain padded path) keeps HF's MLP.

In a batch that mixes LoRA adapters, the gate and up products take their deltas in the same kernel: each a
masked shrink [T, R] by a stacked B [I, R] (models/adapters.py), summed into the product's float32
accumulator after its hidden-size steps, 16 columns a step; the adapted projections write nothing.

The kernel runs in Triton's interpreter on CPU tensors too (float32: the interpreter does not compute
bfloat16 faithfully), so the CPU tests check its tiling, edges and epilogue; its speed is the GPU's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeGuard, cast

import torch
from torch import nn
from transformers import activations

from models.adapters import lora_operands
from models.families import GATED_SILU_MLPS

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # the CPU install may lack Triton; the MLPs then stay HF's
    triton = None
    tl = None
    TensorDescriptor = None

# Output tile (tokens x MLP columns; each program accumulates a gate and an up tile this size), the depth
# of one step along the hidden size, warps, pipeline stages, and how many row tiles share a column band
# (so the weight tiles they read stay in L2): the fastest configurations on the H200 at W1's shapes
# (docs/notes/benchmarks-history.md, "The fused MLP kernel"). One persistent program per multiprocessor,
# looping over tiles, ran 1-5% faster than one program per tile with the same loop and about 1.2x as fast
# as one program per tile without it; warp-specialized and flattened loops were slower.
BLOCK_M = 128
BLOCK_N = 128
BLOCK_K = 64
NUM_WARPS = 8
NUM_STAGES = 3
GROUP_M = 16
# "auto" fuses models of at least this hidden size: from 1536 to 4096 the kernel ran 1.05-1.11x as fast as
# what it replaces (one run had it at par at 4096); at 1024, 0.9x to par.
MIN_HIDDEN = 1536
INTERPRETER_PROGRAMS = 3
OP_NAME = "score_worker::gate_up_silu"
# HF MLP classes whose forward is down(silu(gate(x)) * up(x)), declared with their families
# (models/families.py): "separate" (gate_proj, up_proj, act_fn) or "fused" (gate_up_proj, whose first half
# of outputs is gate and second up; activation_fn).
_SILU_CLASSES: tuple[type, ...] = tuple(
    cls for cls in (nn.SiLU, getattr(activations, "SiLUActivation", None)) if isinstance(cls, type)
)


def available() -> bool:
    """Whether Triton (with host-side tensor descriptors) is installed: the kernel needs it."""
    return triton is not None


def _gate_up_silu_kernel(  # type: ignore[no-untyped-def]  # a Triton kernel: its annotations are Triton's
    x_desc, gate_desc, up_desc, out_desc, tokens, width, hidden, programs,
    gate_s_desc, gate_b_desc, gate_rank, up_s_desc, up_b_desc, up_rank,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    LORA: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """`programs` persistent programs, each looping over output tiles: out[rows, cols] = silu(x[rows] @
    gate[cols]^T) * (x[rows] @ up[cols]^T), BLOCK_M x BLOCK_N at a time. Tiles are taken column band by
    column band, GROUP_M row tiles to a band, so that a band's weight tiles are read from L2 by the row tiles
    that follow. Descriptors fill reads past an edge with zeros and drop writes past it.

    With LORA, each product also takes its LoRA delta into the same float32 accumulator before the
    activation: gate += gate_s[rows] @ gate_b[cols]^T over `gate_rank` columns (the masked shrink [T, R]
    and the stacked B [I, R], models.adapters.lora_operands), BLOCK_R at a time; up likewise."""
    row_tiles = tl.cdiv(tokens, BLOCK_M)
    in_group = GROUP_M * tl.cdiv(width, BLOCK_N)
    steps = tl.cdiv(hidden, BLOCK_K)
    for tile in tl.range(tl.program_id(0), row_tiles * tl.cdiv(width, BLOCK_N), programs):
        first_row_tile = (tile // in_group) * GROUP_M
        group_rows = min(row_tiles - first_row_tile, GROUP_M)
        row = (first_row_tile + (tile % in_group) % group_rows) * BLOCK_M
        col = ((tile % in_group) // group_rows) * BLOCK_N
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in tl.range(0, steps):
            depth = step * BLOCK_K
            x = x_desc.load([row, depth])
            gate = tl.dot(x, gate_desc.load([col, depth]).T, gate)
            up = tl.dot(x, up_desc.load([col, depth]).T, up)
        if LORA:
            for step in tl.range(0, tl.cdiv(gate_rank, BLOCK_R)):
                gate = tl.dot(
                    gate_s_desc.load([row, step * BLOCK_R]), gate_b_desc.load([col, step * BLOCK_R]).T, gate
                )
            for step in tl.range(0, tl.cdiv(up_rank, BLOCK_R)):
                up = tl.dot(
                    up_s_desc.load([row, step * BLOCK_R]), up_b_desc.load([col, step * BLOCK_R]).T, up
                )
        out = gate * tl.sigmoid(gate) * up
        out_desc.store([row, col], out.to(out_desc.dtype))


@functools.cache
def _kernel() -> Any:
    """The kernel, compiled by Triton on first use (or run by its interpreter on CPU tensors)."""
    if triton is None:
        raise RuntimeError("the fused MLP kernel needs the triton package")
    return triton.jit(_gate_up_silu_kernel)


@functools.cache
def _processors(device: torch.device) -> int:
    """Programs to launch: one per multiprocessor on a GPU; in the interpreter a few, so that the CPU tests
    run the loop over tiles as the GPU's programs do."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _aligned(tensor: torch.Tensor) -> bool:
    """Rows of `tensor` as tensor-memory descriptors take them: unit stride across, 16-byte aligned rows."""
    return (
        tensor.stride(-1) == 1
        and (tensor.stride(0) * tensor.element_size()) % 16 == 0
        and tensor.data_ptr() % 16 == 0
    )


class KernelConfig(NamedTuple):
    """Tile sizes, warps, stages and group of one launch (the module's constants by default)."""

    block_m: int = BLOCK_M
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    warps: int = NUM_WARPS
    stages: int = NUM_STAGES
    group_m: int = GROUP_M


class LoraOperands(NamedTuple):
    """The LoRA deltas of the gate and up products (models.adapters.lora_operands): each a masked shrink
    [T, R] and its stacked B [I, R], the delta their product; None where no adapter changes that product."""

    gate: tuple[torch.Tensor, torch.Tensor] | None
    up: tuple[torch.Tensor, torch.Tensor] | None


# The LoRA steps' depth: tl.dot's shortest inner dimension for 16-bit operands (models.adapters.RANK_STEP
# pads the stacked ranks to it).
BLOCK_R = 16


def launch(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    config: KernelConfig,
    lora: LoraOperands | None = None,
) -> torch.Tensor:
    """The kernel on aligned operands (gate_up_silu checks them) with `config`: [T, I]. Benchmarks launch
    other configurations through it."""
    parts = [] if lora is None else [p for pair in lora if pair is not None for p in pair]
    if not all(_aligned(t) for t in (x, gate, up, *parts)):
        raise ValueError("the fused MLP kernel needs unit-stride, 16-byte aligned rows")
    tokens, hidden = x.shape
    width = gate.shape[0]
    out = x.new_empty(tokens, width)
    tiles = triton.cdiv(tokens, config.block_m) * triton.cdiv(width, config.block_n)
    programs = min(tiles, _processors(x.device))

    def deltas(
        pair: tuple[torch.Tensor, torch.Tensor] | None, other: tuple[torch.Tensor, torch.Tensor]
    ) -> list[Any]:
        """One product's delta descriptors and rank; a product without one reads none (rank 0) and is
        handed the other's descriptors, never loaded."""
        s, b = pair if pair is not None else other
        rank = 0 if pair is None else s.shape[1]
        return [
            TensorDescriptor.from_tensor(s, [config.block_m, BLOCK_R]),
            TensorDescriptor.from_tensor(b, [config.block_n, BLOCK_R]),
            rank,
        ]

    x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k])
    gate_desc = TensorDescriptor.from_tensor(gate, [config.block_n, config.block_k])
    present = None if lora is None else lora.gate or lora.up
    if lora is None or present is None:
        # Never read: the kernel is compiled without the LoRA steps.
        extra = [x_desc, gate_desc, 0, x_desc, gate_desc, 0]
    else:
        extra = deltas(lora.gate, present) + deltas(lora.up, present)
    _kernel()[(programs,)](
        x_desc,
        gate_desc,
        TensorDescriptor.from_tensor(up, [config.block_n, config.block_k]),
        TensorDescriptor.from_tensor(out, [config.block_m, config.block_n]),
        tokens, width, hidden, programs, *extra,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        LORA=present is not None, BLOCK_R=BLOCK_R, num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    return out


def _gate_up_silu(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_s: torch.Tensor | None,
    gate_b: torch.Tensor | None,
    up_s: torch.Tensor | None,
    up_b: torch.Tensor | None,
) -> torch.Tensor:
    lora = LoraOperands(
        None if gate_s is None or gate_b is None else (gate_s, gate_b),
        None if up_s is None or up_b is None else (up_s, up_b),
    )
    return launch(x, gate, up, KernelConfig(), lora)


def _gate_up_silu_shape(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *_: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], gate.shape[0])


# One opaque operator: torch.compile keeps it whole inside a compiled layer (the descriptors are built on
# the host at each call) and CUDA graphs record its launch.
if triton is not None:
    torch.library.custom_op(OP_NAME, _gate_up_silu, mutates_args=()).register_fake(_gate_up_silu_shape)


def gate_up_silu(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, lora: LoraOperands | None = None
) -> torch.Tensor:
    """silu(x @ gate^T + delta_gate) * (x @ up^T + delta_up) for x [T, H] and weights [I, H]: [T, I] in x's
    dtype; each delta (`lora`) the product of a shrink [T, R] and a B [I, R] in x's dtype, R a multiple of
    BLOCK_R, or none."""
    if x.dim() != 2 or gate.dim() != 2 or gate.shape != up.shape or x.shape[1] != gate.shape[1]:
        shapes = ", ".join(str(tuple(t.shape)) for t in (x, gate, up))
        raise ValueError(f"x [T, H] and gate, up [I, H] needed, got {shapes}")
    if not x.dtype == gate.dtype == up.dtype:
        raise ValueError(f"one dtype needed, got {x.dtype}, {gate.dtype}, {up.dtype}")
    if (x.shape[1] * x.element_size()) % 16 or (gate.shape[0] * x.element_size()) % 16:
        raise ValueError("the fused MLP kernel needs rows of whole 16-byte units (hidden and MLP widths)")
    pairs = (None, None) if lora is None else tuple(lora)
    for pair in pairs:
        if pair is None:
            continue
        s, b = pair
        if s.dim() != 2 or b.dim() != 2 or s.shape[0] != x.shape[0] or b.shape != (gate.shape[0], s.shape[1]):
            raise ValueError(
                f"a delta's shrink [T, R] and B [I, R] needed, got {tuple(s.shape)}, {tuple(b.shape)}"
            )
        if s.shape[1] % BLOCK_R or s.dtype != x.dtype or b.dtype != x.dtype:
            raise ValueError(f"a delta's rank must be a multiple of {BLOCK_R}, its dtype x's ({x.dtype})")
    flat = [t for pair in pairs for t in (pair if pair is not None else (None, None))]
    flat = [t if t is None else t.contiguous() for t in flat]
    out: torch.Tensor = torch.ops.score_worker.gate_up_silu(x.contiguous(), gate, up, *flat)
    return out


class GatedSilu(NamedTuple):
    """Where a SiLU-gated MLP keeps its weights: `weights(mlp)` -> (gate [I, H], up [I, H]); and its LoRA
    deltas on rows x inside an adapter batch: `lora(mlp, x)`."""

    weights: Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor]]
    lora: Callable[[nn.Module, torch.Tensor], LoraOperands]


def _plain_unbiased(linear: object) -> TypeGuard[nn.Linear]:
    return type(linear) is nn.Linear and linear.bias is None


def _separate_weights(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = cast(nn.Linear, mlp.gate_proj), cast(nn.Linear, mlp.up_proj)
    return gate.weight, up.weight


def _halves_of_fused(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    fused = cast(nn.Linear, mlp.gate_up_proj)
    half = fused.out_features // 2
    return fused.weight[:half], fused.weight[half:]


def _separate_lora(mlp: nn.Module, x: torch.Tensor) -> LoraOperands:
    gate, up = cast(nn.Module, mlp.gate_proj), cast(nn.Module, mlp.up_proj)
    return LoraOperands(lora_operands(gate, x), lora_operands(up, x))


def _lora_of_fused(mlp: nn.Module, x: torch.Tensor) -> LoraOperands:
    """One shrink for both halves; B's first half of rows is the gate's, its second the up's."""
    delta = lora_operands(cast(nn.Module, mlp.gate_up_proj), x)
    if delta is None:
        return LoraOperands(None, None)
    shrunk, b = delta
    half = b.shape[0] // 2
    return LoraOperands((shrunk, b[:half]), (shrunk, b[half:]))


def gated_silu(mlp: nn.Module) -> GatedSilu | None:
    """How to read `mlp`'s gate and up weights when the kernel can compute its activation input, else None:
    a class of GATED_SILU_MLPS with a SiLU activation, plain unbiased gate/up projections and weights whose
    rows start on 16-byte boundaries (FusedMlps.of copies weights that start off one)."""
    layout = GATED_SILU_MLPS.get(type(mlp).__name__)
    activation = getattr(mlp, "act_fn" if layout == "separate" else "activation_fn", None)
    if layout is None or not isinstance(activation, _SILU_CLASSES):
        return None
    parts: GatedSilu
    if layout == "separate":
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        if not (_plain_unbiased(gate) and _plain_unbiased(up)) or gate.weight.shape != up.weight.shape:
            return None
        parts = GatedSilu(_separate_weights, _separate_lora)
    else:
        fused = getattr(mlp, "gate_up_proj", None)
        if not _plain_unbiased(fused) or fused.out_features % 2:
            return None
        parts = GatedSilu(_halves_of_fused, _lora_of_fused)
    gate_w, up_w = parts.weights(mlp)
    if gate_w.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    if not (_aligned(gate_w) and _aligned(up_w) and (gate_w.shape[0] * gate_w.element_size()) % 16 == 0):
        return None
    return parts


def _align_weights(mlp: nn.Module) -> None:
    """Copy a gate/up weight that does not start on a 16-byte boundary to memory that does, once: weights read
    from a file mapped into memory can start on 8, and the descriptors need 16."""
    for name in ("gate_proj", "up_proj", "gate_up_proj"):
        linear = getattr(mlp, name, None)
        if isinstance(linear, nn.Linear) and linear.weight.data_ptr() % 16:
            linear.weight.data = linear.weight.data.clone()


def _fused_forward(mlp: nn.Module, parts: GatedSilu) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = parts.weights(mlp)
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        # Inside an adapter batch, the adapted gate and up products take their deltas in the kernel.
        product = gate_up_silu(rows, gate, up, parts.lora(mlp, rows))
        down: torch.Tensor = cast(nn.Module, mlp.down_proj)(product.reshape(*hidden_states.shape[:-1], -1))
        return down

    return forward


class FusedMlps:
    """The SiLU-gated MLPs of a layer stack with their forward swapped for the fused kernel's, only inside
    the block (the engine's packed forward). The swapped forwards are made once, so a compiled layer that
    traced one finds the same function on every entry."""

    def __init__(self, mlps: list[tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]]) -> None:
        self._mlps = mlps

    @classmethod
    def of(cls, layers: nn.ModuleList) -> FusedMlps | None:
        """The fusable MLPs of `layers`, or None when none is."""
        found = []
        for layer in layers:
            for module in layer.modules():
                if type(module).__name__ in GATED_SILU_MLPS:
                    _align_weights(module)
                parts = gated_silu(module)
                if parts is not None:
                    found.append((module, _fused_forward(module, parts)))
        return cls(found) if found else None

    def __len__(self) -> int:
        return len(self._mlps)

    def __enter__(self) -> FusedMlps:
        for mlp, forward in self._mlps:
            mlp.forward = forward
        return self

    def __exit__(self, *exc: object) -> None:
        for mlp, _ in self._mlps:
            del mlp.forward  # the class's forward again

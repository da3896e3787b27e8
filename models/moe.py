"""Mixture-of-experts blocks on the packed path: each token routed to its top-k experts, the experts run as
one grouped product over the tokens sorted by expert.

A sparse block (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`; Qwen3-Next's `Qwen3NextSparseMoeBlock`, which adds a
shared expert scaled by a sigmoid gate) sends every token through the `top_k` of `E` experts its router
picks: softmax of the router's logits in float32, the top k probabilities, renormalised to sum to one where
the config says `norm_topk_prob`, then cast back to the logits' dtype (HF's arithmetic, step for step, so the
same experts are chosen). Each expert is a SiLU-gated MLP whose weights are stored stacked: gate and up as
`gate_up_proj` [E, 2I, H] (gate rows first), down as `down_proj` [E, H, I].

Here the T x k (token, expert) pairs are sorted by expert (a stable sort: within an expert, tokens keep
their order), their rows gathered into [S, H] (S = T * k), and each expert's run multiplied by its weights
in one grouped product (`offsets` [E]: where each expert's run ends; an expert with no token has an empty
run). The products' rows go back to their pairs, are weighted by the router and summed over k in float32,
then cast to the model's dtype. Nothing depends on a count read on the host, so the block is recorded by
CUDA graphs as it is, and a compiled layer sees one opaque operator.

The grouped product (`kernel_for`): `torch._grouped_mm` on CUDA in bfloat16 on sm90/sm100 (its CUTLASS
kernel; elsewhere torch falls back to a loop that copies the offsets to the host), whose operands need
16-byte aligned rows: hidden and expert widths multiples of 8. Other CUDA cases (float16, float32, unaligned
widths, other GPUs) take a Triton grouped kernel that reads the offsets on the device (models/moe_kernel.py).
The CPU loops over the experts with one matmul each (the run lengths read on the host, where there is no
graph to break); so does CUDA without Triton, for which CUDA graphs are refused (`MoeBlocks.graph_safe`).

Why not HF's own `experts_implementation="grouped_mm"`: it is the same idea, but transformers 5.17 and 5.25
differ in its checks and sentinel handling, its fallback reads the offsets on the host inside every call, and
the engine needs the block swapped in only around the packed forward (HF's forward, the self-check's
reference, keeps whatever HF chose) and split across tensor-parallel ranks on its own terms.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

OP_NAME = "score_worker::moe_experts"
# HF's sparse blocks this module runs: the class name, and whether it has a gated shared expert.
SPARSE_BLOCKS = {"Qwen3MoeSparseMoeBlock": False, "Qwen3NextSparseMoeBlock": True}
# torch._grouped_mm's operands: data and every row stride 16-byte aligned (bfloat16: widths multiples of 8).
_ALIGN_BYTES = 16


def route(
    hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights, as HF's Qwen3 routers choose them: hidden [T, H] and the
    router's weight [E, H] -> (weights [T, k] in the logits' dtype, experts [T, k] int64)."""
    logits = F.linear(hidden, router_weight)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), experts


# How the experts' grouped products run: torch's CUTLASS kernel, the Triton kernel, one matmul per expert.
KERNELS = ("grouped_mm", "triton", "loop")


def grouped_available(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether torch's grouped product runs these operands on its own kernel (no host copy of the offsets):
    CUDA, bfloat16, sm90 or sm100, aligned widths."""
    if x.device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    if not (x.dtype == gate_up.dtype == down.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
        return False
    step = _ALIGN_BYTES // x.element_size()
    widths_aligned = gate_up.shape[-1] % step == 0 and down.shape[-1] % step == 0
    return widths_aligned and gate_up.data_ptr() % _ALIGN_BYTES == 0 and down.data_ptr() % _ALIGN_BYTES == 0


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, in] sorted by expert, weight [E, out, in]: each run of rows times its expert's weight^T."""
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)


def _triton(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from models.moe_kernel import grouped_mm  # imports Triton: only where the kernel runs

    return grouped_mm(x, weight, offsets)


def _looped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The grouped product as one matmul per expert with rows (the run lengths read on the host)."""
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[expert].t()
        start = end
    return out


def _experts(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    kernel: str,
) -> torch.Tensor:
    tokens, k = experts.shape
    count = gate_up.shape[0]
    flat = experts.reshape(-1)  # [S]
    expert_of, order = torch.sort(flat, stable=True)
    rows = hidden.index_select(0, order // k)  # [S, H], by expert
    # Where each expert's run ends: searchsorted on the sorted ids, no count on the host, no atomics.
    ends = torch.arange(1, count + 1, device=flat.device, dtype=expert_of.dtype)
    offsets = torch.searchsorted(expert_of, ends).to(torch.int32)  # [E]
    product = {"grouped_mm": _grouped, "triton": _triton}.get(kernel, _looped)
    gate, up = product(rows, gate_up, offsets).chunk(2, dim=-1)  # [S, I] each
    out = product(F.silu(gate) * up, down, offsets)  # [S, H]
    # Back to (token, k) order, weighted, summed over k in float32.
    pairs = torch.empty_like(out).index_copy_(0, order, out).view(tokens, k, -1)
    summed = (pairs.float() * weights.float().unsqueeze(-1)).sum(dim=1)
    return summed.to(hidden.dtype)


def _experts_shape(
    hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *_: Any
) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)


# One opaque operator: a compiled layer keeps it whole (the sort and the runs are data-dependent), and a CUDA
# graph records its launches.
torch.library.custom_op(OP_NAME, _experts, mutates_args=()).register_fake(_experts_shape)


def routed_experts(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    kernel: str | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, j], for hidden [T, H]:
    [T, H] in hidden's dtype. gate_up [E, 2I, H] (gate rows first), down [E, H, I]. `kernel`: one of
    KERNELS (None: kernel_for decides)."""
    if kernel is None:
        kernel = kernel_for(gate_up, down)
    out: torch.Tensor = torch.ops.score_worker.moe_experts(
        hidden.contiguous(), experts, weights, gate_up, down, kernel
    )
    return out


def kernel_for(gate_up: torch.Tensor, down: torch.Tensor) -> str:
    """Which of KERNELS multiplies these experts, for inputs in their dtype on their device."""
    from models import moe_kernel

    if grouped_available(torch.empty(0, device=gate_up.device, dtype=gate_up.dtype), gate_up, down):
        return "grouped_mm"
    return "triton" if gate_up.device.type == "cuda" and moe_kernel.available() else "loop"


def _stacked(block: Any) -> Any:
    """The module holding the stacked expert weights (a tensor-parallel wrapper's inner experts)."""
    experts = block.experts
    inner = getattr(experts, "inner", None)
    return inner if isinstance(inner, nn.Module) else experts


def packed_block_forward(block: Any) -> Any:
    """The packed path's forward of one sparse block: hidden [..., H] -> [..., H] (any leading shape: the
    packed row [1, T, H], or the pooled rows [R, H] of the last layer)."""
    shared = SPARSE_BLOCKS[type(block).__name__]
    router, stacked, reduce = block.gate, _stacked(block), getattr(block.experts, "all_reduce", None)
    top_k, normalize = int(router.top_k), bool(router.norm_topk_prob)
    # Decided once, with the weights in place: a compiled layer then traces no data pointer.
    kernel = kernel_for(stacked.gate_up_proj, stacked.down_proj)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        weights, chosen = route(flat, router.weight, top_k, normalize)
        out = routed_experts(flat, chosen, weights, stacked.gate_up_proj, stacked.down_proj, kernel)
        if reduce is not None:
            out = reduce(out)  # the ranks' shares of every expert's intermediate columns
        if shared:
            gate = torch.sigmoid(block.shared_expert_gate(flat))  # [T, 1]
            out = out + gate * block.shared_expert(flat)
        return out.reshape(hidden_states.shape)

    return forward


def sparse_blocks(layers: Iterable[nn.Module]) -> list[nn.Module]:
    """The sparse blocks of `layers` (their `mlp`), in order; layers with a dense MLP have none."""
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    return [mlp for mlp in mlps if isinstance(mlp, nn.Module) and type(mlp).__name__ in SPARSE_BLOCKS]


def unsupported(blocks: Iterable[nn.Module]) -> str | None:
    """Why some block cannot take the packed forward (an activation other than SiLU), or None."""
    for block in blocks:
        act = getattr(_stacked(block), "act_fn", None)
        if not isinstance(act, nn.SiLU) and type(act).__name__ != "SiLUActivation":
            return f"its experts' activation is {type(act).__name__}, and the packed experts compute SiLU"
    return None


class MoeBlocks:
    """The sparse blocks of a model with the packed forward swapped in, only while the engine runs its
    packed forward (as the compiled layers and the fused MLPs are): HF's own forward keeps HF's blocks."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self._blocks = blocks
        self._forwards = [packed_block_forward(block) for block in blocks]

    @classmethod
    def of(cls, layers: Iterable[nn.Module] | None) -> MoeBlocks | None:
        """The sparse blocks of `layers`, or None where there are none."""
        blocks = sparse_blocks(layers or ())
        return cls(blocks) if blocks else None

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def blocks(self) -> tuple[nn.Module, ...]:
        """The sparse blocks, in layer order."""
        return tuple(self._blocks)

    def graph_safe(self) -> bool:
        """Whether a CUDA graph can record the blocks: on CUDA, no block loops over its experts (the loop
        reads the run lengths on the host). Off CUDA a recorder is a test's, which runs the forward again:
        any path is."""
        stacks = [_stacked(block) for block in self._blocks]
        on_cuda = any(s.gate_up_proj.device.type == "cuda" for s in stacks)
        return not on_cuda or "loop" not in self.kernels()

    def kernels(self) -> set[str]:
        """The KERNELS the blocks' experts run on."""
        stacks = [_stacked(block) for block in self._blocks]
        return {kernel_for(s.gate_up_proj, s.down_proj) for s in stacks}

    def __enter__(self) -> MoeBlocks:
        for block, forward in zip(self._blocks, self._forwards, strict=True):
            block.forward = forward
        return self

    def __exit__(self, *exc: object) -> None:
        for block in self._blocks:
            del block.forward  # the class's forward again

"""The mixture-of-experts kernels on the GPU (models/moe.py, models/moe_kernel.py): which kernel each dtype
takes, each against one matmul per expert in the same dtype with the same routing, and the packed block
recorded in a CUDA graph and replayed on tokens that route elsewhere.

Marked `gpu` and skipped without a CUDA device. Whole models with experts go through
tests/gpu/test_architectures.py (qwen3_moe is one of the tiny architectures).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tolerances import gamma, unit_roundoff
from transformers import AutoConfig

from models.moe import _experts, kernel_for, packed_block_forward, route

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Qwen3-30B-A3B's block: hidden 2048, 128 experts of width 768, 8 a token.
HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768


def _block(dtype: torch.dtype) -> Any:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        moe_intermediate_size=WIDTH, norm_topk_prob=True, num_attention_heads=16, num_key_value_heads=4,
    )  # fmt: skip
    block = Qwen3MoeSparseMoeBlock(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return block.to("cuda", dtype).eval()


def _bound(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, block: Any) -> torch.Tensor:
    """How far two runs of the experts in x's dtype may differ per output element when only their matmuls'
    float32 accumulation order differs (the grouped kernel against one cuBLAS matmul per expert; both round
    the same intermediates to the dtype and sum the slots alike). A gate or up value differs by its two
    accumulations' difference, 2 gamma(H) of its magnitude sum, and the one ulp (u |g|) that difference can
    flip when rounded; silu (slope at most 1.1) and the product carry that into h, whose own rounding can
    flip an ulp too; the down product adds h's differences over its terms, its own accumulations'
    2 gamma(I) and one flipped ulp of its result. Computed in float64, expert by expert."""
    u = unit_roundoff(x.dtype)
    gamma_h, gamma_i = 2 * gamma(HIDDEN), 2 * gamma(WIDTH)  # float32 accumulations, two orders
    gate_up, down = block.experts.gate_up_proj.double(), block.experts.down_proj.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    x64, w64 = x.double(), weights.double().abs()
    for expert in experts.unique().tolist():
        token, slot = torch.nonzero(experts == expert, as_tuple=True)
        rows = x64[token]
        g, v = (rows @ gate_up[expert].t()).chunk(2, dim=-1)
        g_mag, v_mag = (rows.abs() @ gate_up[expert].abs().t()).chunk(2, dim=-1)
        dg, dv = gamma_h * g_mag + u * g.abs(), gamma_h * v_mag + u * v.abs()
        h = torch.nn.functional.silu(g) * v
        dh = 1.1 * dg * v.abs() + torch.nn.functional.silu(g).abs() * dv + u * h.abs()
        y = h @ down[expert].t()
        dy = dh @ down[expert].abs().t() + gamma_i * (h.abs() @ down[expert].abs().t()) + u * y.abs()
        out.index_add_(0, token, w64[token, slot, None] * dy)
    return out


@pytest.mark.parametrize(
    ("dtype", "kernel"),
    [(torch.bfloat16, "grouped_mm"), (torch.float16, "triton"), (torch.float32, "triton")],
)
@pytest.mark.parametrize("tokens", [1, 300, 4096])
def test_each_dtype_takes_its_kernel_and_matches_a_matmul_per_expert(
    dtype: torch.dtype, kernel: str, tokens: int
) -> None:
    block = _block(dtype)
    stacked = block.experts
    assert kernel_for(stacked.gate_up_proj, stacked.down_proj) == kernel
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    weights, experts = route(x, block.gate.weight, TOP_K, True)
    experts[: tokens // 2, 0] = 7  # half the tokens crowd one expert
    with torch.no_grad():
        got = _experts(x, experts, weights, stacked.gate_up_proj, stacked.down_proj, kernel)
        # One cuBLAS matmul per expert in the same dtype: HF's own eager experts' arithmetic.
        want = _experts(x, experts, weights, stacked.gate_up_proj, stacked.down_proj, "loop")
    bound = _bound(x, experts, weights, block)
    excess = (got.double() - want.double()).abs() - bound
    assert float(excess.max()) <= 0, float(excess.max())
    # Not vacuous: one token sent to another expert in its first slot lands outside the bound.
    wrong = experts.clone()
    wrong[0, 0] = (wrong[0, 0] + 1) % EXPERTS
    with torch.no_grad():
        misrouted = _experts(x, wrong, weights, stacked.gate_up_proj, stacked.down_proj, kernel)
    assert bool(((misrouted[0].double() - want[0].double()).abs() > bound[0]).any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_packed_block_replays_from_a_cuda_graph(dtype: torch.dtype) -> None:
    """Nothing of the block reads a count on the host: recorded once, replayed on tokens routed elsewhere,
    it gives the eager forward's bits."""
    block = _block(dtype)
    forward = packed_block_forward(block)
    generator = torch.Generator().manual_seed(2)
    static = torch.randn(1, 512, HIDDEN, generator=generator).to("cuda", dtype)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(static)  # warm-up off the capture stream, as torch asks
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward(static)
        fresh = torch.randn(1, 512, HIDDEN, generator=generator).to("cuda", dtype) * 3
        static.copy_(fresh)
        graph.replay()
        expected = forward(fresh)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)

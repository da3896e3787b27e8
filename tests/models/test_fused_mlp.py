"""The fused gate/up/SiLU kernel (models/fused_mlp.py), run in Triton's interpreter on CPU tensors (tests/
conftest.py turns it on without a GPU): its tiles, edges and epilogue against float32 arithmetic, which MLPs
it takes, when the setting turns it on, and the engine through it against the exact path. Its speed, and
bfloat16 (which the interpreter does not compute faithfully), are the GPU's:
docs/notes/benchmarks-history.md and tests/gpu."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from scoring_testkit import CpuVarlenKernelGqa, assert_scored_alike, token_requests
from tolerances import assert_within, gamma, gated_silu_bound
from torch import nn

pytest.importorskip("triton")

from models import Scorer, ScorerConfig, fused_mlp, triton_attention
from models.fp8 import quantize_layers

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not triton_attention.interpreting(),
    reason="these drive the kernel in Triton's interpreter; on a GPU, tests/gpu runs it compiled",
)


def _expected(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(x.double() @ gate.double().t()) * (x.double() @ up.double().t())


def _down_bound(down: torch.Tensor, product: torch.Tensor, product_bound: torch.Tensor) -> torch.Tensor:
    """One float32 down projection of a product known within product_bound: that error carried by |W|, and
    the projection's own gamma(I) of its magnitude sum |W||product|."""
    down64 = down.double().abs()
    return product_bound @ down64.t() + gamma(down.shape[-1]) * (product.double().abs() @ down64.t())


@pytest.mark.parametrize(
    ("tokens", "hidden", "width"),
    [
        (1, 64, 128),  # one token: the rest of the row tile is past the edge
        (300, 64, 128),  # three row tiles, the last partial
        (130, 200, 384),  # hidden not a multiple of the step; three column tiles
        (2100, 32, 136),  # more row tiles than a group: a second group, partial column tile
    ],
)
def test_kernel_matches_float32_arithmetic(tokens: int, hidden: int, width: int) -> None:
    generator = torch.Generator().manual_seed(tokens + hidden + width)
    x = torch.randn(tokens, hidden, generator=generator)
    gate = torch.randn(width, hidden, generator=generator) / hidden**0.5
    up = torch.randn(width, hidden, generator=generator) / hidden**0.5
    got = fused_mlp.gate_up_silu(x, gate, up)
    assert got.shape == (tokens, width) and got.dtype == torch.float32
    # The kernel's float32 against float64: `hidden`-term products and the epilogue, per element.
    assert_within(got, _expected(x, gate, up), gated_silu_bound(x, gate, up))


def test_kernel_reads_halves_of_one_weight_and_strided_rows() -> None:
    # Phi-3's gate and up are the two halves of one [2I, H] weight; a [T, H] view of wider rows is made
    # contiguous before the descriptors see it.
    generator = torch.Generator().manual_seed(11)
    fused = torch.randn(2 * 96, 64, generator=generator) / 8
    wide = torch.randn(50, 80, generator=generator)
    x = wide[:, :64]
    got = fused_mlp.gate_up_silu(x, fused[:96], fused[96:])
    # The kernel's float32 against float64, per element (64-term products and the epilogue).
    assert_within(got, _expected(x, fused[:96], fused[96:]), gated_silu_bound(x, fused[:96], fused[96:]))


@pytest.mark.parametrize(("gate_rank", "up_rank"), [(16, 32), (16, 0), (0, 32)])
def test_kernel_adds_each_products_lora_delta_before_the_activation(gate_rank: int, up_rank: int) -> None:
    """An adapter batch's gate and up deltas (a masked shrink [T, R] by a stacked B [I, R] each, or none)
    taken into the products' float32 accumulators: the arithmetic of one product over [x | s_gate | s_up]
    by [gate | b_gate | 0] and [up | 0 | b_up], within that product's bound, per element."""
    generator = torch.Generator().manual_seed(gate_rank + 3 * up_rank)
    tokens, hidden, width = 300, 64, 136  # partial row and column tiles
    x = torch.randn(tokens, hidden, generator=generator)
    gate, up = (torch.randn(width, hidden, generator=generator) / 8 for _ in "gu")

    def delta(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(tokens, rank, generator=generator), torch.randn(
            width, rank, generator=generator
        ) / 4

    (gate_s, gate_b), (up_s, up_b) = delta(gate_rank), delta(up_rank)
    lora = fused_mlp.LoraOperands((gate_s, gate_b) if gate_rank else None, (up_s, up_b) if up_rank else None)
    got = fused_mlp.gate_up_silu(x, gate, up, lora)
    wide = torch.cat([x, gate_s, up_s], 1)
    wide_gate = torch.cat([gate, gate_b, torch.zeros(width, up_rank)], 1)
    wide_up = torch.cat([up, torch.zeros(width, gate_rank), up_b], 1)
    assert_within(got, _expected(wide, wide_gate, wide_up), gated_silu_bound(wide, wide_gate, wide_up))
    # The deltas moved the product: equal to the plain one, the check above would prove nothing.
    assert not torch.allclose(got, fused_mlp.gate_up_silu(x, gate, up), atol=1e-3)


def test_kernel_refuses_what_it_cannot_compute() -> None:
    x, weight = torch.randn(4, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        fused_mlp.gate_up_silu(x, weight, torch.randn(32, 48))
    with pytest.raises(ValueError, match="one dtype"):
        fused_mlp.gate_up_silu(x, weight, weight.double())
    with pytest.raises(ValueError, match="16-byte"):
        fused_mlp.gate_up_silu(torch.randn(4, 6), torch.randn(32, 6), torch.randn(32, 6))
    with pytest.raises(ValueError, match="multiple of 16"):  # a rank the kernel's steps do not cover
        fused_mlp.gate_up_silu(
            x, weight, weight, fused_mlp.LoraOperands((torch.randn(4, 8), torch.randn(32, 8)), None)
        )
    with pytest.raises(ValueError, match=r"\[T, R\] and B \[I, R\]"):
        fused_mlp.gate_up_silu(
            x, weight, weight, fused_mlp.LoraOperands(None, (torch.randn(4, 16), torch.randn(8, 16)))
        )


def _layers(model_dir: Path) -> nn.ModuleList:
    layers: nn.ModuleList = Scorer(model_dir, ScorerConfig(device="cpu")).hf_model.base_model.layers
    return layers


@pytest.mark.parametrize(
    ("architecture", "fusable"),
    [
        ("llama", True),
        ("qwen3", True),
        ("qwen2", True),
        ("mistral", True),
        ("phi3", True),  # one gate_up projection
        ("gemma2", False),  # GELU-gated
        ("gemma3_text", False),
        ("smollm3", True),
        ("olmo2", True),  # its norm after the MLP is the layer's, outside the MLP
        ("olmo3", True),
        ("glm4", True),  # one gate_up projection, as Phi-3's
    ],
)
def test_which_mlps_it_takes(architecture: str, fusable: bool, model_dirs: dict[str, Path]) -> None:
    layers = _layers(model_dirs[architecture])
    fused = fused_mlp.FusedMlps.of(layers)  # copies weights that a file mapping left 8-byte aligned
    assert (fused is not None and len(fused) == len(layers)) if fusable else fused is None
    mlps = [layer.mlp for layer in layers]
    assert all((fused_mlp.gated_silu(mlp) is not None) == fusable for mlp in mlps)
    if fusable:
        # Its gate and up weights as the MLP's own forward uses them.
        gate, up = fused_mlp.gated_silu(mlps[0]).weights(mlps[0])  # type: ignore[union-attr]
        x = torch.randn(5, gate.shape[1])
        product = F.silu(x @ gate.t()) * (x @ up.t())
        # Two float32 computations (these matmuls vs the MLP's own linears), each within the product's
        # bound carried through the down projection and that projection's own gamma.
        down = mlps[0].down_proj.weight.detach()
        bound = 2 * _down_bound(down, product, gated_silu_bound(x, gate, up))
        assert_within(mlps[0].down_proj(product), mlps[0](x), bound)


def test_mlps_it_leaves_alone(tiny_llama_dir: Path) -> None:
    mlp = _layers(tiny_llama_dir)[0].mlp
    assert fused_mlp.FusedMlps.of(nn.ModuleList([mlp])) is not None
    other = copy.deepcopy(mlp)
    other.act_fn = nn.GELU()
    assert fused_mlp.gated_silu(other) is None  # another activation
    other.act_fn = nn.SiLU()
    assert fused_mlp.gated_silu(other) is not None
    other.gate_proj = nn.Linear(mlp.gate_proj.in_features, mlp.gate_proj.out_features, bias=True)
    assert fused_mlp.gated_silu(other) is None  # a biased gate
    layers = nn.ModuleList([nn.Module()])
    layers[0].mlp = _layers(tiny_llama_dir)[0].mlp
    quantize_layers(layers)
    assert fused_mlp.gated_silu(layers[0].mlp) is None  # FP8 projections keep their own path
    assert fused_mlp.FusedMlps.of(layers) is None


def test_the_swap_holds_only_inside_the_block(tiny_llama_dir: Path) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    layers = scorer.hf_model.base_model.layers
    fused = fused_mlp.FusedMlps.of(layers)
    assert fused is not None and len(fused) == len(layers)
    mlp = layers[0].mlp
    x = torch.randn(1, 7, mlp.gate_proj.in_features)
    with fused:
        assert "forward" in vars(mlp)
        inside = mlp(x)
    assert "forward" not in vars(mlp)
    # The kernel's product and HF's, each within its float32 bound carried through the down projection.
    gate, up = mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()
    rows = x.reshape(-1, x.shape[-1])
    product = F.silu(rows @ gate.t()) * (rows @ up.t())
    bound = 2 * _down_bound(mlp.down_proj.weight.detach(), product, gated_silu_bound(rows, gate, up))
    assert_within(inside.reshape(bound.shape), mlp(x).reshape(bound.shape), bound)


def _fused_on_cpu(compile: bool = False) -> ScorerConfig:
    """The packed path (an exact CPU kernel behind the varlen wrapper) with the fused MLPs."""
    return ScorerConfig(
        device="cpu",
        attention="varlen",
        varlen_kernel=CpuVarlenKernelGqa(),
        fused_mlp="on",
        compile="on" if compile else "off",
    )


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "phi3", "olmo2", "glm4"])
def test_engine_through_the_kernel_matches_the_reference_path(
    architecture: str, model_dirs: dict[str, Path]
) -> None:
    # The packed path with the fused MLPs against the exact path with HF's MLPs. Llama's layers are compiled
    # (the kernel's shape function under dynamo, as on the GPU); compiling takes minutes a model on the CPU,
    # so the others run eager.
    compiled = architecture == "llama"
    fused = Scorer(model_dirs[architecture], _fused_on_cpu(compile=compiled))
    assert fused.executor.compiled == compiled and fused.info.fused_mlp
    reference = Scorer(model_dirs[architecture], ScorerConfig(device="cpu", attention="reference"))
    assert not reference.info.fused_mlp
    requests = token_requests([(30,), (3, 41), (17,), (1,)])
    for got, expected in zip(fused.score(requests), reference.score(requests), strict=True):
        # Two float32 forwards, the fused kernel's and HF's MLPs: the chain of sums (forward_atol).
        assert_scored_alike(got, expected, reference, requests)
    # HF's own forward (the self-check's reference) still runs HF's MLP.
    assert all("forward" not in vars(layer.mlp) for layer in fused.hf_model.base_model.layers)


def test_engine_without_a_fusable_mlp_says_so(model_dirs: dict[str, Path]) -> None:
    assert not Scorer(model_dirs["gemma3_text"], _fused_on_cpu()).info.fused_mlp


def test_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    bf16 = torch.bfloat16
    auto = ScorerConfig()
    # Never on the exact path, never for "off"; "auto" never on the CPU.
    assert not ScorerConfig(fused_mlp="on").resolve_fused_mlp(cpu, torch.float32, "reference", 4096)
    assert not ScorerConfig(fused_mlp="off").resolve_fused_mlp(cpu, bf16, "varlen", 4096)
    assert not auto.resolve_fused_mlp(cpu, bf16, "varlen", 4096)
    # "on" in the interpreter (these tests); on CUDA only in half precision.
    assert ScorerConfig(fused_mlp="on").resolve_fused_mlp(cpu, torch.float32, "varlen", 64)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        ScorerConfig(fused_mlp="on").resolve_fused_mlp(gpu, torch.float32, "varlen", 4096)
    monkeypatch.setattr(triton_attention, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="CUDA device"):
        ScorerConfig(fused_mlp="on").resolve_fused_mlp(cpu, torch.float32, "varlen", 64)
    # "auto" on Hopper from MIN_HIDDEN on, in half precision, without FP8.
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    assert auto.resolve_fused_mlp(gpu, bf16, "varlen", fused_mlp.MIN_HIDDEN)
    assert not auto.resolve_fused_mlp(gpu, bf16, "varlen", fused_mlp.MIN_HIDDEN - 1)
    assert not auto.resolve_fused_mlp(gpu, torch.float32, "varlen", 4096)
    assert not ScorerConfig(quantization="fp8").resolve_fused_mlp(gpu, bf16, "varlen", 4096)
    capability["value"] = (8, 9)
    assert not auto.resolve_fused_mlp(gpu, bf16, "varlen", 4096)
    monkeypatch.setattr(fused_mlp, "available", lambda: False)
    capability["value"] = (9, 0)
    assert not auto.resolve_fused_mlp(gpu, bf16, "varlen", 4096)
    with pytest.raises(ValueError, match="triton"):
        ScorerConfig(fused_mlp="on").resolve_fused_mlp(gpu, bf16, "varlen", 4096)
    with pytest.raises(ValueError, match="fused_mlp"):
        ScorerConfig(fused_mlp="yes")  # type: ignore[arg-type]

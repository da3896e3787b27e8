"""FP8 projections (models/fp8.py) on the CPU, where torch runs the same scaled e4m3 product as the GPU.

What is checked exactly: the product equals the dequantized operands multiplied in float64, with one scale
per token and per output channel (an outlier token leaves the others' precision alone). What is checked
against HF: the packed engine with FP8 projections gives what HF's own forward gives with the same FP8
projections, for every architecture, on the exact and on the GPU's path (varlen kernel, compiled
layers, graphs). How far FP8 moves results from float32 is a property of FP8, reported by bench/fp8.py on
real shapes; here it is only bounded loosely, so that a broken scale cannot pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scoring_testkit import (
    CpuVarlenKernelGqa,
    hf_reference,
    hidden_of,
    load_reference_model,
    scores_of,
    token_requests,
)

from models import Scorer, ScorerConfig
from models.engine import transformer_layers
from models.errors import ModelLoadError
from models.fp8 import FP8_MAX, Fp8Linear, fp8_supported, jittered, quantize_layers, quantize_rows
from models.graphs import Recorder
from models.selfcheck import run_self_check
from models.tiny import DECODERS, ENCODERS, write_tiny_model

# The prompts of several requests packed together, single- and multi-item, longer than the tiny sliding
# windows (16 tokens).
LENGTHS = [(40,), (7, 90), (130,), (25, 25, 60), (3,)]


def _dequantized(matrix: torch.Tensor) -> torch.Tensor:
    values, scale = quantize_rows(matrix)
    return values.double() * scale.double()


def test_the_product_is_that_of_the_dequantized_operands_with_a_scale_per_token() -> None:
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=generator) * 0.05)
        linear.bias.copy_(torch.randn(48, generator=generator))
    x = torch.randn(2, 5, 64, generator=generator)
    x[0, 1] *= 1e4  # an outlier token
    x[1, 3] = 0.0  # a token of zeros
    fp8 = Fp8Linear(linear)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight_scale.shape == (1, 48)
    out = fp8(x)
    assert out.shape == (2, 5, 48) and out.dtype == x.dtype
    rows, weight = _dequantized(x.reshape(-1, 64)), _dequantized(linear.weight.detach())
    expected = rows @ weight.T + linear.bias.detach().double()
    # float32 accumulation: each output within a few float32 steps of the sum of its terms' magnitudes.
    bound = 1e-6 * (rows.abs() @ weight.abs().T) + 1e-6
    assert bool(((out.reshape(-1, 48).double() - expected).abs() <= bound).all())
    np.testing.assert_array_equal(out[1, 3].detach().numpy(), linear.bias.detach().numpy())
    # Each token keeps e4m3's precision whatever its neighbours hold: within a few percent of the exact
    # product, the outlier's own row included (one scale for the whole batch would flush the others to 0).
    exact = linear(x).detach()
    relative = (out - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert float(relative.max()) < 0.1, relative
    # bfloat16 input takes the FP8 kernel (torch._scaled_mm, as on the GPU): the same product, rounded to
    # bfloat16 once at the end.
    assert fp8.bias is not None
    fp8.bias.data = fp8.bias.data.bfloat16()  # a bfloat16 model's bias
    half = fp8(x.bfloat16())
    assert half.dtype == torch.bfloat16
    half_rows = _dequantized(x.bfloat16().float().reshape(-1, 64))
    half_expected = half_rows @ weight.T + fp8.bias.detach().double()
    product = half_expected - fp8.bias.detach().double()  # rounded to bfloat16, then again with the bias
    bf16_bound = 2**-8 * (product.abs() + half_expected.abs()) + 1e-6 * (half_rows.abs() @ weight.abs().T)
    assert bool(((half.reshape(-1, 48).double() - half_expected).abs() <= bf16_bound).all())


def test_jitter_moves_the_rounding_of_every_projection_and_is_undone() -> None:
    """The self-check's measure of FP8 sensitivity: inside `jittered`, inputs move by a last bit before
    rounding, so some elements round to the neighbouring e4m3 value; outside it the product is as before."""
    generator = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    replaced, kept = quantize_layers(torch.nn.ModuleList([model]))
    assert (replaced, kept) == (2, 0)
    x = torch.randn(8, 64, generator=generator)
    before = model(x).detach()
    with jittered(model, 2.0**-8) as touched:
        moved = model(x).detach()
    assert touched == 2
    # Some elements round to the neighbouring e4m3 value (a step of 6-12%): a small move of the whole.
    assert 0 < float((moved - before).norm() / before.norm()) < 0.1
    torch.testing.assert_close(model(x).detach(), before, rtol=0, atol=0)
    with jittered(torch.nn.Linear(4, 4), 2.0**-8) as touched:
        assert touched == 0


def test_quantizing_rounds_to_e4m3_within_its_range() -> None:
    matrix = torch.tensor([[1.0, -2.0, 0.5, 1000.0], [0.0, 0.0, 0.0, 0.0], [3e-8, -1e-8, 0.0, 2e-8]])
    values, scale = quantize_rows(matrix)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (3, 1) and bool((scale > 0).all())
    assert float(values.float().abs().max()) == FP8_MAX  # each row's largest value maps to the top
    assert not bool(values.float().isnan().any())
    np.testing.assert_allclose((values.float() * scale).numpy(), matrix.numpy(), rtol=0.07, atol=1e-12)


def test_only_the_decoder_layers_projections_are_replaced(tiny_llama_dir: Path) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", quantization="fp8"))
    model = scorer.hf_model
    assert scorer.info.quantization == "fp8"
    layers = model.model.layers
    swapped = [m for m in layers.modules() if isinstance(m, Fp8Linear)]
    assert len(swapped) == 7 * len(layers)  # q, k, v, o, gate, up, down
    assert not any(type(m) is torch.nn.Linear for m in layers.modules())
    assert type(model.score) is torch.nn.Linear and model.score.weight.dtype == torch.float32  # the head
    assert model.model.embed_tokens.weight.dtype == torch.float32
    # A projection of a shape the FP8 kernels do not take stays as it is.
    odd = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(60, 64), torch.nn.Linear(64, 64))])
    assert quantize_layers(odd) == (1, 1)
    assert type(odd[0][0]) is torch.nn.Linear and isinstance(odd[0][1], Fp8Linear)


def _agrees_with_hf_fp8(scorer: Scorer, model_dir: Path) -> tuple[float, float]:
    """Score LENGTHS with `scorer` and with HF's own eager forward with the same FP8 projections (float32).

    Most items agree to float32 rounding. The two paths' last-bit differences can round a value to the next
    e4m3 step in some layer (6-12% of that one element), so a few items may differ by about 1% of the score
    scale; a packing, position or scale bug moves every item by its whole scale. Returns (median, max) of
    the per-item largest score difference, relative to the scale."""
    reference_model = load_reference_model(model_dir)
    layers = transformer_layers(reference_model.base_model)
    assert layers is not None
    quantize_layers(layers)
    requests = token_requests(LENGTHS, seed=5)
    prompts = [list(item) for request in requests for item in request.items]
    reference = hf_reference(model_dir, prompts, model=reference_model)
    results = scorer.score(requests)
    scores = np.concatenate([scores_of(r) for r in results])
    hidden = np.concatenate([hidden_of(r) for r in results])
    scale = max(1.0, float(np.abs(reference.logits).max()))
    per_item = np.abs(scores - reference.logits).max(axis=1) / scale
    cosine = (hidden * reference.hidden).sum(1) / (
        np.linalg.norm(hidden, axis=1) * np.linalg.norm(reference.hidden, axis=1)
    )
    assert float(cosine.min()) > 0.995, cosine
    return float(np.median(per_item)), float(per_item.max())


@pytest.fixture(scope="module", params=DECODERS)
def decoder_dir(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    architecture = request.param
    return write_tiny_model(tmp_path_factory.mktemp(f"fp8-{architecture}"), architecture, 3, num_labels=2)


@pytest.mark.slow
def test_every_decoder_scores_like_hf_with_the_same_fp8_projections(decoder_dir: Path) -> None:
    scorer = Scorer(decoder_dir, ScorerConfig(device="cpu", quantization="fp8"))
    median, largest = _agrees_with_hf_fp8(scorer, decoder_dir)
    assert median < 1e-5 and largest < 0.05, (median, largest)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ENCODERS)
def test_every_encoder_with_fp8_projections_passes_the_self_check(architecture: str, tmp_path: Path) -> None:
    """Encoders pool and template their prompts their own way: the start-up self-check is their comparison
    with HF's own forward (the same FP8 modules), packed against plain; every layer's projections swapped."""
    model_dir = write_tiny_model(tmp_path / architecture, architecture, seed=3, num_labels=2)
    scorer = Scorer(model_dir, ScorerConfig(device="cpu", quantization="fp8"))
    layers = transformer_layers(scorer.hf_model.base_model)
    assert layers is not None and not any(type(m) is torch.nn.Linear for m in layers.modules())
    report = run_self_check(scorer)
    assert report.max_score_diff < 1e-3 * report.score_scale and report.min_hidden_cosine > 0.999, report


@pytest.mark.slow
def test_the_gpu_path_with_fp8_projections_scores_like_hf(tiny_qwen3_dir: Path) -> None:
    """The varlen kernel's wrapper, compiled layers and the graphed forward (CPU stand-ins, as in
    tests/models/test_cuda_graphs.py), with FP8 projections, against HF with the same projections."""
    kernel = torch._dynamo.disable(CpuVarlenKernelGqa())
    rerun: Recorder = lambda run: run  # noqa: E731 - a recorder whose replay runs the function again
    config = ScorerConfig(
        device="cpu",
        attention="varlen",
        varlen_kernel=kernel,
        compile="on",
        graph_recorder=rerun,
        quantization="fp8",
    )
    scorer = Scorer(tiny_qwen3_dir, config)
    assert scorer.compiled and scorer.graphs is not None
    for _ in range(3):  # ordinary, recorded, replayed
        median, largest = _agrees_with_hf_fp8(scorer, tiny_qwen3_dir)
        assert median < 1e-5 and largest < 0.05, (median, largest)


@pytest.mark.slow
def test_fp8_stays_near_float32_and_passes_the_self_check(tiny_llama_dir: Path) -> None:
    """FP8's own deviation from the unquantized float32 model, bounded loosely (tiny random-weight models
    round worse than real ones: bench/fp8.py reports real shapes); and the start-up self-check holds FP8 to
    its own bounds, so a model that scores right is not refused."""
    fp8 = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", quantization="fp8"))
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    requests = token_requests(LENGTHS, seed=9)
    for a, b in zip(fp8.score(requests), plain.score(requests), strict=True):
        x, y = hidden_of(a), hidden_of(b)
        cosine = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
        assert float(cosine.min()) > 0.95, cosine
        scale = max(1.0, float(np.abs(scores_of(b)).max()))
        assert float(np.abs(scores_of(a) - scores_of(b)).max()) < 0.5 * scale
    report = run_self_check(fp8)
    assert report.max_score_diff <= report.score_bound


def test_fp8_is_refused_where_it_cannot_run(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="quantization"):
        ScorerConfig(quantization="int8")  # type: ignore[arg-type]
    assert fp8_supported(torch.device("cpu")) is None
    assert "CUDA or the CPU" in (fp8_supported(torch.device("meta")) or "")
    assert transformer_layers(torch.nn.Linear(2, 2)) is None
    monkeypatch.setattr("models.engine.transformer_layers", lambda base: None)
    with pytest.raises(ModelLoadError, match="no layer list"):
        Scorer(tiny_llama_dir, ScorerConfig(device="cpu", quantization="fp8"))

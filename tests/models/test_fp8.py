"""FP8 projections (models/fp8.py) on the CPU, where torch runs the same scaled e4m3 product as the GPU.

What is checked exactly: the product equals the dequantized operands multiplied in float64, with one scale
per token and per output channel (an outlier token leaves the others' precision alone). What is checked
against HF: the packed engine with FP8 projections gives what HF's own forward gives with the same FP8
projections, for every architecture, on the exact and on the GPU's path (varlen kernel, compiled
layers, graphs). How far FP8 moves results from float32 is a property of FP8, reported by bench/fp8.py on
real shapes; here it is only bounded loosely, so that a broken scale cannot pass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scoring_testkit import (
    CpuVarlenKernelGqa,
    forward_atol,
    hf_reference,
    hidden_of,
    load_reference_model,
    scores_of,
    token_requests,
)
from tolerances import (
    assert_within,
    cosine_gap,
    e4m3_rounding,
    gamma,
    rounding_bound,
    sum_bound,
    unit_roundoff,
)

from models import Scorer, ScorerConfig
from models.errors import ModelLoadError
from models.fp8 import (
    ALL_PROJECTIONS,
    FP8_MAX,
    Fp8Linear,
    Fp8Selection,
    cpu_scaled_mm_takes_row_scales,
    fp8_supported,
    jittered,
    quantize_layers,
    quantize_rows,
)
from models.graphs import Recorder
from models.layers import transformer_layers
from models.moe import sparse_blocks
from models.selfcheck import (
    FP8_JITTER,
    FP8_MIN_COSINE,
    NOISE_MARGIN,
    _fixed_prompts,
    _hf_noise,
    _plain_forward,
    _prepared_inputs,
    run_self_check,
)
from models.tiny import ENCODERS, NON_HYBRID_DECODERS, write_tiny_model
from schemas import ScoreRequest, ScoreResult

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
    # float32 arithmetic on the dequantized operands: each an e4m3 value times a float32 scale (one
    # rounding, u), 64 products summed (gamma(64)) and the bias added (u of |out|): gamma(66) of the sum of
    # the terms' magnitudes, plus u |out|.
    magnitude = rows.abs() @ weight.abs().T
    bound = sum_bound(torch.float32, 64 + 2, magnitude) + rounding_bound(torch.float32, expected.abs())
    assert_within(out.reshape(-1, 48), expected, bound, "FP8 product")
    np.testing.assert_array_equal(out[1, 3].detach().numpy(), linear.bias.detach().numpy())
    # Each token keeps e4m3's precision whatever its neighbours hold, the outlier's own row included: both
    # operands rounded to e4m3 with their own row's scale (tolerances.e4m3_rounding: 2^-4 of an element and
    # the subnormal half step), the products' errors |x| dw + dx |w| + dx dw summed, and the two float32
    # products' gamma(66): as a norm per token, relative to the exact product's.
    exact = linear(x).detach()
    relative = (out - exact).norm(dim=-1) / exact.norm(dim=-1)
    x_rows, w = x.reshape(-1, 64), linear.weight.detach()
    dx, dw = e4m3_rounding(x_rows, quantize_rows(x_rows)[1]), e4m3_rounding(w, quantize_rows(w)[1])
    x_abs, w_abs = x_rows.double().abs(), w.double().abs()
    bias_abs = linear.bias.detach().double().abs()
    error = x_abs @ dw.T + dx @ w_abs.T + dx @ dw.T + 2 * gamma(66) * (x_abs @ w_abs.T + bias_abs)
    limit = error.norm(dim=-1) / exact.reshape(-1, 48).double().norm(dim=-1)
    assert bool((relative.reshape(-1).double() <= limit).all()), (relative, limit)
    # bfloat16 input takes the FP8 kernel (torch._scaled_mm, as on the GPU): the same product, rounded to
    # bfloat16 once at the end.
    assert fp8.bias is not None
    fp8.bias.data = fp8.bias.data.bfloat16()  # a bfloat16 model's bias
    half_rows = _dequantized(x.bfloat16().float().reshape(-1, 64))
    half_expected = half_rows @ weight.T + fp8.bias.detach().double()
    product = half_expected - fp8.bias.detach().double()  # rounded to bfloat16, then again with the bias
    # The float32-accumulated product as above (gamma(66)), rounded to bfloat16 (u = 2^-8 of |product|)
    # and once more with the bias (2^-8 of |out|): (p + e)(1 + d1)(1 + d2) + b(1 + d2) - (p + b), with |e|
    # within gamma(66) and |d1|, |d2| <= u, is at most e (1 + u)^2 + u (1 + u) |p| + u |p + b|.
    u = unit_roundoff(torch.bfloat16)
    float32_part = sum_bound(torch.float32, 66, half_rows.abs() @ weight.abs().T) * (1 + u) ** 2
    bf16_bound = float32_part + u * (1 + u) * product.abs() + u * half_expected.abs()
    # Both CPU paths: torch's kernel where this torch's CPU has a row-wise scaled one (2.13, not 2.11), and
    # the dequantized float32 product rounded to bfloat16, which takes its place where it has none.
    for dequantize in sorted({True, not cpu_scaled_mm_takes_row_scales()}):
        fp8.dequantize_on_cpu = dequantize
        half = fp8(x.bfloat16())
        assert half.dtype == torch.bfloat16
        assert_within(
            half.reshape(-1, 48), half_expected, bf16_bound, f"bfloat16 FP8 product ({dequantize=})"
        )


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
    # Some elements round to the neighbouring e4m3 value (a step of 6-12%): a move of the whole no larger
    # than each projection's input moved by 2^-8 and rounded twice (tolerances.e4m3_rounding, for the
    # jittered row's scale too), carried by |W| through both layers, relative to the output's norm.
    first, second = model[0], model[1]
    weights = [layer.weight.double() * layer.weight_scale.double().t() for layer in (first, second)]

    def moved_by(rows: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
        scale = quantize_rows(rows)[1] * (1 + 2.0**-8)
        return carried + 2.0**-8 * rows.double().abs() + 2 * e4m3_rounding(rows.abs() + carried, scale)

    def through(layer: int, rows: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
        # Also the two float32 products' gamma(65) (64 terms and the bias) of their magnitude sums.
        w = weights[layer].abs()
        magnitude = (rows.double().abs() + carried) @ w.T + model[layer].bias.detach().double().abs()
        return moved_by(rows, carried) @ w.T + 2 * gamma(65) * magnitude

    hidden = first(x).detach()
    into_second = through(0, x, torch.zeros_like(x, dtype=torch.float64))
    out_moved = through(1, hidden, into_second)
    limit = float(out_moved.norm() / before.norm())
    assert 0 < float((moved - before).norm() / before.norm()) <= limit, limit
    torch.testing.assert_close(model(x).detach(), before, rtol=0, atol=0)
    with jittered(torch.nn.Linear(4, 4), 2.0**-8) as touched:
        assert touched == 0


def test_quantizing_rounds_to_e4m3_within_its_range() -> None:
    matrix = torch.tensor([[1.0, -2.0, 0.5, 1000.0], [0.0, 0.0, 0.0, 0.0], [3e-8, -1e-8, 0.0, 2e-8]])
    values, scale = quantize_rows(matrix)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (3, 1) and bool((scale > 0).all())
    assert float(values.float().abs().max()) == FP8_MAX  # each row's largest value maps to the top
    assert not bool(values.float().isnan().any())
    # One e4m3 rounding of each element: 2^-4 of it, or the subnormal half step of its row's scale.
    assert_within(values.float() * scale, matrix, e4m3_rounding(matrix, scale), "e4m3 values")


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


def _agrees_with_hf_fp8(
    scorer: Scorer,
    model_dir: Path,
    selection: Fp8Selection = ALL_PROJECTIONS,
    requests: list[ScoreRequest] | None = None,
    score: Callable[[list[ScoreRequest]], list[ScoreResult]] | None = None,
) -> tuple[float, float, float]:
    """Score LENGTHS (or `requests`: one item each) with `scorer` (or `score`, which may split them over
    several calls) and with HF's own eager forward with the same FP8 projections (float32).

    Items agree to float32 rounding where no rounding to e4m3 differs between the paths; but their last-bit
    differences can carry a value across a rounding boundary in some layer (a step of 6-12% of that one
    element), and how far such flips carry depends on the model, not on e4m3's step alone (a priori, every
    element could flip). So, as the start-up self-check does, it is measured on these prompts: HF's result
    when every projection input moves by FP8_JITTER (a bfloat16 step, 2^-8) before rounding, up and down
    alternately and then the other way round, flips every rounding the paths' float32 differences can
    (those are below 2^-8 of the values: forward_atol) and more. Allowed: the float32 forward bound plus
    the larger of the two moves, for scores (relative to the scale, at least 1) and as an angle between
    hidden states; a packing, position or scale bug moves every item by its whole scale. Returns (median,
    max) of the per-item largest score difference and the allowed one, all relative to the scale."""
    reference_model = load_reference_model(model_dir)
    layers = transformer_layers(reference_model.base_model)
    assert layers is not None
    quantize_layers(layers, selection)
    requests = token_requests(LENGTHS, seed=5) if requests is None else requests
    prompts = [list(item) for request in requests for item in request.items]
    reference = hf_reference(model_dir, prompts, model=reference_model)
    flipped_scores, flipped_angle = 0.0, 0.0
    for amount in (FP8_JITTER, -FP8_JITTER):
        with jittered(reference_model, amount):
            moved = hf_reference(model_dir, prompts, model=reference_model)
        flipped_scores = max(flipped_scores, float(np.abs(moved.logits - reference.logits).max()))
        flipped_angle = max(
            flipped_angle, float(np.arccos(np.clip(_cosines(moved.hidden, reference.hidden), -1, 1)).max())
        )
    results = (scorer.score if score is None else score)(requests)
    scores = np.concatenate([scores_of(r) for r in results])
    hidden = np.concatenate([hidden_of(r) for r in results])
    scale = max(1.0, float(np.abs(reference.logits).max()))
    per_item = np.abs(scores - reference.logits).max(axis=1) / scale
    longest = max(len(p) for p in prompts)
    allowed = (forward_atol(model_dir, reference.logits, longest=longest) + flipped_scores) / scale
    # The float32 part of the angle: per element forward_atol over the hidden size, at each state's norm.
    norms = np.linalg.norm(reference.hidden, axis=1)
    gap = cosine_gap(forward_atol(model_dir, reference.hidden, longest=longest), hidden.shape[1], norms)
    angle = np.arccos(np.clip(1 - gap, -1, 1)) + flipped_angle
    cosine = _cosines(hidden, reference.hidden)
    assert bool((cosine >= np.cos(np.minimum(angle, np.pi))).all()), (cosine, angle)
    return float(np.median(per_item)), float(per_item.max()), allowed


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module", params=NON_HYBRID_DECODERS)
def decoder_dir(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    architecture = request.param
    return write_tiny_model(tmp_path_factory.mktemp(f"fp8-{architecture}"), architecture, 3, num_labels=2)


@pytest.mark.slow
def test_every_decoder_scores_like_hf_with_the_same_fp8_projections(decoder_dir: Path) -> None:
    scorer = Scorer(decoder_dir, ScorerConfig(device="cpu", quantization="fp8"))
    median, largest, allowed = _agrees_with_hf_fp8(scorer, decoder_dir)
    assert median <= allowed and largest <= allowed, (median, largest, allowed)


def _fp8_paths(model: torch.nn.Module) -> list[set[str]]:
    """Per transformer layer, the paths (inside the layer) of its projections that run in FP8."""
    layers = transformer_layers(model.base_model)
    assert layers is not None
    return [{name for name, m in layer.named_modules() if isinstance(m, Fp8Linear)} for layer in layers]


@pytest.mark.parametrize("architecture", [*NON_HYBRID_DECODERS, *ENCODERS])
def test_attention_and_mlp_projections_are_told_apart_in_every_architecture(
    architecture: str, tmp_path: Path
) -> None:
    """fp8_projections "attention" and "mlp" split what "all" quantizes into two parts, each non-empty in
    every layer, through the engine's loading (decoders layer by layer as they are read, encoders after
    loading); the attention part is what sits in the layer's attention module."""
    model_dir = write_tiny_model(tmp_path / architecture, architecture, seed=3, num_labels=2)
    found = {
        part: _fp8_paths(
            Scorer(model_dir, ScorerConfig(device="cpu", quantization="fp8", fp8_projections=part)).hf_model
        )
        for part in ("all", "attention", "mlp")
    }
    # A mixture of experts' sparse layers have no MLP projection: their experts keep the model's dtype.
    layers = transformer_layers(Scorer(model_dir, ScorerConfig(device="cpu")).hf_model.base_model)
    sparse = [bool(sparse_blocks([layer])) for layer in layers or ()]
    for whole, attention, mlp, experts in zip(
        found["all"], found["attention"], found["mlp"], sparse, strict=True
    ):
        assert attention and (mlp or experts) and not attention & mlp, (attention, mlp)
        assert attention | mlp == whole, (attention, mlp)
        assert all("attn" in path or "attention" in path for path in attention), attention


def test_kept_layers_keep_the_model_dtype(tiny_llama_dir: Path) -> None:
    for kept in ((-1,), (0,)):
        config = ScorerConfig(device="cpu", quantization="fp8", fp8_keep_layers=kept)
        paths = _fp8_paths(Scorer(tiny_llama_dir, config).hf_model)
        count = len(paths)
        assert [len(p) for p in paths] == [0 if k in kept or k - count in kept else 7 for k in range(count)]
    with pytest.raises(ModelLoadError, match=f"the model has {count} layers"):
        Scorer(tiny_llama_dir, ScorerConfig(device="cpu", quantization="fp8", fp8_keep_layers=(count,)))
    encoder = write_tiny_model(tiny_llama_dir.parent / "fp8-keep-bert", "bert", seed=3, num_labels=2)
    with pytest.raises(ModelLoadError, match="layers"):  # loaded whole, then quantized (models/execute.py)
        Scorer(encoder, ScorerConfig(device="cpu", quantization="fp8", fp8_keep_layers=(-99,)))
    with pytest.raises(ValueError, match="need quantization='fp8'"):
        ScorerConfig(fp8_projections="mlp")
    with pytest.raises(ValueError, match="need quantization='fp8'"):
        ScorerConfig(fp8_keep_layers=(0,))
    # A flag's or variable's text: a JSON list or comma-separated numbers.
    for text in ("[0, -1]", "0,-1"):
        assert ScorerConfig(quantization="fp8", fp8_keep_layers=text).fp8_keep_layers == (0, -1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layer numbers"):
        ScorerConfig(quantization="fp8", fp8_keep_layers="first")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize(
    "selection", [Fp8Selection("attention"), Fp8Selection("mlp"), Fp8Selection("all", (-1,))], ids=str
)
def test_a_selection_of_fp8_projections_scores_like_hf_with_the_same_projections(
    tiny_llama_dir: Path, selection: Fp8Selection
) -> None:
    config = ScorerConfig(
        device="cpu",
        quantization="fp8",
        fp8_projections=selection.projections,
        fp8_keep_layers=selection.keep_layers,
    )
    median, largest, allowed = _agrees_with_hf_fp8(Scorer(tiny_llama_dir, config), tiny_llama_dir, selection)
    assert median <= allowed and largest <= allowed, (median, largest, allowed)


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
    # What the check itself allows FP8 (models.selfcheck): bfloat16's bounds at the least, widened by HF's
    # own result moved by FP8_JITTER before every rounding (the same cause as the paths' differences,
    # measured on the same prompts) times NOISE_MARGIN; the cosine floor likewise.
    inputs = _prepared_inputs(scorer, _fixed_prompts(scorer), None)
    plain_scores, plain_hidden = _plain_forward(scorer, inputs, None, batched=False)
    _, noise_cosine = _hf_noise(scorer, inputs, None, plain_scores, plain_hidden)
    floor = min(FP8_MIN_COSINE, 1.0 - NOISE_MARGIN * (1.0 - noise_cosine))
    assert report.max_score_diff <= report.score_bound and report.min_hidden_cosine >= floor, report


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
    assert scorer.executor.compiled and scorer.executor.graphs is not None
    for _ in range(3):  # ordinary, recorded, replayed
        median, largest, allowed = _agrees_with_hf_fp8(scorer, tiny_qwen3_dir)
        assert median <= allowed and largest <= allowed, (median, largest, allowed)


def test_the_prefix_cache_serves_the_fp8_path_as_hf_with_the_same_projections(tiny_qwen3_dir: Path) -> None:
    """FP8 projections with the prefix cache: a prompt's answers over three calls, the later two taking the
    prompt's first 40 tokens from the cache (keys and values the FP8 projections made in an earlier batch),
    score as HF with the same projections on the whole prompts, within what the FP8 check allows."""
    config = ScorerConfig(
        device="cpu",
        quantization="fp8",
        prefix_cache_mib=16,
        prefix_cache_block_tokens=8,
        prefix_cache_admit="first",
    )
    scorer = Scorer(tiny_qwen3_dir, config)
    prompt = tuple(range(40, 85))  # five whole blocks of 8 before every answer's pooled token
    requests = [
        ScoreRequest(
            f"answer-{i}",
            items=(prompt + tuple(range(100 + 10 * i, 103 + 11 * i)),),
            return_pooled_hidden_states=True,
        )
        for i in range(6)
    ]

    def three_calls(batch: list[ScoreRequest]) -> list[ScoreResult]:
        return [result for call in range(3) for result in scorer.score(batch[2 * call : 2 * call + 2])]

    median, largest, allowed = _agrees_with_hf_fp8(
        scorer, tiny_qwen3_dir, requests=requests, score=three_calls
    )
    assert median <= allowed and largest <= allowed, (median, largest, allowed)
    stats = scorer.executor.prefix_cache.stats  # type: ignore[union-attr]
    assert (stats.hits, stats.tokens_saved) == (4, 160)


@pytest.mark.slow
def test_fp8_stays_near_float32_and_passes_the_self_check(tiny_llama_dir: Path) -> None:
    """FP8's own deviation from the unquantized float32 model, bounded loosely (tiny random-weight models
    round worse than real ones: bench/fp8.py reports real shapes); and the start-up self-check holds FP8 to
    its own bounds, so a model that scores right is not refused."""
    fp8 = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", quantization="fp8"))
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    requests = token_requests(LENGTHS, seed=9)
    # FP8's deviation is every projection's input and weight rounded to e4m3, each by at most 2^-4 of the
    # element. A priori (every rounding at its worst, 8 projections in series) it exceeds the values, so
    # the model's response is measured on these prompts, as models.selfcheck measures FP8's sensitivity:
    # every projection input moved by the whole 2^-4 before rounding, up and down alternately, then the
    # other way round; the larger move (scores, and the angle between hidden states) bounds a rounding
    # pattern of mixed signs and mostly smaller steps. A broken scale moves results by their whole scale.
    baseline = fp8.score(requests)
    moves = []
    for amount in (2.0**-4, -(2.0**-4)):
        with jittered(fp8.hf_model, amount):
            moves.append(fp8.score(requests))
    for index, (a, b) in enumerate(zip(baseline, plain.score(requests), strict=True)):
        x, y = hidden_of(a), hidden_of(b)
        angle = max(float(np.arccos(np.clip(_cosines(hidden_of(m[index]), x), -1, 1)).max()) for m in moves)
        assert float(_cosines(x, y).min()) >= np.cos(min(angle, np.pi)), (_cosines(x, y), angle)
        moved = max(float(np.abs(scores_of(m[index]) - scores_of(a)).max()) for m in moves)
        assert float(np.abs(scores_of(a) - scores_of(b)).max()) <= moved, moved
    report = run_self_check(fp8)
    assert report.max_score_diff <= report.score_bound


def test_fp8_is_refused_where_it_cannot_run(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="quantization"):
        ScorerConfig(quantization="int8")  # type: ignore[arg-type]
    assert fp8_supported(torch.device("cpu")) is None
    assert "CUDA or the CPU" in (fp8_supported(torch.device("meta")) or "")
    assert transformer_layers(torch.nn.Linear(2, 2)) is None
    monkeypatch.setattr("models.execute.transformer_layers", lambda base: None)
    with pytest.raises(ModelLoadError, match="no layer list"):
        Scorer(tiny_llama_dir, ScorerConfig(device="cpu", quantization="fp8"))

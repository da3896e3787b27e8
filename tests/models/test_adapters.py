"""LoRA adapters: a batch mixing several adapters and the base model equals, request by request, the model
with that adapter merged into its weights by PEFT (float32, HF's own forward), on every decoder family;
adapters with their own trained head; prefixes shared only within an adapter; token outputs and the
deterministic setting under adapters; the refusals."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from scoring_testkit import (
    assert_forward_close,
    hf_reference,
    hidden_of,
    load_reference_model,
    scores_of,
)
from transformers import AutoModelForSequenceClassification

from models import ModelLoadError, Scorer, ScorerConfig
from models.tiny import DECODERS, HYBRIDS
from schemas import ErrorCode, ScoreRequest, ScoreResult

# Adapter name -> (rank, which projections, rsLoRA, its own trained head)
ADAPTERS = {
    "full": (4, "all", False, True),
    "attn": (8, "attention", True, False),
    "mlp": (2, "mlp", False, True),
}
# The token mixers' projections: attention's, and the hybrids' Gated DeltaNet layers' (Qwen3.5's separate
# ones, Qwen3-Next's fused in_proj_qkvz and in_proj_ba).
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
_ATTENTION += ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")

# Prefixes shared or cached within an adapter, on the hybrids too: a prefix's Gated DeltaNet state is its
# adapter's.
WITHIN_ADAPTER = ["llama", *HYBRIDS]


def _targets(model: Any, which: str) -> list[str]:
    """The names of the decoder layers' linear projections to adapt (Phi-3's fused ones included)."""
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".layers." in name
    }
    if getattr(model.config, "num_experts", 0):
        # A mixture of experts: PEFT turns MLP targets into its experts' stacked parameters, on which LoRA
        # is refused (tests/models/test_moe.py); its "mlp" adapter adapts the output projection instead.
        # Qwen3-Next's shared expert's gate is a projection of its own, called on the rows like any.
        if which == "mlp":
            return ["o_proj", *sorted(names & {"shared_expert_gate"})]
        return sorted(names & set(_ATTENTION))
    if which == "attention":
        names &= set(_ATTENTION)
    elif which == "mlp":
        names -= set(_ATTENTION)
    return sorted(names)


def _write_adapter(base_dir: Path, target: Path, name: str, seed: int) -> Path:
    """A PEFT LoRA adapter of the tiny model with random factors (PEFT initialises B to zero: no effect)."""
    rank, which, rslora, own_head = ADAPTERS[name]
    model = AutoModelForSequenceClassification.from_pretrained(str(base_dir))
    config = LoraConfig(
        task_type="SEQ_CLS",
        r=rank,
        lora_alpha=2 * rank,
        use_rslora=rslora,
        target_modules=_targets(model, which),
    )
    if not own_head:
        config.modules_to_save = None
    # Factors whose delta B A s has the spread of the base weights (the tiny models' initializer_range, 0.1):
    # entries sum r products of two factors of spread f, so f = sqrt(0.1 / (sqrt(r) s)). Larger deltas (rank
    # 8 under rsLoRA at f = 0.2 gave six times the weights' spread) make the adapted model round far more
    # than the base model whose forward bound the comparisons use: PEFT's own merged and unmerged forwards
    # of a tiny Qwen3.5 then differed by 5e-4.
    scaling = 2 * rank / (rank**0.5 if rslora else rank)
    spread = (0.1 / (rank**0.5 * scaling)) ** 0.5
    return _saved_with_random_factors(get_peft_model(model, config), target, seed, spread)


def _saved_with_random_factors(peft_model: Any, target: Path, seed: int, spread: float = 0.2) -> Path:
    """`peft_model` with random LoRA factors of `spread` and a random head (PEFT initialises B to zero: no
    effect), saved."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, parameter in peft_model.named_parameters():
            if "lora_" in key or "modules_to_save" in key:
                scale = spread if "lora_" in key else 0.2
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(target))
    return target


@functools.cache
def _adapters(base_dir: Path, root: str) -> dict[str, Path]:
    return {
        name: _write_adapter(base_dir, Path(root) / f"{base_dir.name}-{name}", name, seed)
        for seed, name in enumerate(ADAPTERS)
    }


@functools.cache
def _merged(base_dir: Path, adapter_dir: Path) -> Any:
    """PEFT's merge of the adapter into a float32 copy of the model (eager attention): the reference."""
    return (
        PeftModel.from_pretrained(load_reference_model(base_dir), str(adapter_dir)).merge_and_unload().eval()
    )


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("adapters"))


def _setting(adapters: dict[str, Path]) -> str:
    return ",".join(f"{name}={directory}" for name, directory in adapters.items())


def _ids(seed: int, count: int, length: int, vocab: int = 500) -> list[tuple[int, ...]]:
    generator = np.random.default_rng(seed)
    return [tuple(int(t) for t in generator.integers(4, vocab, size=length - i)) for i in range(count)]


def _mixed_requests() -> tuple[list[str | None], list[ScoreRequest]]:
    chosen = [None, "full", "attn", "mlp", "full", None]
    requests = [
        ScoreRequest(
            f"r{index}",
            items=_ids(index, 3, 20),
            query=(5, 6, 7),
            adapter=name,
            return_pooled_hidden_states=True,
        )
        for index, name in enumerate(chosen)
    ]
    return chosen, requests


def _assert_equal_to_merged(
    base_dir: Path, adapters: dict[str, Path], results: list[ScoreResult], chosen: list[str | None],
    requests: list[ScoreRequest],
) -> None:  # fmt: skip
    for request, result, name in zip(requests, results, chosen, strict=True):
        assert result.ok, result.error
        prompts = [(5, 6, 7, *item) for item in request.items]
        model = None if name is None else _merged(base_dir, adapters[name])
        reference = hf_reference(base_dir, prompts, model=model)
        assert_forward_close(scores_of(result), reference.logits, base_dir, longest=23)
        assert_forward_close(hidden_of(result), reference.hidden, base_dir, longest=23)


@pytest.mark.parametrize("architecture", DECODERS)
def test_a_mixed_adapter_batch_equals_each_adapter_merged(
    model_dirs: dict[str, Path], adapter_root: str, architecture: str
) -> None:
    base_dir = model_dirs[architecture]
    adapters = _adapters(base_dir, adapter_root)
    scorer = Scorer(base_dir, ScorerConfig(device="cpu", adapters=_setting(adapters)))
    chosen, requests = _mixed_requests()
    results = scorer.score(requests)  # one batch: every adapter and the base model together
    _assert_equal_to_merged(base_dir, adapters, results, chosen, requests)
    # An adapter's delta and its head move the scores: equal scores would prove nothing above.
    (plain,) = scorer.score([ScoreRequest("b", items=requests[1].items, query=(5, 6, 7))])
    assert not np.allclose(scores_of(plain), scores_of(results[1]), atol=1e-3)


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "phi3"])
def test_adapters_on_the_fast_path_with_the_last_layer_at_the_pooled_rows(
    model_dirs: dict[str, Path], adapter_root: str, architecture: str
) -> None:
    """The GPU's default path on the CPU: the varlen kernel, the last layer's row-wise modules at the pooled
    rows only (their adapted projections see only those rows and read those rows' adapters), Phi-3's fused
    projections among them."""
    from scoring_testkit import CpuVarlenKernelGqa

    base_dir = model_dirs[architecture]
    adapters = _adapters(base_dir, adapter_root)
    config = ScorerConfig(
        device="cpu", attention="varlen", varlen_kernel=CpuVarlenKernelGqa(), adapters=_setting(adapters)
    )
    scorer = Scorer(base_dir, config)
    assert scorer.executor.pooled_layer is not None
    chosen, requests = _mixed_requests()
    _assert_equal_to_merged(base_dir, adapters, scorer.score(requests), chosen, requests)


@pytest.mark.parametrize("architecture", ["llama", "phi3"])
def test_adapter_batches_take_their_gate_and_up_deltas_in_the_fused_mlp_kernel(
    model_dirs: dict[str, Path], adapter_root: str, architecture: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adapter batches keep the fused MLP kernel (Triton's interpreter on the CPU): the adapted gate and up
    products' deltas go into it (Llama's two projections, Phi-3's halves of one), and every request scores
    as its adapter merged into the model does."""
    pytest.importorskip("triton")
    from scoring_testkit import CpuVarlenKernelGqa

    from models import fused_mlp, triton_attention

    if torch.cuda.is_available() or not triton_attention.interpreting():
        pytest.skip("drives the kernel in Triton's interpreter; on a GPU, tests/gpu runs it compiled")
    taken: list[bool] = []
    kernel = fused_mlp.gate_up_silu

    def recorded(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, lora: Any = None) -> torch.Tensor:
        taken.append(lora is not None and (lora.gate is not None or lora.up is not None))
        return kernel(x, gate, up, lora)

    monkeypatch.setattr(fused_mlp, "gate_up_silu", recorded)
    base_dir = model_dirs[architecture]
    adapters = _adapters(base_dir, adapter_root)
    config = ScorerConfig(
        device="cpu", attention="varlen", varlen_kernel=CpuVarlenKernelGqa(), fused_mlp="on",
        adapters=_setting(adapters),
    )  # fmt: skip
    scorer = Scorer(base_dir, config)
    assert scorer.info.fused_mlp
    chosen, requests = _mixed_requests()
    _assert_equal_to_merged(base_dir, adapters, scorer.score(requests), chosen, requests)
    assert any(taken)  # every layer's MLP, with the full and mlp adapters' deltas


@pytest.mark.slow
@pytest.mark.parametrize("pooled_rows", [False, True])
def test_adapters_under_compiled_layers_compile_once_for_every_batch(
    tiny_llama_dir: Path, adapter_root: str, pooled_rows: bool
) -> None:
    """Adapter batches run the compiled layers, their adapted projections a variant the layers trace once:
    the same results as the merged models; batches of other sizes and other adapter mixes reuse the variant;
    and the variant takes as many graphs as the base model's batches (one per kind of layer, shared by the
    layers, as their weights are inputs), not one per layer (which a model of 32 layers would take past the
    recompile limit, and run eager)."""
    from scoring_testkit import CpuVarlenKernelGqa

    from models.layers import traced_graphs

    torch._dynamo.reset()  # other tests' graphs of the same layer code would hide what this one compiles
    adapters = _adapters(tiny_llama_dir, adapter_root)
    kernel = torch._dynamo.disable(CpuVarlenKernelGqa())  # host-side checks stay out of dynamo, as on a GPU
    config = ScorerConfig(
        device="cpu", attention="varlen", varlen_kernel=kernel, compile="on", adapters=_setting(adapters),
        last_layer_pooled_rows=pooled_rows,
    )  # fmt: skip
    scorer = Scorer(tiny_llama_dir, config)
    assert scorer.executor.compiled and (scorer.executor.pooled_layer is not None) == pooled_rows
    chosen, requests = _mixed_requests()
    base = [dataclasses.replace(request, adapter=None) for request in requests]
    for batch in (base, base[:2]):  # static sizes, then dynamic ones
        assert all(result.ok for result in scorer.score(batch))
    base_graphs = traced_graphs()
    # The first two adapter batches compile (static sizes, then dynamic ones); the others must not.
    batches = [[0, 1, 2, 3, 4, 5], [1, 3], [2, 3, 4], [4], [0, 5, 1]]
    for index, picks in enumerate(batches):
        if index == 2:
            compiled_by_then = traced_graphs()
            assert compiled_by_then - base_graphs <= base_graphs, (compiled_by_then, base_graphs)
        batch = [requests[i] for i in picks]
        _assert_equal_to_merged(
            tiny_llama_dir, adapters, scorer.score(batch), [chosen[i] for i in picks], batch
        )
    assert traced_graphs() == compiled_by_then


@pytest.mark.parametrize("architecture", WITHIN_ADAPTER)
def test_prefixes_are_shared_only_within_an_adapter(
    model_dirs: dict[str, Path], adapter_root: str, architecture: str
) -> None:
    base_dir = model_dirs[architecture]
    adapters = _adapters(base_dir, adapter_root)
    scorer = Scorer(
        base_dir, ScorerConfig(device="cpu", adapters=_setting(adapters), share_prefix_min_tokens=4)
    )
    query = tuple(range(10, 40))
    chosen = ["full", "full", "attn", None]
    requests = [
        ScoreRequest(f"s{i}", items=_ids(i, 2, 6), query=query, adapter=a) for i, a in enumerate(chosen)
    ]
    prompts = [(*query, *item) for request in requests for item in request.items]
    keys = [scorer.prompt_builder.adapter_index(r) for r in requests for _ in r.items]
    groups = scorer.plan.shared_prefixes(prompts, keys)
    assert groups and all(len({keys[m] for m in group.members}) == 1 for group in groups)
    assert {keys[group.members[0]] for group in groups} == set(keys)  # every adapter shares within itself
    results = scorer.score(requests)
    for request, result, name in zip(requests, results, chosen, strict=True):
        model = None if name is None else _merged(base_dir, adapters[name])
        item_prompts = [(*query, *item) for item in request.items]
        reference = hf_reference(base_dir, item_prompts, model=model)
        assert_forward_close(scores_of(result), reference.logits, base_dir, longest=36)


@pytest.mark.parametrize("architecture", WITHIN_ADAPTER)
def test_the_prefix_cache_serves_a_prefix_only_under_the_adapter_that_computed_it(
    model_dirs: dict[str, Path], adapter_root: str, architecture: str
) -> None:
    """One query under the base model and two adapters, over three calls with the prefix cache: the second
    sight keeps each prompt's blocks, the third call finds them under its own adapter only (the first
    call's sight of the query under one adapter admits nothing under another), and every item equals its
    adapter merged."""
    base_dir = model_dirs[architecture]
    adapters = _adapters(base_dir, adapter_root)
    config = ScorerConfig(
        device="cpu", adapters=_setting(adapters), prefix_cache_mib=8, prefix_cache_block_tokens=8
    )
    scorer = Scorer(base_dir, config)
    query = tuple(range(10, 40))  # 30 tokens: three whole blocks before the items
    chosen = [None, "full", "attn"]
    for call in range(3):
        requests = [
            ScoreRequest(
                f"c{call}-{i}",
                items=_ids(10 * call + i, 1, 5),
                query=query,
                adapter=name,
                return_pooled_hidden_states=True,
            )
            for i, name in enumerate(chosen)
        ]
        results = scorer.score(requests)
        for request, result, name in zip(requests, results, chosen, strict=True):
            assert result.ok, result.error
            model = None if name is None else _merged(base_dir, adapters[name])
            reference = hf_reference(base_dir, [(*query, *request.items[0])], model=model)
            assert_forward_close(scores_of(result), reference.logits, base_dir, longest=35)
            assert_forward_close(hidden_of(result), reference.hidden, base_dir, longest=35)
    stats = scorer.executor.prefix_cache.stats  # type: ignore[union-attr]
    # The second call kept three blocks per adapter; the third took them, each its own.
    assert (stats.hits, stats.tokens_saved) == (3, 3 * 24)


def test_the_deterministic_device_check_covers_the_adapters_products(
    tiny_qwen3_dir: Path, adapter_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up check of the deterministic tiles runs on the model's widths and the LoRA deltas' in one
    call; a delta product the device rounds by its place sends every item to run alone."""
    import models.execute

    checked: list[list[tuple[int, int]]] = []

    def refusing_deltas(rows: int, widths: list[tuple[int, int]], *args: Any) -> str | None:
        checked.append(widths)
        return "a delta's product moved" if (16, 64) in widths else None

    monkeypatch.setattr(models.execute, "rows_invariant", refusing_deltas)
    setting = _setting(_adapters(tiny_qwen3_dir, adapter_root))
    scorer = Scorer(tiny_qwen3_dir, ScorerConfig(device="cpu", adapters=setting, deterministic=True))
    assert scorer.executor.adapters is not None and scorer.executor.row_tiles is None
    (widths,) = checked
    assert set(scorer.executor.adapters.product_widths()) <= set(widths) and (64, 64) in widths


def test_token_outputs_and_the_deterministic_setting_under_adapters(
    tiny_qwen3_dir: Path, adapter_root: str
) -> None:
    adapters = _adapters(tiny_qwen3_dir, adapter_root)
    scorer = Scorer(
        tiny_qwen3_dir, ScorerConfig(device="cpu", adapters=_setting(adapters), deterministic=True)
    )
    request = ScoreRequest(
        "tokens", items=_ids(3, 2, 12), adapter="mlp", token_outputs="tokens", token_range=(-4, None),
        return_token_hidden_states=True,
    )  # fmt: skip
    # The deltas' products are in the device check: ranks stacked per projection (attention: full 4 +
    # attn 8; MLP: full 4 + mlp 2), padded to whole steps of 16 columns, each product both ways (x A^T,
    # then B^T).
    assert scorer.executor.adapters is not None
    widths = scorer.executor.adapters.product_widths()
    assert {min(pair) for pair in widths} == {16} and {(r, k) for k, r in widths} & set(widths)
    alone = scorer.score([request])[0]
    beside = scorer.score([ScoreRequest("other", items=_ids(9, 4, 30), adapter="full"), request])[1]
    # bit-identical whatever shares its batch (the batch's timings aside)
    assert dataclasses.replace(alone, timings={}) == dataclasses.replace(beside, timings={})
    merged = _merged(tiny_qwen3_dir, adapters["mlp"])
    for index, item in enumerate(request.items):
        with torch.inference_mode():
            out = merged(input_ids=torch.tensor([item]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0][-4:].numpy()
        logits = merged.score(out.hidden_states[-1][0][-4:]).numpy()  # the adapter's own head, per token
        assert alone.token_hidden_states is not None and alone.token_scores is not None
        assert_forward_close(alone.token_hidden_states[index].to_numpy(), hidden, tiny_qwen3_dir, longest=12)
        assert_forward_close(alone.token_scores[index].to_numpy(), logits, tiny_qwen3_dir, longest=12)


def _encoder_adapter(base_dir: Path, target: Path, modules: str | list[str]) -> Path:
    """A PEFT LoRA adapter of a tiny encoder classifier on `modules`, random factors and its own trained head
    (PEFT's default for sequence classification saves the classifier beside the factors)."""
    model = AutoModelForSequenceClassification.from_pretrained(str(base_dir))
    config = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=modules)
    return _saved_with_random_factors(get_peft_model(model, config), target, 5)


@pytest.mark.parametrize("architecture", ["bert", "roberta"])
def test_encoder_adapters_equal_their_merge_with_the_pooler_before_their_own_head(
    architecture: str, tmp_path: Path
) -> None:
    """An encoder classifier with an adapter on its layers' projections and its own trained classifier: each
    item's scores those of PEFT's merge run by HF on the item alone (BERT's pooler, which the engine runs
    on the pooled rows, stays before the adapter's classifier). An adapter on the pooler itself, outside
    the layers, is refused at start-up with its reason."""
    from models import write_tiny_model

    base_dir = write_tiny_model(tmp_path / architecture, architecture, seed=3)
    layers = r".*encoder\.layer\.\d+\..*(query|key|value|dense)"
    adapter = _encoder_adapter(base_dir, tmp_path / "adapter", layers)
    scorer = Scorer(base_dir, ScorerConfig(device="cpu", adapters=f"a={adapter}"))
    items = [tuple(range(5, 15)), tuple(range(20, 27)), (40,)]
    adapted, plain = scorer.score(
        [ScoreRequest("a", items=items, adapter="a"), ScoreRequest("b", items=items)]
    )
    merged = PeftModel.from_pretrained(load_reference_model(base_dir), str(adapter)).merge_and_unload().eval()
    prompts = scorer.prepare(ScoreRequest("a", items=items)).prompts
    with torch.no_grad():
        expected = np.concatenate([merged(input_ids=torch.tensor([p])).logits.numpy() for p in prompts])
    assert_forward_close(scores_of(adapted), expected, base_dir, longest=max(len(p) for p in prompts))
    assert not np.allclose(scores_of(adapted), scores_of(plain), atol=1e-3)  # the adapter moved them
    if architecture == "bert":
        pooler = _encoder_adapter(base_dir, tmp_path / "pooler", ["query", "value", "dense"])
        with pytest.raises(ModelLoadError, match=r"pooler\.dense.*outside the model's transformer layers"):
            Scorer(base_dir, ScorerConfig(device="cpu", adapters=f"p={pooler}"))


def test_unknown_adapters_and_adapters_that_cannot_run_are_refused(
    tiny_llama_dir: Path, adapter_root: str, tmp_path: Path
) -> None:
    adapters = _adapters(tiny_llama_dir, adapter_root)
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", adapters=_setting(adapters)))
    refused = scorer.prepare(ScoreRequest("x", items=["a"], adapter="nope"))
    assert isinstance(refused, ScoreResult) and refused.error is not None
    assert refused.error.code is ErrorCode.ADAPTER_NOT_FOUND and "'full'" in refused.error.message
    dora = tmp_path / "dora"
    dora.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (dora / name).write_bytes((adapters["full"] / name).read_bytes())
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ModelLoadError, match="use_dora"):
        Scorer(tiny_llama_dir, ScorerConfig(device="cpu", adapters=f"d={dora}"))
    other = adapters["attn"]
    with pytest.raises(ValueError, match="twice"):
        ScorerConfig(adapters=f"a={other},a={other}")
    with pytest.raises(ValueError, match="tensor_parallel"):
        ScorerConfig(adapters=f"a={other}", tensor_parallel=2)


@pytest.mark.parametrize("module", ["conv1d", "norm"])
def test_a_hybrid_adapter_on_what_is_not_a_projection_is_refused(
    model_dirs: dict[str, Path], adapter_root: str, tmp_path: Path, module: str
) -> None:
    """A Gated DeltaNet layer's convolution and gated norm are not linear projections: the packed forward
    reads the convolution's weights (and the norm is no product), so a LoRA factor on them could not be
    added to any token's rows. Such an adapter is refused at start-up, never served without its delta."""
    base_dir = model_dirs["qwen3_5_text"]
    source = _adapters(base_dir, adapter_root)["attn"]
    target = tmp_path / module
    target.mkdir()
    (target / "adapter_config.json").write_bytes((source / "adapter_config.json").read_bytes())
    tensors = load_file(str(source / "adapter_model.safetensors"))
    path = f"base_model.model.model.layers.0.linear_attn.{module}"
    tensors[f"{path}.lora_A.weight"] = torch.zeros(8, 16)
    tensors[f"{path}.lora_B.weight"] = torch.zeros(16, 8)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"linear_attn\.{module}'.*not a linear projection"):
        Scorer(base_dir, ScorerConfig(device="cpu", adapters=f"a={target}"))


def test_adapters_heads_and_token_outputs_compose_with_graphs_fp8_and_the_self_check(
    tiny_llama_dir: Path, adapter_root: str, tmp_path: Path
) -> None:
    """Batches with adapter requests or token outputs take the ordinary forward under CUDA graphs (their
    results those of the exact path); FP8 projections carry the adapters' deltas; the self-check passes with
    adapters loaded; a token output at an item's last position is its pooled state."""
    from test_cuda_graphs import CountingRecorder

    from models.selfcheck import run_self_check
    from tests.models.scoring_testkit import CpuVarlenKernel

    adapters = _setting(_adapters(tiny_llama_dir, adapter_root))
    recorder = CountingRecorder()
    graphed = Scorer(
        tiny_llama_dir,
        ScorerConfig(
            device="cpu", attention="varlen", varlen_kernel=CpuVarlenKernel(), graph_recorder=recorder,
            adapters=adapters,
        ),
    )  # fmt: skip
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", adapters=adapters))
    base = ScoreRequest("base", items=_ids(1, 2, 10))
    for _ in range(3):  # recorded at its second batch, replayed at its third
        graphed.score([base])
    assert graphed.executor.graphs is not None
    replays = graphed.executor.graphs.replays
    assert replays >= 1
    special = [
        ScoreRequest("adapted", items=_ids(1, 2, 10), adapter="full"),
        ScoreRequest("tokens", items=_ids(1, 2, 10), token_outputs="tokens", return_token_hidden_states=True),
    ]
    for request in special:
        (got,) = graphed.score([request])
        (expected,) = plain.score([request])
        assert graphed.executor.graphs.replays == replays  # not replayed: the ordinary forward
        assert_forward_close(scores_of(got), scores_of(expected), tiny_llama_dir, longest=10)
    fp8 = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", quantization="fp8", adapters=adapters))
    request = ScoreRequest(
        "fp8", items=_ids(4, 2, 12), adapter="attn", token_outputs="tokens", token_range=(-1, None),
        return_token_hidden_states=True, return_pooled_hidden_states=True,
    )  # fmt: skip
    (result,) = fp8.score([request])
    (unadapted,) = fp8.score([dataclasses.replace(request, adapter=None)])
    assert not np.allclose(scores_of(result), scores_of(unadapted), atol=1e-3)  # the delta is applied
    assert result.token_hidden_states is not None and result.pooled_hidden_states is not None
    for at, pooled in zip(result.token_hidden_states, result.pooled_hidden_states, strict=True):
        assert at.to_numpy()[0].tobytes() == pooled.to_numpy().tobytes()  # the same row of one forward
    report = run_self_check(plain)
    assert report.items > 0

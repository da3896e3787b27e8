"""Decoder layers under torch.compile: the same scores and hidden states as eager HF, on the CPU in float32.

On the GPU the compiled layers run by default with the varlen kernel (tests/gpu/test_architectures.py,
bench/w1.py); here the same wrapping runs through inductor's CPU code generation, so its logic is
exercised where CI runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from models import Scorer, ScorerConfig
from models.layers import compile_layers
from schemas import ScoreRequest


def _requests() -> list[ScoreRequest]:
    return [
        ScoreRequest(f"r{i}", query="the question", items=tuple(f"answer {i} " + "x " * j for j in range(3)),
                     return_pooled_hidden_states=True)
        for i in range(5)
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["llama", "qwen3_moe"])
def test_compiled_layers_score_like_eager(architecture: str, model_dirs: dict[str, Path]) -> None:
    """A mixture of experts' sparse blocks run inside the compiled layers as one opaque operator each."""
    import torch
    from scoring_testkit import CpuVarlenKernelGqa, assert_scored_alike

    tiny_llama_dir = model_dirs[architecture]
    eager = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    # The varlen path, as on the GPU. Its CPU kernel's host-side checks stay out of dynamo, as the GPU
    # kernel's custom op does.
    kernel = torch._dynamo.disable(CpuVarlenKernelGqa())
    compiled = Scorer(
        tiny_llama_dir, ScorerConfig(device="cpu", attention="varlen", varlen_kernel=kernel, compile="on")
    )
    assert compiled.executor.compiled and not eager.executor.compiled and compiled.info.compiled
    requests = _requests()
    for first, second in zip(eager.score(requests), compiled.score(requests), strict=True):
        assert second.ok, second.error
        assert first.pooled_hidden_states is not None and second.pooled_hidden_states is not None
        # Inductor's fused kernels sum in their own order: two float32 forwards (forward_atol).
        assert_scored_alike(second, first, eager, requests)
    # Another batch shape reuses the graph (dynamic token counts) and still agrees.
    (alone,) = compiled.score(requests[:1])
    assert_scored_alike(alone, eager.score(requests[:1])[0], eager, requests[:1])


def test_auto_compiles_only_the_varlen_path_on_cuda() -> None:
    import torch

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert ScorerConfig().resolve_compile("varlen", cuda)
    assert not ScorerConfig().resolve_compile("varlen", cpu)
    assert not ScorerConfig().resolve_compile("reference", cuda)
    assert not ScorerConfig().resolve_compile("plain", cuda)
    assert ScorerConfig(compile="on").resolve_compile("reference", cpu)
    assert ScorerConfig(compile="on").resolve_compile("varlen", cpu)
    assert not ScorerConfig(compile="off").resolve_compile("varlen", cuda)
    with pytest.raises(ValueError, match="compile"):
        ScorerConfig(compile="maybe")  # type: ignore[arg-type]


def test_a_model_without_a_layer_list_stays_eager() -> None:
    import torch

    assert not compile_layers(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_compiled_layers_on_the_exact_path_compile_once_not_per_batch(tiny_llama_dir: Path) -> None:
    """The exact attention reads each batch's sequence bounds on the host: traced into the layers' graphs, it
    unrolled every batch composition into a compilation of its own. It runs eager between the graphs."""
    import torch
    from scoring_testkit import assert_scored_alike

    from models.layers import traced_graphs

    torch._dynamo.reset()  # other tests' graphs of the same layer code would hide what this one compiles
    eager = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    compiled = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", attention="reference", compile="on"))
    assert compiled.executor.compiled
    requests = _requests()
    # The first two batches compile: static sizes, then dynamic ones.
    batches = [requests, requests[:2], requests[1:4], requests[3:4], requests[:1] + requests[4:]]
    for index, batch in enumerate(batches):
        if index == 2:
            compiled_by_then = traced_graphs()
        for first, second in zip(eager.score(batch), compiled.score(batch), strict=True):
            assert second.ok, second.error
            # Two float32 forwards, inductor's and eager (forward_atol).
            assert_scored_alike(second, first, eager, batch)
    assert traced_graphs() == compiled_by_then


@pytest.mark.slow
def test_the_graphed_path_does_not_recompile_the_layers(tiny_llama_dir: Path) -> None:
    """The CUDA-graph buffers reach the compiled layers as the engine's own inputs do: inference tensors
    with a packed row's strides. torch.compile guards on both, and any difference recompiled the layers
    (seconds each, mid-serving) whenever a batch switched between the graphed and the ordinary path."""
    import torch
    from scoring_testkit import CpuVarlenKernelGqa

    from models.graphs import Recorder

    # The CPU kernel's host-side checks are not what runs compiled on the GPU: keep dynamo out of them.
    kernel = torch._dynamo.disable(CpuVarlenKernelGqa())
    rerun: Recorder = lambda run: run  # noqa: E731 - a recorder whose replay runs the function again
    config = ScorerConfig(
        device="cpu", attention="varlen", varlen_kernel=kernel, compile="on", graph_recorder=rerun
    )
    scorer = Scorer(tiny_llama_dir, config)
    torch._dynamo.utils.guard_failures.clear()
    # Each shape three times (ordinary, recorded, replayed), and shapes that alternate between the paths.
    for count in (1, 4, 1, 2, 4):
        for _ in range(3):
            assert all(r.ok for r in scorer.score(_requests()[:count]))
    graphs = scorer.executor.graphs
    assert graphs is not None and graphs.replays > 0
    failures = [f for reasons in torch._dynamo.utils.guard_failures.values() for f in reasons]
    layout = [f for f in failures if "dispatch key" in f or "stride" in f]
    assert not layout, layout


class _Reduction:
    """What inductor's heuristic reads of a reduction: its hint and how many elements a row has."""

    def __init__(self, hint: str, row: int) -> None:
        import sympy
        from torch._inductor.runtime.hints import ReductionHint

        self.hint = ReductionHint[hint]
        self.reduction_numel, self.numel = sympy.Integer(row), sympy.Integer(64)

    def get_reduction_hint(self) -> object:
        return self.hint


def test_rows_up_to_the_limit_reduce_in_one_pass() -> None:
    import types

    from torch._inductor.choices import InductorChoices
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    from models import reductions

    ours, inductors = reductions.heuristics(), InductorChoices()
    with V.set_graph_handler(types.SimpleNamespace(sizevars=SizeVarAllocator())):  # type: ignore[arg-type]
        # Contiguous rows: inductor's own limit is 1,024; ours ONE_PASS_MAX.
        for row in (512, 1024):
            assert ours.should_use_persistent_reduction(_Reduction("INNER", row), False)
            assert inductors.should_use_persistent_reduction(_Reduction("INNER", row), False)
        for row in (3072, reductions.ONE_PASS_MAX):
            assert ours.should_use_persistent_reduction(_Reduction("INNER", row), False)
            assert not inductors.should_use_persistent_reduction(_Reduction("INNER", row), False)
        wider = _Reduction("INNER", reductions.ONE_PASS_MAX * 2)
        assert not ours.should_use_persistent_reduction(wider, False)
        # Reductions across rows, and cooperative ones, keep inductor's answer.
        for hint in ("OUTER", "DEFAULT"):
            assert not ours.should_use_persistent_reduction(_Reduction(hint, 3072), False)
        assert not ours.should_use_persistent_reduction(_Reduction("INNER", 3072), True)


def test_the_packed_forward_compiles_with_one_pass_rows_on_its_own_thread(tiny_llama_dir: Path) -> None:
    import threading

    from torch._inductor.virtualized import V

    from models import reductions

    compiled = compile_layers(Scorer(tiny_llama_dir, ScorerConfig(device="cpu")).hf_model.base_model)
    assert compiled is not None
    seen: list[bool] = []

    def run() -> None:
        with compiled:
            seen.append(V.choices is reductions.heuristics())
        seen.append(V.choices is reductions.heuristics())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [True, False]
    assert V.choices is not reductions.heuristics()

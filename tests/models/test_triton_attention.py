"""The Triton varlen attention kernel, run in Triton's interpreter on CPU tensors (tests/conftest.py turns it
on without a GPU): its masks, offsets, grouped-query heads and log-sum-exp against exact float32 attention,
and the engine through it against the reference path. Its speed, and bfloat16 (which the interpreter does not
compute faithfully), are the GPU's: bench/attention.py and tests/gpu."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from scoring_testkit import (
    _reference_varlen,
    assert_forward_close,
    exact_attention,
    hidden_of,
    scores_of,
    token_requests,
)
from tolerances import assert_within, attention_bound, lse_bound

pytest.importorskip("triton")

from models import Scorer, ScorerConfig, triton_attention
from models.attention import triton_or_flash
from models.varlen import CAUSAL_OR_FULL, WANT_LSE, LseRequest, varlen_outputs
from schemas import ScoreRequest

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not triton_attention.interpreting(),
    reason="these drive the kernel in Triton's interpreter; on a GPU, tests/gpu runs it compiled",
)


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)


def _attention_case(
    q_lengths: list[int],
    k_lengths: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    causal: bool,
    dtype: torch.dtype,
) -> None:
    generator = torch.Generator().manual_seed(sum(q_lengths) + heads + head_dim)
    q = torch.randn(sum(q_lengths), heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(sum(k_lengths), kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(sum(k_lengths), kv_heads, head_dim, generator=generator).to(dtype)
    cu_q, cu_k = _offsets(q_lengths), _offsets(k_lengths)
    out, lse = triton_attention.triton_varlen_attn(
        q, k, v, cu_q, cu_k, max(q_lengths), max(k_lengths),
        scale=0.3, window_size=(-1, 0) if causal else (-1, -1), enable_gqa=kv_heads != heads,
        return_aux=WANT_LSE,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (heads, sum(q_lengths))
    for i, q_len in enumerate(q_lengths):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        keys = slice(int(cu_k[i]), int(cu_k[i + 1]))
        if q_len == 0:
            continue
        qs, ks, vs = q[rows].transpose(0, 1), k[keys].transpose(0, 1), v[keys].transpose(0, 1)
        # Queries are the last q_len positions when causal, as flash aligns them.
        exact = exact_attention(qs, ks, vs, scale=0.3, causal=causal)
        # Against float64: the kernel's float32 scores (head_dim terms) and online softmax over the row's
        # keys in 32-key blocks, at each row's score magnitude and each element's sum p|v|; float16 also
        # rounds the weights and the output (u = 2^-11).
        bound = attention_bound(
            torch.float32, head_dim=head_dim, keys=exact.keys, score_magnitude=exact.score,
            value_magnitude=exact.value, stored=dtype, value_max=exact.value_max,
        )  # fmt: skip
        assert_within(out[rows].transpose(0, 1), exact.out, bound, "attention")
        # The same float32 arithmetic, and log2 of the normaliser, at the row's |lse|.
        lse_limit = lse_bound(
            torch.float32, head_dim=head_dim, keys=exact.keys, score_magnitude=exact.score[..., 0],
            lse_magnitude=exact.lse.abs(),
        )  # fmt: skip
        assert_within(lse[:, rows], exact.lse, lse_limit, "log-sum-exp")


@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "head_dim"),
    [
        ([5, 130, 1, 0, 64], 4, 2, 64),  # a row past one block, one token alone, an empty sequence
        ([200, 3], 4, 1, 80),  # head dim not a power of two (padded lanes masked); one K/V head for 4
        ([64, 129], 2, 2, 32),  # block edges exactly; no grouping
        ([37, 70], 6, 1, 64),  # a group of 6: programs of 2 heads, three to a K/V head
        ([90, 17], 8, 1, 32),  # a group of 8: programs of 4 heads, two to a K/V head
    ],
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_exact_attention(
    lengths: list[int], heads: int, kv_heads: int, head_dim: int, causal: bool, dtype: torch.dtype
) -> None:
    _attention_case(lengths, lengths, heads, kv_heads, head_dim, causal, dtype)


def test_a_running_maximum_that_rises_late_is_exact() -> None:
    """Keys whose scores grow along the sequence: the running maximum rises block after block, a little
    and then by tens of units (in base 2), and every rise rescales what was accumulated before it."""
    generator = torch.Generator().manual_seed(7)
    length, heads, head_dim = 300, 2, 32
    q = torch.randn(length, heads, head_dim, generator=generator).abs()
    growth = torch.linspace(0.0, 1.0, length)[:, None, None]
    k = torch.randn(length, 1, head_dim, generator=generator).abs() * (0.2 + 4.0 * growth**2)
    v = torch.randn(length, 1, head_dim, generator=generator)
    cu = _offsets([length])
    for causal in (True, False):
        out, lse = triton_attention.triton_varlen_attn(
            q, k, v, cu, cu, length, length, scale=0.3, window_size=(-1, 0) if causal else (-1, -1),
            enable_gqa=True, return_aux=WANT_LSE,
        )  # fmt: skip
        qs, ks, vs = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        exact = exact_attention(qs, ks, vs, scale=0.3, causal=causal)
        # "Exact" is float32's own error against float64: 32-term scores of up to S = sum |q k| * 0.3 (here
        # tens of units: the rising keys make each score error gamma(34) * S carry into its weight), the
        # rescales of 10 key blocks, a 300-key weighted sum: tolerances.attention_bound per element.
        bound = attention_bound(
            torch.float32, head_dim=head_dim, keys=length, score_magnitude=exact.score,
            value_magnitude=exact.value,
        )  # fmt: skip
        assert_within(out.transpose(0, 1), exact.out, bound, "attention")
        scores = qs.double() @ ks.double().repeat_interleave(heads, 0).transpose(1, 2) * 0.3
        if causal:
            scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        rise = (scores.amax(-1).max() - scores[..., :32].amax(-1).min()) * triton_attention.LOG2_E
        assert float(rise) > 24  # base 2: the last keys outweigh the first block's by more than 2**24
        # The same arithmetic and log2 of the normaliser, at each row's |lse|.
        lse_limit = lse_bound(
            torch.float32, head_dim=head_dim, keys=length, score_magnitude=exact.score[..., 0],
            lse_magnitude=exact.lse.abs(),
        )  # fmt: skip
        assert_within(lse, exact.lse, lse_limit, "log-sum-exp")


def test_a_program_packs_the_heads_that_share_keys() -> None:
    # The largest power of two dividing the group, at most PACK_HEADS, leaving at least 16 token rows.
    pack = triton_attention.PACK_HEADS
    assert triton_attention.heads_per_program(1, 128) == 1  # no grouping: one head a program
    assert triton_attention.heads_per_program(6, 128) == min(2, pack)
    assert triton_attention.heads_per_program(7, 128) == 1
    assert triton_attention.heads_per_program(8, 128) == pack
    assert triton_attention.heads_per_program(8, 32) == 2  # 16 rows of 2 heads
    assert triton_attention.heads_per_program(8, 16) == 1


@pytest.mark.parametrize("causal", [True, False])
def test_fewer_queries_than_keys_are_the_last_positions(causal: bool) -> None:
    # The shared-prefix cross pass: suffixes' queries over their prefix's keys (not causal there); causal
    # with fewer queries than keys aligns the queries to the end, as flash attention does.
    _attention_case([3, 20, 70], [40, 7 if not causal else 20, 140], 4, 2, 64, causal, torch.float32)


def test_rows_that_see_no_key_are_zero_with_lse_minus_infinity() -> None:
    # Causal with more queries than keys: the first rows precede every key.
    q = torch.randn(6, 2, 16)
    k = v = torch.randn(2, 2, 16)
    out, lse = triton_attention.triton_varlen_attn(
        q, k, v, _offsets([6]), _offsets([2]), 6, 2, window_size=(-1, 0), return_aux=WANT_LSE
    )
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))
    assert torch.isinf(lse[:, :4]).all() and (lse[:, :4] < 0).all()
    assert torch.isfinite(out[4:]).all() and torch.isfinite(lse[:, 4:]).all()


def test_kernel_refuses_what_it_cannot_run() -> None:
    q = torch.randn(4, 4, 16)
    kv = torch.randn(4, 2, 16)
    cu = _offsets([4])
    with pytest.raises(ValueError, match="sliding window"):
        triton_attention.triton_varlen_attn(q, q, q, cu, cu, 4, 4, window_size=(3, 0))
    with pytest.raises(ValueError, match="enable_gqa"):
        triton_attention.triton_varlen_attn(q, kv, kv, cu, cu, 4, 4, window_size=(-1, 0))
    with pytest.raises(ValueError, match="unit-stride"):
        strided = torch.randn(4, 4, 32)[..., ::2]
        triton_attention.triton_varlen_attn(strided, q, q, cu, cu, 4, 4)


@torch.library.custom_op("score_worker_tests::flash_stand_in", mutates_args=())
def _flash_stand_in(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    left: int,
    right: int,
    want_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    FlashStandIn.windows.append((left, right))
    aux = WANT_LSE if want_lse else None
    got = _reference_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(left, right), return_aux=aux
    )
    out, lse = got if isinstance(got, tuple) else (got, q.new_empty((1, 1), dtype=torch.float32))
    return out.clone(), lse.clone()


@_flash_stand_in.register_fake
def _(q: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    want_lse = bool(args[-1])
    return varlen_outputs(q, want_lse)


class FlashStandIn:
    """torch's flash kernel's part, exact on the CPU and, like it, one opaque operator to torch.compile
    (a Python stand-in would break the compiled graph where the real kernel does not); the log-sum-exp too
    where asked (the shared prefixes' two passes)."""

    windows: ClassVar[list[tuple[int, int]]] = []

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        *,
        scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
        enable_gqa: bool = False,
        return_aux: LseRequest | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        want_lse = return_aux is not None and return_aux.lse
        out, lse = torch.ops.score_worker_tests.flash_stand_in(
            q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size[0], window_size[1], want_lse
        )
        return (out, lse) if want_lse else out


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "mistral", "gemma3_text"])
def test_engine_through_the_kernel_matches_the_reference_path(
    architecture: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The production wrapper: Triton where it applies, flash for sliding windows. Gemma 3 (both kernels) runs
    # it under compiled layers, as the GPU does; compiling takes minutes a model on the CPU, so the others
    # run eager.
    monkeypatch.setattr(triton_attention, "MIN_LENGTH", 0)  # these prompts are short
    FlashStandIn.windows.clear()
    compiled = architecture == "gemma3_text"
    config = ScorerConfig(
        device="cpu",
        attention="varlen",
        varlen_kernel=triton_or_flash(FlashStandIn()),
        compile="on" if compiled else "off",
    )
    varlen = Scorer(model_dirs[architecture], config)
    assert varlen.executor.compiled == compiled
    reference = Scorer(model_dirs[architecture], ScorerConfig(device="cpu", attention="reference"))
    requests = token_requests([(30,), (3, 41), (17,), (1,)])
    for got, expected in zip(varlen.score(requests), reference.score(requests), strict=True):
        # Two float32 forwards (Triton or flash vs the exact path's SDPA, other GEMM shapes): the model's
        # chain of sums for prompts of up to 41 tokens, at the values' scale (at least 1).
        model = model_dirs[architecture]
        assert_forward_close(scores_of(got), scores_of(expected), model, longest=41)
        assert_forward_close(hidden_of(got), hidden_of(expected), model, longest=41)
    # Flash served the sliding-window layers and nothing else (tiny mistral and gemma3 have windows).
    windowed = architecture in ("mistral", "gemma3_text")
    assert bool(FlashStandIn.windows) == windowed
    assert all(window not in CAUSAL_OR_FULL for window in FlashStandIn.windows)


def test_shared_prefixes_through_the_kernel_match_whole_prompts(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two passes merged by their log-sum-exps: each suffix over itself (causal) and over its prefix (full).
    monkeypatch.setattr(triton_attention, "MIN_LENGTH", 0)
    config = ScorerConfig(
        device="cpu",
        attention="varlen",
        varlen_kernel=triton_or_flash(FlashStandIn()),
        share_prefix_min_tokens=8,
    )
    shared = Scorer(tiny_llama_dir, config)
    reference = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", attention="reference"))
    prefix = tuple(range(5, 45))
    requests = [
        ScoreRequest(
            request_id=f"r{n}",
            return_pooled_hidden_states=True,
            items=tuple(prefix + tuple(range(100 + n, 103 + n + item)) for item in range(3)),
        )
        for n in range(2)
    ]
    longest = max(len(item) for request in requests for item in request.items)
    for got, expected in zip(shared.score(requests), reference.score(requests), strict=True):
        # Two float32 forwards: the model's chain of sums for the whole prompts (45 tokens), at the values'
        # scale (at least 1); the two passes' merge adds two roundings, well inside one key's share.
        assert_forward_close(scores_of(got), scores_of(expected), tiny_llama_dir, longest=longest)
        assert_forward_close(hidden_of(got), hidden_of(expected), tiny_llama_dir, longest=longest)


def test_short_batches_take_flash() -> None:
    # Up to MIN_LENGTH tokens in the longest sequence flash measured faster; beyond it, Triton runs.
    FlashStandIn.windows.clear()
    kernel = triton_or_flash(FlashStandIn())
    for longest in (triton_attention.MIN_LENGTH, triton_attention.MIN_LENGTH + 1):
        lengths = [3, longest]
        q = torch.randn(sum(lengths), 2, 16)
        cu = _offsets(lengths)
        out = kernel(q, q, q, cu, cu, longest, longest, window_size=(-1, 0))
        for start, end in ((0, 3), (3, 3 + longest)):
            rows = q[start:end].transpose(0, 1)
            exact = exact_attention(rows, rows, rows, scale=None)
            # Either kernel (SDPA's or Triton's float32 online softmax) against float64: 16-term scores,
            # the row's keys in blocks, per element.
            bound = attention_bound(
                torch.float32, head_dim=16, keys=exact.keys, score_magnitude=exact.score,
                value_magnitude=exact.value,
            )  # fmt: skip
            assert_within(out[start:end].transpose(0, 1), exact.out, bound, f"{longest} keys")
    assert FlashStandIn.windows == [(-1, 0)]  # the short batch only


def test_a_batch_replayed_from_a_graph_takes_the_kernel_it_takes_without_one() -> None:
    # A graph's key keeps the longest sequence rounded up (graph_key), and the recorded forward is handed
    # that rounded length: the choice must come out the same from it as from the batch's own.
    from models.graphs import graph_key, next_power_of_two

    assert next_power_of_two(triton_attention.MIN_LENGTH) == triton_attention.MIN_LENGTH
    for longest in range(1, 4 * triton_attention.MIN_LENGTH):
        for total in (longest, longest + 1, 3 * longest + 5, 16384):
            recorded = graph_key(total, 2, longest).max_length
            assert recorded >= longest
            assert triton_attention.takes(recorded) == triton_attention.takes(longest), (longest, total)
    assert not triton_attention.takes(triton_attention.MIN_LENGTH)
    assert triton_attention.takes(triton_attention.MIN_LENGTH + 1)


_ROUTED = triton_or_flash(FlashStandIn())


def _routed_layer(q: torch.Tensor, cu: torch.Tensor, longest: int) -> torch.Tensor:
    # A module-level function reaching the kernel through a global, as compiled HF layers reach it through
    # the attention registry.
    return _ROUTED(q, q, q, cu, cu, longest, longest, window_size=(-1, 0)) * 2


def test_the_choice_costs_compiled_layers_one_guard() -> None:
    # The layers are compiled with dynamic shapes and get the longest sequence as an int: the routing must
    # not make torch.compile specialize on its value (a new graph per length, then the recompile limit and
    # eager layers), only on which side of MIN_LENGTH it lies; and each side must take its own kernel.
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(_routed_layer, backend=counter, dynamic=True)
    torch._dynamo.reset()
    try:
        for longest in (5, 40, 100, 256, 300, 333, 420, 257):
            FlashStandIn.windows.clear()
            q = torch.randn(longest + 3, 2, 16)
            rows = q[3:].transpose(0, 1)
            exact = exact_attention(rows, rows, rows, scale=None)
            got = compiled(q, _offsets([3, longest]), longest)
            # Either kernel against float64 (16-term scores, `longest` keys in blocks), doubled exactly.
            bound = attention_bound(
                torch.float32, head_dim=16, keys=exact.keys, score_magnitude=exact.score,
                value_magnitude=exact.value,
            )  # fmt: skip
            assert_within(got[3:].transpose(0, 1), 2 * exact.out, 2 * bound, f"{longest} keys")
            assert bool(FlashStandIn.windows) == (longest <= triton_attention.MIN_LENGTH), longest
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 2, f"compiled {counter.frame_count} times for 8 lengths"


def test_kernel_choice() -> None:
    cpu = torch.device("cpu")
    assert ScorerConfig().resolve_attention_kernel(cpu) == "flash"  # Triton by default on Hopper only
    assert ScorerConfig(attention_kernel="flash").resolve_attention_kernel(cpu) == "flash"
    assert ScorerConfig(attention_kernel="triton").resolve_attention_kernel(cpu) == "triton"
    with pytest.raises(ValueError, match="attention_kernel"):
        ScorerConfig(attention_kernel="cudnn")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("capability", "expected"), [((8, 0), "flash"), ((8, 9), "flash"), ((9, 0), "triton")]
)
def test_auto_is_triton_from_hopper_on(
    capability: tuple[int, int], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    gpu = torch.device("cuda", 0)
    assert ScorerConfig().resolve_attention_kernel(gpu) == expected
    assert ScorerConfig(attention_kernel="flash").resolve_attention_kernel(gpu) == "flash"
    monkeypatch.setattr(triton_attention, "available", lambda: False)
    assert ScorerConfig().resolve_attention_kernel(gpu) == "flash"  # no Triton: flash, not an error


def test_kernel_choice_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_attention, "available", lambda: False)
    with pytest.raises(ValueError, match="needs the triton package"):
        ScorerConfig(attention_kernel="triton").resolve_attention_kernel()

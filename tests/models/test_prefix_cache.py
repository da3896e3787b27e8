"""The prefix cache (models/prefix_cache.py): a prompt whose beginning an earlier batch computed reuses that
prefix's keys and values and computes only the rest. Its results are those of its whole prompt through
HuggingFace in float32, on every decoder, on the exact and the varlen path; it holds its memory bound,
evicting least recently used blocks that nothing continues; it never serves a prefix to another adapter,
nor a row a result reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scoring_testkit import (
    CpuVarlenKernelGqa,
    PackSpy,
    assert_forward_close,
    hf_judge_reference,
    hf_reference,
    hidden_of,
    scores_of,
)
from tolerances import forward_sums, half_forward_bound

from models import Scorer, ScorerConfig, prefix_cache
from models.errors import ModelLoadError
from models.layers import CompiledLayers
from models.prefix_cache import CacheIO, PrefixCache
from models.tiny import DECODERS, write_tiny_model
from schemas import ScoreRequest

BLOCK = 8
PROMPT = tuple(range(40, 85))  # 45 tokens: five whole blocks, longer than the tiny 16-token windows
ANSWERS = tuple(tuple(range(100 + 10 * i, 103 + 10 * i + i)) for i in range(6))  # 3..8 tokens each


def _requests(answers: range) -> list[ScoreRequest]:
    return [
        ScoreRequest(f"answer-{i}", items=(PROMPT + ANSWERS[i],), return_pooled_hidden_states=True)
        for i in answers
    ]


@pytest.mark.parametrize("attention", ["reference", "varlen"])
@pytest.mark.parametrize("architecture", DECODERS)
def test_answers_in_later_calls_reuse_the_prompt_and_score_as_their_whole_prompt(
    architecture: str, attention: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Best of N over three calls (two answers each): the first computes the prompt and keeps its blocks;
    the next two take its first 40 tokens (five blocks) from the cache. Every item equals HF float32 on
    its whole prompt, within the float32 forward bound for the longest prompt."""
    if attention == "varlen" and architecture == "gemma2":
        pytest.skip(
            "gemma2's attention logit softcap runs on the exact path only (the varlen kernel has none)"
        )
    scorer = Scorer(model_dirs[architecture], _cached_config(attention, share_prefix_min_tokens=0))
    held = _three_calls_score_as_whole_prompts(scorer, model_dirs[architecture], monkeypatch)
    # The first call computes both prompts whole; the later ones all but the cached 40 tokens.
    assert held.computed == [held.whole[0], held.whole[1] - 80, held.whole[2] - 80], held
    stats = scorer.executor.prefix_cache.stats  # type: ignore[union-attr]
    assert (stats.hits, stats.tokens_saved) == (4, 160)


@pytest.mark.parametrize("attention", ["reference", "varlen"])
def test_a_gemma4_judge_reads_its_prompt_from_the_cache(
    attention: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 4 with heads of one width in every layer: its layers that reuse an earlier layer's keys and
    values take the cached ones of that layer's prefix; label logits and hidden states as HF's on the
    whole prompts. With its global layers' wider heads the cache is refused (one pool shape)."""
    wide = write_tiny_model(tmp_path / "wide", "gemma4_text", seed=10)
    with pytest.raises(ModelLoadError, match="keys of different shapes"):
        Scorer(wide, _cached_config(attention, share_prefix_min_tokens=0))
    uniform = {"global_head_dim": 16, "num_global_key_value_heads": 2}
    model_dir = write_tiny_model(tmp_path / "uniform", "gemma4_text", seed=10, overrides=uniform)
    scorer = Scorer(model_dir, _cached_config(attention, share_prefix_min_tokens=0))
    labels = (40, 7, 300)
    spy = PackSpy(monkeypatch)
    results = []
    for call in range(3):
        requests = [
            ScoreRequest(
                r.request_id, items=r.items, label_token_ids=labels, return_pooled_hidden_states=True
            )
            for r in _requests(range(2 * call, 2 * call + 2))
        ]
        results += scorer.score(requests)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    whole = [PROMPT + answer for answer in ANSWERS]
    reference = hf_judge_reference(model_dir, whole, labels)
    longest = max(len(p) for p in whole)
    for got, want in ((scores_of, reference.logits), (hidden_of, reference.hidden)):
        # Two float32 forwards: the model's chain of sums for the longest prompt (forward_atol).
        assert_forward_close(np.concatenate([got(r) for r in results]), want, model_dir, longest=longest)
    computed = [sum(len(whole[i]) for i in range(2 * call, 2 * call + 2)) for call in range(3)]
    assert spy.tokens == [computed[0], computed[1] - 80, computed[2] - 80], spy.tokens
    assert scorer.executor.prefix_cache.stats.hits == 4  # type: ignore[union-attr]


def _cached_config(attention: str, share_prefix_min_tokens: int) -> ScorerConfig:
    """The CPU engine on the exact path or the varlen kernel's (a CPU stand-in), with a prefix cache."""
    return ScorerConfig(
        device="cpu",
        attention=attention,
        varlen_kernel=CpuVarlenKernelGqa() if attention == "varlen" else None,
        prefix_cache_mib=16,
        prefix_cache_block_tokens=BLOCK,
        share_prefix_min_tokens=share_prefix_min_tokens,
    )


@dataclass
class _Calls:
    whole: list[int]  # the tokens each call's prompts hold
    computed: list[int]  # the tokens each call's packed row computed


def _three_calls_score_as_whole_prompts(
    scorer: Scorer, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> _Calls:
    """Score the answers as three calls of two; every item must equal HF float32 on its whole prompt, within
    the float32 forward bound for the longest prompt."""
    spy = PackSpy(monkeypatch)
    results = [r for call in range(3) for r in scorer.score(_requests(range(2 * call, 2 * call + 2)))]
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    whole = [PROMPT + answer for answer in ANSWERS]
    reference = hf_reference(model_dir, whole)
    longest = max(len(p) for p in whole)
    assert_forward_close(
        np.concatenate([scores_of(r) for r in results]), reference.logits, model_dir, longest=longest
    )
    assert_forward_close(
        np.concatenate([hidden_of(r) for r in results]), reference.hidden, model_dir, longest=longest
    )
    return _Calls(
        [sum(len(whole[i]) for i in range(2 * call, 2 * call + 2)) for call in range(3)], spy.tokens
    )


def test_the_bfloat16_path_with_the_cache_scores_as_without_it(tiny_qwen3_dir: Path) -> None:
    """In bfloat16 the cached keys and values are the model's own dtype, as the row's would be: three calls
    of a prompt's answers (the later two reading 40 tokens from the cache) score as the same calls without
    the cache. Two bfloat16 forwards of another batch shape: each of the model's sums in series within
    float32's gamma and rounded to bfloat16 once (half_forward_bound), at the compared values' scale (at
    least 1); a cached row served at the wrong place moves items by their whole scale."""
    common: dict[str, Any] = {"device": "cpu", "dtype": "bfloat16"}
    cache: dict[str, Any] = {"prefix_cache_mib": 16, "prefix_cache_block_tokens": BLOCK}
    cached, plain = (
        Scorer(tiny_qwen3_dir, ScorerConfig(**common, **cache)),
        Scorer(tiny_qwen3_dir, ScorerConfig(**common)),
    )
    sums = forward_sums(tiny_qwen3_dir, len(PROMPT) + max(len(a) for a in ANSWERS))
    for call in range(3):
        requests = _requests(range(2 * call, 2 * call + 2))
        for got, want in zip(cached.score(requests), plain.score(requests), strict=True):
            for a, b in ((scores_of(got), scores_of(want)), (hidden_of(got), hidden_of(want))):
                bound = half_forward_bound(
                    torch.bfloat16, sums=sums, magnitude=max(1.0, float(np.abs(b).max()))
                )
                np.testing.assert_allclose(a, b, atol=bound, rtol=0)
    assert cached.executor.prefix_cache.stats.hits == 4  # type: ignore[union-attr]


def test_the_compiled_and_graphed_path_uses_the_cache_and_scores_the_same(
    tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With compiled layers and CUDA graphs (CPU stand-ins), batches that read or fill the cache run the
    compiled layers (broken around the cache's traffic), no CUDA graph, and equal the engine without the
    cache."""
    rerun = lambda run: run  # noqa: E731 - a recorder whose replay runs the function again
    common: dict[str, Any] = {
        "device": "cpu",
        "attention": "varlen",
        "varlen_kernel": torch._dynamo.disable(CpuVarlenKernelGqa()),
        "compile": "on",
        "graph_recorder": rerun,
    }
    cached = Scorer(
        tiny_qwen3_dir, ScorerConfig(**common, prefix_cache_mib=16, prefix_cache_block_tokens=BLOCK)
    )
    plain = Scorer(tiny_qwen3_dir, ScorerConfig(**common))
    # Prompts seen once neither read nor fill the cache: their batches keep the compiled, graphed path.
    made: list[object] = []
    monkeypatch.setattr(prefix_cache, "CacheIO", lambda *a: made.append(a) or CacheIO(*a))
    rng = np.random.default_rng(5)
    fresh = [
        ScoreRequest(f"fresh-{k}", items=(tuple(int(t) for t in rng.integers(4, 200, 40)),)) for k in range(3)
    ]
    for request in fresh:
        cached.score([request])
    assert made == [] and len(cached.executor.prefix_cache) == 0  # type: ignore[arg-type]
    entered: list[object] = []  # the compiled layers swapped in, once per forward of the cached scorer
    enter = CompiledLayers.__enter__
    monkeypatch.setattr(CompiledLayers, "__enter__", lambda self: entered.append(self) or enter(self))
    recorded = cached.executor.graphs.recorded  # type: ignore[union-attr]
    for call in range(3):
        requests = _requests(range(2 * call, 2 * call + 2))
        got = cached.score(requests)
        # This batch used the cache, on the compiled layers.
        assert len(made) == entered.count(cached.executor.compiled_layers) == call + 1
        expected = plain.score(requests)
        longest = len(PROMPT) + max(len(a) for a in ANSWERS)
        for a, b in zip(got, expected, strict=True):
            assert_forward_close(scores_of(a), scores_of(b), tiny_qwen3_dir, longest=longest)
            assert_forward_close(hidden_of(a), hidden_of(b), tiny_qwen3_dir, longest=longest)
    assert cached.executor.prefix_cache.stats.hits == 4  # type: ignore[union-attr]
    assert cached.executor.graphs.recorded == recorded  # type: ignore[union-attr]


def test_positions_read_are_never_taken_from_the_cache(tiny_llama_dir: Path) -> None:
    """A request reading token outputs inside the cached prefix takes only the blocks before the first
    position it reads; its token outputs equal the engine's without the cache."""
    config = ScorerConfig(device="cpu", prefix_cache_mib=16, prefix_cache_block_tokens=BLOCK)
    cached, plain = Scorer(tiny_llama_dir, config), Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    cached.score(_requests(range(2)))  # two answers: the prompt's blocks seen twice, and kept
    reading = ScoreRequest(
        "tokens",
        items=(PROMPT + ANSWERS[1],),
        token_outputs="tokens",
        token_range=(20, None),
        return_token_hidden_states=True,
        return_pooled_hidden_states=True,
    )
    (got,), (expected,) = cached.score([reading]), plain.score([reading])
    assert got.ok, got.error
    assert cached.executor.prefix_cache.stats.tokens_saved == 16  # type: ignore[union-attr]  # two blocks < 20
    longest = len(PROMPT) + len(ANSWERS[1])
    assert got.token_positions == expected.token_positions
    for a, b in zip(got.token_hidden_states or (), expected.token_hidden_states or (), strict=True):
        assert_forward_close(a.to_numpy(), b.to_numpy(), tiny_llama_dir, longest=longest)
    assert_forward_close(scores_of(got), scores_of(expected), tiny_llama_dir, longest=longest)


def test_the_cache_keeps_its_memory_bound_and_results_stay_exact(tiny_llama_dir: Path) -> None:
    """A bound of six blocks for two prompts of four blocks each: every batch evicts, the cache never holds
    more than its bound, the prompts keep finding what is left of them, and results are unchanged."""
    config = ScorerConfig(device="cpu", prefix_cache_mib=1, prefix_cache_block_tokens=BLOCK)
    cached, plain = Scorer(tiny_llama_dir, config), Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    cache = cached.executor.prefix_cache
    assert cache is not None
    cache.max_bytes = 6 * _block_bytes(cached)
    rng = np.random.default_rng(3)
    prompts = [tuple(int(t) for t in rng.integers(4, 200, 35)) for _ in range(2)]
    for round_ in range(3):
        for k, prompt in enumerate(prompts):
            request = ScoreRequest(
                f"{round_}-{k}", items=((*prompt, round_ + 4),), return_pooled_hidden_states=True
            )
            (got,), (expected,) = cached.score([request]), plain.score([request])
            assert cache.bytes <= cache.max_bytes
            assert_forward_close(scores_of(got), scores_of(expected), tiny_llama_dir, longest=len(prompt) + 1)
            assert_forward_close(hidden_of(got), hidden_of(expected), tiny_llama_dir, longest=len(prompt) + 1)
    assert cache.stats.evicted > 0 and cache.stats.hits > 0


def _block_bytes(scorer: Scorer) -> int:
    config = scorer.hf_model.config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * BLOCK * head_dim * 4  # keys and values, float32


def test_the_cache_is_refused_where_it_cannot_serve(tmp_path: Path, tiny_llama_dir: Path) -> None:
    encoder = write_tiny_model(tmp_path / "bert", "bert", seed=3, num_labels=2)
    with pytest.raises(ModelLoadError, match="not a causal decoder"):
        Scorer(encoder, ScorerConfig(device="cpu", prefix_cache_mib=4))
    with pytest.raises(ModelLoadError, match="mean pooling"):
        Scorer(tiny_llama_dir, ScorerConfig(device="cpu", prefix_cache_mib=4, pooling="mean"))
    with pytest.raises(ModelLoadError, match="deterministic"):
        Scorer(tiny_llama_dir, ScorerConfig(device="cpu", prefix_cache_mib=4, deterministic=True))


def _tensors(blocks: int, layers: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Captured keys and values of `blocks` blocks, [L, 1, blocks * BLOCK, 2]: each block's rows hold its
    number."""
    rows = torch.arange(blocks).repeat_interleave(BLOCK).float()
    keys = rows.reshape(1, 1, -1, 1).expand(layers, 1, -1, 2).contiguous()
    return keys, -keys


def test_a_plan_takes_the_longest_cached_run_within_each_limit_and_captures_the_rest_once() -> None:
    cache = PrefixCache(BLOCK, 1 << 20, admit_first_sight=True)
    prompt = list(range(1, 41))  # five blocks
    first = cache.plan([prompt, [*prompt, 99]], None, [39, 40])
    assert first.hits == [(), ()] and [c.start for c in first.captures] == [0, 8, 16, 24, 32]  # once for both
    assert all(c.prompt == 0 for c in first.captures)
    cache.store(first, *_tensors(5))
    again = cache.plan([[*prompt, 7], prompt[:20] + [5] * 20, prompt], None, [40, 40, 17])
    assert [len(run) for run in again.hits] == [5, 2, 2]  # the third may not take its 17th token
    assert [again.cached_tokens(i) for i in range(3)] == [40, 16, 16]
    assert again.regions == [again.hits[0], again.hits[1]] and again.offsets == [0, 40, 40]
    assert [(c.prompt, c.start) for c in again.captures] == [(1, 16), (1, 24), (1, 32)]  # the second's own
    region = cache.region(again)
    assert region is not None and region.rows.shape == (56,)
    keys = region.keys[0].index_select(1, region.rows)  # what attention reads for layer 0
    assert keys[0, :, 0].tolist() == [float(b) for b in (0, 1, 2, 3, 4, 0, 1) for _ in range(BLOCK)]
    assert torch.equal(region.values[1].index_select(1, region.rows), -keys)
    # Under another adapter the same tokens are another prefix.
    assert cache.plan([prompt], [1], [40]).hits == [()]


def test_eviction_takes_least_recently_used_blocks_that_nothing_continues() -> None:
    block_bytes = 2 * 2 * BLOCK * 2 * 4
    cache = PrefixCache(BLOCK, 6 * block_bytes, admit_first_sight=True)
    a, b = list(range(1, 33)), list(range(101, 133))  # four blocks each
    cache.store(cache.plan([a], None, [32]), *_tensors(4))
    cache.store(cache.plan([b], None, [32]), *_tensors(4))
    assert cache.bytes <= cache.max_bytes and len(cache) == 6 and cache.stats.evicted == 2
    # The pools were allocated once, at the first block kept, for the six blocks the bound holds.
    pools = cache.region(cache.plan([b], None, [32]))
    assert pools is not None and 2 * pools.keys.numel() * pools.keys.element_size() == 6 * block_bytes
    # a's last two blocks went (its leaves, the oldest); a's first two remain and are found.
    assert [len(run) for run in cache.plan([a, b], None, [32, 32]).hits] == [2, 4]
    use = cache.plan([a], None, [32])
    cache.region(use)  # a used again: b is now the least recently used
    cache.store(use, *_tensors(2))
    assert [len(run) for run in cache.plan([a, b], None, [32, 32]).hits] == [4, 2]
    assert cache.bytes <= cache.max_bytes


def test_each_batch_reports_the_cache_traffic_and_the_worker_counts_it(tiny_llama_dir: Path) -> None:
    """BatchStats carry the prompts looked up, those that hit, the tokens taken and the bytes held; the
    worker's metrics add them up, and count as shared-prefix savings only what sharing saved."""
    from prometheus_client import CollectorRegistry

    from worker.metrics import WorkerMetrics

    config = ScorerConfig(device="cpu", prefix_cache_mib=16, prefix_cache_block_tokens=BLOCK)
    scorer = Scorer(tiny_llama_dir, config)
    seen: list[Any] = []
    for call in range(2):
        scorer.score_prepared(
            [scorer.prepare(r) for r in _requests(range(2 * call, 2 * call + 2))], seen.append
        )
    first, second = seen
    assert (first.cache_lookups, first.cache_hits, first.cached_tokens) == (2, 0, 0)
    assert (second.cache_lookups, second.cache_hits, second.cached_tokens) == (2, 2, 80)
    assert second.packed_tokens == second.tokens - 80
    assert second.cache_bytes == scorer.executor.prefix_cache.bytes > 0  # type: ignore[union-attr]
    metrics = WorkerMetrics("w", registry=CollectorRegistry())
    for stats in seen:
        metrics.model_batch(stats)

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(f"score_worker_{name}", {"model": "", "worker": "w"})

    assert value("prefix_cache_lookups_total") == 4 and value("prefix_cache_hits_total") == 2
    assert value("prefix_cache_tokens_saved_total") == 80
    assert value("prefix_cache_bytes") == second.cache_bytes
    assert value("shared_prefix_tokens_saved_total") == 0
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    seen.clear()
    plain.score_prepared([plain.prepare(r) for r in _requests(range(2))], seen.append)
    assert seen[0].cache_bytes is None and seen[0].cache_lookups == 0


@pytest.mark.parametrize("attention", ["reference", "varlen"])
def test_a_prefix_shared_in_a_batch_is_kept_from_its_one_row_and_reused_later(
    attention: str, tiny_mistral_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With shared prefixes on, the first call computes the prompt once for its answers and the cache keeps
    its blocks from that one run of rows; later calls take them from the cache (a prompt with cached tokens
    joins no group). Mistral: a 16-token sliding window shorter than the prompts."""
    scorer = Scorer(tiny_mistral_dir, _cached_config(attention, share_prefix_min_tokens=8))
    held = _three_calls_score_as_whole_prompts(scorer, tiny_mistral_dir, monkeypatch)
    assert held.computed == [held.whole[0] - len(PROMPT), held.whole[1] - 80, held.whole[2] - 80], held


def test_a_block_is_kept_the_second_time_it_is_seen() -> None:
    """Admission on the second sight: a prompt seen once leaves the cache empty (a batch that repeats
    nothing neither reads nor fills it); seen again, in a later batch or by another prompt of the same one,
    its blocks are kept; a block seen once whose parent is new is not kept without it."""
    cache = PrefixCache(BLOCK, 1 << 20)
    prompt = list(range(1, 25))  # three blocks
    once = cache.plan([prompt], None, [24])
    assert not once.active
    again = cache.plan([prompt], None, [24])
    assert [c.start for c in again.captures] == [0, 8, 16]
    cache.store(again, *_tensors(3))
    assert [len(run) for run in cache.plan([prompt], None, [24]).hits] == [3]
    other = list(range(101, 125))
    together = cache.plan([other, [*other[:16], 7, 7, 7, 7, 7, 7, 7, 7]], None, [24, 24])
    assert [(c.prompt, c.start) for c in together.captures] == [(1, 0), (1, 8)]  # the two blocks both hold
    assert len(cache) == 3


def test_the_self_check_runs_without_the_cache(tiny_llama_dir: Path) -> None:
    """The start-up self-check scores the packed path as traffic without a cache finds it, and leaves the
    cache as it was."""
    from models.selfcheck import run_self_check

    config = ScorerConfig(device="cpu", prefix_cache_mib=8, prefix_cache_block_tokens=BLOCK)
    scorer = Scorer(tiny_llama_dir, config)
    report = run_self_check(scorer)
    assert report.max_score_diff <= report.score_bound
    cache = scorer.executor.prefix_cache
    assert cache is not None and cache.stats.lookups == 0 and len(cache) == 0


@pytest.mark.parametrize("admit", ["first", "second"])
def test_the_admission_setting_keeps_a_prompt_at_its_first_or_second_sight(
    admit: str, tiny_llama_dir: Path
) -> None:
    """prefix_cache_admit: "first" keeps a prompt seen once, so the next call takes it; "second" keeps it
    at the next call, and the one after takes it. Either way the results are the whole prompts'."""
    config = ScorerConfig(
        device="cpu", prefix_cache_mib=8, prefix_cache_block_tokens=BLOCK, prefix_cache_admit=admit
    )
    scorer, plain = Scorer(tiny_llama_dir, config), Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    cache = scorer.executor.prefix_cache
    assert cache is not None
    saved = []
    for call in range(3):
        requests = _requests(range(call, call + 1))
        for got, expected in zip(scorer.score(requests), plain.score(requests), strict=True):
            longest = len(PROMPT) + len(ANSWERS[call])
            assert_forward_close(scores_of(got), scores_of(expected), tiny_llama_dir, longest=longest)
            assert_forward_close(hidden_of(got), hidden_of(expected), tiny_llama_dir, longest=longest)
        saved.append(cache.stats.tokens_saved)
    assert saved == ([0, 40, 80] if admit == "first" else [0, 0, 40])


@pytest.mark.parametrize("attention", ["reference", "varlen"])
@pytest.mark.parametrize("architecture", DECODERS)
def test_a_hit_beside_misses_and_a_shared_prefix_scores_as_whole_prompts(
    architecture: str, attention: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 100-token prompt (longer than a chunk of the hybrids' delta rule, its end not on a block end)
    scored cold, then again and with a longer answer beside prompts the cache lacks, two of which share a
    prefix within the batch (their kept blocks come from the prefix's row and from a suffix's); then the
    block kept from the suffix's rows read from the cache, and the blocks the longer answer kept after
    starting from the cache. In the hybrids' Gated DeltaNet layers, which keep no keys, a prompt
    starts from the recurrent state and convolution inputs kept at its cached run's last block end; on the
    varlen path, a batch reading cached keys gathers every sequence's keys, its shared groups' too. Every
    item equals HF float32 on its whole prompt, within the float32 forward bound for the longest prompt."""
    if attention == "varlen" and architecture == "gemma2":
        pytest.skip(
            "gemma2's attention logit softcap runs on the exact path only (the varlen kernel has none)"
        )
    block = 16
    config = _cached_config(attention, share_prefix_min_tokens=8)
    config = config.model_copy(update={"prefix_cache_block_tokens": block, "prefix_cache_admit": "first"})
    model_dir = model_dirs[architecture]
    scorer = Scorer(model_dir, config)
    spy = PackSpy(monkeypatch)
    rng = np.random.default_rng(9)

    def ids(count: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(4, 400, count))

    prompt, other = ids(100), ids(40)  # 100: six blocks and 4 tokens; 40: two blocks and 8 tokens
    cold = prompt + ids(3)
    second = [cold, prompt + ids(30), ids(20), other + ids(5), other + ids(9)]
    calls = [
        [cold],
        second,
        # The third block of `other + ...` was kept from a suffix's rows, after its shared prefix's state.
        [second[4][:48] + ids(3), ids(12)],
        # Blocks seven and eight were kept from a prompt that started from the cache's sixth.
        [second[1][:128] + ids(5)],
    ]
    results = []
    for number, prompts in enumerate(calls):
        requests = [
            ScoreRequest(f"{number}-{k}", items=(p,), return_pooled_hidden_states=True)
            for k, p in enumerate(prompts)
        ]
        results += scorer.score(requests)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    whole = [p for prompts in calls for p in prompts]
    reference = hf_reference(model_dir, whole)
    longest = max(len(p) for p in whole)
    for got, want in ((scores_of, reference.logits), (hidden_of, reference.hidden)):
        assert_forward_close(np.concatenate([got(r) for r in results]), want, model_dir, longest=longest)
    # The second call takes six blocks for each of its first two prompts, and shares `other`'s 40 tokens;
    # the third takes three blocks of `other + ...`, the fourth eight of the second's longer prompt.
    lengths = [sum(len(p) for p in prompts) for prompts in calls]
    assert spy.tokens == [lengths[0], lengths[1] - 2 * 96 - 40, lengths[2] - 48, lengths[3] - 128], spy.tokens
    stats = scorer.executor.prefix_cache.stats  # type: ignore[union-attr]
    assert (stats.hits, stats.tokens_saved) == (4, 2 * 96 + 48 + 128)


def test_a_hybrid_cache_counts_the_states_in_its_bound(model_dirs: dict[str, Path]) -> None:
    """A hybrid's block costs its full-attention layers' keys and values plus, per Gated DeltaNet layer, a
    float32 state [Hv, Dk, Dv] and its last W-1 convolution inputs [W-1, C]; blocks shorter than W-1 tokens
    are refused (their kept inputs are read from the block's own rows)."""
    model_dir = model_dirs["qwen3_5_text"]
    scorer = Scorer(model_dir, _cached_config("reference", share_prefix_min_tokens=0))
    scorer.score(_requests(range(2)))  # the prompt's blocks seen twice: kept
    cache = scorer.executor.prefix_cache
    assert cache is not None and len(cache) == 5
    config = scorer.hf_model.config
    width = config.linear_conv_kernel_dim
    k_dim = config.linear_num_key_heads * config.linear_key_head_dim
    v_dim = config.linear_num_value_heads * config.linear_value_head_dim
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    window = (width - 1) * (2 * k_dim + v_dim)
    kv = 2 * config.num_key_value_heads * BLOCK * config.head_dim
    per_block = 4 * (1 * kv + 3 * (state + window))  # float32; one full-attention layer, three linear
    assert cache.bytes == 5 * per_block
    short = _cached_config("reference", share_prefix_min_tokens=0).model_copy(
        update={"prefix_cache_block_tokens": width - 2}
    )
    with pytest.raises(ModelLoadError, match="prefix_cache_block_tokens to at least 3"):
        Scorer(model_dir, short)

"""Shared prefixes computed once (a multi-item request's query, one prompt sent with several responses):
each item's scores and hidden states are those of its whole prompt through HuggingFace in float32."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scoring_testkit import (
    CpuVarlenKernelGqa,
    PackSpy,
    assert_forward_close,
    exact_attention,
    hf_judge_reference,
    hf_reference,
    hidden_of,
    scores_of,
)
from tolerances import assert_within, attention_bound, sum_bound

from models import Scorer, ScorerConfig, execute, plan
from models.attention import attend_causal
from models.packing import SharedPrefix, find_shared_prefixes, pack, packed_length, pool
from models.tiny import CAUSAL, JUDGE_ONLY, write_tiny_model
from schemas import ScoreRequest

# Token ids from 4 up (0..3 are special); the query is longer than the 16-token sliding windows of the
# tiny mistral and gemma models, so a suffix's window reaches into the shared prefix only partly.
QUERY = tuple(range(40, 80))
ITEMS = ((5, 6, 7), (8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25), (30,), (31, 32))
RESPONSES = ((100, 101, 102), (100, 101, 103, 104), (200,))  # best of N: same prompt, three requests
OTHER = (7, 8, 9, 10, 11, 12)  # shares nothing
MIN_TOKENS = 8


def _requests() -> list[ScoreRequest]:
    return [
        ScoreRequest("multi", query=QUERY, items=ITEMS, return_pooled_hidden_states=True),
        ScoreRequest("other", items=(OTHER,), return_pooled_hidden_states=True),
        *(
            ScoreRequest(f"best-of-n-{i}", items=(QUERY + response,), return_pooled_hidden_states=True)
            for i, response in enumerate(RESPONSES)
        ),
    ]


def _whole_prompts() -> list[tuple[int, ...]]:
    return [QUERY + item for item in ITEMS] + [OTHER] + [QUERY + r for r in RESPONSES]


# The longest whole prompt (40 + 18 tokens): the most keys a softmax-weighted sum adds up here.
LONGEST = max(len(p) for p in _whole_prompts())


@pytest.mark.parametrize("attention", ["reference", "varlen"])
@pytest.mark.parametrize("architecture", CAUSAL)
def test_each_item_scores_as_its_whole_prompt_in_hf(
    architecture: str, attention: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    if attention == "varlen" and architecture == "gemma2":
        pytest.skip(
            "gemma2's attention logit softcap runs on the exact path only (the varlen kernel has none)"
        )
    _scores_as_whole_prompts(model_dirs[architecture], attention, monkeypatch)


@pytest.mark.parametrize("attention", ["reference", "varlen"])
@pytest.mark.parametrize("architecture", JUDGE_ONLY)
def test_a_judge_only_family_scores_each_item_as_its_whole_prompt(
    architecture: str, attention: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 4's text model (a judge only): its shared key-value layers read keys an earlier layer computed
    over the prefix and the suffix alike, its sliding layers' windows end inside the prefix."""
    model_dir = write_tiny_model(tmp_path / architecture, architecture, seed=9)
    _scores_as_whole_prompts(model_dir, attention, monkeypatch, labels=(40, 7, 300))


def _scores_as_whole_prompts(
    model_dir: Path, attention: str, monkeypatch: pytest.MonkeyPatch, labels: tuple[int, ...] | None = None
) -> None:
    """_requests() with shared prefixes (a judge's on `labels`) score as HF float32 on the whole prompts,
    and each shared query runs once."""
    kernel = CpuVarlenKernelGqa() if attention == "varlen" else None
    config = ScorerConfig(
        device="cpu", attention=attention, varlen_kernel=kernel, share_prefix_min_tokens=MIN_TOKENS
    )
    scorer = Scorer(model_dir, config)
    requests = [
        ScoreRequest(r.request_id, query=r.query, items=r.items, label_token_ids=labels,
                     return_pooled_hidden_states=True)
        for r in _requests()
    ]  # fmt: skip
    spy = PackSpy(monkeypatch)
    results = scorer.score(requests)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    if labels is None:
        reference = hf_reference(model_dir, _whole_prompts())
    else:
        reference = hf_judge_reference(model_dir, _whole_prompts(), labels)
    # The engine (prefixes once, merged passes or gathered keys) and HF's whole prompts, both float32: the
    # model's chain of sums for LONGEST keys, at the values' scale (forward_atol).
    assert_forward_close(
        np.concatenate([scores_of(r) for r in results]), reference.logits, model_dir, longest=LONGEST
    )
    assert_forward_close(
        np.concatenate([hidden_of(r) for r in results]), reference.hidden, model_dir, longest=LONGEST
    )
    # The query ran once for the four items and the three responses, not seven times.
    whole = sum(len(p) for p in _whole_prompts())
    assert spy.tokens == [whole - 6 * len(QUERY)], (spy.tokens, whole)
    if kernel is not None:
        assert kernel.calls


@pytest.mark.parametrize("pooling", ["last", "last_token", "cls", "mean"])
def test_every_pooling_gives_the_unshared_result(pooling: str, tiny_qwen3_dir: Path) -> None:
    plain = Scorer(tiny_qwen3_dir, ScorerConfig(device="cpu", pooling=pooling))
    shared = Scorer(
        tiny_qwen3_dir, ScorerConfig(device="cpu", pooling=pooling, share_prefix_min_tokens=MIN_TOKENS)
    )
    mean = pooling == "mean"  # one more sum, over each prompt's tokens
    for got, expected in zip(shared.score(_requests()), plain.score(_requests()), strict=True):
        # Two float32 forwards of the same prompts: the chain of sums for LONGEST keys (forward_atol).
        assert_forward_close(
            scores_of(got), scores_of(expected), tiny_qwen3_dir, longest=LONGEST, mean_pooled=mean
        )
        assert_forward_close(
            hidden_of(got), hidden_of(expected), tiny_qwen3_dir, longest=LONGEST, mean_pooled=mean
        )


def test_an_item_never_sees_its_siblings(tiny_llama_dir: Path) -> None:
    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", share_prefix_min_tokens=MIN_TOKENS))
    before = scorer.score([ScoreRequest("r", query=QUERY, items=ITEMS, return_pooled_hidden_states=True)])[0]
    changed = (ITEMS[0], (90, 91, 92, 93, 94, 95), *ITEMS[2:])
    after = scorer.score([ScoreRequest("r", query=QUERY, items=changed, return_pooled_hidden_states=True)])[0]
    assert before.pooled_hidden_states is not None and after.pooled_hidden_states is not None
    # The two batches differ in length (item 1 has 18 tokens, then 6), so their GEMMs may block the other
    # items' rows differently: equal up to two float32 forwards' rounding (forward_atol, LONGEST keys). A
    # sibling seen would move them by a token's share of attention, orders of magnitude more.
    for index in (0, 2, 3):
        assert_forward_close(before.scores[index], after.scores[index], tiny_llama_dir, longest=LONGEST)
        assert_forward_close(
            before.pooled_hidden_states[index].to_numpy(),
            after.pooled_hidden_states[index].to_numpy(),
            tiny_llama_dir,
            longest=LONGEST,
        )
    assert before.scores[1] != after.scores[1]


def test_short_prefixes_are_packed_whole() -> None:
    """Below the configured length (or with sharing off) every prompt is packed whole, as before."""
    prompts = [(*QUERY[:5], 6), (*QUERY[:5], 7)]
    assert find_shared_prefixes(prompts, 8) == []
    assert find_shared_prefixes(prompts, 0) == []
    assert find_shared_prefixes(prompts, 5) == [SharedPrefix((0, 1), 5)]


def test_an_encoder_never_shares(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder's query tokens see the item after them: nothing of them can be computed once."""
    model_dir = write_tiny_model(tmp_path / "bert", "bert", seed=8, num_labels=2)
    shared = Scorer(model_dir, ScorerConfig(device="cpu", share_prefix_min_tokens=1))
    plain = Scorer(model_dir, ScorerConfig(device="cpu"))
    request = ScoreRequest("e", query="the same question here", items=("one answer", "another answer"))
    spy = PackSpy(monkeypatch)
    for got, expected in zip(shared.score([request]), plain.score([request]), strict=True):
        # Nothing shared: the same packed row through the same code, so the same arithmetic, bit for bit.
        np.testing.assert_array_equal(scores_of(got), scores_of(expected))
    assert spy.tokens[0] == spy.tokens[1]


def test_groups_keep_a_token_of_their_own_and_the_longest_saving() -> None:
    # Identical prompts share all but their last token (which each needs for its own pooled state).
    assert find_shared_prefixes([(1, 2, 3, 4)] * 3, 2) == [SharedPrefix((0, 1, 2), 3)]
    # Five prompts with a 40-token query and one sharing only its first 35 tokens: one group of six over
    # 35 tokens saves 5 x 35 = 175, more than 4 x 40 = 160 for the five alone.
    query = tuple(range(100, 140))
    prompts = [(*query, i) for i in range(5)] + [(*query[:35], 0, 0)]
    assert find_shared_prefixes(prompts, 32) == [SharedPrefix((0, 1, 2, 3, 4, 5), 35)]
    # Two prompts sharing 33 tokens with those five and 60 with each other: two groups save
    # 4 x 40 + 1 x 60 = 220, more than 6 x 33 = 198 for one group of seven.
    other = (*query[:33], *range(500, 527))
    prompts = [(*query, i) for i in range(5)] + [(*other, 0), (*other, 1)]
    groups = find_shared_prefixes(prompts, 32)
    assert groups == [SharedPrefix((0, 1, 2, 3, 4), 40), SharedPrefix((5, 6), 60)]
    # Random prompts share nothing.
    generator = np.random.default_rng(0)
    random_prompts = [tuple(generator.integers(4, 1000, 50).tolist()) for _ in range(200)]
    assert find_shared_prefixes(random_prompts, 8) == []


def test_common_prefixes_are_found_exactly_across_block_boundaries() -> None:
    """The prefix comparison goes block by block; a difference anywhere, at a block's edge or not, ends the
    shared prefix exactly there, for prompts given as lists or tuples alike."""
    base = tuple(range(10, 300))
    for cut in (0, 1, 31, 63, 64, 65, 127, 128, 129, 200):
        other = (*base[:cut], 999, *base[cut + 1 :])
        for a, b in ((base, other), (list(base), list(other)), (base, list(other))):
            groups = find_shared_prefixes([a, b], 1)
            assert groups == ([SharedPrefix((0, 1), cut)] if cut else []), cut
    # One prompt a prefix of the other: all but the shorter one's last token is shared.
    assert find_shared_prefixes([base[:130], base], 1) == [SharedPrefix((0, 1), 129)]
    assert find_shared_prefixes([base, base], 1) == [SharedPrefix((0, 1), len(base) - 1)]


def test_packing_lays_out_the_prefixes_then_the_suffixes_then_the_rest() -> None:
    prompts = [(9,), (1, 2, 3, 4, 5), (1, 2, 3, 6)]
    groups = [SharedPrefix((1, 2), 3)]
    packed = pack(prompts, torch.device("cpu"), "last_token", shared=groups)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0]]
    assert packed.host_cu_seqlens.tolist() == [0, 3, 5, 6, 7]
    assert packed.pooled_rows.tolist() == [6, 4, 5]
    # The cross pass: the group's suffixes (rows 3..5) over its prefix (rows 0..2); no key is copied.
    assert packed.cross is not None and packed.shared is None
    assert (packed.cross.cu_q.tolist(), packed.cross.cu_k.tolist()) == ([3, 6], [0, 3])
    assert (packed.cross.max_q, packed.cross.max_k) == (3, 3)
    assert packed.cross.rows.tolist() == [False, False, False, True, True, True, False]
    # Gathered keys, where asked (the exact path, sliding windows): each suffix's prefix rows, then its own.
    gathered = pack(prompts, torch.device("cpu"), "last_token", shared=groups, gather_keys=True).shared
    assert gathered is not None
    assert gathered.key_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6]
    assert gathered.host_cu_seqlens_k.tolist() == [0, 3, 8, 12, 13]
    mean = pack(prompts, torch.device("cpu"), "mean", shared=groups)
    hidden = torch.arange(7, dtype=torch.float32).unsqueeze(1)  # row r holds r
    expected = torch.tensor([[6.0], [(0 + 1 + 2 + 3 + 4) / 5], [(0 + 1 + 2 + 5) / 4]], dtype=torch.float64)
    # A float32 averaging matmul against the exact means: at most 5 terms of one sign, each weighted by
    # the rounded 1/n: within gamma(6) of the mean.
    assert_within(pool(hidden, mean), expected, sum_bound(torch.float32, 6, expected))


def test_two_groups_lie_in_one_run_of_prefixes_and_one_of_suffixes() -> None:
    prompts = [(1, 2, 7), (5, 6, 8, 9), (1, 2, 3), (5, 6, 4)]
    groups = find_shared_prefixes(prompts, 2)
    assert groups == [SharedPrefix((0, 2), 2), SharedPrefix((1, 3), 2)]
    packed = pack(prompts, torch.device("cpu"), "last_token", shared=groups)
    assert packed.input_ids.tolist() == [[1, 2, 5, 6, 7, 3, 8, 9, 4]]
    assert packed.cross is not None
    assert (packed.cross.cu_q.tolist(), packed.cross.cu_k.tolist()) == ([4, 6, 9], [0, 2, 4])
    assert (packed.cross.max_q, packed.cross.max_k) == (3, 2)
    assert packed.pooled_rows.tolist() == [4, 7, 5, 8]


@pytest.mark.parametrize("pooling", ["last", "last_token", "cls", "mean"])
def test_shared_packing_pools_the_token_whole_packing_pools(pooling: str) -> None:
    """Each prompt's pooled row holds the token, at the position, that packing the prompts whole pools:
    with a pad id, "last" skips padding at a prompt's end (one prompt is padding after its shared prefix;
    one is padding throughout and pools its first token, as whole packing does)."""
    pad = 0
    prompts = [(1, 2, 3, 4, 0, 0), (1, 2, 3, 5), (1, 2, 3, 0), (7, 8, 0), (0, 0, 0)]
    groups = find_shared_prefixes(prompts, 2)
    assert groups == [SharedPrefix((0, 1, 2), 3)]
    cpu = torch.device("cpu")
    whole = pack(prompts, cpu, pooling, pad_id=pad)  # type: ignore[arg-type]
    shared = pack(prompts, cpu, pooling, pad_id=pad, shared=groups)  # type: ignore[arg-type]
    for packed_whole, packed_shared in (
        (whole.input_ids, shared.input_ids),
        (whole.position_ids, shared.position_ids),
    ):
        assert packed_shared[0, shared.pooled_rows].tolist() == packed_whole[0, whole.pooled_rows].tolist()
    expected_positions = {"last": [3, 3, 2, 1, 0], "last_token": [5, 3, 3, 2, 2], "cls": [0] * 5}
    if pooling in expected_positions:
        assert shared.position_ids[0, shared.pooled_rows].tolist() == expected_positions[pooling]


def test_fewer_queries_than_keys_are_the_last_positions() -> None:
    """The exact kernel with a shared prefix: queries 4..5 of a 6-key sequence, causal and windowed."""
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(h, n, 4, generator=generator) for h, n in ((4, 6), (2, 6), (2, 6)))
    for window in (None, 2):
        whole = attend_causal(q, k, v, scale=0.5, left_window=window)
        tail = attend_causal(q[:, 4:], k, v, scale=0.5, left_window=window)
        exact = exact_attention(q[:, 4:], k, v, scale=0.5, left_window=window)
        # Two float32 computations (SDPA over 2 or over 6 queries, other masks): 4-term scores, 6 keys,
        # per element (tolerances.attention_bound, implementations=2).
        bound = attention_bound(
            torch.float32, head_dim=4, keys=6, score_magnitude=exact.score, value_magnitude=exact.value,
            implementations=2,
        )  # fmt: skip
        assert_within(tail, whole[:, 4:], bound)
        assert not math.isnan(float(tail.sum()))


def test_cuda_graphs_replay_batches_with_shared_prefixes(tiny_llama_dir: Path) -> None:
    """A batch with a shared prefix is recorded and replayed like any other (its key rows and their bounds
    are buffers of the graph too), and each replay scores the batch it is given."""
    from models.graphs import Recorder

    rerun: Recorder = lambda run: run  # noqa: E731 - a recorder whose replay runs the function again
    config = ScorerConfig(
        device="cpu",
        attention="varlen",
        varlen_kernel=CpuVarlenKernelGqa(),
        graph_recorder=rerun,
        share_prefix_min_tokens=MIN_TOKENS,
    )
    scorer = Scorer(tiny_llama_dir, config)
    graphs = scorer.executor.graphs
    assert graphs is not None
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    for round_ in range(3):  # a shape is recorded at its second batch and replayed from the third
        items = tuple((5 + round_, 6, 7 + round_) for _ in range(4))  # same shape, other tokens each time
        multi = [ScoreRequest("m", query=QUERY, items=items, return_pooled_hidden_states=True)]
        for got, expected in zip(scorer.score(multi), plain.score(multi), strict=True):
            # Two float32 forwards: the chain of sums for 43-token prompts (forward_atol).
            assert_forward_close(scores_of(got), scores_of(expected), tiny_llama_dir, longest=43)
            assert_forward_close(hidden_of(got), hidden_of(expected), tiny_llama_dir, longest=43)
    assert graphs.recorded == 1 and graphs.replays == 1
    # A shape without sharing after it: its own graph, with no stale key rows in the way.
    for _ in range(3):
        (got,) = scorer.score([ScoreRequest("a", items=(OTHER,), return_pooled_hidden_states=True)])
        (expected,) = plain.score([ScoreRequest("a", items=(OTHER,), return_pooled_hidden_states=True)])
        # Two float32 forwards of a 6-token prompt (forward_atol).
        assert_forward_close(hidden_of(got), hidden_of(expected), tiny_llama_dir, longest=len(OTHER))
    assert graphs.recorded == 2 and graphs.replays == 2


def test_the_deterministic_setting_is_unchanged_by_sharing(tiny_qwen3_dir: Path) -> None:
    """`deterministic` runs every item alone, so nothing is shared: results stay bit-identical to it."""
    alone = Scorer(tiny_qwen3_dir, ScorerConfig(device="cpu", deterministic=True))
    shared = Scorer(
        tiny_qwen3_dir, ScorerConfig(device="cpu", deterministic=True, share_prefix_min_tokens=MIN_TOKENS)
    )
    for got, expected in zip(shared.score(_requests()), alone.score(_requests()), strict=True):
        # The deterministic setting's promise: the same arithmetic item by item, bit for bit.
        np.testing.assert_array_equal(scores_of(got), scores_of(expected))
        np.testing.assert_array_equal(hidden_of(got), hidden_of(expected))


def test_the_token_budget_counts_a_shared_prefix_once(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's budget counts what it computes: requests whose prompts hold more than the budget but
    compute less run as one batch (not cut into batches that each compute the query again), and give what
    the unshared engine gives in several."""
    held = sum(len(p) for p in _whole_prompts())
    computed = packed_length(_whole_prompts(), MIN_TOKENS)
    assert computed < held // 2
    budget = computed + 5
    shared = Scorer(
        tiny_llama_dir,
        ScorerConfig(device="cpu", share_prefix_min_tokens=MIN_TOKENS, max_batch_tokens=budget),
    )
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", max_batch_tokens=budget))
    assert shared.plan.tokens(_whole_prompts()) == computed and plain.plan.tokens(_whole_prompts()) == held
    batches: dict[str, list[Any]] = {"shared": [], "plain": []}
    spy = PackSpy(monkeypatch)
    ours = shared.score_prepared([shared.prepare(r) for r in _requests()], batches["shared"].append)
    assert spy.tokens == [computed]
    theirs = plain.score_prepared([plain.prepare(r) for r in _requests()], batches["plain"].append)
    (stats,) = batches["shared"]
    assert (stats.tokens, stats.packed_tokens) == (held, computed)
    assert len(batches["plain"]) > 1 and all(s.packed_tokens == s.tokens for s in batches["plain"])
    for a, b in zip(ours, theirs, strict=True):
        # Two float32 forwards of the same prompts: the chain of sums for LONGEST keys (forward_atol).
        assert_forward_close(scores_of(a), scores_of(b), tiny_llama_dir, longest=LONGEST)
        assert_forward_close(hidden_of(a), hidden_of(b), tiny_llama_dir, longest=LONGEST)


def test_the_budget_never_counts_less_than_a_share_of_what_prompts_hold(tiny_llama_dir: Path) -> None:
    """Each suffix reads its prefix's keys again: however much is shared, a batch counts at least
    1/KEYS_PER_TOKEN of the tokens it holds, which bounds the keys its layers gather."""
    from models.graphs import KEYS_PER_TOKEN

    scorer = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", share_prefix_min_tokens=MIN_TOKENS))
    prompts = [QUERY * 4 + (300 + i,) for i in range(200)]  # 160 shared tokens, one of each prompt's own
    held = sum(len(p) for p in prompts)
    assert scorer.plan.tokens(prompts) == math.ceil(held / KEYS_PER_TOKEN) > 160 + 200
    # Off, or deterministic (every item alone): what the prompts hold.
    for config in (
        ScorerConfig(device="cpu"),
        ScorerConfig(device="cpu", share_prefix_min_tokens=8, deterministic=True),
    ):
        assert Scorer(tiny_llama_dir, config).plan.tokens(prompts) == held


@pytest.mark.parametrize("architecture", ["mistral", "gemma3_text"])
def test_sliding_windows_take_two_passes_until_a_prompt_outgrows_them(
    architecture: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model with a 16-token window: a batch whose prompts all fit in it takes the two passes (the window
    cuts nothing); one prompt longer than the window, and the batch gathers every sequence's keys, so a
    suffix's window ends inside its prefix where it should. Both as the whole prompts in HF float32."""
    packs: list[Any] = []
    real = execute.pack
    monkeypatch.setattr(execute, "pack", lambda *a, **k: packs.append(real(*a, **k)) or packs[-1])
    config = ScorerConfig(
        device="cpu", attention="varlen", varlen_kernel=CpuVarlenKernelGqa(), share_prefix_min_tokens=8
    )
    scorer = Scorer(model_dirs[architecture], config)
    query = tuple(range(40, 50))
    for items, gathered in (
        (((5, 6), (7, 8, 9, 10, 11, 12)), False),
        (((5, 6), tuple(range(100, 110))), True),
    ):
        request = ScoreRequest("w", query=query, items=items, return_pooled_hidden_states=True)
        (result,) = scorer.score([request])
        assert packs[-1].cross is not None and (packs[-1].shared is not None) == gathered
        reference = hf_reference(model_dirs[architecture], [query + item for item in items])
        # The engine and HF's float32 forward: the chain of sums for the longest whole prompt.
        model, longest = model_dirs[architecture], len(query) + max(len(item) for item in items)
        assert_forward_close(scores_of(result), reference.logits, model, longest=longest)
        assert_forward_close(hidden_of(result), reference.hidden, model, longest=longest)


def test_a_batch_measured_then_launched_finds_its_groups_once(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's split measures a batch (its prompts hold more than the budget, it computes less), then
    launches it: the groups are found once for both. Equal prompts in new objects are found again."""
    calls: list[int] = []
    real = plan.find_shared_prefixes

    def counted(prompts: Any, min_tokens: int) -> Any:
        calls.append(len(prompts))
        return real(prompts, min_tokens)

    monkeypatch.setattr(plan, "find_shared_prefixes", counted)
    computed = packed_length(_whole_prompts(), MIN_TOKENS)
    config = ScorerConfig(device="cpu", share_prefix_min_tokens=MIN_TOKENS, max_batch_tokens=computed + 5)
    scorer = Scorer(tiny_llama_dir, config)
    prepared = [scorer.prepare(r) for r in _requests()]
    first = scorer.score_prepared(prepared)
    assert calls == [len(_whole_prompts())]
    again = scorer.score_prepared([scorer.prepare(r) for r in _requests()])
    assert len(calls) == 2
    for a, b in zip(first, again, strict=True):
        # The same prompts in the same batches through the same code: the same arithmetic, bit for bit.
        np.testing.assert_array_equal(scores_of(a), scores_of(b))


def test_cuda_graphs_pad_the_cross_pass_with_empty_groups(tiny_llama_dir: Path) -> None:
    """Three groups fill a graph bucketed for four: the unused group slot is an empty sequence (its bounds
    repeat the last), so it adds nothing, and each replay scores the batch it is given."""
    from models.graphs import Recorder

    rerun: Recorder = lambda run: run  # noqa: E731 - a recorder whose replay runs the function again
    kernel = CpuVarlenKernelGqa()
    config = ScorerConfig(
        device="cpu",
        attention="varlen",
        varlen_kernel=kernel,
        graph_recorder=rerun,
        share_prefix_min_tokens=8,
        # The padding is the subject here: compiled layers with shared prefixes in graphs are covered by
        # test_cuda_graphs_replay_batches_with_shared_prefixes, and compiling on the CPU took minutes.
        compile="off",
    )
    scorer = Scorer(tiny_llama_dir, config)
    graphs = scorer.executor.graphs
    assert graphs is not None
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))
    for round_ in range(3):  # recorded at the second batch, replayed at the third
        items = ((5 + round_, 6), (7, 8 + round_))
        batch = [
            ScoreRequest(f"m{q}", query=tuple(range(10 * q + 40, 10 * q + 50)), items=items) for q in range(3)
        ]
        for got, expected in zip(scorer.score(batch), plain.score(batch), strict=True):
            # Two float32 forwards of 12-token prompts (forward_atol).
            assert_forward_close(scores_of(got), scores_of(expected), tiny_llama_dir, longest=12)
    assert graphs.recorded == 1 and graphs.replays == 1
    cross_bounds = [bounds for bounds in kernel.calls if bounds[0] != 0]  # the cross passes start past row 0
    assert cross_bounds and all(len(b) == 5 and b[-1] == b[-2] for b in cross_bounds[-4:])


def test_the_engines_split_keeps_requests_sharing_a_prompt_in_one_batch(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Best-of-N requests of two prompts whose batches the budget cuts after the second prompt's second
    request: the engine leaves those two for the next batch with the third, so each prompt is computed
    once; results are those of the engine that shares nothing."""
    prompts = (tuple(range(40, 60)), tuple(range(60, 80)))  # 20 tokens each
    requests = [
        ScoreRequest(
            f"p{p}-r{r}", items=(prompts[p] + (100 + r, 101 + r, 102 + r),), return_pooled_hidden_states=True
        )
        for p in range(2)
        for r in range(3)
    ]
    config = ScorerConfig(device="cpu", share_prefix_min_tokens=MIN_TOKENS, max_batch_tokens=56)
    shared = Scorer(tiny_llama_dir, config)
    prepared = [shared.prepare(r) for r in requests]
    assert shared.plan.joins(prepared[3], prepared[4]) and not shared.plan.joins(prepared[2], prepared[3])
    assert shared.plan.tokens([p for r in prepared[:5] for p in r.prompts]) == 55  # 20 + 3 x 3, 20 + 2 x 3
    spy = PackSpy(monkeypatch)
    ours = shared.score_prepared(prepared)
    assert spy.tokens == [29, 29]  # not [55, 23]: the second prompt computed in both batches
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", max_batch_tokens=56))
    assert not plain.plan.joins(prepared[3], prepared[4])
    for a, b in zip(ours, plain.score(requests), strict=True):
        # Two float32 forwards of 23-token prompts (forward_atol).
        assert_forward_close(scores_of(a), scores_of(b), tiny_llama_dir, longest=23)
        assert_forward_close(hidden_of(a), hidden_of(b), tiny_llama_dir, longest=23)
    short = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", share_prefix_min_tokens=21))
    assert not short.plan.joins(prepared[3], prepared[4])  # 20 shared, fewer than it asks


def test_interleaved_best_of_n_is_grouped_across_one_call(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three prompts' answers interleaved (p0, p1, p2, p0, p1, ...) across a call cut into several batches:
    each prompt's answers land in one batch and its prompt is computed once, as when the answers come back
    to back; results are those of the engine that shares nothing, in request order."""
    prompts = [tuple(range(40 + 30 * p, 60 + 30 * p)) for p in range(3)]  # 20 tokens each, nothing common
    requests = [
        ScoreRequest(f"p{p}-r{r}", items=(prompts[p] + (100 + r, 101 + r),), return_pooled_hidden_states=True)
        for r in range(4)
        for p in range(3)
    ]
    budget = 20 + 4 * 2 + 1  # one prompt's four answers and a token to spare
    config = ScorerConfig(device="cpu", share_prefix_min_tokens=MIN_TOKENS, max_batch_tokens=budget)
    shared = Scorer(tiny_llama_dir, config)
    prepared = [shared.prepare(r) for r in requests]
    order = plan.order_of_places(shared.plan.grouped_places(prepared))
    assert order == [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]  # each group where its first request came
    spy = PackSpy(monkeypatch)
    ours = shared.score_prepared(prepared)
    assert spy.tokens == [28, 28, 28]  # each prompt once: 20 + 4 x 2; in arrival order every batch holds 2-3
    plain = Scorer(tiny_llama_dir, ScorerConfig(device="cpu", max_batch_tokens=budget))
    for request, a, b in zip(requests, ours, plain.score(requests), strict=True):
        assert a.request_id == b.request_id == request.request_id
        # Two float32 forwards of 22-token prompts (forward_atol).
        assert_forward_close(scores_of(a), scores_of(b), tiny_llama_dir, longest=22)
        assert_forward_close(hidden_of(a), hidden_of(b), tiny_llama_dir, longest=22)


def test_grouping_keeps_arrival_order_where_nothing_is_shared_and_keys_apart() -> None:
    """Requests sharing nothing keep their order (a workload without shared prompts runs as it came);
    the same prompt under two keys (two LoRA adapters) is not one group; a group spans requests that
    share only through their neighbours in sorted order (a, ab, abc)."""
    grouping = plan.BatchPlan(share_prefix_min_tokens=4)

    def request(prompt: tuple[int, ...]) -> Any:
        from models.prepare import PreparedRequest

        return PreparedRequest(ScoreRequest("r", items=(prompt,)), prompts=(prompt,), tokenize_s=0.0)

    alone = [request(tuple(range(10 * i, 10 * i + 8))) for i in (5, 1, 3, 2, 4)]
    assert plan.order_of_places(grouping.grouped_places(alone)) == [0, 1, 2, 3, 4]
    same = (1, 2, 3, 4, 5, 6)
    keyed = [request((*same, 9)), request((50, 51, 52, 53, 54)), request((*same, 8)), request((*same, 7))]
    assert plan.order_of_places(grouping.grouped_places(keyed, keys=[0, -1, 1, 0])) == [0, 3, 1, 2]
    assert plan.order_of_places(grouping.grouped_places(keyed)) == [0, 2, 3, 1]
    assert plan.order_of_places(plan.BatchPlan().grouped_places(keyed)) == [
        0,
        1,
        2,
        3,
    ]  # no sharing: arrival order
    # The plan's own key (an engine serving adapters) keeps them apart as the keys given do.
    by_key = plan.BatchPlan(
        share_prefix_min_tokens=4, key=lambda p: {9: 0, 8: 1, 7: 0}.get(p.prompts[0][-1], -1)
    )
    assert plan.order_of_places(by_key.grouped_places(keyed)) == [0, 3, 1, 2]
    assert not by_key.joins(keyed[0], keyed[2]) and by_key.joins(keyed[0], keyed[3])


def test_grouping_moves_a_request_ahead_only_within_its_reach_of_the_oldest() -> None:
    """With arrival numbers and a reach, a request joins its group's place only if it arrived at most
    `reach` after the oldest request given; later ones keep their place (and the order stays a
    permutation). So a request that shares nothing is overtaken by at most `reach` later requests."""
    grouping = plan.BatchPlan(share_prefix_min_tokens=4)
    shared = (1, 2, 3, 4, 5, 6)

    def request(prompt: tuple[int, ...]) -> Any:
        from models.prepare import PreparedRequest

        return PreparedRequest(ScoreRequest("r", items=(prompt,)), prompts=(prompt,), tokenize_s=0.0)

    # 0 shares, 1 shares nothing, 2..6 share with 0.
    stream = [request((*shared, 100)), request((50, 51, 52, 53)), *(request((*shared, n)) for n in range(5))]
    assert plan.order_of_places(grouping.grouped_places(stream)) == [0, 2, 3, 4, 5, 6, 1]
    arrivals = [10, 11, 12, 13, 14, 15, 16]
    places = grouping.grouped_places(stream, arrivals=arrivals, reach=3)
    assert plan.order_of_places(places) == [0, 2, 3, 1, 4, 5, 6]
    for reach in range(8):
        order = plan.order_of_places(grouping.grouped_places(stream, arrivals=arrivals, reach=reach))
        assert sorted(order) == list(range(7))
        overtaking = [k for k in order[: order.index(1)] if arrivals[k] > arrivals[1]]
        assert len(overtaking) <= reach

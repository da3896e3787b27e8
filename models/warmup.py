"""Start-up warm-up: every variant of the compiled layers a batch can meet, compiled before the first request.

The decoder layers run under torch.compile with dynamic sizes (models.layers.CompiledLayers): batches of any
token count or item count reuse one graph. A few things still give the layers a graph of their own, traced
and compiled the first time a batch shows them, and on the GPU that takes seconds (7.5 s for Qwen3-0.6B
shapes on an H200) during which the model thread scores nothing:
- which side of the attention kernel's length switch the batch's longest sequence lies on (the Triton
  kernel takes long sequences, flash short ones: models.triton_attention.takes), for each attention pass;
- a batch of one token, or of one-token sequences (torch.compile specializes a size or a length of 1);
- shared prefixes (the cross pass and its own lengths), and gathered keys where a sliding window is shorter
  than the prompts;
- LoRA adapters (their adapted projections, models/adapters.py): each variant above again with an adapter;
- the prefix cache (models/prefix_cache.py): a batch that fills it or reads from it breaks the layers' graphs
  around the cache's traffic, and the pieces are graphs of their own.
A worker that met them in traffic stalled on them: one such batch in the middle of a run at half of its
capacity queued the requests behind it for seconds (docs/benchmarks.md). So before it is ready the worker
scores one small synthetic batch of each variant its settings allow, each twice where CUDA graphs are on
(the second sight of a shape records its graph, which reaches the layers through the graphs' own buffers).

Where CUDA graphs are on, it then records the graph of every small batch one request of a few items can make
(models.graphs.small_batch_keys: about two per token bucket up to 2,048 tokens, 56 in all), so that a worker
at low load replays a graph from its first request rather than running the host-bound ordinary forward
until each shape has come twice.

Where a prefix cache is set, every variant is then scored twice more through a scratch cache that keeps each
block at its first sight (filling it, then reading from it), and once beside a request that shares a prefix
with neither: the worker's own cache starts empty, and knows nothing of the synthetic prompts.

On a CUDA device it then scores one batch at the full token budget: the allocator reserves that memory now,
and a budget the GPU cannot hold fails here rather than on the first large batch.

A scorer with nothing compiled and no graphs (the CPU's exact path) has nothing to warm up; its first batch
costs what every later one does.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from models.errors import ModelLoadError
from models.graphs import length_switch
from models.layers import traced_graphs
from models.prefix_cache import PrefixCache
from models.prepare import PreparedRequest
from models.selfcheck import judge_labels
from schemas import ScoreRequest

if TYPE_CHECKING:
    from models.engine import Scorer
    from schemas import ScoreResult

    Prepared = PreparedRequest | ScoreResult  # what Scorer.prepare returns

SHORT = 16  # tokens of a short item: flash's side of the length switch for every kernel
# The long side: twice the switch of the Triton kernel (models.triton_attention.MIN_LENGTH), read when the
# warm-up runs. Lengths past the switch all take the same graph, so one is enough.
LONG_OVER_SWITCH = 2
# The scratch prefix cache's blocks: small, so that short prompts read from it too (the layers' graphs do not
# depend on the block size). OTHER: the offset of a request's ids that begins none of its prompts alike with
# those of offset 0 (queries from the 0th and 3rd ids, items from the 7th, 14th, ... and 10th, 17th, ...).
SCRATCH_BLOCK = 4
OTHER = 3
FULL_BUDGET_ITEM = 512  # ids of each item of the full-budget batch: W2's and W1's items are of this order


@dataclass(frozen=True)
class WarmUpReport:
    """What the warm-up ran: batches (the repeats for graphs included), tokens in them, graphs torch.compile
    traced while it ran (0 where the layers are not compiled, or were warm already), CUDA graphs recorded
    (those of small batches recorded ahead included, and counted in `ahead_graphs` too), and how long it
    took."""

    batches: int
    tokens: int
    compiled_graphs: int
    cuda_graphs: int
    seconds: float
    ahead_graphs: int = 0


def warm_up(scorer: Scorer) -> WarmUpReport:
    """Score the synthetic batches (see the module's docstring); ModelLoadError when one of them fails: a
    model that cannot score them would fail the same requests in traffic. The worker's prefix cache is left
    out: the second sight of a kind would fill it, and that kind's CUDA graph would go unrecorded."""
    cache = scorer.executor.prefix_cache
    with scorer.executor.prefix_cache_paused():
        return _warm_up(scorer, cache)


def _warm_up(scorer: Scorer, cache: PrefixCache | None) -> WarmUpReport:
    started = time.perf_counter()
    graphs_before = traced_graphs()
    recorded_before = scorer.executor.graphs.recorded if scorer.executor.graphs is not None else 0
    batches = tokens = 0
    extra = _template_tokens(scorer)
    if scorer.executor.compiled or scorer.executor.graphs is not None:
        repeats = 2 if scorer.executor.graphs is not None else 1
        # One adapter stands for all: they share the variant (their factors are its inputs).
        adapters = (None, *scorer.prompt_builder.adapters[:1])
        kinds = [
            (name if adapter is None else f"{name}, adapter {adapter}", lengths, query, adapter)
            for (name, lengths, query), adapter in itertools.product(_variants(scorer, extra), adapters)
        ]
        for name, lengths, query, adapter in kinds:
            request = _request(scorer, name, lengths, query, adapter)
            for _ in range(repeats):
                tokens += _score(scorer, name, [scorer.prepare(request)])
                batches += 1
        if cache is not None and scorer.executor.compiled:
            # The worker's cache's size: its pools are held through the full-budget batch below, as the
            # worker's own will be once it keeps a block.
            scratch = PrefixCache(SCRATCH_BLOCK, cache.max_bytes, admit_first_sight=True)
            with scorer.executor.prefix_cache_paused(scratch):
                for name, lengths, query, adapter in kinds:
                    scratch.clear()  # the variants' prompts begin alike: each fills an empty cache first
                    request = _request(scorer, name, lengths, query, adapter)
                    named = f"{name}, through the prefix cache"
                    for prepared in ([scorer.prepare(request)], [scorer.prepare(request)]):
                        tokens += _score(scorer, named, prepared)  # filling the cache, then reading it
                    # Beside a request of its own prefix: a prompt with cached rows joins no group, the
                    # other's prompts still share theirs (or run alone), in one batch.
                    other = _request(scorer, f"{name}, unseen", lengths, query, adapter, offset=OTHER)
                    tokens += _score(scorer, named, [scorer.prepare(request), scorer.prepare(other)])
                    batches += 3
    ahead = scorer.executor.record_small_batch_graphs(scorer.config.max_batch_tokens)
    if scorer.device.type == "cuda":
        tokens += _score(scorer, "full token budget", _full_budget(scorer, extra))
        batches += 1
    return WarmUpReport(
        batches=batches,
        tokens=tokens,
        compiled_graphs=traced_graphs() - graphs_before,
        cuda_graphs=(scorer.executor.graphs.recorded if scorer.executor.graphs is not None else 0)
        - recorded_before,
        seconds=time.perf_counter() - started,
        ahead_graphs=ahead,
    )


Variant = tuple[str, tuple[int, ...], int]  # a name, the items' lengths, the length of a query they share


def _variants(scorer: Scorer, extra: int) -> list[Variant]:
    """The batches that show the layers each variant (each a single request, so a single batch), no two
    alike; a prompt holds `extra` tokens besides its ids."""
    limit = _room(scorer, extra)
    short = min(SHORT, limit)
    long = min(limit, LONG_OVER_SWITCH * length_switch())
    variants: list[Variant] = [("one token", (1,), 0), ("one-token items", (1, 1), 0)]
    variants.append(("short items", (short, max(1, short - 3)), 0))
    if long > short:
        variants.append(("a long item", (short, long), 0))
    if scorer.plan.shares_prefixes:
        prefix = scorer.config.share_prefix_min_tokens
        window = scorer.executor.sliding_window
        # Prompts no longer than a sliding window take the cross pass in every layer; longer ones gather
        # each suffix's keys in the windowed layers (the others still take the cross pass).
        within = limit if window is None else min(limit, window - extra)
        variants += _shared_prefix_variants(prefix, within, "")
        if window is not None:
            variants += _shared_prefix_variants(max(prefix, window + 1 - extra), limit, " past the window")
    unique: dict[tuple[tuple[int, ...], int], Variant] = {}
    for variant in variants:
        unique.setdefault(variant[1:], variant)
    return list(unique.values())


def _shared_prefix_variants(prefix: int, room: int, where: str) -> list[Variant]:
    """Requests whose items share a query of `prefix` tokens, no prompt over `room` ids. Each attention pass
    routes by its own longest sequence (the prompts' own pass: the prefix or a suffix; the cross pass: the
    suffixes), and a pass whose longest is one token is a variant of its own."""
    if prefix + 1 > room:
        return []
    switch = length_switch()
    short = min(SHORT, room - prefix)
    variants: list[Variant] = [
        (f"a shared prefix{where}, one-token suffixes", (1, 1), prefix),
        (f"a shared prefix{where}, short suffixes", (1, short), prefix),
    ]
    long_prefix = min(room - short, LONG_OVER_SWITCH * switch)
    if long_prefix > max(prefix, switch):
        variants.append((f"a long shared prefix{where}, short suffixes", (1, short), long_prefix))
    long_suffix = min(room - prefix, LONG_OVER_SWITCH * switch)
    if long_suffix > switch:
        variants.append((f"a shared prefix{where}, long suffixes", (short, long_suffix), prefix))
    return variants


def _room(scorer: Scorer, extra: int) -> int:
    """The most ids a prompt's query and item may hold together: the scorer's limit on a prompt and the
    token budget, less `extra` tokens of a template (at least 1: a model that takes no id scores nothing)."""
    return max(1, min(scorer.max_input_tokens, scorer.config.max_batch_tokens) - extra)


def _template_tokens(scorer: Scorer) -> int:
    """Tokens a prompt holds besides its query's and item's ids (a template's, special tokens)."""
    prepared = scorer.prepare(_request(scorer, "template", (1,), 1))
    return max(0, prepared.num_tokens - 2) if isinstance(prepared, PreparedRequest) else 0


def _ids(scorer: Scorer, count: int, offset: int) -> tuple[int, ...]:
    """`count` valid token ids, never the pad id; different offsets give different ids (so that items of a
    request share no prefix the engine would compute once)."""
    vocab, pad = scorer.vocab_size, scorer.pad_token_id
    low = min(4, vocab - 1)  # past the special tokens most vocabularies start with
    span = max(1, vocab - low)
    ids = [low + (offset + i) % span for i in range(count)]
    return tuple(low + (token - low + 1) % span if token == pad else token for token in ids)


def _request(
    scorer: Scorer,
    name: str,
    lengths: Sequence[int],
    query: int,
    adapter: str | None = None,
    offset: int = 0,
) -> ScoreRequest:
    """A request of `lengths` items behind a query of `query` ids (none for 0); requests of another `offset`
    begin with other ids."""
    return ScoreRequest(
        request_id=f"warm-up {name}",
        query=_ids(scorer, query, offset) if query else None,
        items=tuple(_ids(scorer, length, offset + 7 * (n + 1)) for n, length in enumerate(lengths)),
        return_pooled_hidden_states=True,
        label_token_ids=judge_labels(scorer),
        adapter=adapter,
    )


def _full_budget(scorer: Scorer, extra: int) -> list[Prepared]:
    """Requests of one item each, prepared, that together fill the token budget (within an item's length)."""
    budget = scorer.config.max_batch_tokens
    length = min(_room(scorer, extra), FULL_BUDGET_ITEM)
    requests: list[Prepared] = []
    held = 0
    for n in itertools.count():
        prepared = scorer.prepare(_request(scorer, f"full budget {n}", (length,), 0))
        size = prepared.num_tokens if isinstance(prepared, PreparedRequest) else length
        if held + size > budget:
            break
        requests.append(prepared)
        held += size
    return requests or [scorer.prepare(_request(scorer, "full budget", (1,), 0))]


def _score(scorer: Scorer, name: str, prepared: list[Prepared]) -> int:
    """Score prepared requests (one batch); the tokens they held. ModelLoadError on any error result."""
    tokens = sum(p.num_tokens for p in prepared if isinstance(p, PreparedRequest))
    for result in scorer.score_prepared(prepared):
        if not result.ok:
            error = result.error
            detail = f"{error.code}: {error.message}" if error is not None else "no scores"
            raise ModelLoadError(f"warm-up: the batch of {name} failed ({detail})")
    return tokens


def describe(report: WarmUpReport) -> str:
    """One line for the log."""
    if not report.batches:
        return "nothing to warm up: no compiled layers, no CUDA graphs, not a GPU"
    ahead = f" ({report.ahead_graphs} of them ahead, for small batches)" if report.ahead_graphs else ""
    return (
        f"warmed up in {report.seconds:.2f} s: {report.batches} batches of {report.tokens} tokens, "
        f"{report.compiled_graphs} layer graphs compiled, {report.cuda_graphs} CUDA graphs recorded{ahead}"
    )


__all__ = ["WarmUpReport", "describe", "warm_up"]

"""The check of every architecture against HuggingFace float32 that tests/gpu/test_architectures.py runs (on
the GPU, and on the CPU with the exact reference attention), on small local models.

For each model (every tiny architecture of models.write_tiny_model, plus a llama with 4:1 grouped-query
attention and head_dim 128) and each dtype, one mixed batch (single items of 1..N tokens, multi-item requests
with a query, item_first, text items, mixed hidden-state flags and dtypes, apply_softmax, one invalid
request) is scored in several packs, compared with per-prompt HF float32 forwards, and with the same
requests scored one at a time. An error is accepted when it is within twice HF's own error in that dtype plus
a small floor. The Scorer runs with the worker's defaults: compiled decoder layers, and CUDA graphs replaying
the packs (a varlen check fails when none was replayed).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from bench.common import relative_errors
from models.loading import ENCODER_MODEL_TYPES as ENCODERS

Attention = Literal["auto", "varlen", "reference"]
# float32 with varlen may be refused at start (flash kernels are half precision only) but must not fail later;
# float32 with "auto" must work on the GPU, through whatever exact path the engine falls back to.
GPU_RUNS: tuple[tuple[str, Attention], ...] = (
    ("bfloat16", "varlen"),
    ("float16", "varlen"),
    ("float32", "varlen"),
    ("float32", "auto"),
    # The path a worker takes by default: varlen, or the exact path for a model whose attention the varlen
    # kernel cannot compute (Gemma 2's soft-capped logits).
    ("bfloat16", "auto"),
)
# Floors for (score error / score scale, hidden relative error): rounding of the dtype over a few layers.
FLOORS = {"bfloat16": (2e-2, 1e-2), "float16": (3e-3, 2e-3), "float32": (1e-4, 1e-4)}
HIDDEN_DTYPES = ("float32", "float16", "bfloat16")
# Relative rounding of a vector stored in a narrower dtype (unit roundoff 2^-11 and 2^-8, with margin).
NARROW_ROUNDING = {"float16": 1e-3, "bfloat16": 8e-3}
MAX_BATCH_TOKENS = 700  # small, so the mixed batch is cut into several packs
# The label tokens every request to a judge (a causal LM, Gemma 4's text model among them) is scored on.
JUDGE_LABELS = (40, 7, 300)
GQA_MODEL = "llama-gqa4-d128-3labels"


@dataclass
class Outcome:
    """One model x dtype check."""

    model: str
    dtype: str
    attention: str
    failures: list[str] = field(default_factory=list)
    numbers: dict[str, float | str] = field(default_factory=dict)

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)


def write_models(root: Path) -> dict[str, Path]:
    """The tiny models of every supported architecture, plus one with realistic head size and 4:1 GQA."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from bench.packed_path import attach_tokenizer
    from models import write_tiny_model
    from models.tiny import ARCHITECTURES

    dirs: dict[str, Path] = {}
    for arch in ARCHITECTURES:
        dirs[arch] = root / arch
        write_tiny_model(dirs[arch], architecture=arch, seed=1, num_labels=1)
    shapes: dict[str, Any] = {
        "hidden_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "intermediate_size": 1024,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "num_labels": 3,
        "pad_token_id": 0,
    }
    torch.manual_seed(2)
    dirs[GQA_MODEL] = root / "llama-gqa"
    model = LlamaForSequenceClassification(LlamaConfig(**shapes))  # type: ignore[no-untyped-call]
    model.save_pretrained(dirs[GQA_MODEL])
    attach_tokenizer(dirs[GQA_MODEL])
    return dirs


def make_requests(max_tokens: int, vocab: int, seed: int, labels: tuple[int, ...] | None = None) -> list[Any]:
    """A mixed batch; request i asks for hidden states unless i % 4 == 3, cycling the hidden dtypes; each
    scored on the label tokens `labels` where given (a judge)."""
    from schemas import HiddenDType, ScoreRequest

    rng = random.Random(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(4, vocab) for _ in range(n))

    lengths = [1, 2, 17, 64, 255, max_tokens // 2, max_tokens]
    specs: list[dict[str, Any]] = [{"items": (ids(n),)} for n in lengths]
    specs += [
        {"query": ids(20), "items": tuple(ids(rng.randrange(1, 40)) for _ in range(3))},
        {"query": ids(9), "items": (ids(30), ids(1)), "item_first": True},
        {"items": ("a reward model reads a prompt", "the quick brown fox"), "query": "Is this correct?"},
        {"items": (ids(33),), "apply_softmax": True},
        {"items": (ids(12), ids(50))},
    ]
    requests = []
    for i, spec in enumerate(specs):
        dtype = HiddenDType(HIDDEN_DTYPES[i % 3])
        if labels is not None:
            spec["label_token_ids"] = labels
        requests.append(
            ScoreRequest(
                request_id=f"c{i}", return_pooled_hidden_states=i % 4 != 3, hidden_states_dtype=dtype, **spec
            )
        )
    return requests


@torch.inference_mode()
def hf_per_prompt(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    token_types: Sequence[Sequence[int]] | None = None,
    labels: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Logits [n, labels] and the final hidden state at the pooled token [n, H], one prompt per forward:
    the last token for decoders, the first (CLS) for encoders, whose segment ids come in `token_types`; a
    judge's logits are its last token's at the label tokens `labels`."""
    scores, hidden = [], []
    device = next(model.parameters()).device
    encoder = not getattr(model.config, "is_decoder", False) and model.config.model_type in ENCODERS
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)], device=device)
        extra = {}
        if token_types is not None:
            extra["token_type_ids"] = torch.tensor([list(token_types[index])], device=device)
        out = model(input_ids=ids, output_hidden_states=True, **extra)
        logits = out.logits[0] if labels is None else out.logits[0, -1, list(labels)]
        scores.append(logits.float().cpu().numpy())
        states = out.hidden_states[-1][0]  # [L, H]
        if getattr(model.config, "classifier_pooling", None) == "mean":  # ModernBERT may pool the mean
            pooled = states.float().mean(0)
        else:
            pooled = states[0 if encoder else -1].float()
        hidden.append(pooled.cpu().numpy())
    return np.stack(scores), np.stack(hidden)


def load_hf(model_dir: Path, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from models.loading import is_judge, packable, read_config

    # HF's SDPA path has no logit soft-capping (Gemma 2 refuses it) and DeBERTa has only its own attention:
    # those run eager attention.
    config = read_config(model_dir)
    eager = config.get("attn_logit_softcapping") is not None or not packable(config["model_type"])
    auto: Any = AutoModelForCausalLM if is_judge(config) else AutoModelForSequenceClassification
    model: torch.nn.Module = auto.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="eager" if eager else "sdpa"
    )
    return model.to(device).eval()


def flatten(results: Sequence[Any], prepared: Sequence[Any]) -> dict[str, Any]:
    """Per-prompt packed scores and (where asked) hidden states, with the dtype each was returned in."""
    scores, hidden, rows = [], [], []
    for result, prep in zip(results, prepared, strict=True):
        if not hasattr(prep, "prompts"):
            continue
        for item, score in enumerate(result.scores):
            scores.append(np.asarray(score, dtype=np.float64))
            if result.pooled_hidden_states is not None:
                tensor = result.pooled_hidden_states[item]
                hidden.append((len(scores) - 1, tensor.dtype, tensor.shape, tensor.to_numpy()))
            rows.append((prep.request, item))
    return {"scores": np.stack(scores), "hidden": hidden, "rows": rows}


def check_results(
    outcome: Outcome, requests: Sequence[Any], results: Sequence[Any], hidden_size: int
) -> None:
    """Statuses, result order, and that hidden states come exactly where asked, in the asked dtype."""
    outcome.expect(len(results) == len(requests), f"{len(results)} results for {len(requests)} requests")
    for request, result in zip(requests, results, strict=False):
        outcome.expect(
            result.request_id == request.request_id, f"order: {result.request_id} at {request.request_id}"
        )
        if request.request_id == "bad":
            outcome.expect(result.status.value == "error", "out-of-range token id was not refused")
            continue
        outcome.expect(result.status.value == "ok", f"{request.request_id}: {result.error}")
        if result.status.value != "ok":
            continue
        asked = request.return_pooled_hidden_states
        got = result.pooled_hidden_states
        outcome.expect(
            (got is not None) == asked, f"{request.request_id}: hidden asked={asked} got={got is not None}"
        )
        for tensor in got or ():
            outcome.expect(tensor.dtype == request.hidden_states_dtype.value, f"hidden dtype {tensor.dtype}")
            outcome.expect(tuple(tensor.shape) == (hidden_size,), f"hidden shape {tensor.shape}")


def expected_scores(logits: np.ndarray, rows: Sequence[tuple[Any, int]]) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for i, (request, _) in enumerate(rows):
        if request.apply_softmax:
            shifted = np.exp(out[i] - out[i].max())
            out[i] = shifted / shifted.sum()
    return out


def compare_to_reference(
    outcome: Outcome,
    packed: dict[str, Any],
    ref: tuple[np.ndarray, np.ndarray],
    same: tuple[np.ndarray, np.ndarray],
) -> None:
    """Packed error vs float32, accepted within 2x HF's own error in the same dtype plus a floor."""
    rows = packed["rows"]
    ref_scores, same_scores = expected_scores(ref[0], rows), expected_scores(same[0], rows)
    scale = max(1.0, float(np.abs(ref_scores).max()))
    score_err = float(np.abs(packed["scores"] - ref_scores).max()) / scale
    hf_score_err = float(np.abs(same_scores - ref_scores).max()) / scale
    floor_s, floor_h = FLOORS[outcome.dtype]
    outcome.numbers.update(score_err=score_err, hf_score_err=hf_score_err)
    outcome.expect(
        score_err <= 2 * hf_score_err + floor_s, f"score err {score_err:.2e} vs HF {hf_score_err:.2e}"
    )
    hf_index = [i for i, *_ in packed["hidden"]]
    outcome.numbers["hf_hidden_err"] = float(relative_errors(same[1][hf_index], ref[1][hf_index]).max())
    for returned in HIDDEN_DTYPES:  # each returned dtype separately: a narrow one adds its own rounding
        index = [i for i, dtype, *_ in packed["hidden"] if dtype == returned]
        if not index:
            continue
        values = np.stack([h for _, dtype, _, h in packed["hidden"] if dtype == returned])
        err = float(relative_errors(values, ref[1][index]).max())
        hf_err = float(relative_errors(same[1][index], ref[1][index]).max())
        outcome.numbers[f"hidden_err_{returned}"] = err
        limit = 2 * hf_err + floor_h + NARROW_ROUNDING.get(returned, 0.0)
        outcome.expect(err <= limit, f"hidden ({returned}) err {err:.2e} vs HF {hf_err:.2e}")


def varlen_kernel_names(scorer: Any, requests: Sequence[Any]) -> list[str]:
    """CUDA kernels with flash/varlen/attention in their names during one score call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        scorer.score(requests)
        torch.cuda.synchronize()
    names = {evt.key for evt in prof.key_averages()}
    return sorted(n for n in names if any(s in n.lower() for s in ("flash", "varlen", "fmha", "attention")))


@dataclass(frozen=True)
class Case:
    """One model's inputs and float32 reference, shared by its dtype checks."""

    name: str
    model_dir: Path
    requests: list[Any]
    prompts: list[tuple[int, ...]]  # every valid request's prompts, in order
    token_types: list[tuple[int, ...]] | None  # their segment ids, for encoders that embed them
    reference: tuple[np.ndarray, np.ndarray]  # HF float32 (scores, hidden) per prompt
    device: str  # "cuda"; "cpu" on the exact reference path
    labels: tuple[int, ...] | None = None  # a judge's label tokens


def check_one(
    case: Case, dtype: str, attention: Attention, same_model: torch.nn.Module, kernel: str = "auto"
) -> Outcome:
    """Score the mixed batch with the Scorer in `dtype`, `attention` and attention `kernel` (ScorerConfig's
    attention_kernel) and check it from every side."""
    from models import ModelLoadError, Scorer, ScorerConfig

    outcome = Outcome(model=case.name, dtype=dtype, attention=attention)
    config = ScorerConfig(
        device=case.device,
        dtype=dtype,
        attention=attention,
        max_batch_tokens=MAX_BATCH_TOKENS,
        attention_kernel=kernel,
    )
    try:
        scorer = Scorer(str(case.model_dir), config)
    except ModelLoadError as exc:
        # Flash kernels have no float32 and no logit soft-capping: refusing those at start is right.
        if attention == "varlen" and (dtype == "float32" or "caps attention logits" in str(exc)):
            outcome.numbers["refused_at_start"] = str(exc)
            return outcome
        raise
    requests = case.requests
    prepared = [scorer.prepare(r) for r in requests]
    results = scorer.score(requests)
    check_results(outcome, requests, results, scorer.hidden_size)
    if outcome.failures:
        return outcome
    packed = flatten(results, prepared)
    same = hf_per_prompt(same_model, case.prompts, case.token_types, case.labels)
    compare_to_reference(outcome, packed, case.reference, same)
    # Batch invariance: each request alone (one pack) against the same request inside the mixed batch.
    alone = flatten([scorer.score([r])[0] for r in requests], prepared)
    drift = float(np.abs(alone["scores"] - packed["scores"]).max())
    outcome.numbers["batch_drift"] = drift
    # With the deterministic setting there must be none at all, scores and hidden states bit for bit.
    exact = Scorer(str(case.model_dir), ScorerConfig(**{**config.__dict__, "deterministic": True}))
    mixed = flatten(exact.score(list(reversed(requests)))[::-1], prepared)
    single = flatten([exact.score([r])[0] for r in requests], prepared)
    identical = np.array_equal(mixed["scores"], single["scores"]) and all(
        np.array_equal(a[3], b[3]) for a, b in zip(mixed["hidden"], single["hidden"], strict=True)
    )
    outcome.numbers["deterministic_identical"] = str(identical)
    rows = exact.executor.row_tiles
    outcome.numbers["deterministic_form"] = "every item alone" if rows is None else f"tiles of {rows} rows"
    outcome.expect(identical, "deterministic results changed with the batch")
    outcome.expect(
        drift <= FLOORS[dtype][0] * max(1.0, float(np.abs(packed["scores"]).max())), f"drift {drift:.2e}"
    )
    outcome.numbers["path"] = scorer.attention  # a model that cannot run packed takes the plain path
    if scorer.attention != "varlen":
        return outcome
    # Every pack here is under graph_max_tokens; a shape is recorded at its second batch and replayed from
    # its third, which must give the batch's own results again.
    graphs = scorer.executor.graphs
    if case.device == "cuda":
        first = flatten(scorer.score(requests[:3]), prepared[:3])
        for _ in range(2):
            again = flatten(scorer.score(requests[:3]), prepared[:3])
        replay_drift = float(np.abs(again["scores"] - first["scores"]).max())
        outcome.numbers["replay_drift"] = replay_drift
        outcome.expect(
            replay_drift <= FLOORS[dtype][0] * max(1.0, float(np.abs(first["scores"]).max())),
            f"replay drift {replay_drift:.2e}",
        )
        outcome.numbers["graphs"] = "none" if graphs is None else f"{graphs.recorded}rec/{graphs.replays}rep"
        # Hybrids (Gated DeltaNet layers) run without graphs, as their start-up log says.
        hybrid = scorer.executor.linear_layers is not None
        outcome.expect(
            hybrid or (graphs is not None and graphs.enabled and graphs.replays > 0),
            "no CUDA graph was replayed",
        )
        if hybrid:
            outcome.numbers["linear_kernel"] = scorer.executor.linear_layers.kernel
    kernels = varlen_kernel_names(scorer, requests[:3])
    outcome.numbers["attention_kernels"] = len(kernels)
    outcome.expect(
        any("flash" in k.lower() or "varlen" in k.lower() for k in kernels), f"no varlen kernel: {kernels}"
    )
    return outcome


def check_model(
    name: str,
    model_dir: Path,
    device: str,
    runs: Sequence[tuple[str, Attention]],
    kernel: str = "auto",
) -> list[Outcome]:
    """float32 HF reference once per model, then every dtype of the packed path against it, the varlen runs
    through attention `kernel`."""
    from models import Scorer, ScorerConfig
    from models.loading import is_judge, read_config
    from schemas import ScoreRequest

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference must be float32, not TF32

    labels = JUDGE_LABELS if is_judge(read_config(model_dir)) else None
    probe = Scorer(str(model_dir), ScorerConfig(device=device, dtype="float32", attention="reference"))
    # Room for an encoder's template tokens ([CLS] q [SEP] i [SEP]) around the longest generated prompt.
    requests = make_requests(min(probe.max_input_tokens, MAX_BATCH_TOKENS) - 8, 512, seed=7, labels=labels)
    prepared = [probe.prepare(r) for r in requests]
    prompts = [p for r in prepared for p in r.prompts]  # type: ignore[union-attr]
    types = [t for r in prepared for t in (r.token_types or ())]  # type: ignore[union-attr]
    del probe
    # An out-of-range token id among valid requests: refused alone, without disturbing its batch.
    requests.insert(4, ScoreRequest(request_id="bad", items=((1, 2, 10**6),), label_token_ids=labels))
    reference = load_hf(model_dir, torch.float32, device)
    case = Case(
        name,
        model_dir,
        requests,
        prompts,
        types or None,
        hf_per_prompt(reference, prompts, types or None, labels),
        device,
        labels,
    )
    del reference
    outcomes = []
    for dtype, attention in runs:
        same_model = load_hf(model_dir, getattr(torch, dtype), device)
        try:
            outcomes.append(check_one(case, dtype, attention, same_model, kernel))
        except Exception as exc:  # a kernel refusing a dtype is a result to report, not a crash of the check
            failure = f"raised {type(exc).__name__}: {exc}"
            outcomes.append(Outcome(model=name, dtype=dtype, attention=attention, failures=[failure]))
        del same_model
        if device == "cuda":
            torch.cuda.empty_cache()
    return outcomes

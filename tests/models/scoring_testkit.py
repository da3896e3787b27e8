"""Engine test helpers: a float32 HuggingFace reference and CPU stand-ins for the varlen GPU kernel."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tolerances import assert_forward_close as assert_forward_close
from tolerances import assert_scored_alike as assert_scored_alike
from tolerances import cosine_gap, forward_bound
from tolerances import forward_atol as forward_atol
from tolerances import forward_length as forward_length
from tolerances import forward_sums as forward_sums
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from models.attention import attend_causal


def self_check_atol(model_dir: str | Path, report: Any, *, mean_pooled: bool = False) -> float:
    """forward_bound for the start-up self-check's comparison (models.selfcheck: its fixed prompts of at
    most max(_LENGTHS) token ids, plus at most three template tokens of an encoder, packed and through HF's
    plain forward, both float32), at the report's score scale (the largest |score|, at least 1)."""
    from models.selfcheck import _LENGTHS

    length = forward_length(model_dir, max(_LENGTHS) + 3, mean_pooled=mean_pooled)
    return forward_bound(torch.float32, length=length, magnitude=report.score_scale)


def self_check_cosine_floor(scorer: Any, model_dir: str | Path) -> float:
    """The least cosine two float32 computations of the self-check's pooled states can have: each element
    within forward_bound at the states' scale (at least 1), so 1 - cos <= r^2 with r = sqrt(H) times that
    over the smallest state's norm (tolerances.cosine_gap); the states are the packed path's, scored here
    on the check's own fixed prompts."""
    from models.selfcheck import _LENGTHS, _fixed_prompts
    from schemas import ScoreRequest

    labels = (4,) if scorer.model.judge else None  # a judge's states are read with any label token
    request = ScoreRequest(
        "floor", items=tuple(_fixed_prompts(scorer)), return_pooled_hidden_states=True, label_token_ids=labels
    )
    hidden = hidden_of(scorer.score([request])[0]).astype(np.float64)
    mean = scorer.pooling == "mean"
    length = forward_length(model_dir, max(_LENGTHS) + 3, mean_pooled=mean)
    elementwise = forward_bound(torch.float32, length=length, magnitude=max(1.0, float(np.abs(hidden).max())))
    norm = float(np.linalg.norm(hidden, axis=1).min())
    return 1.0 - float(cosine_gap(elementwise, hidden.shape[1], norm))


@dataclass(frozen=True)
class Reference:
    """HF's outputs for prompts: pooled logits [N, L] and hidden_states[-1] at the last token [N, H]."""

    logits: np.ndarray
    hidden: np.ndarray


def load_reference_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """HF's model with eager attention: plain matmuls, independent of the SDPA and varlen paths under test."""
    return AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), attn_implementation="eager", dtype=dtype
    ).eval()


@functools.cache
def _reference_model(model_dir: str, dtype: torch.dtype = torch.float32) -> Any:
    return load_reference_model(model_dir, dtype)


@functools.cache
def tokenizer(model_dir: str | Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir))


def tokenize(model_dir: str | Path, text: str) -> list[int]:
    """What the engine must feed the model for a text prompt: the tokenizer's ids with special tokens."""
    return list(tokenizer(model_dir)(text, add_special_tokens=True)["input_ids"])


def hf_reference(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    left_pad: bool = False,
    dtype: torch.dtype = torch.float32,
    model: Any = None,
) -> Reference:
    """Run HF's own forward on a padded batch of token-id prompts (the pad id must not occur in them), on
    the CPU in `dtype` (float32: the reference; bfloat16: HF's own error, to bound a bf16 path's), or with
    `model` when given (a reference model changed by the test; the cached one is shared)."""
    model = model if model is not None else _reference_model(str(model_dir), dtype)
    pad = model.config.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        span = slice(width - len(prompt), width) if left_pad else slice(0, len(prompt))
        ids[row, span] = torch.tensor(prompt)
        mask[row, span] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as HF's generate does, so left padding shifts nothing
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    last = torch.full((len(prompts),), width - 1) if left_pad else mask.sum(1) - 1
    hidden = out.hidden_states[-1][torch.arange(len(prompts)), last]
    return Reference(logits=out.logits.float().numpy(), hidden=hidden.float().numpy())


@torch.inference_mode()
def hf_judge_reference(
    model_dir: str | Path, prompts: Sequence[Sequence[int]], labels: Sequence[int]
) -> Reference:
    """A judge's HF float32 reference (its causal LM with eager attention, one prompt per forward): the
    last token's logits at the label tokens `labels` [n, len(labels)] and its final hidden state [n, H]."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    logits, hidden = [], []
    for prompt in prompts:
        out = model(input_ids=torch.tensor([list(prompt)]), output_hidden_states=True)
        logits.append(out.logits[0, -1, list(labels)].float().numpy())
        hidden.append(out.hidden_states[-1][0, -1].float().numpy())
    return Reference(logits=np.stack(logits), hidden=np.stack(hidden))


def token_requests(lengths: Sequence[tuple[int, ...]], seed: int = 7, hidden: bool = True) -> list[Any]:
    """One request per entry, with items of those many random token ids (4..499)."""
    from schemas import ScoreRequest

    generator = torch.Generator().manual_seed(seed)
    return [
        ScoreRequest(
            request_id=f"r{i}",
            return_pooled_hidden_states=hidden,
            items=tuple(tuple(torch.randint(4, 500, (n,), generator=generator).tolist()) for n in item),
        )
        for i, item in enumerate(lengths)
    ]


def hidden_of(result: Any) -> np.ndarray:
    """The pooled hidden states of a result as one float32 matrix [items, H]."""
    assert result.pooled_hidden_states is not None
    return np.stack([tensor.to_numpy().astype(np.float32) for tensor in result.pooled_hidden_states])


def scores_of(result: Any) -> np.ndarray:
    assert result.ok, result.error
    return np.asarray(result.scores, dtype=np.float32)


def _reference_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None,
    window_size: tuple[int, int],
    return_aux: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """varlen_attn's contract checked strictly (layout, dtypes, causal window), computed exactly per item;
    with `return_aux.lse`, also each row's log-sum-exp [H, T] in float32, as the flash kernel returns it."""
    assert query.dim() == 3 and key.dim() == 3 and value.dim() == 3, "varlen q/k/v are [T, H, D]"
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
    assert cu_seq_q.dtype == torch.int32 and cu_seq_k.dtype == torch.int32, "cu_seqlens must be int32"
    assert cu_seq_q.shape == cu_seq_k.shape, "one key range per query range"
    # Decoders: (left, 0). Encoders, and the shared prefixes' cross pass, see both ways: (-1, -1), or a
    # symmetric window (left, left).
    causal = window_size[1] == 0
    assert causal or window_size[1] == window_size[0], f"unexpected window {window_size}"
    lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
    key_lengths = (cu_seq_k[1:] - cu_seq_k[:-1]).tolist()
    assert min([*lengths, 0]) >= 0 and min([*key_lengths, 0]) >= 0, "bounds must not decrease"
    if causal:  # a shared prefix adds keys, and the queries are the last positions: never fewer keys
        assert all(k >= q for q, k in zip(lengths, key_lengths, strict=True)), (lengths, key_lengths)
    # An upper bound on the lengths (CUDA graphs pass their bucket's); a larger one only costs time.
    assert max_q >= max(lengths) and max_k >= max(key_lengths)
    # The sequences lie inside the row; the first need not start at row 0 (the cross pass's do not).
    assert cu_seq_q[0] >= 0 and cu_seq_q[-1] <= query.shape[0], "the sequences must lie inside the row"
    assert cu_seq_k[0] >= 0 and cu_seq_k[-1] <= key.shape[0], "the key ranges must lie inside the keys"
    left = None if window_size[0] < 0 else window_size[0]
    # Rows outside every sequence (a CUDA graph's padding, the rows a cross pass leaves) are left unwritten
    # by the real kernel: NaN here, so a test sees at once if anything of them reaches an item.
    out = torch.full_like(query, float("nan"))
    lse = torch.full((query.shape[1], query.shape[0]), float("nan"), dtype=torch.float32)
    bounds, key_bounds = cu_seq_q.tolist(), cu_seq_k.tolist()
    for (start, end), (key_start, key_end) in zip(
        itertools.pairwise(bounds), itertools.pairwise(key_bounds), strict=True
    ):
        if start == end:  # an empty sequence (an unused slot of a CUDA graph)
            continue
        q, k, v = (
            query[start:end].transpose(0, 1),
            key[key_start:key_end].transpose(0, 1),
            value[key_start:key_end].transpose(0, 1),
        )
        item = attend_causal(q, k, v, scale=scale, left_window=left, causal=causal)
        out[start:end] = item.transpose(0, 1).to(query.dtype)
        if return_aux is not None and return_aux.lse:
            lse[:, start:end] = _log_sum_exp(q, k, scale=scale, left_window=left, causal=causal)
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out


def _log_sum_exp(
    query: torch.Tensor, key: torch.Tensor, *, scale: float | None, left_window: int | None, causal: bool
) -> torch.Tensor:
    """log(sum(exp(scores))) of each query row over the keys it may see: [H, Lq] from [H, Lq, D], [Hkv, Lk,
    D], with attend_causal's alignment (queries are the last Lq positions) and head mapping."""
    heads, length, head_dim = query.shape
    keys = key.shape[1]
    k = key.float().repeat_interleave(heads // key.shape[0], dim=0)
    scores = query.float() @ k.transpose(-1, -2) * (scale if scale is not None else head_dim**-0.5)
    rows = torch.arange(length).unsqueeze(1) + (keys - length)
    cols = torch.arange(keys).unsqueeze(0)
    allowed = cols <= rows if causal else torch.ones(length, keys, dtype=torch.bool)
    if left_window is not None:
        allowed &= cols >= rows - left_window
    return torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1)


@dataclass(frozen=True)
class ExactAttention:
    """Attention of one sequence in float64 (exact, for float32 inputs, to 2^-29 of float32's error), and the
    magnitudes that bound a float32 computation of it (tolerances.attention_bound, lse_bound)."""

    out: torch.Tensor  # [H, Lq, D]
    lse: torch.Tensor  # [H, Lq], natural log; -inf where a row sees no key
    score: torch.Tensor  # [H, Lq, 1]: the largest sum of |q_i k_i| * |scale| over the keys a row sees
    value: torch.Tensor  # [H, Lq, D]: the softmax-weighted sum of |v| (at least |out|)
    value_max: float  # the largest |v|
    keys: int  # the most keys a row sees


def exact_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None,
    left_window: int | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> ExactAttention:
    """attend_causal's contract ([H, Lq, D], [Hkv, Lk, D]: queries the last Lq positions, left window w,
    softcap, grouped heads) computed in float64 from the inputs' values."""
    heads, length, head_dim = query.shape
    keys = key.shape[1]
    q = query.double()
    k = key.double().repeat_interleave(heads // key.shape[0], dim=0)
    v = value.double().repeat_interleave(heads // value.shape[0], dim=0)
    scale = scale if scale is not None else head_dim**-0.5
    device = query.device
    rows = torch.arange(length, device=device).unsqueeze(1) + (keys - length)
    cols = torch.arange(keys, device=device).unsqueeze(0)
    allowed = cols <= rows if causal else torch.ones(length, keys, dtype=torch.bool, device=device)
    if left_window is not None:
        allowed &= cols >= rows - left_window
        if not causal:
            allowed &= cols <= rows + left_window
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row that sees no key: all 0
    terms = (q.abs() @ k.abs().transpose(-1, -2) * abs(scale)).masked_fill(~allowed, 0.0)
    return ExactAttention(
        out=weights @ v,
        lse=lse,
        score=terms.amax(-1, keepdim=True),
        value=weights @ v.abs(),
        value_max=float(v.abs().max()) if v.numel() else 0.0,
        keys=int(allowed.sum(-1).max()) if allowed.numel() else 0,
    )


@dataclass
class CpuVarlenKernel:
    """torch 2.11's varlen_attn signature (no enable_gqa): K/V must arrive with as many heads as Q."""

    calls: list[list[int]] = field(default_factory=list)  # cu_seqlens of every call, to observe batching
    fail_next: str | None = None  # an error message to raise once, to simulate a failing forward
    # Raise on every call whose packed row holds a sequence of this length: a request that always fails.
    fail_on_length: int | None = None

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seq_q: torch.Tensor,
        cu_seq_k: torch.Tensor,
        max_q: int,
        max_k: int,
        *,
        return_aux: Any = None,
        scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self._record(cu_seq_q)
        assert key.shape[1] == query.shape[1], "without enable_gqa, K/V heads must be repeated to Q's"
        return _reference_varlen(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
            scale=scale, window_size=window_size, return_aux=return_aux,
        )  # fmt: skip

    def _record(self, cu_seq_q: torch.Tensor) -> None:
        self.calls.append(cu_seq_q.tolist())
        bounds = self.calls[-1]
        lengths = {end - start for start, end in itertools.pairwise(bounds)}
        if self.fail_on_length is not None and self.fail_on_length in lengths:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        if self.fail_next is not None:
            message, self.fail_next = self.fail_next, None
            raise RuntimeError(message)


@dataclass
class CpuVarlenKernelGqa(CpuVarlenKernel):
    """torch 2.13's signature: takes enable_gqa, and K/V may keep fewer heads than Q."""

    gqa_calls: int = 0

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seq_q: torch.Tensor,
        cu_seq_k: torch.Tensor,
        max_q: int,
        max_k: int,
        *,
        return_aux: Any = None,
        scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
        enable_gqa: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self._record(cu_seq_q)
        if key.shape[1] != query.shape[1]:
            assert enable_gqa, "fewer K/V heads than Q heads needs enable_gqa=True"
            self.gqa_calls += 1
        return _reference_varlen(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
            scale=scale, window_size=window_size, return_aux=return_aux,
        )  # fmt: skip


class PackSpy:
    """Counts the tokens each batch's packed row holds (what the model actually runs)."""

    def __init__(self, monkeypatch: Any) -> None:
        from models import execute

        self.tokens: list[int] = []
        real = execute.pack

        def spy(*args: Any, **kwargs: Any) -> Any:
            packed = real(*args, **kwargs)
            self.tokens.append(int(packed.input_ids.shape[1]))
            return packed

        monkeypatch.setattr(execute, "pack", spy)

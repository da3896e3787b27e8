"""Gated DeltaNet (linear attention) layers of hybrid models, run on the engine's packed rows.

Qwen3.5 and Qwen3-Next mix full-attention layers (which take ours through HF's attention interface) with
Gated DeltaNet layers: a causal depthwise convolution over the projected q/k/v, then the gated delta rule,
a recurrence whose state carries every earlier token. HF's layer on a packed row would carry both across
items: its convolution reads the previous item's last tokens and its recurrence starts each item from the
previous one's state. While the engine's packed forward runs (`PackedLinearAttention`), each such layer
runs our forward instead: its own projections, gates and norms (HF's modules and arithmetic), with the
convolution window and the recurrent state starting afresh at every sequence of `cu_seq_lens_q`.

Two implementations of the recurrence and the convolution:
- "torch": a chunked gated delta rule in float32 (every sequence padded to whole chunks, all sequences in one
  batch), and the convolution as a masked sum of shifted rows. The CPU path and the tests' reference.
- "fla": flash-linear-attention's Triton kernels (chunk_gated_delta_rule and causal_conv1d, both with
  cu_seqlens), for bfloat16 and float16 models on CUDA where the package is installed (the `linear` extra).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from models.linear_cache import StateIO

log = logging.getLogger(__name__)

# HF model types whose decoder mixes Gated DeltaNet layers with full attention.
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_next")
LINEAR_LAYER = "linear_attention"  # the config's layer_types entry of a Gated DeltaNet layer
CHUNK = 64  # tokens per chunk of the torch recurrence (flash-linear-attention's chunk, too)
L2NORM_EPS = 1e-6  # HF's (and flash-linear-attention's) epsilon of the q/k l2 normalisation


def is_hybrid(text_config: Any) -> bool:
    """Whether a (text) config has Gated DeltaNet layers."""
    return LINEAR_LAYER in (getattr(text_config, "layer_types", None) or ())


@functools.cache
def fla_available() -> bool:
    """flash-linear-attention's two kernels import (only asked on CUDA: their Triton needs it to run)."""
    if importlib.util.find_spec("fla") is None:
        return False
    try:
        from fla.modules.causal_conv1d import causal_conv1d  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as exc:  # an install that cannot run here (a Triton or torch it does not take)
        log.warning("flash-linear-attention is installed but does not import (%s): torch path", exc)
        return False
    return True


def resolve_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """ "fla" for a half-precision model on CUDA where flash-linear-attention is installed, else "torch". A
    float32 model takes the torch path: Triton's float32 products may round their inputs to TF32."""
    half = dtype in (torch.bfloat16, torch.float16)
    return "fla" if half and device.type == "cuda" and fla_available() else "torch"


# HF's own Gated DeltaNet functions, which its kernel decorators replace with flash-linear-attention's
# wherever that package imports (transformers 5.17 even for CPU tensors, where Triton cannot run; and for
# float32, whose Triton products may round to TF32).
_HF_MODULES = ("qwen3_5", "qwen3_next")
_HF_FUNCTIONS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


@contextlib.contextmanager
def hf_torch_functions(load: bool = False) -> Iterator[None]:
    """HF's forward of the hybrids runs HF's own torch functions inside (each the `__wrapped__` of what its
    kernel decorators put in its place): the self-check's reference, and the tests', on any device, dtype
    and transformers version, whether or not flash-linear-attention is installed.

    Only in the hybrids' modeling modules already imported (a loaded hybrid's own), unless `load` (a
    context entered before any model is built): importing one imports flash-linear-attention, seconds of
    start-up and a warning on the CPU that a worker serving another model must not pay."""
    swapped = []
    for name in _HF_MODULES:
        qualified = f"transformers.models.{name}.modeling_{name}"
        module = sys.modules.get(qualified)
        if module is None and load:
            try:
                module = importlib.import_module(qualified)
            except ImportError:
                continue
        if module is None:
            continue
        for function in _HF_FUNCTIONS:
            current = getattr(module, function, None)
            own = None if current is None else inspect.unwrap(current)
            if own is not None and own is not current:
                swapped.append((module, function, current))
                setattr(module, function, own)
    try:
        yield
    finally:
        for module, function, current in swapped:
            setattr(module, function, current)


def plain_kernels(text_config: Any, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """The context HF's own forward of a model runs in on the plain path (Qwen3.5's image-text model, whose
    Gated DeltaNet layers are HF's there): HF's torch functions wherever resolve_kernel picks the torch path
    (float32, whose Triton products may round to TF32; the CPU, where transformers 5.17 would still call
    Triton), else flash-linear-attention's, as HF's decorators put them; nothing to swap without them."""
    if is_hybrid(text_config) and resolve_kernel(device, dtype) == "torch":
        return hf_torch_functions
    return contextlib.nullcontext


@dataclass(frozen=True)
class Sequences:
    """The sequences of a packed row: bounds on the host (a Python list) and on the row's device."""

    host: list[int]  # [S + 1]
    device: torch.Tensor  # [S + 1] int64

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, device: torch.device) -> Sequences:
        host = [int(b) for b in cu_seqlens.tolist()]
        return cls(host, torch.tensor(host, dtype=torch.int64, device=device))

    @property
    def lengths(self) -> list[int]:
        return [end - start for start, end in zip(self.host[:-1], self.host[1:], strict=True)]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, in float32 (HF's and flash-linear-attention's rule)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def positions_within(sequences: Sequences, device: torch.device) -> torch.Tensor:
    """[T] int64: each row's position within its sequence."""
    lengths = torch.tensor(sequences.lengths, dtype=torch.int64, device=device)
    starts = sequences.device[:-1].to(device)
    total = sequences.host[-1]
    return torch.arange(total, device=device) - torch.repeat_interleave(starts, lengths, output_size=total)


def causal_conv_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    sequences: Sequences,
    history: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU of the causal depthwise convolution of every sequence: x [T, C], weight [C, W] -> [T, C] float32.

    Row t of a sequence sums weight[:, W-1-s] * x[t-s] over s = 0..W-1, where x[t-s] before the sequence's
    first row is zero (HF's left padding of each prompt alone), or with `history` [S, W-1, C] the rows
    before it (oldest first: a shared prefix's last rows)."""
    width = weight.shape[1]
    rows = x.float()
    w = weight.float()
    position = positions_within(sequences, x.device)
    out = rows * w[:, width - 1]
    if history is not None:
        sequence_of = torch.repeat_interleave(
            torch.arange(len(sequences.lengths), device=x.device),
            torch.tensor(sequences.lengths, device=x.device),
            output_size=rows.shape[0],
        )
    for shift in range(1, width):
        earlier = F.pad(rows, (0, 0, shift, 0))[: rows.shape[0]]  # row t holds x[t - shift]
        inside = (position >= shift).unsqueeze(1)
        if history is None:
            earlier = earlier * inside
        else:
            # Before the sequence's first row: history row (W - 1) - (shift - position).
            slot = (position + (width - 1 - shift)).clamp(min=0, max=width - 2)
            earlier = torch.where(inside, earlier, history.float()[sequence_of, slot])
        out = out + earlier * w[:, width - 1 - shift]
    return F.silu(out)


def conv_history(x: torch.Tensor, sequences: Sequences, width: int) -> torch.Tensor:
    """[S, W-1, C] float32: each sequence's last W-1 convolution inputs, oldest first (zeros where a sequence
    is shorter: the zeros its own convolution read before its first row)."""
    starts = torch.tensor(sequences.host[:-1], device=x.device)
    ends = torch.tensor(sequences.host[1:], device=x.device)
    rows = ends.unsqueeze(1) - (width - 1) + torch.arange(width - 1, device=x.device)  # [S, W-1]
    inside = (rows >= starts.unsqueeze(1)).unsqueeze(-1)
    return torch.where(inside, x[rows.clamp(min=0)].float(), 0.0)


class RuleInputs(NamedTuple):
    """The gated delta rule's inputs for the rows of a packed row."""

    query: torch.Tensor  # [T, Hk, Dk], l2-normalised by the rule
    key: torch.Tensor  # [T, Hk, Dk], l2-normalised by the rule
    value: torch.Tensor  # [T, Hv, Dv]
    g: torch.Tensor  # [T, Hv] float32: the log of each token's decay of the state
    beta: torch.Tensor  # [T, Hv]: each token's write strength

    def rows(self, span: slice) -> RuleInputs:
        return RuleInputs(*(x[span] for x in self))


def gated_delta_rule_torch(
    inputs: RuleInputs,
    sequences: Sequences,
    initial_state: torch.Tensor | None = None,
    at: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gated delta rule of every sequence, each from its own initial state (zeros, or `initial_state`
    [S, Hv, Dk, Dv]) -> (outputs [T, Hv, Dv], final states [S, Hv, Dk, Dv], the states right after the rows
    `at` [K, Hv, Dk, Dv] or None), float32.

    Per token: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; out = S^T q / sqrt(Dk). Chunk by chunk, with
    G the cumulative log decay inside a chunk and S0 the state entering it, the corrections u of its tokens
    solve (I + A) u = beta v - beta exp(G) K S0, A[i, j] = beta_i exp(G_i - G_j) k_i.k_j for j < i; then
    out_i = exp(G_i) q_i S0 + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j and the state leaving it is
    exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T, and the state right after its token i the same sum
    stopped at i. Each key head serves consecutive value heads (HF's repeat_interleave)."""
    query, key, value, g, beta = inputs
    heads, k_dim, v_dim = value.shape[1], key.shape[2], value.shape[2]
    group = heads // key.shape[1]
    q = (l2norm(query) * k_dim**-0.5).repeat_interleave(group, dim=1)
    k = l2norm(key).repeat_interleave(group, dim=1)
    count, padded = len(sequences.lengths), -(-max(sequences.lengths) // CHUNK) * CHUNK
    slots = _padded_slots(sequences, padded, value.device)
    qc, kc, vc, gc, bc = (_in_chunks(x, slots, count, padded) for x in (q, k, value, g, beta))
    cum = gc.cumsum(-1)  # [N, H, chunks, C]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=value.device).tril()
    # exp(G_i - G_j) for j <= i; the masked entries (j > i) may overflow, so they are zeroed before exp.
    decay = torch.where(causal, cum.unsqueeze(-1) - cum.unsqueeze(-2), float("-inf")).exp()
    system = (bc.unsqueeze(-1) * decay * (kc @ kc.transpose(-1, -2))).tril(-1)
    system = system + torch.eye(CHUNK, device=value.device)
    new_values = torch.linalg.solve_triangular(system, bc.unsqueeze(-1) * vc, upper=False, unitriangular=True)
    state_reads = torch.linalg.solve_triangular(
        system, (bc * cum.exp()).unsqueeze(-1) * kc, upper=False, unitriangular=True
    )
    scores = decay * (qc @ kc.transpose(-1, -2))
    q_decayed = qc * cum.exp().unsqueeze(-1)
    k_to_end = kc * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [N, H, chunks, 1, 1]
    state = (
        value.new_zeros((count, heads, k_dim, v_dim), dtype=torch.float32)
        if initial_state is None
        else initial_state.float()
    )
    out = torch.empty_like(vc)
    wanted = _rows_by_chunk(at, slots, padded)
    states_at = state.new_empty((len(at), heads, k_dim, v_dim)) if at else None
    for c in range(padded // CHUNK):
        u = new_values[:, :, c] - state_reads[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + scores[:, :, c] @ u
        if c in wanted and states_at is not None:
            index, sequence, offset = wanted[c]
            states_at[index] = _state_after(
                state[sequence], cum[sequence, :, c], kc[sequence, :, c], u[sequence], offset
            )
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    rows = out.permute(0, 2, 3, 1, 4).reshape(count * padded, heads, v_dim)
    return rows.index_select(0, slots), state, states_at


def _padded_slots(sequences: Sequences, padded: int, device: torch.device) -> torch.Tensor:
    """[T] int64: each row's slot when every sequence lies in a row of its own of `padded` tokens, padded at
    its end with tokens that change nothing (beta = g = 0)."""
    count, lengths = len(sequences.lengths), torch.tensor(sequences.lengths, device=device)
    starts = torch.repeat_interleave(torch.arange(count, device=device) * padded, lengths)
    return starts + positions_within(sequences, device)


def _in_chunks(rows: torch.Tensor, slots: torch.Tensor, count: int, padded: int) -> torch.Tensor:
    """[T, H, ...] -> [N, H, chunks, CHUNK, ...] float32, every sequence in its row (`_padded_slots`)."""
    out = rows.new_zeros((count * padded, *rows.shape[1:]), dtype=torch.float32)
    out.index_copy_(0, slots, rows.float())
    out = out.view(count, padded // CHUNK, CHUNK, *rows.shape[1:])
    return out.permute(0, 3, 1, 2, *range(4, out.dim())) if rows.dim() > 2 else out.permute(0, 3, 1, 2)


def _state_after(
    entering: torch.Tensor,
    cum: torch.Tensor,
    keys: torch.Tensor,
    corrections: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """The states right after token i = `offset` [E] of a chunk, exp(G_i) S0 + sum_{j<=i} exp(G_i - G_j)
    k_j u_j^T, from the state S0 entering it [E, H, Dk, Dv], its cumulative log decays G [E, H, C], keys k
    [E, H, C, Dk] and corrections u [E, H, C, Dv]."""
    upto = cum.gather(-1, offset.view(-1, 1, 1).expand(-1, cum.shape[1], 1))  # [E, H, 1]: G_i
    inside = torch.arange(cum.shape[-1], device=cum.device) <= offset.view(-1, 1, 1)  # j <= i
    weights = torch.where(inside, upto - cum, float("-inf")).exp()  # exp(G_i - G_j), the masked ones 0
    return (
        entering * upto.exp().unsqueeze(-1) + (keys * weights.unsqueeze(-1)).transpose(-1, -2) @ corrections
    )


def _rows_by_chunk(
    at: Sequence[int], slots: torch.Tensor, padded: int
) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The rows `at`, by the chunk of the padded layout their sequence's token falls in: per chunk, their
    indices in `at`, their sequences and their offsets within the chunk."""
    if not at:
        return {}
    where = slots.index_select(0, torch.tensor(list(at), dtype=torch.int64, device=slots.device))
    sequence, position = where // padded, where % padded
    chunk, offset = position // CHUNK, position % CHUNK
    out = {}
    for c in set(chunk.tolist()):
        index = (chunk == c).nonzero().flatten()
        out[int(c)] = (index, sequence[index], offset[index])
    return out


@dataclass(frozen=True)
class SharedRows:
    """A packed row with shared prefixes (models/packing.py): every group's prefix once (rows [0, P), one
    sequence each), then the rest (every group's suffixes, each a sequence, then the other prompts). The
    prefixes run first; their final recurrent states and last convolution inputs are where each suffix of
    their group starts, as the whole prompt would have them there."""

    prefixes: Sequences  # the G prefix sequences, rows [0, P)
    rest: Sequences  # the other sequences, their bounds counted from row P
    suffixes: torch.Tensor  # [M] int64: which of `rest` are suffixes
    groups: torch.Tensor  # [M] int64: the group (prefix) of each

    @classmethod
    def of(
        cls, sequences: Sequences, cu_q: torch.Tensor, cu_k: torch.Tensor, device: torch.device
    ) -> SharedRows:
        prefix_bounds = [int(b) for b in cu_k.tolist()]
        suffix_bounds = [int(b) for b in cu_q.tolist()]
        count = len(prefix_bounds) - 1
        if sequences.host[: count + 1] != prefix_bounds:
            raise ValueError("shared prefixes must be the packed row's first sequences, one each")
        start = prefix_bounds[-1]
        rest = [b - start for b in sequences.host[count:]]
        suffixes, groups = [], []
        for index, first in enumerate(sequences.host[count:-1]):
            for group in range(count):
                if suffix_bounds[group] <= first < suffix_bounds[group + 1]:
                    suffixes.append(index)
                    groups.append(group)
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        return cls(
            Sequences(prefix_bounds, as_tensor(prefix_bounds)),
            Sequences(rest, as_tensor(rest)),
            as_tensor(suffixes),
            as_tensor(groups),
        )

    def carried(self, finals: torch.Tensor) -> torch.Tensor:
        """Per sequence of `rest`: its group's prefix's `finals` [G, ...] for a suffix, zeros for others."""
        out = finals.new_zeros((len(self.rest.host) - 1, *finals.shape[1:]))
        out[self.suffixes] = finals[self.groups]
        return out


class PackedLinearAttention:
    """Every Gated DeltaNet layer of a base model on our packed forward, swapped in only around the engine's
    packed forward (HF's own forward, the self-check's reference, keeps HF's layer)."""

    def __init__(self, modules: Sequence[torch.nn.Module], kernel: str) -> None:
        self._modules: list[Any] = list(modules)  # HF's Gated DeltaNet modules
        self.kernel = kernel
        self._bounds: tuple[torch.Tensor, Sequences, SharedRows | None] | None = None

    @classmethod
    def of(cls, base: torch.nn.Module, device: torch.device) -> PackedLinearAttention | None:
        """The swap for `base`'s Gated DeltaNet layers (their `linear_attn`), or None when it has none. An
        image-text base (Qwen3.5's) holds its decoder layers in its text model, `language_model`."""
        text = getattr(base, "language_model", base)
        layers = getattr(text, "layers", None) or ()
        modules = [layer.linear_attn for layer in layers if hasattr(layer, "linear_attn")]
        if not modules:
            return None
        return cls(modules, resolve_kernel(device, modules[0].out_proj.weight.dtype))

    def __len__(self) -> int:
        return len(self._modules)

    @property
    def layer_numbers(self) -> list[int]:
        """The decoder layer index (`layer_idx`) of each Gated DeltaNet layer, in order."""
        return [int(module.layer_idx) for module in self._modules]

    @property
    def conv_width(self) -> int:
        """The short convolution's kernel size (its window of tokens)."""
        return int(self._modules[0].conv1d.weight.shape[-1])

    def __enter__(self) -> PackedLinearAttention:
        for module in self._modules:
            module.forward = functools.partial(self._forward, module)
        return self

    def __exit__(self, *exc: object) -> None:
        self._bounds = None
        for module in self._modules:
            del module.forward  # the class's forward again

    def _layout(
        self, cu_seqlens: torch.Tensor, cross: Any, device: torch.device
    ) -> tuple[Sequences, SharedRows | None]:
        """The row's sequences (and shared prefixes), read from the device once per forward: every layer
        gets the same tensors."""
        if self._bounds is None or self._bounds[0] is not cu_seqlens:
            sequences = Sequences.of(cu_seqlens, device)
            shared = None if cross is None else SharedRows.of(sequences, cross.cu_q, cross.cu_k, device)
            self._bounds = (cu_seqlens, sequences, shared)
        return self._bounds[1], self._bounds[2]

    def _forward(
        self,
        module: torch.nn.Module,
        hidden_states: torch.Tensor,
        *args: Any,
        cu_seq_lens_q: torch.Tensor | None = None,
        prefix_cross: Any = None,
        prefix_cache: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if cu_seq_lens_q is None:
            raise ValueError("packed linear attention needs cu_seq_lens_q; call it through models.Scorer")
        sequences, shared = self._layout(cu_seq_lens_q, prefix_cross, hidden_states.device)
        states = None if prefix_cache is None else prefix_cache.states  # models/prefix_cache.py's CacheIO
        return layer_forward(module, hidden_states, sequences, self.kernel, shared, states)


def _projections(
    module: Any, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's convolution input [T, 2 Dk Hk + Dv Hv], output gate z [T, Hv, Dv], beta and decay inputs
    b, a [T, Hv], through its own projections: Qwen3-Next's fused in_proj_qkvz / in_proj_ba (split by its
    own fix_query_key_value_ordering), Qwen3.5's separate in_proj_qkv, _z, _b, _a."""
    if hasattr(module, "in_proj_qkvz"):
        q, k, v, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden), module.in_proj_ba(hidden)
        )
        mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
    else:
        mixed, z = module.in_proj_qkv(hidden), module.in_proj_z(hidden)
        b, a = module.in_proj_b(hidden), module.in_proj_a(hidden)
    return mixed[0], z[0].reshape(z.shape[1], -1, module.head_v_dim), b[0], a[0]


def layer_forward(
    module: Any,
    hidden_states: torch.Tensor,
    sequences: Sequences,
    kernel: str,
    shared: SharedRows | None = None,
    cache: StateIO | None = None,
) -> torch.Tensor:
    """A Gated DeltaNet layer on a packed row [1, T, H] -> [1, T, H], every sequence on its own, or with
    `shared` prefixes each suffix from where its prefix ended; with the prefix `cache`, a prompt with cached
    tokens from the state kept where they end, and the states where the batch's kept blocks end copied out."""
    dtype, length = hidden_states.dtype, hidden_states.shape[1]
    mixed, z, b, a = _projections(module, hidden_states)
    weight = module.conv1d.weight.squeeze(1)  # [C, W]
    resumed = None if cache is None else cache.starts(module)
    kept_windows = None if cache is None else cache.windows(mixed)
    history = None if resumed is None else resumed[1]
    mixed = _convolve_row(kernel, mixed, weight, sequences, shared, history).to(dtype)
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(length, -1, module.head_k_dim)
    key = key.reshape(length, -1, module.head_k_dim)
    value = value.reshape(length, -1, module.head_v_dim)
    beta = b.sigmoid()
    # HF's decay: float32, so that an fp16 model's A cannot overflow.
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    inputs = RuleInputs(query, key, value, g, beta)
    initial = None if resumed is None else resumed[0]
    core, kept = _recur_row(kernel, inputs, sequences, shared, initial, () if cache is None else cache.ends)
    if cache is not None:
        cache.keep(module, kept, kept_windows)
    gated = module.norm(core.to(dtype).reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(gated.reshape(1, length, -1))  # type: ignore[no-any-return]


def _convolve_row(
    kernel: str,
    mixed: torch.Tensor,
    weight: torch.Tensor,
    sequences: Sequences,
    shared: SharedRows | None,
    history: torch.Tensor | None,
) -> torch.Tensor:
    """The convolution of a packed row's sequences, each after its `history` [S, W-1, C] where given (zeros:
    none), a shared prefix's suffixes after their prefix's last inputs."""
    if shared is None:
        return convolve(kernel, mixed, weight, sequences, history)
    split, groups = shared.prefixes.host[-1], len(shared.prefixes.host) - 1
    carried = shared.carried(conv_history(mixed[:split], shared.prefixes, weight.shape[1]))
    if history is not None:
        carried = carried + history[groups:]  # disjoint: a prompt with cached tokens joins no group
    return torch.cat([
        convolve(kernel, mixed[:split], weight, shared.prefixes),
        convolve(kernel, mixed[split:], weight, shared.rest, carried),
    ])  # fmt: skip


def _recur_row(
    kernel: str,
    inputs: RuleInputs,
    sequences: Sequences,
    shared: SharedRows | None,
    initial: torch.Tensor | None,
    at: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule of a packed row's sequences, each from its `initial` state where given (zeros:
    none), a shared prefix's suffixes from their prefix's final state -> (outputs [T, Hv, Dv], the states
    right after the rows `at` [K, Hv, Dk, Dv] or None)."""
    if shared is None:
        core, _, kept = recur(kernel, inputs, sequences, initial, at)
        return core, kept
    split, groups = shared.prefixes.host[-1], len(shared.prefixes.host) - 1
    in_prefix = [row < split for row in at]
    head_at = [row for row, inside in zip(at, in_prefix, strict=True) if inside]
    tail_at = [row - split for row, inside in zip(at, in_prefix, strict=True) if not inside]
    head, finals, head_kept = recur(kernel, inputs.rows(slice(None, split)), shared.prefixes, None, head_at)
    carried = shared.carried(finals)
    if initial is not None:
        carried = carried + initial[groups:]  # disjoint: a prompt with cached tokens joins no group
    tail, _, tail_kept = recur(kernel, inputs.rows(slice(split, None)), shared.rest, carried, tail_at)
    kept = None
    if at:
        kept = finals.new_empty((len(at), *finals.shape[1:]))
        mask = torch.tensor(in_prefix, device=finals.device)
        for part, rows in ((head_kept, mask), (tail_kept, ~mask)):
            if part is not None:
                kept[rows] = part
    return torch.cat([head, tail]), kept


def convolve(
    kernel: str,
    mixed: torch.Tensor,
    weight: torch.Tensor,
    sequences: Sequences,
    history: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU of the causal convolution of every sequence (causal_conv_torch's contract) on `kernel`."""
    if kernel != "fla":
        return causal_conv_torch(mixed, weight, sequences, history)
    from fla.modules.causal_conv1d import causal_conv1d

    # Its state is [S, C, W], oldest first, the last W - 1 slots the inputs before the sequence.
    state = None if history is None else F.pad(history, (0, 0, 1, 0)).transpose(1, 2).to(mixed.dtype)
    out, _ = causal_conv1d(
        mixed.unsqueeze(0),
        weight=weight,
        activation="silu",
        initial_state=state,
        cu_seqlens=sequences.device,
        cu_seqlens_cpu=torch.tensor(sequences.host, dtype=torch.int64),
    )
    return out[0]  # type: ignore[no-any-return]


def recur(
    kernel: str,
    inputs: RuleInputs,
    sequences: Sequences,
    initial_state: torch.Tensor | None = None,
    at: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gated delta rule of every sequence (gated_delta_rule_torch's contract) on `kernel`. States
    inside a sequence (`at`: where a batch's blocks kept in the prefix cache end) take the torch rule on
    any device: flash-linear-attention's kernel returns each sequence's final state only."""
    if kernel != "fla" or at:
        return gated_delta_rule_torch(inputs, sequences, initial_state, at)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(
        *(x.unsqueeze(0) for x in inputs),
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=sequences.device,
        cu_seqlens_cpu=torch.tensor(sequences.host, dtype=torch.int64),
    )
    return out[0], final, None

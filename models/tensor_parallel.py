"""A decoder reward model split across the ranks of a torch.distributed group (tensor parallelism).

Megatron's split: each rank holds a contiguous share of the attention heads (the query heads, and the
key-value heads they read; a key-value head is copied to several ranks where there are fewer of them than
ranks) and of the MLP's intermediate columns. The query, key, value, gate and up projections are cut by
their output rows (column parallel: each rank computes its heads' and columns' outputs alone), the output
and down projections by their input columns (row parallel: each rank's partial product is summed across the
group, then the bias, once); a mixture-of-experts block's experts the same way, each expert's intermediate
columns cut (its gate and up rows, its down columns) and the block's routed sum summed across the group, its
router whole on every rank; the token embedding by vocabulary rows (each rank looks up the tokens it holds,
the rows are summed across the group). Norms, rotary tables and the classification head are whole on every
rank, so every rank ends with the whole hidden state: the scores and the pooled hidden states are those of
the unsplit model, up to the order of the sums.

Weights are read shard by shard: the model is built with its parameters on the meta device (no storage),
its modules are cut, and each rank reads only its slices from the safetensors files (`get_slice`), one
tensor at a time. No rank, and no process, ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel

from models.errors import ModelLoadError
from models.families import family, tensor_parallel_refusal

if TYPE_CHECKING:
    from models.fp8 import Fp8Selection
from models.checkpoint_heads import checkpoint_files, find_head
from models.layers import decoder_layers
from models.loading import (
    DECODER_MODEL_TYPES,
    LoadedModel,
    _base_and_embeddings,
    _load_tokenizer,
    _pad_token_id,
    _positions,
    declared_head,
    is_judge,
    packable,
    quiet_progress_bars,
    read_config,
    step_separator,
)
from models.moe import sparse_blocks

log = logging.getLogger(__name__)

Ranges = tuple[tuple[int, int], ...]  # [start, end) runs kept along one dimension, concatenated in order


@dataclass(frozen=True)
class Shard:
    """Which rank of how many, and the group whose sums join the ranks' partial results."""

    rank: int
    world: int
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group


@dataclass(frozen=True)
class Cut:
    """Where a parameter comes from: a checkpoint tensor, and the runs of one of its dimensions kept (none:
    the whole tensor)."""

    key: str
    dim: int = 0
    ranges: Ranges | None = None
    shape: tuple[int, ...] | None = None  # the whole tensor's (None: the parameter's own)
    # A parameter stacked from several checkpoint tensors (a mixture of experts' [E, 2I, H] from each expert's
    # gate and up projections): per entry of its first dimension, the cuts joined along their first.
    stacked: tuple[tuple[Cut, ...], ...] | None = None


def assemble(cut: Cut, read: Callable[[Cut], torch.Tensor]) -> torch.Tensor:
    """The values of `cut`: `read` of a plain cut, or the stack of its joined parts."""
    if cut.stacked is None:
        return read(cut)
    return torch.stack([torch.cat([read(part) for part in parts]) for parts in cut.stacked])


def _all_reduce(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(tensor, group=group)
    return tensor


class RowParallelExperts(nn.Module):
    """A mixture-of-experts block's experts holding the rank's intermediate columns of each expert: their
    routed sum is a partial sum, completed across the group (`all_reduce`, which the packed block calls
    too: models/moe.py)."""

    def __init__(self, inner: nn.Module, group: Any) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return _all_reduce(partial, self.group)

    def forward(self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.inner(hidden, experts, weights))


class RowParallelLinear(nn.Module):
    """The rank's input columns of a projection: its partial product, summed across the group, then the
    bias (held whole, added once). The projection itself stays an nn.Linear child, so that what swaps
    projections (FP8) swaps it too."""

    def __init__(self, linear: nn.Linear, bias: nn.Parameter | None, group: Any, reduce: bool = True) -> None:
        """`reduce`: sum across the group (False for a group of one: the model whole, cut the same way)."""
        super().__init__()
        self.linear = linear
        self.bias = bias
        self.group = group
        self.reduce = reduce

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(hidden)
        if self.reduce:
            out = _all_reduce(out, self.group)
        return out if self.bias is None else out + self.bias


class ProjectionNormShard(nn.Module):
    """A rank's share of an RMSNorm over a whole query or key projection (OLMo 2's q/k norms): its columns'
    squares summed here, the sums added across the group, the mean taken over the whole width. Where a
    key-value head is copied to several ranks (`copies`), the group's sum counts it that many times."""

    def __init__(self, weight: nn.Parameter, eps: float, width: int, copies: int, group: Any) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.count = width * copies  # terms in the group's sum of squares
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        squares = _all_reduce(hidden.pow(2).sum(-1, keepdim=True), self.group)
        # The same arithmetic as HF's norm (weight * (x * rsqrt(mean + eps))), the mean over the group's sum.
        return (self.weight * (hidden * torch.rsqrt(squares / self.count + self.eps))).to(dtype)


def _vocab_parallel_forward(module: nn.Embedding, start: int, end: int, group: Any) -> Any:
    """The embedding's own forward (a scaled embedding's scale included) over this rank's rows only: other
    tokens' rows are zero here and come from their rank in the sum."""
    own = type(module).forward

    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - start
        outside = (local < 0) | (local >= end - start)
        rows = own(module, local.masked_fill(outside, 0))
        return _all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0), group)

    return forward


def shares(total: int, world: int, rank: int) -> tuple[int, int]:
    """The rank's contiguous run of `total` units (the last runs may be shorter)."""
    size = -(-total // world)
    return min(total, rank * size), min(total, (rank + 1) * size)


def head_shares(heads: int, kv_heads: int, shard: Shard) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rank's query heads and the key-value heads they read ([start, end) each)."""
    world, rank = shard.world, shard.rank
    if heads % world:
        raise ModelLoadError(
            f"{heads} attention heads do not split evenly over {world} tensor-parallel ranks"
        )
    if kv_heads >= world:
        if kv_heads % world:
            raise ModelLoadError(f"{kv_heads} key-value heads do not split evenly over {world} ranks")
        per = kv_heads // world
        return (rank * heads // world, (rank + 1) * heads // world), (rank * per, (rank + 1) * per)
    if world % kv_heads:
        raise ModelLoadError(f"{world} ranks cannot share {kv_heads} key-value heads evenly")
    kv = (
        rank * kv_heads // world
    )  # fewer key-value heads than ranks: each is copied to world / kv_heads ranks
    return (rank * heads // world, (rank + 1) * heads // world), (kv, kv + 1)


def _scaled(run: tuple[int, int], unit: int, offset: int = 0) -> tuple[int, int]:
    return offset + run[0] * unit, offset + run[1] * unit


def _column(linear: nn.Linear, ranges: Ranges) -> nn.Linear:
    rows = sum(end - start for start, end in ranges)
    return nn.Linear(
        linear.in_features, rows, bias=linear.bias is not None, device="meta", dtype=linear.weight.dtype
    )


def _row(linear: nn.Linear, ranges: Ranges, shard: Shard) -> RowParallelLinear:
    columns = sum(end - start for start, end in ranges)
    inner = nn.Linear(columns, linear.out_features, bias=False, device="meta", dtype=linear.weight.dtype)
    return RowParallelLinear(inner, linear.bias, shard.group if shard.world > 1 else None, shard.world > 1)


class _LocalHeads:
    """A model's config as one attention module of a rank sees it: the rank's head counts, everything else
    (the attention implementation a caller switches, the sliding window, ...) read live from the config."""

    def __init__(self, config: Any, heads: int, kv_heads: int) -> None:
        self._config = config
        self.num_attention_heads = heads
        self.num_key_value_heads = kv_heads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class _Surgery:
    """Cuts a model's modules in place and records where each cut parameter's values come from."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.cuts: dict[str, Cut] = {}

    def column(self, owner: nn.Module, prefix: str, name: str, ranges: Ranges) -> None:
        linear = getattr(owner, name)
        setattr(owner, name, _column(linear, ranges))
        key = f"{prefix}{name}"
        self.cuts[f"{key}.weight"] = Cut(f"{key}.weight", 0, ranges, tuple(linear.weight.shape))
        if linear.bias is not None:
            self.cuts[f"{key}.bias"] = Cut(f"{key}.bias", 0, ranges, tuple(linear.bias.shape))

    def row(self, owner: nn.Module, prefix: str, name: str, ranges: Ranges) -> None:
        linear = getattr(owner, name)
        setattr(owner, name, _row(linear, ranges, self.shard))
        key = f"{prefix}{name}"
        self.cuts[f"{key}.linear.weight"] = Cut(f"{key}.weight", 1, ranges, tuple(linear.weight.shape))
        self.cuts[f"{key}.bias"] = Cut(f"{key}.bias")

    def attention(self, attention: nn.Module, prefix: str, config: Any) -> None:
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        head_dim = int(cast(int, attention.head_dim))
        q, kv = head_shares(heads, kv_heads, self.shard)
        if hasattr(attention, "qkv_proj"):  # Phi-3: one projection, queries then keys then values
            keys_at = heads * head_dim
            values_at = keys_at + kv_heads * head_dim
            fused = (_scaled(q, head_dim), _scaled(kv, head_dim, keys_at), _scaled(kv, head_dim, values_at))
            self.column(attention, prefix, "qkv_proj", fused)
        else:
            self.column(attention, prefix, "q_proj", (_scaled(q, head_dim),))
            self.column(attention, prefix, "k_proj", (_scaled(kv, head_dim),))
            self.column(attention, prefix, "v_proj", (_scaled(kv, head_dim),))
        self.row(attention, prefix, "o_proj", (_scaled(q, head_dim),))
        declared = family(getattr(config, "model_type", None))
        if declared is not None and declared.qk_norm == "projection" and self.shard.world > 1:
            copies = max(1, self.shard.world // kv_heads)  # ranks holding each key-value head
            self.projection_norm(attention, prefix, "q_norm", _scaled(q, head_dim), heads * head_dim, 1)
            self.projection_norm(
                attention, prefix, "k_norm", _scaled(kv, head_dim), kv_heads * head_dim, copies
            )
        heads_here, kv_here = q[1] - q[0], kv[1] - kv[0]
        if getattr(attention, "config", None) is config:  # Phi-3 reads the head counts from its config
            setattr(attention, "config", _LocalHeads(config, heads_here, kv_here))  # noqa: B010
        for name, value in (("num_key_value_heads", kv_here), ("num_heads", heads_here)):
            if hasattr(attention, name):
                setattr(attention, name, value)

    def projection_norm(
        self, attention: nn.Module, prefix: str, name: str, run: tuple[int, int], width: int, copies: int
    ) -> None:
        norm = getattr(attention, name)
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        weight = nn.Parameter(
            torch.empty(run[1] - run[0], device="meta", dtype=norm.weight.dtype), requires_grad=False
        )
        setattr(attention, name, ProjectionNormShard(weight, eps, width, copies, self.shard.group))
        key = f"{prefix}{name}.weight"
        self.cuts[key] = Cut(key, 0, (run,), (width,))

    def mlp(self, mlp: nn.Module, prefix: str, intermediate: int) -> None:
        columns = shares(intermediate, self.shard.world, self.shard.rank)
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate rows, then up rows
            self.column(
                mlp, prefix, "gate_up_proj", (columns, (intermediate + columns[0], intermediate + columns[1]))
            )
        else:
            self.column(mlp, prefix, "gate_proj", (columns,))
            self.column(mlp, prefix, "up_proj", (columns,))
        self.row(mlp, prefix, "down_proj", (columns,))

    def experts(self, block: nn.Module, prefix: str) -> None:
        """A sparse block's stacked experts [E, 2I, H] and [E, H, I], read from each expert's gate, up and
        down projections (the checkpoints' layout), cut to the rank's columns of every expert."""
        experts: Any = block.experts
        count, width = int(cast(int, experts.num_experts)), int(cast(int, experts.intermediate_dim))
        start, end = shares(width, self.shard.world, self.shard.rank)
        gate_up = cast(nn.Parameter, experts.gate_up_proj)
        hidden, dtype = int(gate_up.shape[-1]), gate_up.dtype
        experts.gate_up_proj = nn.Parameter(
            torch.empty(count, 2 * (end - start), hidden, device="meta", dtype=dtype), requires_grad=False
        )
        experts.down_proj = nn.Parameter(
            torch.empty(count, hidden, end - start, device="meta", dtype=dtype), requires_grad=False
        )
        experts.intermediate_dim = end - start
        own = f"{prefix}experts."
        if self.shard.world > 1:
            block.experts = RowParallelExperts(experts, self.shard.group)
            own = f"{prefix}experts.inner."

        def part(expert: int, name: str, dim: int) -> Cut:
            key = f"{prefix}experts.{expert}.{name}.weight"
            shape = (width, hidden) if dim == 0 else (hidden, width)
            return Cut(key, dim, ((start, end),), shape)

        self.cuts[f"{own}gate_up_proj"] = Cut(
            f"{prefix}experts.gate_up_proj",
            stacked=tuple((part(e, "gate_proj", 0), part(e, "up_proj", 0)) for e in range(count)),
        )
        self.cuts[f"{own}down_proj"] = Cut(
            f"{prefix}experts.down_proj", stacked=tuple((part(e, "down_proj", 1),) for e in range(count))
        )

    def embedding(self, embedding: nn.Embedding, name: str) -> None:
        start, end = shares(embedding.num_embeddings, self.shard.world, self.shard.rank)
        embedding.weight = nn.Parameter(
            torch.empty(end - start, embedding.embedding_dim, device="meta", dtype=embedding.weight.dtype),
            requires_grad=False,
        )
        shape = (embedding.num_embeddings, embedding.embedding_dim)
        if self.shard.world > 1:
            embedding.forward = _vocab_parallel_forward(embedding, start, end, self.shard.group)  # type: ignore[method-assign]
        self.cuts[f"{name}.weight"] = Cut(f"{name}.weight", 0, ((start, end),), shape)


def shard_model(model: PreTrainedModel, shard: Shard) -> dict[str, Cut]:
    """Cut a decoder classifier's layers and embedding for `shard`, in place; the cut parameters' sources."""
    config = model.config.get_text_config()
    base, embedding = _base_and_embeddings(model)
    layers = decoder_layers(base)
    if layers is None:
        raise ModelLoadError(f"{type(model).__name__} has no decoder layer list to split")
    surgery = _Surgery(shard)
    names = {module: name for name, module in model.named_modules()}
    for layer in layers:
        prefix = names[layer] + "."
        surgery.attention(cast(nn.Module, layer.self_attn), prefix + "self_attn.", config)
        if sparse_blocks([layer]):
            surgery.experts(cast(nn.Module, layer.mlp), prefix + "mlp.")
        else:
            surgery.mlp(cast(nn.Module, layer.mlp), prefix + "mlp.", int(config.intermediate_size))
    surgery.embedding(embedding, names[embedding])
    return surgery.cuts


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules whose parameters have no storage (their buffers, such as rotary tables, are real)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _read(files: dict[str, Path], cut: Cut) -> torch.Tensor:
    """The slice of one checkpoint tensor, read through a mapping of its file that is closed at once: the
    pages read leave this process's resident memory with it."""
    from safetensors import safe_open

    if cut.stacked is not None:
        return assemble(cut, lambda part: _read(files, part))
    path = files.get(cut.key)
    if path is None:
        raise ModelLoadError(f"{cut.key} is not in the checkpoint")
    with safe_open(str(path), framework="pt") as checkpoint:
        if cut.ranges is None:
            return checkpoint.get_tensor(cut.key)  # type: ignore[no-any-return]
        sliced = checkpoint.get_slice(cut.key)
        index = (slice(None),) * cut.dim
        return torch.cat([sliced[(*index, slice(start, end))] for start, end in cut.ranges], dim=cut.dim)


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    expected = owner._parameters[leaf]
    if expected is None or tuple(expected.shape) != tuple(value.shape):
        shape = None if expected is None else tuple(expected.shape)
        raise ModelLoadError(
            f"{name}: the checkpoint's slice is {tuple(value.shape)}, the model wants {shape}"
        )
    owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)


ValueOf = Callable[[str, Cut, nn.Parameter], torch.Tensor]  # a parameter's values (this rank's share)


def checkpoint_values(model_dir: Path) -> ValueOf:
    """Values read from the checkpoint's safetensors files, this rank's slices only."""
    files = checkpoint_files(model_dir)
    return lambda name, cut, param: _read(files, cut)


# config.json of a model without weight files whose weights are made in memory, each rank its share
# ({"seed": S, "std": 0.02}): a benchmark's 70B-shaped model then needs no 140 GB on disk.
RANDOM_WEIGHTS = "score_worker_random_weights"


def _random_value(
    name: str,
    owner: nn.Module,
    shape: tuple[int, ...],
    seed: int,
    std: float,
    device: torch.device,
    norm_adds_one: bool = False,
) -> torch.Tensor:
    """The whole tensor `name` of a random model, the same on every rank and for every split: HF's
    initialisation (normal(0, std) projections and embeddings, zero biases, unit norms, zero for norms that
    add one themselves, as Gemma's do), from a generator seeded by the seed and the name."""
    if "Norm" in type(owner).__name__:
        return (torch.zeros if norm_adds_one else torch.ones)(shape, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(shape, generator=generator, device=device) * std


def random_values(model: nn.Module, spec: dict[str, Any], device: torch.device) -> ValueOf:
    """Values of a random model (`spec`: RANDOM_WEIGHTS), each whole tensor made on `device`, then cut."""
    seed, std = int(spec.get("seed", 0)), float(spec.get("std", 0.02))
    declared = family(getattr(getattr(model, "config", None), "model_type", None))
    adds_one = declared is not None and declared.norm_adds_one

    def value(name: str, cut: Cut, param: nn.Parameter) -> torch.Tensor:
        owner = model.get_submodule(name.rpartition(".")[0])

        def one(part: Cut) -> torch.Tensor:
            whole = _random_value(
                part.key, owner, part.shape or tuple(param.shape), seed, std, device, adds_one
            )
            if part.ranges is None:
                return whole
            index = (slice(None),) * part.dim
            return torch.cat([whole[(*index, slice(a, b))] for a, b in part.ranges], dim=part.dim)

        return assemble(cut, one)

    return value


def fill(
    model: nn.Module,
    cuts: dict[str, Cut],
    value_of: ValueOf,
    device: torch.device,
    dtype: torch.dtype,
    quantize: Fp8Selection | None = None,
) -> int:
    """Give every meta parameter its values, one tensor at a time; with `quantize`, each decoder layer's
    projections it selects become FP8 as soon as the layer is complete, so that no more than one layer is
    ever held at the model's dtype beside the FP8 ones. The bytes this rank holds."""
    from models.fp8 import quantize_layers

    layers = decoder_layers(_base_and_embeddings(cast(PreTrainedModel, model))[0]) or nn.ModuleList()
    if quantize is not None:
        try:
            quantize.kept_layers(len(layers))
        except ValueError as exc:
            raise ModelLoadError(f"quantization='fp8': {exc}") from exc
    names = {module: name for name, module in model.named_modules()}
    left = {names[layer] + ".": sum(1 for _ in layer.parameters()) for layer in layers}
    owner = {names[layer] + ".": layer for layer in layers}
    number = {names[layer] + ".": index for index, layer in enumerate(layers)}
    for name, param in list(model.named_parameters()):
        _set(model, name, value_of(name, cuts.get(name, Cut(name)), param).to(device=device, dtype=dtype))
        prefix = next((p for p in left if name.startswith(p)), None)
        if prefix is not None:
            left[prefix] -= 1
            if quantize is not None and left[prefix] == 0:
                quantize_layers(nn.ModuleList([owner[prefix]]), quantize, [number[prefix]], len(layers))
    missing = [name for name, param in model.named_parameters() if param.is_meta]
    if missing:
        raise ModelLoadError(f"parameters without values after loading: {', '.join(missing[:5])}")
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def splittable(config: dict[str, Any], trust_remote_code: bool) -> bool:
    """Whether this loader takes the whole model, as a group of one (check_splittable raises nothing)."""
    try:
        check_splittable(Path("."), config, trust_remote_code, world=1)
    except ModelLoadError:
        return False
    return True


def check_splittable(model_dir: Path, config: dict[str, Any], trust_remote_code: bool, world: int) -> None:
    """ModelLoadError where this loader cannot take the model cut for `world` ranks, saying why."""
    model_type = str(config.get("model_type"))
    if model_type not in DECODER_MODEL_TYPES or not packable(model_type):
        raise ModelLoadError(
            f"tensor parallelism splits decoders of the families {', '.join(DECODER_MODEL_TYPES)}; "
            f"{model_dir.name} is {model_type!r}"
        )
    refusal = tensor_parallel_refusal(model_type, world)
    if refusal is not None:
        raise ModelLoadError(f"tensor parallelism cannot split {model_type!r}: {refusal}")
    if trust_remote_code and config.get("auto_map"):
        raise ModelLoadError("tensor parallelism does not split a model that ships its own code")
    if is_judge(config) or declared_head(config) is not None:
        raise ModelLoadError(
            "tensor parallelism splits *ForSequenceClassification models with HF's linear head; judges "
            "(causal LMs scored on label tokens) and declared heads run on one device"
        )


def load_sharded(
    model_dir: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str,
    shard: Shard,
    trust_remote_code: bool = False,
    quantize: Fp8Selection | None = None,
) -> tuple[LoadedModel, int]:
    """This rank's share of a decoder classifier (LoadedModel, as load_model gives the whole one), and the
    bytes of weights it holds; with `quantize`, its projections in FP8, each layer quantized as it is read."""
    config = read_config(model_dir, trust_remote_code)
    check_splittable(model_dir, config, trust_remote_code, shard.world)
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    auto: Any = AutoModelForSequenceClassification
    with quiet_progress_bars(), parameters_on_meta():
        model = auto.from_config(hf_config, attn_implementation=attn_implementation, dtype=dtype)
    cuts = shard_model(model, shard)
    random = config.get(RANDOM_WEIGHTS)
    if isinstance(random, dict) and not any(model_dir.glob("*.safetensors")):
        values = random_values(model, random, device)
    else:
        values = checkpoint_values(model_dir)
    held = fill(model, cuts, values, device, dtype, quantize)
    module: nn.Module = model
    module.to(device).eval()  # the buffers (rotary tables); the parameters are there already
    base, embedding = _base_and_embeddings(model)
    max_positions, position_pad = _positions(config)
    loaded = LoadedModel(
        model=model,
        base=base,
        head=find_head(model),
        tokenizer=_load_tokenizer(model_dir, False, encoder=False),
        vocab_size=int(hf_config.get_text_config().vocab_size),
        max_position_embeddings=max_positions,
        name=model_dir.resolve().name,
        pad_token_id=_pad_token_id(model),
        default_pooling="last",
        position_pad=position_pad,
        step_separator=step_separator(config),
    )
    log.info(
        "rank %d of %d holds %.1f MiB of %s's weights (its heads, MLP columns and vocabulary rows)",
        shard.rank, shard.world, held / 2**20, loaded.name,
    )  # fmt: skip
    del embedding
    return loaded, held

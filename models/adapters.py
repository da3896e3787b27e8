"""LoRA adapters beside one base model: PEFT directories read at start-up, each request naming one (or none),
and a batch that mixes them run as one packed forward.

Each adapted projection computes y = W x + B_a (A_a x) s_a for the adapter a of x's token. The adapters' A
matrices of a projection are stacked into one [R, in] matrix (R the sum of their ranks) and their B matrices,
scaled, into one [out, R]: a batch's delta is then two matmuls, (x A^T * mask) B^T, the mask [T, R] keeping
each token's own adapter's columns (zero for the base model's tokens). Every adapter's shrink is computed for
every token of the batch and masked (R (1/in + 1/out) more arithmetic per projection); punica's SGMV and
S-LoRA's kernels compute only each token's own, which pays off where many adapters of large rank meet. Two
matmuls and a mask are graph-, compile- and determinism-friendly and need no sort of the tokens. Where the
fused MLP kernel runs, the gate and up products take their two operands (lora_operands) into its sums.

An adapter saved for sequence classification also carries its own head (PEFT's `modules_to_save`: the
trained `score`); its requests' rows are scored with it.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from models.errors import ModelLoadError
from models.settings import parse_adapters

__all__ = ["Adapter", "AdapterSet", "load_adapters", "lora_operands", "parse_adapters", "read_adapter"]

log = logging.getLogger(__name__)

_PREFIX = "base_model.model."
# adapter_config.json values score-worker runs as PEFT does; anything else is refused with its name.
_PLAIN = {"bias": "none", "use_dora": False, "fan_in_fan_out": False, "lora_bias": False}


@dataclass(frozen=True)
class Adapter:
    """One PEFT LoRA adapter: per adapted module (its path in the model), A [r, in] and B [out, r] scaled
    by lora_alpha / r (or / sqrt(r) with rsLoRA); its own head where it saved one."""

    name: str
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    head: nn.Module | None


def read_adapter(
    name: str,
    directory: Path,
    model: nn.Module,
    head_name: str | None,
    layers: nn.Module | None = None,
    chain: nn.Module | None = None,
) -> Adapter:
    """A PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) checked against `model`:
    every module it adapts exists with the shapes its factors need, inside `layers` where given (the
    transformer layers, whose packed forward carries each token's adapter); ModelLoadError otherwise.
    `chain`: what the engine runs on the pooled rows (an encoder's pooler, then its classifier; the
    classifier alone where None), which the adapter's own head takes the place of."""
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise ModelLoadError(
            f"adapter {name!r}: {str(directory)!r} is not a PEFT adapter directory (adapter_config.json and "
            "adapter_model.safetensors)"
        )
    config = json.loads(config_path.read_text())
    _check_config(name, config)
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scaling = alpha / (rank**0.5 if config.get("use_rslora") else rank)
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    head_weights: dict[str, torch.Tensor] = {}
    with safe_open(str(weights_path), framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
            path = key.removeprefix(_PREFIX)
            if ".lora_A." in path:
                module = path.split(".lora_A.")[0]
                b_key = key.replace(".lora_A.", ".lora_B.")
                factors[module] = (
                    tensors.get_tensor(key).float(),
                    tensors.get_tensor(b_key).float() * scaling,
                )
            elif ".lora_B." in path:
                continue
            elif head_name is not None and path.split(".")[0] == head_name:
                head_weights[path.removeprefix(f"{head_name}.")] = tensors.get_tensor(key)
            else:
                raise ModelLoadError(
                    f"adapter {name!r} saves {path!r}, which is neither a LoRA factor nor the head; "
                    "score-worker serves LoRA factors and a trained head only"
                )
    inside = None if layers is None else {id(m) for m in layers.modules()}
    for module, (a, b) in factors.items():
        _check_factors(name, model, module, a, b, inside)
    head = _adapter_head(name, model, head_name, head_weights, chain) if head_weights else None
    return Adapter(name, factors, head)


def _check_config(name: str, config: dict[str, Any]) -> None:
    """ModelLoadError unless adapter_config.json describes plain LoRA on linear projections, one rank for
    every module: what the packed forward applies per token."""
    if config.get("peft_type") != "LORA":
        raise ModelLoadError(
            f"adapter {name!r} is a {config.get('peft_type')!r} adapter; only LoRA is served"
        )
    if config.get("target_parameters"):
        raise ModelLoadError(
            f"adapter {name!r} adapts parameters ({', '.join(map(str, config['target_parameters']))[:200]}), "
            "such as a mixture-of-experts block's stacked experts; score-worker serves LoRA on the layers' "
            "linear projections only (the experts run as one grouped product with no per-token adapter): "
            "merge it into the weights with PEFT and serve the merged model"
        )
    for key, plain in _PLAIN.items():
        if config.get(key, plain) != plain:
            raise ModelLoadError(
                f"adapter {name!r} sets {key}={config.get(key)!r}, which score-worker does not run; merge it "
                "into the weights with PEFT and serve the merged model instead"
            )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ModelLoadError(f"adapter {name!r} gives modules their own ranks; merge it into the weights")


def _check_factors(
    name: str, model: nn.Module, module: str, a: torch.Tensor, b: torch.Tensor, inside: set[int] | None
) -> None:
    if ".experts." in f".{module}.":
        raise ModelLoadError(
            f"adapter {name!r} adapts {module!r}, inside a mixture-of-experts block's experts, which run as "
            "one grouped product with no per-token adapter; merge it into the weights with PEFT and serve "
            "the merged model, or adapt the attention projections only"
        )
    try:
        target = model.get_submodule(module)
    except AttributeError:
        raise ModelLoadError(f"adapter {name!r} adapts {module!r}, which the model does not have") from None
    if inside is not None and id(target) not in inside:
        raise ModelLoadError(
            f"adapter {name!r} adapts {module!r}, outside the model's transformer layers (a pooler or a "
            "head runs on the pooled rows, where tokens carry no adapter); score-worker serves LoRA on the "
            "layers' projections: merge this adapter into the weights with PEFT and serve the merged model"
        )
    projection = getattr(target, "linear", target)  # a row-parallel wrapper holds its projection
    if not (hasattr(projection, "in_features") and hasattr(projection, "out_features")):
        # A Gated DeltaNet layer's convolution, a norm, a mixture-of-experts router: the packed forward
        # reads their weights, never calls them on a token's rows, so no delta could be added.
        raise ModelLoadError(
            f"adapter {name!r} adapts {module!r}, a {type(projection).__name__}, which is not a linear "
            "projection; score-worker serves LoRA on the layers' linear projections only: merge this "
            "adapter into the weights with PEFT and serve the merged model"
        )
    shape = (int(getattr(projection, "out_features", 0)), int(getattr(projection, "in_features", 0)))
    if a.shape[1] != shape[1] or b.shape[0] != shape[0] or a.shape[0] != b.shape[1]:
        raise ModelLoadError(
            f"adapter {name!r}: the factors of {module!r} ({list(a.shape)}, {list(b.shape)}) do not fit its "
            f"projection [{shape[0]}, {shape[1]}]; was it trained on this base model?"
        )


def _adapter_head(
    name: str,
    model: nn.Module,
    head_name: str | None,
    weights: dict[str, torch.Tensor],
    chain: nn.Module | None,
) -> nn.Module:
    """A copy of what runs on the pooled rows (`chain`, or the model's head alone) with the adapter's trained
    head weights (PEFT's modules_to_save) in the head's place: an encoder's pooler stays before it."""
    assert head_name is not None
    classifier = model.get_submodule(head_name)
    chain = classifier if chain is None else chain
    path = next((p for p, module in chain.named_modules() if module is classifier), None)
    if path is None:
        raise ModelLoadError(f"adapter {name!r}: the model's head {head_name!r} is not in what scores it")
    copied = copy.deepcopy(chain)
    head = copied.get_submodule(path)
    own = dict(head.named_parameters())
    if set(weights) != set(own) or any(weights[k].shape != own[k].shape for k in own):
        raise ModelLoadError(
            f"adapter {name!r} saves a head ({', '.join(sorted(weights))}) of another shape than the "
            f"model's ({', '.join(sorted(own))})"
        )
    with torch.no_grad():
        for key, parameter in own.items():
            parameter.copy_(weights[key])
    return copied


# The masks of the batch an AdapterSet runs, by the set's number, then by column layout (odd keys: the masks
# at the restricted rows). A module global, read by the swapped forwards, as models.pooled_rows keeps its
# rows: torch.compile gives a tensor reached through an nn.Module a static shape, and one reached from here
# a dynamic token count, so compiled layers take every batch in one graph.
_MASKS: dict[int, dict[int, torch.Tensor]] = {}
_NUMBERS = itertools.count()
# What each adapted projection carries (non-persistent buffers and plain attributes, so that nothing of it
# reaches a saved state): its stacked factors, the set's number, its mask's key, and the forward it wraps.
_A, _B, _SET, _KEY, _INNER = (
    "score_worker_lora_a",
    "score_worker_lora_b",
    "score_worker_lora_set",
    "score_worker_lora_mask",
    "score_worker_lora_inner",
)


# Stacked ranks are padded with zero columns to whole steps of this many: the fused MLP kernel
# (models/fused_mlp.py) reads the shrink and B in tiles of 16 columns (its products' shortest inner step)
# whose rows must start on 16-byte boundaries.
RANK_STEP = 16


def lora_operands(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The delta of an adapted projection inside an active block (AdapterSet.active) as two operands: the
    shrink of x [T, in] by every adapter, masked to each token's own adapter's columns, [T, R], and the
    stacked B [out, R]; the delta is their product. None for a projection no adapter changes, or outside
    the block."""
    masks = _MASKS.get(getattr(module, _SET, -1))
    if masks is None:  # not adapted, or its set is not active: a batch of the base model alone
        return None
    a_stack, b_stack = getattr(module, _A), getattr(module, _B)
    flat = x.reshape(-1, x.shape[-1]).to(a_stack.dtype)
    shrunk = (flat @ a_stack.T) * masks[getattr(module, _KEY)]  # [T, R]: own columns
    return shrunk, b_stack


def _adapted_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An adapted projection's forward: the one it wraps, plus the expand of each token's own adapter's
    shrink. One function for every projection, its differences read from the module (factors as buffers,
    which torch.compile takes as inputs): the layers' compiled graph stays shared by all of them, as it is
    for their weights."""
    inner = getattr(module, _INNER)
    base: torch.Tensor = inner(x) if inner is not None else type(module).forward(module, x)
    shrunk, b_stack = cast(tuple[torch.Tensor, torch.Tensor], lora_operands(module, x))
    out = base.reshape(-1, base.shape[-1])
    # In place, the expand's product added in its epilogue: the [T, out] result is read and written once
    # more, where a separate delta would be written, read and added.
    out.addmm_(shrunk.to(out.dtype), b_stack.T.to(out.dtype))
    adapted: torch.Tensor = out.view(base.shape)
    return adapted


class AdapterSet:
    """The adapters a worker serves, their factors stacked per module on the device (module docstring).
    Adapter i of `names` is index i; -1 is the base model.

    The adapted projections carry their stacked factors and read the batch's masks from _MASKS. A projection
    inside one of the modules the last layer runs at the pooled rows only (models/pooled_rows.py;
    `restrict_within`) reads the masks of those rows: it sees only them."""

    def __init__(
        self, adapters: Sequence[Adapter], model: nn.Module, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.names = tuple(adapter.name for adapter in adapters)
        self.heads = {i: a.head.to(device=device, dtype=dtype) for i, a in enumerate(adapters) if a.head}
        self._number = next(_NUMBERS)
        self._dtype = dtype
        self._modules: dict[str, nn.Module] = {}
        layouts: dict[tuple[int, ...], int] = {}
        self._owners: list[torch.Tensor] = []  # per column layout, each column's adapter index [R]
        for name in sorted({m for adapter in adapters for m in adapter.factors}):
            present = [(i, a.factors[name]) for i, a in enumerate(adapters) if name in a.factors]
            module = model.get_submodule(name)
            # A stacked [R, in], B stacked [out, R], R padded with zero factors to whole RANK_STEPs
            a_stack = torch.cat([a for _, (a, _) in present])
            pad = -a_stack.shape[0] % RANK_STEP
            a_stack = torch.cat([a_stack, a_stack.new_zeros(pad, a_stack.shape[1])])
            outputs = present[0][1][1].shape[0]
            b_stack = torch.cat([*(b for _, (_, b) in present), a_stack.new_zeros(outputs, pad)], 1)
            module.register_buffer(_A, a_stack.to(device, dtype), False)
            module.register_buffer(_B, b_stack.to(device, dtype), False)
            # Each column's adapter; the padding's, -2, is no token's (the base model's tokens are -1).
            columns = tuple(i for i, (a, _) in present for _ in range(a.shape[0])) + (-2,) * pad
            if columns not in layouts:  # one mask per column layout and batch, shared by its modules
                layouts[columns] = len(self._owners)
                self._owners.append(torch.tensor(columns, device=device))
            setattr(module, _SET, self._number)
            setattr(module, _KEY, 2 * layouts[columns])
            setattr(module, _INNER, None)
            self._modules[name] = module
        # Bound once: the forward a compiled layer traced is the one it finds at every later entry.
        self._forwards = [(m, types.MethodType(_adapted_forward, m)) for m in self._modules.values()]
        log.info(
            "%d LoRA adapters (%s) on %d projections",
            len(self.names),
            ", ".join(self.names),
            len(self._modules),
        )

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The adapted projections."""
        return tuple(self._modules.values())

    def product_widths(self) -> list[tuple[int, int]]:
        """The (inner, outer) widths of the deltas' two products: x [T, in] by A^T [in, R], then by B^T
        [R, out]."""
        widths = set()
        for module in self._modules.values():
            a, b = getattr(module, _A), getattr(module, _B)
            widths |= {(int(a.shape[1]), int(a.shape[0])), (int(b.shape[1]), int(b.shape[0]))}
        return sorted(widths)

    def restrict_within(self, outer: Sequence[nn.Module]) -> None:
        """Projections that are, or sit inside, one of `outer` (the last layer's modules that run at the
        pooled rows only) read the masks of the restricted rows."""
        inside = {id(module) for parent in outer for module in parent.modules()}
        for module in self._modules.values():
            if id(module) in inside:
                setattr(module, _KEY, getattr(module, _KEY) | 1)

    @contextmanager
    def active(self, token_adapters: torch.Tensor, rows: torch.Tensor | None = None) -> Iterator[None]:
        """Within the block, every adapted projection adds each token's adapter delta; `token_adapters` [T]
        is the adapter index of every row of the packed input (-1: none); `rows`, where the last layer runs
        at the pooled rows only, those rows (models.pooled_rows)."""
        masks: dict[int, torch.Tensor] = {}
        for layout, owner in enumerate(self._owners):
            full = (owner[None, :] == token_adapters[:, None]).to(self._dtype)
            torch._dynamo.maybe_mark_dynamic(full, 0)
            masks[2 * layout] = full
            picked = full if rows is None else full.index_select(0, rows)
            torch._dynamo.maybe_mark_dynamic(picked, 0)
            masks[2 * layout + 1] = picked
        _MASKS[self._number] = masks
        swapped: list[nn.Module] = []
        try:
            for module, forward in self._forwards:
                setattr(module, _INNER, module.__dict__.get("forward"))  # a swapped-in forward, or None
                swapped.append(module)
                module.forward = forward
            yield
        finally:
            for module in swapped:
                inner = getattr(module, _INNER)
                if inner is None:
                    del module.forward
                else:
                    module.forward = inner
                setattr(module, _INNER, None)
            _MASKS.pop(self._number, None)

    def apply_heads(
        self, logits: torch.Tensor, pooled: torch.Tensor, row_adapters: Sequence[int], per_row: bool = False
    ) -> None:
        """Replace, in place, the logits [N, L] of rows whose adapter has its own head by that head's on
        their pooled states [N, H] (`per_row`: each row alone, as the deterministic setting runs heads)."""
        for index, head in self.heads.items():
            rows = [row for row, adapter in enumerate(row_adapters) if adapter == index]
            if not rows:
                continue
            at = torch.tensor(rows, device=logits.device)
            states = pooled.index_select(0, at).to(next(head.parameters()).dtype)
            own = torch.cat([head(row[None]) for row in states]) if per_row else head(states)
            logits.index_copy_(0, at, own.float())


def load_adapters(
    directories: Mapping[str, Path],
    model: nn.Module,
    head_name: str | None,
    device: torch.device,
    dtype: torch.dtype,
    layers: nn.Module | None = None,
    chain: nn.Module | None = None,
) -> AdapterSet | None:
    """Every adapter of `directories` read (read_adapter) and stacked (None when there are none)."""
    if not directories:
        return None
    adapters = [
        read_adapter(name, directory, model, head_name, layers, chain)
        for name, directory in directories.items()
    ]
    return AdapterSet(adapters, model, device, dtype)

"""LoRA adapters beside one base model: PEFT directories read at start-up, each request naming one (or none),
and a batch that mixes them run as one packed forward.

Each adapted projection computes y = W x + B_a (A_a x) s_a for the adapter a of x's token. The adapters' A
matrices of a projection are stacked into one [R, in] matrix (R the sum of their ranks) and their B matrices,
scaled, into one [out, R]: a batch's delta is then two matmuls, (x A^T * mask) B^T, the mask [T, R] keeping
each token's own adapter's columns (zero for the base model's tokens). Every adapter's shrink is computed for
every token of the batch and masked (R (1/in + 1/out) more arithmetic per projection); punica's SGMV and
S-LoRA's kernels compute only each token's own, which pays off where many adapters of large rank meet. Two
matmuls and a mask are graph-, compile- and determinism-friendly and need no sort of the tokens.

An adapter saved for sequence classification also carries its own head (PEFT's `modules_to_save`: the
trained `score`); its requests' rows are scored with it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from models.errors import ModelLoadError
from models.settings import parse_adapters

__all__ = ["Adapter", "AdapterSet", "load_adapters", "parse_adapters", "read_adapter"]

log = logging.getLogger(__name__)

_PREFIX = "base_model.model."
# adapter_config.json values score-worker runs as PEFT does; anything else is refused with its name.
_PLAIN = {"bias": "none", "use_dora": False, "fan_in_fan_out": False, "lora_bias": False}


@dataclass(frozen=True)
class Adapter:
    """One PEFT LoRA adapter: per adapted module (its path in the model), A [r, in] and B [out, r] scaled
    by lora_alpha / r (or / sqrt(r) with rsLoRA); its own head where it saved one."""

    name: str
    rank: int
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    head: nn.Module | None


def read_adapter(name: str, directory: Path, model: nn.Module, head_name: str | None) -> Adapter:
    """A PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) checked against `model`:
    every module it adapts exists with the shapes its factors need; ModelLoadError otherwise."""
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise ModelLoadError(
            f"adapter {name!r}: {str(directory)!r} is not a PEFT adapter directory (adapter_config.json and "
            "adapter_model.safetensors)"
        )
    config = json.loads(config_path.read_text())
    if config.get("peft_type") != "LORA":
        raise ModelLoadError(
            f"adapter {name!r} is a {config.get('peft_type')!r} adapter; only LoRA is served"
        )
    for key, plain in _PLAIN.items():
        if config.get(key, plain) != plain:
            raise ModelLoadError(
                f"adapter {name!r} sets {key}={config.get(key)!r}, which score-worker does not run; merge it "
                "into the weights with PEFT and serve the merged model instead"
            )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ModelLoadError(f"adapter {name!r} gives modules their own ranks; merge it into the weights")
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
    for module, (a, b) in factors.items():
        _check_factors(name, model, module, a, b)
    head = _adapter_head(name, model, head_name, head_weights) if head_weights else None
    return Adapter(name, rank, factors, head)


def _check_factors(name: str, model: nn.Module, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
    try:
        target = model.get_submodule(module)
    except AttributeError:
        raise ModelLoadError(f"adapter {name!r} adapts {module!r}, which the model does not have") from None
    projection = getattr(target, "linear", target)  # a row-parallel wrapper holds its projection
    shape = (int(getattr(projection, "out_features", 0)), int(getattr(projection, "in_features", 0)))
    if a.shape[1] != shape[1] or b.shape[0] != shape[0] or a.shape[0] != b.shape[1]:
        raise ModelLoadError(
            f"adapter {name!r}: the factors of {module!r} ({list(a.shape)}, {list(b.shape)}) do not fit its "
            f"projection [{shape[0]}, {shape[1]}]; was it trained on this base model?"
        )


def _adapter_head(
    name: str, model: nn.Module, head_name: str | None, weights: dict[str, torch.Tensor]
) -> nn.Module:
    """A copy of the model's head with the adapter's trained weights (PEFT's modules_to_save)."""
    import copy

    assert head_name is not None
    head = copy.deepcopy(model.get_submodule(head_name))
    own = dict(head.named_parameters())
    if set(weights) != set(own) or any(weights[k].shape != own[k].shape for k in own):
        raise ModelLoadError(
            f"adapter {name!r} saves a head ({', '.join(sorted(weights))}) of another shape than the "
            f"model's ({', '.join(sorted(own))})"
        )
    with torch.no_grad():
        for key, parameter in own.items():
            parameter.copy_(weights[key])
    return head


class AdapterSet:
    """The adapters a worker serves, their factors stacked per module on the device (module docstring).
    Adapter i of `names` is index i; -1 is the base model."""

    def __init__(
        self, adapters: Sequence[Adapter], model: nn.Module, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.names = tuple(adapter.name for adapter in adapters)
        self.heads = {i: a.head.to(device=device, dtype=dtype) for i, a in enumerate(adapters) if a.head}
        self._modules: dict[str, nn.Module] = {}
        # Per module: A stacked [R, in], B stacked [out, R], and each column's adapter index [R].
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        owners: dict[tuple[int, ...], torch.Tensor] = {}
        for module in sorted({m for adapter in adapters for m in adapter.factors}):
            present = [(i, a.factors[module]) for i, a in enumerate(adapters) if module in a.factors]
            a_stack = torch.cat([a for _, (a, _) in present]).to(device=device, dtype=dtype)
            b_stack = torch.cat([b for _, (_, b) in present], dim=1).to(device=device, dtype=dtype)
            columns = tuple(i for i, (a, _) in present for _ in range(a.shape[0]))
            if columns not in owners:  # one tensor per column layout, so that a batch builds each mask once
                owners[columns] = torch.tensor(columns, device=device)
            self._stacks[module] = (a_stack, b_stack, owners[columns])
            self._modules[module] = model.get_submodule(module)
        log.info(
            "%d LoRA adapters (%s) on %d projections",
            len(self.names),
            ", ".join(self.names),
            len(self._stacks),
        )

    @contextmanager
    def active(self, token_adapters: torch.Tensor) -> Iterator[None]:
        """Within the block, every adapted projection adds each token's adapter delta; `token_adapters` [T]
        is the adapter index of every row of the packed input (-1: none)."""
        masks: dict[int, torch.Tensor] = {}  # by the owner tensor: modules with one column layout share it
        swapped: list[tuple[nn.Module, Callable[..., torch.Tensor] | None]] = []
        try:
            for module_name, module in self._modules.items():
                a_stack, b_stack, owner = self._stacks[module_name]
                key = id(owner)
                if key not in masks:
                    masks[key] = (owner[None, :] == token_adapters[:, None]).to(a_stack.dtype)
                inner = module.__dict__.get("forward")
                swapped.append((module, inner))
                module.forward = _adapted(module, inner, a_stack, b_stack, masks[key])
            yield
        finally:
            for module, inner in swapped:
                if inner is None:
                    del module.forward
                else:
                    module.forward = inner

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


def _adapted(
    module: nn.Module,
    inner: Callable[..., torch.Tensor] | None,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    mask: torch.Tensor,
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        base = inner(x) if inner is not None else type(module).forward(module, x)
        flat = x.reshape(-1, x.shape[-1]).to(a_stack.dtype)
        delta = ((flat @ a_stack.T) * mask) @ b_stack.T
        return base + delta.reshape(*base.shape[:-1], delta.shape[-1]).to(base.dtype)

    return forward


def load_adapters(
    directories: Mapping[str, Path], model: nn.Module, head_name: str | None, device: torch.device,
    dtype: torch.dtype,
) -> AdapterSet | None:  # fmt: skip
    """Every adapter of `directories` read and stacked (None when there are none)."""
    if not directories:
        return None
    adapters = [read_adapter(name, directory, model, head_name) for name, directory in directories.items()]
    return AdapterSet(adapters, model, device, dtype)

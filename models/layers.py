"""The layer stacks of HF models: where they are, which of them run under torch.compile, and their window."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from models.loading import LoadedModel
from models.reductions import one_pass_rows


class CompiledLayers:
    """The decoder layers of a base model under torch.compile, swapped in only for the packed forward.

    One layer at a time rather than the whole model: the layers share one compiled graph (their weights are
    its inputs), compiling takes seconds rather than minutes, and the packed attention kwargs, the pooling
    and the head stay eager. Token counts are dynamic, so batches of any size reuse the graph. HF's own
    forward (the self-check's reference, the plain padded path) keeps the eager layers: it calls them with
    other arguments (masks, caches), each of which would cost a compilation.
    """

    # The layers share their class's forward, so torch.compile keeps all their graphs under one code object
    # and counts them against one recompile limit (8 by default). The last layer at the pooled rows, shared
    # prefixes, gathered keys, a one-token batch and rows read at token positions each add graphs, LoRA
    # adapters (their adapted projections) double them, and so do the prefix cache's batches (a graph
    # break around its traffic: models/prefix_cache.py); past the limit the layers would run eager for the
    # rest of the process. This leaves room for every combination.
    RECOMPILE_LIMIT = 64

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self._layers = list(layers)
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, self.RECOMPILE_LIMIT)
        self._compiled = [torch.compile(layer.forward, dynamic=True) for layer in self._layers]
        self._reductions: contextlib.AbstractContextManager[None] = contextlib.nullcontext()

    def __enter__(self) -> CompiledLayers:
        for layer, compiled in zip(self._layers, self._compiled, strict=True):
            layer.forward = compiled
        # Traced and compiled on this thread, at a batch's first call: with one-pass row reductions.
        self._reductions = one_pass_rows()
        self._reductions.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._reductions.__exit__(None, None, None)
        for layer in self._layers:
            del layer.forward  # the class's forward again


def sliding_window(config: Any) -> int | None:
    """The tokens a windowed layer of this model lets a token see (itself included), or None when no layer
    has a window. HF configs carry a window some models do not use: Qwen2's unless use_sliding_window,
    Gemma's only on layers typed "sliding_attention"."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def decoder_layers(base: torch.nn.Module) -> torch.nn.ModuleList | None:
    """`base`'s decoder layers (its `layers` list), or None when it has none (encoders)."""
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        return None
    return layers


def transformer_layers(base: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The layer stack of a decoder (`layers`) or of a BERT-style encoder (`encoder.layer`), or None."""
    layers = decoder_layers(base)
    if layers is not None:
        return layers
    stack = getattr(getattr(base, "encoder", None), "layer", None)
    return stack if isinstance(stack, torch.nn.ModuleList) and len(stack) > 0 else None


def compile_layers(base: torch.nn.Module) -> CompiledLayers | None:
    """CompiledLayers for `base`'s decoder layers, or None when it has none."""
    layers = decoder_layers(base)
    return None if layers is None else CompiledLayers(layers)


def traced_graphs() -> int:
    """Graphs torch.compile has traced in this process so far."""
    import torch._dynamo.utils  # loaded with torch.compile; imported here for a process that never compiled

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def is_causal_decoder(loaded: LoadedModel) -> bool:
    """A decoder whose tokens see only earlier ones: no encoder, token types or padded positions (what
    shared prefixes and the last layer at the pooled rows need)."""
    return not (loaded.encoder or loaded.token_types or loaded.position_pad is not None)

"""The prefix cache's side in Gated DeltaNet layers: the recurrent state and the convolution's last inputs
at the end of each block kept, and a prompt with cached tokens starting each such layer from them.

A Gated DeltaNet layer has no keys and values to keep: everything a later token reads of a prefix is the
layer's recurrent state after it ([Hv, Dk, Dv], float32) and the last W-1 inputs of its causal convolution
([W-1, C], C = 2 Dk Hk + Dv Hv). The cache (models/prefix_cache.py) keeps both for every block it holds, in
pools of their own beside the keys and values, so that a prompt's deepest cached block is where its layers
start, as a shared prefix's suffixes start from where their prefix ended (models/linear_attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CachedStates:
    """What a hybrid model keeps in the prefix cache for its Gated DeltaNet layers: their `layer_idx`, in
    the pools' order, and the convolution's window."""

    layers: tuple[int, ...]
    width: int

    def refusal(self, block_tokens: int) -> str | None:
        """Why blocks of `block_tokens` cannot hold a layer's convolution inputs (None: they can): a block's
        last W-1 inputs are read from its own rows."""
        if block_tokens < self.width - 1:
            return (
                f"blocks of {block_tokens} tokens are shorter than the Gated DeltaNet convolution's "
                f"{self.width - 1} earlier inputs a block keeps; set prefix_cache_block_tokens to at least "
                f"{self.width - 1}"
            )
        return None

    def io(
        self,
        pools: Sequence[torch.Tensor],
        last_slots: Sequence[int],
        resumed: Sequence[int] | None,
        capture_rows: torch.Tensor | None,
        block_tokens: int,
    ) -> StateIO:
        """One batch's traffic: `pools` the cache's (states [Lg, slots, Hv, Dk, Dv], windows [Lg, slots,
        W-1, C]; empty before the first block is kept), `last_slots` per prompt the slot of the block its
        cached run ends with (-1: none), `resumed` per sequence of the packed row the prompt whose cached
        run it continues (-1: none), `capture_rows` the rows of the blocks the batch keeps, block after
        block."""
        starts = None
        if resumed is not None and pools and last_slots:
            slots = [last_slots[prompt] if prompt >= 0 else -1 for prompt in resumed]
            starts = torch.tensor(slots, dtype=torch.int64).to(pools[0].device, non_blocking=True)
        ends: list[int] = []
        windows = None
        if capture_rows is not None:
            spans = capture_rows.view(-1, block_tokens)  # [K, B]
            ends = [int(row) for row in spans[:, -1].tolist()]
            windows = spans[:, block_tokens - (self.width - 1) :]  # [K, W-1]
        return StateIO(self, tuple(pools), starts, ends, windows)


class StateIO:
    """One batch's traffic between the prefix cache and its Gated DeltaNet layers: each layer reads the
    states its sequences start from (`starts`), and gives the states and convolution inputs where the
    batch's kept blocks end (`windows`, `keep`), which the cache stores with the blocks' keys and values."""

    def __init__(
        self,
        layout: CachedStates,
        pools: tuple[torch.Tensor, ...],
        starts: torch.Tensor | None,
        ends: list[int],
        windows: torch.Tensor | None,
    ) -> None:
        self._order = {layer: index for index, layer in enumerate(layout.layers)}
        self._pools = pools
        self._starts = starts  # [S] int64: per sequence of the row, the slot it starts from (-1: none)
        self.ends = ends  # the rows right after which a kept block ends, block by block
        self._window_rows = windows  # [K, W-1] int64: the rows of each kept block's last inputs
        self._kept: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(layout.layers)

    def starts(self, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where each sequence of the row starts in the layer `module` is: (states [S, Hv, Dk, Dv], last
        convolution inputs [S, W-1, C]), float32, zeros for a sequence without cached tokens (the start of
        a prompt); None when no sequence has any."""
        if self._starts is None:
            return None
        layer = self._order[int(module.layer_idx)]  # type: ignore[arg-type]
        slots, cached = self._starts.clamp(min=0), self._starts >= 0
        states = self._pools[0][layer].index_select(0, slots)
        windows = self._pools[1][layer].index_select(0, slots)
        zero = states.new_zeros(())
        return (
            torch.where(cached.view(-1, 1, 1, 1), states, zero),
            torch.where(cached.view(-1, 1, 1), windows, zero),
        )

    def windows(self, mixed: torch.Tensor) -> torch.Tensor | None:
        """The kept blocks' last convolution inputs [K, W-1, C] float32, of a layer's inputs `mixed` [T, C]
        (before the convolution); None when the batch keeps no block."""
        if self._window_rows is None:
            return None
        return mixed[self._window_rows].float()

    def keep(
        self, module: torch.nn.Module, states: torch.Tensor | None, windows: torch.Tensor | None
    ) -> None:
        """The layer's states right after each kept block [K, Hv, Dk, Dv] and its inputs `windows`."""
        if states is None or windows is None:
            return
        self._kept[self._order[int(module.layer_idx)]] = (states, windows)  # type: ignore[arg-type]

    def captured(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's kept states [Lg, K, Hv, Dk, Dv] and convolution inputs [Lg, K, W-1, C]."""
        if any(kept is None for kept in self._kept):
            raise RuntimeError("a Gated DeltaNet layer did not pass through the prefix cache")
        states, windows = zip(*self._kept, strict=True)
        return torch.stack(states), torch.stack(windows)

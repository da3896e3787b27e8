"""The last decoder layer's MLP at the pooled rows only.

A decoder's result for an item is its hidden state at one row (the pooled token: its last). Every layer but
the last must run at every row, since the next layer's keys and values come from all of them; the last
layer's output is read at the pooled rows alone. Its attention still needs the keys and values of every row,
but its MLP, most of a layer's work, is needed only at the rows pooled. On W1 (8B shapes, a few hundred
tokens an item) that is about 2.5% of a batch's arithmetic (docs/benchmarks.md).

The other rows of the last layer's output keep the attention's contribution without the MLP's, and the
final norm runs over them: they are never read (models.packing.pool selects the pooled rows). Batches that
average all rows (MEAN pooling) keep the whole MLP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class LastMlpAtPooledRows:
    """Inside `at(rows)`, `mlp`'s forward computes only `rows` of its [..., H] input and returns zeros at
    the others.

    It calls the forward that was in place when the block was entered (the fused kernel's, models/fused_mlp,
    or the class's), on the selected rows. The swapped forward is made once, and it reads the rows from this
    object, so a compiled layer that traced it finds the same function on every entry and takes each batch's
    rows as an input (their count is a dynamic size, like the token count).
    """

    def __init__(self, mlp: nn.Module) -> None:
        self._mlp = mlp
        self._inner: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.rows: torch.Tensor | None = None

        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            rows = self.rows
            assert rows is not None, "the pooled rows are set by at(rows)"
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            picked = flat.index_select(0, rows)
            inner = self._inner
            out = inner(picked) if inner is not None else type(mlp).forward(mlp, picked)
            # index_copy, not index_put with accumulate: each row is written once, in a fixed order.
            whole = torch.zeros_like(flat).index_copy(0, rows, out.to(flat.dtype))
            return whole.reshape(hidden_states.shape)

        self._forward = forward

    def at(self, rows: torch.Tensor) -> LastMlpAtPooledRows:
        """The block in which the MLP computes `rows` (a 1-D index tensor on the model's device) only."""
        self.rows = rows
        return self

    def __enter__(self) -> LastMlpAtPooledRows:
        self._inner = self._mlp.__dict__.get("forward")  # a swapped-in forward (fused MLP), or None
        self._mlp.forward = self._forward
        return self

    def __exit__(self, *exc: object) -> None:
        if self._inner is None:
            del self._mlp.forward  # the class's forward again
        else:
            self._mlp.forward = self._inner
        self._inner = None
        self.rows = None


def padded_rows(rows: torch.Tensor, slots: int) -> torch.Tensor:
    """`rows` (one per item) padded to `slots` entries by repeating the last: the length a CUDA graph of the
    batch's shape holds (models/graphs.py), so that the ordinary forward multiplies the same number of rows
    and gets the bits a replay gets. The repeats compute the same values into the same row."""
    missing = slots - rows.shape[0]
    return rows if missing <= 0 else torch.cat([rows, rows[-1:].expand(missing)])


def last_mlp(layers: nn.ModuleList | None) -> nn.Module | None:
    """The last layer's MLP (`mlp`), or None when the stack has no such module."""
    if layers is None or len(layers) == 0:
        return None
    mlp = getattr(layers[-1], "mlp", None)
    return mlp if isinstance(mlp, nn.Module) else None

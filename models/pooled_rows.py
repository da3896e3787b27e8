"""The last decoder layer at the pooled rows only, wherever its rows are independent.

A decoder's result for an item is its hidden state at one row (the pooled token: its last). Every layer but
the last must run at every row, since the next layer's keys and values come from all of them; the last
layer's output is read at the pooled rows alone. Its keys and values still come from every row, but its
query projection, its output projection and its MLP act on each row by itself, and are needed only at the
rows pooled. On W1 (8B shapes, a few hundred tokens an item) the three are about 3% of a batch's arithmetic
(docs/benchmarks.md).

The other rows get zeros from those modules: zero queries (a uniform attention, finite in every kernel),
no attention output, no MLP contribution. The residual stream and the final norm carry them on, and they are
never read (models.packing.pool selects the pooled rows). Batches that average all rows (MEAN pooling) keep
the whole layer. A fused q/k/v projection (Phi-3's `qkv_proj`) keeps computing every row: its keys and
values are needed there.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import torch
from torch import nn

# The last layer's modules that map each row of their input to the same row of their output, where a
# layer has them: the attention's query and output projections, the MLP.
ROW_WISE = ("self_attn.q_proj", "self_attn.o_proj", "mlp")


# The rows of each object's block while it runs, by the object's number. A module global, read by the swapped
# forwards, rather than an attribute of the object they close over: the swapped forwards hang on nn.Modules,
# and torch.compile gives a tensor it reaches through an nn.Module a static shape (a graph per row count,
# then its recompile limit and eager layers). Reached from here, the count is a dynamic size like the token
# count.
_ROWS: dict[int, torch.Tensor] = {}
_NUMBERS = itertools.count()


class LastLayerAtPooledRows:
    """Inside `at(rows)`, each of `modules` computes only `rows` of its [..., in] input and returns zeros
    [..., out] at the others.

    Each calls the forward that was in place when the block was entered (the fused MLP kernel's,
    models/fused_mlp; an FP8 module's; or the class's) on the selected rows. The swapped forwards are made
    once and read the rows from _ROWS, so a compiled layer that traced them finds the same functions on
    every entry and takes each batch's rows as an input whose count is a dynamic size.
    """

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        self.names = tuple(modules)
        self._number = next(_NUMBERS)
        self._modules = tuple(modules.values())
        self._inner: list[Callable[[torch.Tensor], torch.Tensor] | None] = [None] * len(self._modules)
        self._forwards = tuple(self._restricted(i, module) for i, module in enumerate(self._modules))

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The modules restricted to the rows."""
        return self._modules

    @property
    def rows(self) -> torch.Tensor | None:
        """The rows of the block being run, or None outside one."""
        return _ROWS.get(self._number)

    def _restricted(self, index: int, module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        number = self._number

        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            rows = _ROWS[number]  # set by at(rows)
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            picked = flat.index_select(0, rows)
            inner = self._inner[index]
            out = inner(picked) if inner is not None else type(module).forward(module, picked)
            # index_copy, not index_put with accumulate: each row is written once, in a fixed order.
            whole = flat.new_zeros(flat.shape[0], out.shape[-1]).index_copy(0, rows, out.to(flat.dtype))
            return whole.reshape(*hidden_states.shape[:-1], out.shape[-1])

        return forward

    def at(self, rows: torch.Tensor) -> LastLayerAtPooledRows:
        """The block in which the modules compute `rows` (a 1-D index tensor on the model's device, padded
        to models.graphs.pooled_row_slots, never one long) only."""
        torch._dynamo.maybe_mark_dynamic(rows, 0)  # dynamic from the first batch on, not from the second
        _ROWS[self._number] = rows
        return self

    def __enter__(self) -> LastLayerAtPooledRows:
        for index, module in enumerate(self._modules):
            self._inner[index] = module.__dict__.get("forward")  # a swapped-in forward, or None
            module.forward = self._forwards[index]
        return self

    def __exit__(self, *exc: object) -> None:
        for index, module in enumerate(self._modules):
            inner = self._inner[index]
            if inner is None:
                del module.forward  # the class's forward again
            else:
                module.forward = inner
            self._inner[index] = None
        _ROWS.pop(self._number, None)


def padded_rows(rows: torch.Tensor, slots: int) -> torch.Tensor:
    """`rows` (one per item) padded to `slots` entries by repeating the last: the length a CUDA graph of the
    batch's shape holds (models/graphs.py), so that the ordinary forward multiplies the same number of rows
    and gets the bits a replay gets. The repeats compute the same values into the same row."""
    missing = slots - rows.shape[0]
    return rows if missing <= 0 else torch.cat([rows, rows[-1:].expand(missing)])


def last_layer_row_wise(layers: nn.ModuleList | None) -> dict[str, nn.Module]:
    """The last layer's row-wise modules (ROW_WISE) that it has, by dotted name; empty when the stack has
    no layer."""
    if layers is None or len(layers) == 0:
        return {}
    found: dict[str, nn.Module] = {}
    for name in ROW_WISE:
        try:
            found[name] = layers[-1].get_submodule(name)
        except AttributeError:  # not in this architecture (Phi-3 fuses its query projection)
            continue
    return found

"""Running the model on a batch: the packed padding-free forward with its speed-ups (FP8 projections, fused
MLPs, compiled layers, CUDA graphs, the last layer at the pooled rows) and its mixture-of-experts blocks, the
padded forward for models that cannot be packed, and each item's pooled hidden state."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from models.adapters import AdapterSet, load_adapters
from models.checkpoint_heads import head_name
from models.config import ScorerConfig
from models.errors import ModelLoadError
from models.fp8 import fp8_supported, quantize_layers
from models.graphs import GraphedForward, pooled_row_slots
from models.layers import (
    CompiledLayers,
    compile_layers,
    decoder_layers,
    is_causal_decoder,
    sliding_window,
    traced_graphs,
    transformer_layers,
)
from models.linear_attention import plain_kernels
from models.loading import LoadedModel
from models.mechanisms import linear_layers, moe_blocks, prefix_cache
from models.packing import (
    KeyLayout,
    PackedBatch,
    Pooling,
    PrefixCross,
    SharedPrefix,
    pack,
    pool,
    pool_each,
    pooled_positions,
    position_rows,
)
from models.pooled_rows import LastLayerAtPooledRows, last_layer_row_wise, padded_rows
from models.prefix_cache import CacheIO, CacheUse, PrefixCache
from models.prepare import Prompt
from models.tiles import RowTiles, rows_invariant
from models.vision import ImageInputs
from models.vision_packed import PackedImages

if TYPE_CHECKING:
    from models.fused_mlp import FusedMlps

log = logging.getLogger(__name__)


class Executor:
    """Turns a batch's prompts into their pooled hidden states [N, H] on the device (float32 for MEAN).

    It owns the model's forward and everything that changes how it runs: which attention path
    (`attention`: "varlen", "reference" or "plain"), the FP8 projections (swapped in at construction),
    the fused MLPs, the compiled layers and the CUDA graphs of small batches (swapped in around each packed
    forward only, so HF's own modules serve every other caller, such as the self-check's reference).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: ScorerConfig,
        device: torch.device,
        dtype: torch.dtype,
        attention: str,
        pooling: Pooling,
    ) -> None:
        self._loaded = loaded
        self._config = config
        self.device, self.dtype, self.attention, self.pooling = device, dtype, attention, pooling
        text_config = loaded.model.config.get_text_config()
        self.hidden_size = int(text_config.hidden_size)
        # Read once: the worker's prepare thread asks while the model thread runs, and a transformers
        # config's attribute lookup costs tens of microseconds.
        self.sliding_window = sliding_window(text_config)
        self.moe_blocks = moe_blocks(loaded)
        # Gated DeltaNet layers on the packed path (models/linear_attention.py); None: the model has none.
        self.linear_layers = linear_layers(loaded, config, device, attention)
        self._plain_kernels = plain_kernels(text_config, device, dtype)  # HF's own Gated DeltaNet, padded
        if config.quantization == "fp8":
            self._quantize_fp8()
        self.adapters = self._load_adapters()
        # The deterministic setting on packed batches: every product in tiles of this many rows (None: off,
        # or every item alone). Decided before the fused, compiled and graphed forms, which it keeps out.
        self.row_tiles = self._row_tiles()
        self.fused_mlps = None if self.row_tiles is not None else self._fuse_mlps()
        self.pooled_layer = self._last_layer_at_pooled_rows()
        if self.adapters is not None and self.pooled_layer is not None:
            self.adapters.restrict_within(self.pooled_layer.modules)
        self.prefix_cache, self._cache_layout = prefix_cache(loaded, config, pooling, self.linear_layers)
        # The tokens the last packed batch's row computed (shared prefixes once, cached ones not at all);
        # None after a padded or item-by-item batch.
        self.row_tokens: int | None = None
        self.compiled_layers: CompiledLayers | None = None
        hybrid, vision = self.linear_layers is not None, loaded.vision is not None
        if config.resolve_compile(attention, device) and self.row_tiles is None and not hybrid:
            self.compiled_layers = compile_layers(loaded.base)
            if self.compiled_layers is None:
                log.info("%s has no decoder layer list to compile: it runs eager", loaded.name)
        self.packed_images = PackedImages.of(
            loaded, config, device, dtype, attention, pooling, self.linear_layers
        )
        self.graphs = self._graphs(hybrid or vision)

    def _graphs(self, unrecordable: bool) -> GraphedForward | None:
        """The CUDA-graphed packed forward where the settings ask for it and the model's paths allow it;
        `unrecordable`: a hybrid's or an image-text model's forward, which graphs cannot record."""
        config, loaded, device, attention = self._config, self._loaded, self.device, self.attention
        dtype = self.dtype
        graph_safe = self.moe_blocks is None or self.moe_blocks.graph_safe()
        if config.resolve_graphs(device, attention) and self.row_tiles is None and not graph_safe:
            log.info(
                "%s: no CUDA graphs, its experts multiply per expert with run lengths read on the host "
                "(the grouped kernels need torch's bfloat16 product on sm90/sm100, or Triton)",
                loaded.name,
            )
        elif config.resolve_graphs(device, attention) and self.row_tiles is None and not unrecordable:
            return GraphedForward(
                self._fast_packed_forward,
                device,
                config.graph_tokens,
                self.hidden_size,
                dtype,
                token_types=loaded.token_types,
                pooled_rows=self.pooled_layer is not None,
                recorder=config.graph_recorder,
            )
        elif config.cuda_graphs == "on" and self.packed_images is not None:
            log.info("%s: no CUDA graphs, the image-text packed path does not record them", loaded.name)
        elif config.cuda_graphs == "on":
            log.info("%s takes the %s path, which CUDA graphs cannot record", loaded.name, attention)
        return None

    def _quantize_fp8(self) -> None:
        """Swap the layers' projections for FP8 ones, or refuse to load (ModelLoadError)."""
        reason = fp8_supported(self.device)
        if reason is None and self.device.type == "cuda" and self.dtype != torch.bfloat16:
            reason = f"FP8 projections on CUDA produce bfloat16 (row-wise scales), not {self.dtype}"
        layers = transformer_layers(self._loaded.base)
        if reason is None and layers is None:
            reason = f"{self._loaded.name} has no layer list whose projections could run in FP8"
        if reason is not None or layers is None:
            raise ModelLoadError(f"quantization='fp8': {reason}")
        selection = self._config.fp8_selection
        try:
            replaced, kept = quantize_layers(layers, selection)
        except ValueError as exc:
            raise ModelLoadError(f"quantization='fp8': {exc}") from exc
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the bfloat16 weights just dropped
        log.info(
            "%s: %d projections of its %d layers run in FP8 e4m3 (%s projections, layers kept whole: %s; "
            "%d of other shapes do not)",
            self._loaded.name, replaced, len(layers), selection.projections,
            list(selection.keep_layers) or "none", kept,
        )  # fmt: skip

    def _load_adapters(self) -> AdapterSet | None:
        """The LoRA adapters of the `adapters` setting, on the (possibly FP8) projections; None without."""
        loaded = self._loaded
        head = None if loaded.judge or loaded.value_head else head_name(loaded.model)
        layers = transformer_layers(loaded.base)
        return load_adapters(
            self._config.adapter_dirs, loaded.model, head, self.device, self.dtype, layers, loaded.head
        )

    @contextlib.contextmanager
    def prefix_cache_paused(self, scratch: PrefixCache | None = None) -> Iterator[None]:
        """Batches inside neither read nor fill the prefix cache (they use `scratch` instead, where given):
        the start-up warm-up (which scores each kind of batch twice, the second time for its CUDA graph,
        then compiles the cache's kinds on a scratch cache) and the self-check."""
        cache, self.prefix_cache = self.prefix_cache, scratch
        try:
            yield
        finally:
            self.prefix_cache = cache

    def _row_tiles(self) -> int | None:
        """The deterministic setting's tile of rows (models/tiles.py) where its batches can be packed with
        every product tiled and the device sums a row alike wherever it sits in a tile; None where the
        setting is off, or each item must run alone (said in the log, with the reason)."""
        config, loaded = self._config, self._loaded
        if not config.deterministic or config.deterministic_tile_rows == 0:
            return None
        rows = config.deterministic_tile_rows
        why = None
        if not loaded.packable:
            why = f"{loaded.name} runs padded batches, whose attention follows the longest item"
        elif loaded.judge:
            why = "a judge's label columns are the batch's, and a product's kernel follows their count"
        elif config.quantization == "fp8":
            why = "FP8 products run torch._scaled_mm, whose kernel follows the batch's rows"
        elif config.tensor_parallel > 1:
            why = "the ranks' partial sums are reduced in chunks that follow the batch's size"
        elif self.moe_blocks is not None:
            why = "an expert's product takes the rows routed to it, whose count follows the batch"
        elif self.linear_layers is not None:
            why = "the Gated DeltaNet kernels batch a row's sequences in shapes that follow the batch"
        elif self.attention == "varlen" and config.varlen_kernel_name(self.attention, self.device) != "flash":
            why = "only torch's flash kernel is known to tile each sequence from its own first row"
        else:
            # The model's projections and heads, and the LoRA deltas' two products where adapters are served.
            widths = {
                (m.in_features, m.out_features)
                for m in loaded.model.modules()
                if isinstance(m, torch.nn.Linear)
            }
            widths |= set(self.adapters.product_widths() if self.adapters is not None else ())
            why = rows_invariant(rows, sorted(widths), self.device, self.dtype)
        if why is not None:
            log.warning("deterministic: every item runs alone (%s)", why)
            return None
        log.info("deterministic: batches packed, every product in tiles of %d rows", rows)
        return rows

    def _last_layer_at_pooled_rows(self) -> LastLayerAtPooledRows | None:
        """The last layer's row-wise modules restricted to the pooled rows (models/pooled_rows.py), where set,
        on a causal decoder's varlen path (the exact path stays HF's arithmetic) whose pooling selects rows
        (MEAN reads every row); else None."""
        wanted = self._config.last_layer_pooled_rows and self.pooling != "mean"
        if not (wanted and self.attention == "varlen" and is_causal_decoder(self._loaded)):
            return None
        if self.linear_layers is not None:
            return None
        modules = last_layer_row_wise(decoder_layers(self._loaded.base))
        if not modules:
            return None
        log.info("the last layer's %s run only at the rows a batch pools", ", ".join(modules))
        return LastLayerAtPooledRows(modules)

    def _fuse_mlps(self) -> FusedMlps | None:
        """The layers' SiLU-gated MLPs on the fused kernel where the setting asks (models/fused_mlp.py), or
        None; ModelLoadError when "on" cannot be had."""
        try:
            wanted = self._config.resolve_fused_mlp(self.device, self.dtype, self.attention, self.hidden_size)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        if not wanted:
            return None
        from models.fused_mlp import FusedMlps  # imports Triton: only where the kernel is wanted

        name = self._loaded.name
        layers = decoder_layers(self._loaded.base)
        fused = None if layers is None else FusedMlps.of(layers)
        if fused is None:
            log.info("%s has no SiLU-gated MLP the fused kernel takes: its MLPs stay as loaded", name)
        else:
            log.info("%s: the gate/up products and SiLU of %d MLPs run as one kernel", name, len(fused))
        return fused

    @property
    def compiled(self) -> bool:
        """The packed path runs the decoder layers under torch.compile."""
        return self.compiled_layers is not None

    def traced_graphs(self) -> int:
        """Graphs torch.compile has traced in this process so far (0 without compiled layers)."""
        return traced_graphs() if self.compiled_layers is not None else 0

    def record_small_batch_graphs(self, max_tokens: int) -> int:
        """Record the CUDA graphs of every small batch a request of a few items can make
        (GraphedForward.record_ahead), up to `max_tokens`; how many were recorded (0 without graphs)."""
        if self.graphs is None:
            return 0
        with torch.inference_mode():
            return self.graphs.record_ahead(max_tokens)

    def pooled(
        self,
        prompts: list[Prompt],
        token_types: list[Prompt] | None,
        shared: Sequence[SharedPrefix],
        positions: Sequence[Sequence[int]] | None = None,
        adapters: Sequence[int] | None = None,
        images: Sequence[ImageInputs] | None = None,
        alone: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each prompt's pooled hidden state [N, H] (float32 for MEAN), the prefixes of `shared` once; and,
        with `positions` (per prompt, token positions), the hidden states at them [M, H], prompt by prompt
        (None without). `adapters`: each prompt's LoRA adapter index (-1: the base model). `images`: each
        prompt's images (image-text models: models/vision_packed.py, or padded)."""
        self.row_tokens = None
        if self._config.deterministic and self.row_tiles is None and not alone:
            # Every item alone: no result depends on what else shares the batch (kernels pick their tiling
            # by the matrix shapes, so a row's rounding can change with the batch).
            outputs = [
                self.pooled(
                    [prompt],
                    None if token_types is None else [token_types[index]],
                    (),
                    positions=None if positions is None else [positions[index]],
                    adapters=None if adapters is None else [adapters[index]],
                    images=None if images is None else [images[index]],
                    alone=True,
                )
                for index, prompt in enumerate(prompts)
            ]
            self.row_tokens = None  # the last item's row only
            pooled = torch.cat([one for one, _ in outputs])
            at = [rows for _, rows in outputs if rows is not None]
            return pooled, torch.cat(at) if at else None
        if self.packed_images is not None:
            return self.packed_images.pooled(prompts, token_types, positions, images)
        if self._loaded.packable:
            return self.packed_pooled(prompts, token_types, shared, positions, adapters)
        return self.padded_pooled(prompts, token_types, positions, adapters, images)

    def packed_pooled(
        self,
        prompts: list[Prompt],
        token_types: list[Prompt] | None,
        groups: Sequence[SharedPrefix] = (),
        positions: Sequence[Sequence[int]] | None = None,
        adapters: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the base model on the packed row, the prefixes of shared `groups` once, and pool each item:
        [N, H] (float32 for MEAN); and the rows at `positions` [M, H] where given. With the prefix cache, a
        prompt's cached prefix is not computed again, and the blocks the batch computes are kept."""
        use = None
        if self.prefix_cache is not None:
            use = self.prefix_cache.plan(
                prompts, self._adapted(adapters), self._cache_limits(prompts, positions)
            )
            if use.regions:  # a prompt with cached tokens shares them with no group
                groups = _without_members(groups, {i for i, run in enumerate(use.hits) if run})
            if not use.active:
                use = None
        packed = pack(
            prompts,
            self.device,
            self.pooling,
            self._loaded.pad_token_id,
            token_types=token_types,
            position_pad=self._loaded.position_pad,
            shared=groups,
            gather_keys=bool(groups) and self._gathers_keys(prompts),
            read_at=positions,
            adapters=self._adapted(adapters),
            cached=None
            if use is None
            else [(use.cached_tokens(i), use.offsets[i]) for i in range(len(prompts))],
            capture=None
            if use is None
            else [(c.prompt, c.start, c.start + use.block_tokens) for c in use.captures],
        )
        self.row_tokens = int(packed.input_ids.shape[1])
        # A replayed graph runs no Python forward: the layers are swapped in only where one runs (in the
        # graphs' own forward when they record, and below). Graphs hold the pooled rows' count of their
        # shape: a batch that also reads positions runs the ordinary forward, as one that uses the prefix
        # cache does (its cached rows and the rows it keeps vary with every batch; no buffer of a graph
        # holds them).
        plain = positions is not None or packed.adapter_rows is not None or use is not None
        hidden = None if self.graphs is None or plain else self.graphs.run(packed)
        if hidden is None:
            hidden = self._eager_packed(packed, use)
        at = None if packed.position_rows is None else hidden.index_select(0, packed.position_rows)
        if self.row_tiles is not None and packed.item_of_token is not None:
            # Item by item: one product over the batch's rows would sum them in tiles that follow the batch.
            return pool_each(hidden, packed), at
        return pool(hidden, packed), at  # [N, H], float32 for MEAN pooling; [M, H]

    def _eager_packed(self, packed: PackedBatch, use: CacheUse | None) -> torch.Tensor:
        """The packed row's forward run in Python (no graph replay): its keys' layout for shared prefixes,
        the adapters active on their rows, and the prefix cache read and written (`use`: its plan)."""
        # The varlen kernel reads the bounds on the device; the exact path loops over items in
        # Python, and reading them from a device tensor would stall on a copy in every layer.
        on_device = self.attention == "varlen"
        cu_seqlens = packed.cu_seqlens if on_device else packed.host_cu_seqlens
        keys = None
        if packed.shared is not None:
            shared = packed.shared
            cu_k = shared.cu_seqlens_k if on_device else shared.host_cu_seqlens_k
            keys = KeyLayout(shared.key_index, cu_k, shared.max_length_k)
        pooled_rows = self._pooled_rows(packed)
        adapted: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if packed.adapter_rows is not None:
            assert self.adapters is not None
            adapted = self.adapters.active(packed.adapter_rows, pooled_rows)
        cache = None
        if use is not None and self.prefix_cache is not None:
            cache = self._cache_layout.io(self.prefix_cache, use, packed.capture_rows, packed.resumed)
        with adapted:
            hidden = self._fast_packed_forward(
                packed.input_ids,
                packed.position_ids,
                cu_seqlens,
                packed.max_length,
                packed.token_type_ids,
                keys=keys,
                cross=packed.cross,
                pooled_rows=pooled_rows,
                prefix_cache=cache,
            )
        if cache is not None and use is not None and use.captures and self.prefix_cache is not None:
            self.prefix_cache.store(use, *cache.captured())
        return hidden

    def _fast_packed_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`packed_forward` with the mixture-of-experts blocks, the compiled layers and the fused MLPs in
        place, where they are set, for the call: HF's own modules stay as they are for everything else (the
        self-check's reference, the padded path). Swapping them costs host time, which a replayed graph does
        not spend. Adapter batches come with their adapted projections swapped in: the compiled layers trace
        them as a variant of their own, and the fused MLPs take the gate and up deltas in their kernel.
        Batches that read or fill the prefix cache run the compiled layers too, its traffic eager between
        their graphs (`CacheIO.extend`)."""
        tiles = RowTiles(self.row_tiles) if self.row_tiles is not None else None
        nothing = contextlib.nullcontext()
        moe = self.moe_blocks or nothing
        with moe, self.compiled_layers or nothing, self.fused_mlps or nothing, tiles or nothing:
            return self.packed_forward(*args, **kwargs)

    def _adapted(self, adapters: Sequence[int] | None) -> Sequence[int] | None:
        """`adapters` where some prompt has one (None: the base model throughout)."""
        if adapters is None or self.adapters is None or max(adapters, default=-1) < 0:
            return None
        return adapters

    def _pooled_rows(self, packed: PackedBatch) -> torch.Tensor | None:
        """The rows at which a batch's last layer computes its row-wise modules (padded as a CUDA graph of
        its shape pads them), or None: the whole layer."""
        if self.pooled_layer is None:
            return None
        if packed.rows_read is not None:  # the positions read are computed too
            return padded_rows(packed.rows_read, pooled_row_slots(packed.rows_read.shape[0]))
        return padded_rows(packed.pooled_rows, pooled_row_slots(len(packed.host_cu_seqlens) - 1))

    def _cache_limits(
        self, prompts: Sequence[Prompt], positions: Sequence[Sequence[int]] | None
    ) -> list[int]:
        """How many first tokens of each prompt may come from the prefix cache: up to the first row its
        results read (the pooled token; any position asked for), which must be computed."""
        lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
        ends = np.cumsum(lengths)
        starts = ends - lengths
        pooled = pooled_positions(prompts, starts, ends, self.pooling, self._loaded.pad_token_id) - starts
        limits: list[int] = pooled.tolist()
        if positions is not None:
            limits = [min([limit, *read]) for limit, read in zip(limits, positions, strict=True)]
        return limits

    def _gathers_keys(self, prompts: Sequence[Prompt]) -> bool:
        """Whether a batch with shared prefixes gathers each sequence's keys: on the exact path, which reads
        them so, and where a sliding window is shorter than a prompt (a suffix's window then ends inside
        its prefix, which the cross pass over the whole prefix cannot express)."""
        if self.attention != "varlen":
            return True
        window = self.sliding_window
        return window is not None and max(len(p) for p in prompts) > window

    def packed_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_length: int,
        token_type_ids: torch.Tensor | None,
        *,
        keys: KeyLayout | None = None,
        cross: PrefixCross | None = None,
        pooled_rows: torch.Tensor | None = None,
        prefix_cache: CacheIO | None = None,
    ) -> torch.Tensor:
        """The base model on one packed row [1, T]: its last hidden states [T, H]. Shared prefixes
        (models/packing.py): suffixes attend to their prefixes through `cross` and, where given, attention
        sequences find their keys through `keys`. With `pooled_rows`, the last layer's row-wise modules run
        at those rows only (models/pooled_rows.py), and only they of the result are meaningful."""
        extra: dict[str, Any] = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        if keys is not None:
            extra["packed_key_index"] = keys.key_index
        if cross is not None:
            extra["prefix_cross"] = cross
        if prefix_cache is not None:
            extra["prefix_cache"] = prefix_cache
        restricted: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if pooled_rows is not None and self.pooled_layer is not None:
            restricted = self.pooled_layer.at(pooled_rows)
        with restricted, self.linear_layers or contextlib.nullcontext():
            output = self._loaded.base(
                input_ids=input_ids,
                position_ids=position_ids,
                **extra,
                use_cache=False,
                # Reach our attention function through HF's **kwargs plumbing (see models/attention.py).
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens if keys is None else keys.cu_seqlens_k,
                max_length_q=max_length,
                max_length_k=max_length if keys is None else keys.max_length_k,
            )
        hidden: torch.Tensor = output.last_hidden_state[0]
        return hidden

    def padded_pooled(
        self,
        prompts: list[Prompt],
        token_types: list[Prompt] | None,
        positions: Sequence[Sequence[int]] | None = None,
        adapters: Sequence[int] | None = None,
        images: Sequence[ImageInputs] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Models whose attention cannot be packed: HF's own forward on a right-padded batch, then the same
        pooling as the packed path: [N, H] (float32 for MEAN); and the rows at `positions` [M, H]. `images`:
        each prompt's pixel values, the vision tower run once on all of them (the model puts each image's
        features at its tokens in row order, which is the prompts' order)."""
        count, width = len(prompts), max(len(p) for p in prompts)
        pad = self._loaded.pad_token_id or 0
        ids = np.full((count, width), pad, dtype=np.int64)
        mask = np.zeros((count, width), dtype=np.int64)
        types = np.zeros((count, width), dtype=np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = prompt
            mask[row, : len(prompt)] = 1
            if token_types is not None:
                types[row, : len(prompt)] = token_types[row]
        vision = self._loaded.vision
        key = "token_type_ids" if vision is None else vision.family.token_types
        extra = {} if token_types is None else {key: torch.from_numpy(types).to(self.device)}
        if images is not None and vision is not None:
            for name, array in vision.forward_images(images).items():
                # Pixel values in the model's dtype; grids stay integers.
                dtype = self.dtype if array.dtype.kind == "f" else None
                extra[name] = torch.from_numpy(array).to(self.device, dtype)
        adapted: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if (chosen := self._adapted(adapters)) is not None and self.adapters is not None:
            rows = np.repeat(np.asarray(chosen, dtype=np.int64), width)  # every padded row of each prompt
            adapted = self.adapters.active(torch.from_numpy(rows).to(self.device))
        with adapted, self._plain_kernels():
            output = self._loaded.base(
                input_ids=torch.from_numpy(ids).to(self.device),
                attention_mask=torch.from_numpy(mask).to(self.device),
                **extra,
            )
        hidden: torch.Tensor = output.last_hidden_state  # [N, W, H]
        starts = np.arange(count, dtype=np.int64) * width
        flat = hidden.reshape(count * width, -1)
        at = None
        if positions is not None:
            at = flat.index_select(0, torch.from_numpy(position_rows(positions, starts)).to(self.device))
        if self.pooling == "mean":
            weights = torch.from_numpy(mask).to(self.device, torch.float32).unsqueeze(-1)  # [N, W, 1]
            return (hidden.float() * weights).sum(1) / weights.sum(1), at
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        rows = pooled_positions(prompts, starts, starts + lengths, self.pooling, self._loaded.pad_token_id)
        return flat.index_select(0, torch.from_numpy(rows).to(self.device)), at


def _without_members(groups: Sequence[SharedPrefix], gone: set[int]) -> list[SharedPrefix]:
    """`groups` without the prompts of `gone` (a group left with one member is no group)."""
    out = []
    for group in groups:
        members = tuple(m for m in group.members if m not in gone)
        if len(members) > 1:
            out.append(SharedPrefix(members, group.length))
    return out

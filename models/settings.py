"""The engine's settings a user chooses, each declared once: the worker embeds them in its settings, a Scorer
in code takes them in models.config.ScorerConfig. Pydantic alone, no torch: the light install imports it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

CompileChoice = Literal["auto", "on", "off"]
GraphChoice = Literal["auto", "on", "off"]
AttentionKernel = Literal["auto", "flash", "triton", "fa4"]
FusedMlpChoice = Literal["auto", "on", "off"]
PoolingChoice = Literal["auto", "last", "last_token", "cls", "mean"]  # "auto" or a models.packing.Pooling
DtypeChoice = Literal["auto", "float32", "float16", "bfloat16"]
Quantization = Literal["none", "fp8"]
Fp8Projections = Literal["all", "attention", "mlp"]

_DEVICES = ("auto", "cpu", "cuda")


class EngineSettings(BaseModel):
    """The engine's settings, each declared here once with its meaning, type, bounds and default: a worker
    reads them from SCORE_WORKER_* variables and flags of the same names (worker.config.WorkerSettings embeds
    this model), a Scorer in code takes them in ScorerConfig."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: DtypeChoice = Field("auto", description="model dtype")
    pooling: PoolingChoice = Field(
        "auto", description="how an item's tokens become its pooled state; auto: what the model's head pools"
    )
    deterministic: bool = Field(
        False,
        description="bit-identical results whatever shares a request's batch: batches packed as usual with "
        "every matrix product in tiles of deterministic_tile_rows rows (checked on the device at start-up), "
        "or, where that cannot hold, every item alone (slower)",
    )
    deterministic_tile_rows: int = Field(
        1024,
        ge=0,
        description="the deterministic setting's tile: every product of the forward runs on this many token "
        "rows at a time (the last tile padded), so a row's arithmetic never depends on its batch; results "
        "are bit-identical between workers of the same tile, device and software; 0: every item alone",
    )
    attention_kernel: AttentionKernel = Field(
        "auto",
        description="the packed path's attention kernel: torch's flash kernel, or the project's Triton "
        "kernel for batches with a sequence over 256 tokens (faster on Hopper; sliding-window layers "
        "and shorter batches still take flash); auto: Triton on Hopper and later GPUs, flash elsewhere; "
        "fa4: FlashAttention-4 (the optional flash-attn-4 package) for every batch, flash for "
        "sliding-window layers",
    )
    compile: CompileChoice = Field(
        "auto",
        description="run the decoder layers under torch.compile (fused kernels; seconds of compiling at "
        "start-up); auto: on for the varlen path on CUDA",
    )
    fused_mlp: FusedMlpChoice = Field(
        "auto",
        description="run the gate and up products and the SiLU of Llama/Mistral/Qwen/Phi-3 MLPs as one "
        "Triton kernel on the packed path; auto: on Hopper and later GPUs for models of hidden size 1536 "
        "or more (measured faster there, slower on smaller ones)",
    )
    cuda_graphs: GraphChoice = Field(
        "auto",
        description="replay small batches from recorded CUDA graphs (one launch instead of hundreds; each "
        "batch shape is recorded at its second batch); auto: on for the varlen path on CUDA",
    )
    packed_images: bool = Field(
        True,
        description="run the image-text models whose packed path is checked (Qwen2.5-VL, Qwen3-VL, "
        "Qwen3.5) packed: their items in one row, the vision tower once over the batch's images; false: "
        "HF's own forward on right-padded batches (the fallback; Gemma 3 always runs there)",
    )
    graph_max_tokens: int | None = Field(
        None,
        ge=1,
        description="the largest batch (tokens) that CUDA graphs replay; larger ones run as usual. Default: "
        "max_batch_tokens, so every batch is replayed (their shared memory pool holds the largest batch's "
        "activations once more; a lower value saves that on large models, whose launches cost less in "
        "proportion)",
    )
    share_prefix_min_tokens: int = Field(
        32,
        ge=0,
        description="compute a token prefix that prompts of one batch share (a multi-item request's query, "
        "one prompt sent with several responses) once when it is at least this long; 0: never. Causal "
        "decoders on the packed path; looking for them costs little on batches that share nothing",
    )
    prefix_cache_mib: int = Field(
        0,
        ge=0,
        description="memory (MiB, on the model's device) for the keys and values of prompt prefixes computed "
        "recently, so that a later batch computes only what follows them (a prompt's answers sent in several "
        "calls, a system prompt every request repeats), and a hybrid model's linear-attention states at "
        "block ends (tens of MiB a block on real shapes: use large blocks there); least recently used blocks "
        "go first; 0: off. Causal decoders on the packed path, pooling one row",
    )
    prefix_cache_admit: Literal["second", "first"] = Field(
        "second",
        description="when the prefix cache keeps a block: the second time its prefix is seen (a stream that "
        "repeats nothing never fills it, and its batches keep their CUDA graphs), or the first (every batch "
        "fills it and runs without a CUDA graph; a prompt's answers over several calls are served from the "
        "second call on)",
    )
    prefix_cache_block_tokens: int = Field(
        16,
        ge=1,
        le=4096,
        description="tokens per block of the prefix cache: a prompt reuses whole blocks only",
    )
    quantization: Quantization = Field(
        "none",
        description="fp8: the transformer layers' projections run in FP8 e4m3 (weights per output channel, "
        "activations per token); Hopper/Ada GPUs in bfloat16, or the CPU",
    )
    fp8_projections: Fp8Projections = Field(
        "all",
        description="with quantization=fp8, the projections of each layer that run in FP8: all; attention "
        "(query, key, value and output; the MLP's keep the model dtype); mlp (the MLP's; attention's keep "
        "the model dtype): less of FP8's speed for less of its rounding",
    )
    fp8_keep_layers: tuple[int, ...] = Field(
        (),
        description="with quantization=fp8, layers whose projections all keep the model dtype (0 the first, "
        "-1 the last); a JSON list in the environment",
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        le=64,
        description="GPUs (CPU processes on the CPU) one model is split across, Megatron's way: each holds a "
        "share of the attention heads, MLP columns and vocabulary; one worker (rank 0) fetches, plans and "
        "publishes, the others follow it. Decoder classifiers only; 1: the model on one device",
    )
    tensor_parallel_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a tensor-parallel rank that fails or hangs is noticed by the others within this "
        "(their collectives and the leader's heartbeat time out); the group then exits uncommitted",
    )
    trust_remote_code: bool = Field(
        False, description="load a model directory that ships its own code (runs that code: opt in knowingly)"
    )
    allow_pickle_weights: bool = Field(
        False,
        description="load weights from pickle files (pytorch_model.bin) when a model has no safetensors; "
        "unpickling can run code: opt in knowingly",
    )
    adapters: str = Field(
        "",
        description="LoRA adapters served beside the model, as name=directory,name2=directory2 (PEFT "
        "directories); a request names one in its adapter field, and a batch mixing them runs as one forward",
    )
    heads: str = Field(
        "",
        description="extra heads over the model's pooled hidden state, as name=directory,name2=directory2 "
        "(each directory: head.safetensors, a linear head or an MLP with head_config.json); a request names "
        "the ones it wants in its heads field, and the backbone runs once for all of them",
    )
    max_batch_tokens: int = Field(8192, gt=0, description="token budget of one model batch")
    # Limits: each checked before any model work, each with its own error code (schemas/README.md).
    max_request_items: int | None = Field(
        4096,
        gt=0,
        description="most items in one request; more is TOO_MANY_ITEMS (checked before tokenizing)",
    )
    max_request_tokens: int | None = Field(
        262_144, gt=0, description="most prompt tokens in one request; more is REQUEST_TOO_LONG"
    )
    max_item_tokens: int | None = Field(
        None,
        gt=0,
        description="most tokens in one item's prompt (default: the model's limit); INPUT_TOO_LONG",
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        index = value.removeprefix("cuda:")
        if value not in _DEVICES and not (value.startswith("cuda:") and index.isdigit()):
            raise ValueError(f"{value!r} is not a device; use auto, cpu, cuda or cuda:N")
        return value

    @field_validator("fp8_keep_layers", mode="before")
    @classmethod
    def _layers_from_text(cls, value: Any) -> Any:
        """A flag's text: a JSON list ("[0, -1]") or comma-separated numbers ("0,-1")."""
        if isinstance(value, str):
            text = value.strip().removeprefix("[").removesuffix("]")
            try:
                return tuple(int(part) for part in text.split(",") if part.strip())
            except ValueError:
                raise ValueError(f"fp8_keep_layers {value!r}: layer numbers, e.g. [0, -1] or 0,-1") from None
        return value

    @field_validator("adapters", "heads")
    @classmethod
    def _check_named_directories(cls, value: str) -> str:
        parse_adapters(value)
        return value

    @model_validator(mode="after")
    def _fp8_choices_with_fp8(self) -> EngineSettings:
        if self.quantization != "fp8" and (self.fp8_projections != "all" or self.fp8_keep_layers):
            raise ValueError(
                "fp8_projections and fp8_keep_layers choose what runs in FP8: they need quantization='fp8'"
            )
        return self

    @model_validator(mode="after")
    def _adapters_on_one_device(self) -> EngineSettings:
        if self.adapters and self.tensor_parallel > 1:
            raise ValueError(
                "adapters run on a model on one device: tensor_parallel splits the base projections, not "
                "their adapters; serve adapters with tensor_parallel 1, or merge them into the weights"
            )
        return self

    @property
    def adapter_dirs(self) -> dict[str, Path]:
        """`adapters` by name."""
        return parse_adapters(self.adapters)

    @property
    def head_dirs(self) -> dict[str, Path]:
        """`heads` by name."""
        return parse_adapters(self.heads)

    @property
    def graph_tokens(self) -> int:
        """The largest batch CUDA graphs replay: graph_max_tokens, or the whole budget when unset."""
        return self.graph_max_tokens or self.max_batch_tokens

    def engine_settings(self) -> dict[str, Any]:
        """These settings by name (of a model that embeds them, only theirs)."""
        return {name: getattr(self, name) for name in EngineSettings.model_fields}


def parse_adapters(value: str) -> dict[str, Path]:
    """`name=directory,name2=directory2` (adapters, heads) as a mapping; ValueError for a malformed entry or
    a repeated name."""
    adapters: dict[str, Path] = {}
    for entry in filter(None, (part.strip() for part in value.split(","))):
        name, equals, directory = entry.partition("=")
        name = name.strip()
        if not equals or not name or not directory.strip():
            raise ValueError(f"{entry!r} is not name=directory; list them as name=dir,name2=dir2")
        if name in adapters:
            raise ValueError(f"{name!r} is listed twice")
        adapters[name] = Path(directory.strip())
    return adapters

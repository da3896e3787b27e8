"""ScorerConfig: how the engine runs a model (device, dtype, attention kernel, batch size); validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch

from models.graphs import Recorder
from models.packing import POOLINGS, Pooling
from models.varlen import VarlenKernel

AttentionChoice = Literal["auto", "varlen", "reference"]
CompileChoice = Literal["auto", "on", "off"]
GraphChoice = Literal["auto", "on", "off"]
AttentionKernel = Literal["auto", "flash", "triton", "fa4"]
FusedMlpChoice = Literal["auto", "on", "off"]
# "auto" takes the Triton attention kernel from this compute capability on (Hopper), where it was measured.
TRITON_AUTO_CAPABILITY = (9, 0)
Quantization = Literal["none", "fp8"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ScorerConfig:
    """Engine settings; `resolve_*` methods turn the "auto" values into concrete choices."""

    device: str = "auto"
    dtype: str = "auto"
    attention: AttentionChoice = "auto"
    max_batch_tokens: int = 16384
    # None: the model's own limit (config.max_position_embeddings) is the only one.
    max_input_tokens: int | None = None
    # Per-request limits, checked before any tokenizing (items) or model work (tokens); None: no limit.
    max_request_items: int | None = None
    max_request_tokens: int | None = None
    # Replaces torch's varlen_attn for attention="varlen"; lets CPU tests drive the GPU wrapper logic.
    varlen_kernel: VarlenKernel | None = None
    # The varlen path's kernel: torch's flash kernel, or ours in Triton (models/triton_attention.py), which
    # runs batches whose longest sequence is over triton_attention.MIN_LENGTH tokens and leaves sliding-window
    # layers and shorter batches to flash. "auto" is Triton on Hopper and later GPUs (faster there,
    # docs/benchmarks.md), flash elsewhere. "fa4": FlashAttention-4's kernels where that optional package is
    # installed (models/fa4_attention.py), flash for sliding windows. An injected varlen_kernel overrides all.
    attention_kernel: AttentionKernel = "auto"
    # "auto": what the model's own HF head pools; else one of models.packing.POOLINGS.
    pooling: str = "auto"
    # Bit-identical results whatever else is in a request's batch and however batches are cut: every item
    # runs alone (at a throughput cost measured on W1, docs/benchmarks.md).
    deterministic: bool = False
    # Load a directory that ships its own model code (auto_map): that code runs, so only on explicit opt-in.
    trust_remote_code: bool = False
    # Compile each decoder layer with torch.compile (dynamic token counts): fuses the norms, rotary, the
    # activation and the residual adds that eager HF code runs as separate kernels. "auto": on for the
    # varlen path on CUDA, off elsewhere (the float32 CPU path stays the exact reference).
    compile: CompileChoice = "auto"
    # A causal decoder's last layer runs its query and output projections and its MLP only at the rows a
    # batch pools (models/pooled_rows.py), on the varlen path; False only to measure what that saves
    # (bench/w1.py, bench/latency.py).
    last_layer_pooled_rows: bool = True
    # Replay the packed forward of batches of at most `graph_max_tokens` tokens from recorded CUDA graphs
    # (models/graphs.py): one launch instead of hundreds, which sets the latency of small batches. "auto":
    # on for the varlen path on CUDA.
    cuda_graphs: GraphChoice = "auto"
    graph_max_tokens: int = 8192
    # Replaces CUDA graph recording; lets CPU tests drive the padding and buffer logic of the graphed path.
    graph_recorder: Recorder | None = None
    # Load pickle weights (pytorch_model.bin) when there are no safetensors: unpickling can run code.
    allow_pickle_weights: bool = False
    # Prompts of one batch that start with the same tokens (a multi-item request's query; one prompt sent
    # with several responses) have that prefix computed once when it is at least this long; 0: never.
    # Causal decoders on the packed path only; each suffix attends to the prefix and to itself.
    share_prefix_min_tokens: int = 0
    # "fp8": the transformer layers' projections run in FP8 e4m3 (models/fp8.py): weights scaled per output
    # channel, activations per token. Hopper/Ada GPUs in bfloat16, or the CPU; results deviate from the
    # model's dtype by what docs/benchmarks.md reports.
    quantization: Quantization = "none"
    # SiLU-gated MLPs (Llama, Mistral, Qwen, Phi-3) with the gate and up products and the activation in one
    # Triton kernel (models/fused_mlp.py) on the packed path. "auto": on CUDA Hopper and later GPUs in
    # float16/bfloat16 for models of hidden size fused_mlp.MIN_HIDDEN or more, where it was measured faster;
    # "on": wherever it can run (on the CPU only in Triton's interpreter, which tests use).
    fused_mlp: FusedMlpChoice = "auto"

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.attention not in ("auto", "varlen", "reference"):
            raise ValueError(f"attention must be 'auto', 'varlen' or 'reference', got {self.attention!r}")
        if self.attention_kernel not in ("auto", "flash", "triton", "fa4"):
            raise ValueError(
                f"attention_kernel must be 'auto', 'flash', 'triton' or 'fa4', got {self.attention_kernel!r}"
            )
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile must be 'auto', 'on' or 'off', got {self.compile!r}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be 'auto', 'on' or 'off', got {self.cuda_graphs!r}")
        if self.fused_mlp not in ("auto", "on", "off"):
            raise ValueError(f"fused_mlp must be 'auto', 'on' or 'off', got {self.fused_mlp!r}")
        if self.quantization not in ("none", "fp8"):
            raise ValueError(f"quantization must be 'none' or 'fp8', got {self.quantization!r}")
        if self.share_prefix_min_tokens < 0:
            raise ValueError(f"share_prefix_min_tokens must be 0 or more, got {self.share_prefix_min_tokens}")
        if self.graph_max_tokens < 1:
            raise ValueError(f"graph_max_tokens must be at least 1, got {self.graph_max_tokens}")
        if self.pooling not in ("auto", *POOLINGS):
            raise ValueError(f"pooling must be 'auto' or one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be at least 1, got {self.max_batch_tokens}")
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            raise ValueError(f"max_input_tokens must be at least 1 when set, got {self.max_input_tokens}")
        for name in ("max_request_items", "max_request_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 when set, got {value}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    def resolve_pooling(self, model_default: Pooling) -> Pooling:
        """The pooling to run: the setting, or the model's own when 'auto'."""
        if self.pooling == "auto":
            return model_default
        return cast(Pooling, self.pooling)

    def resolve_device(self) -> torch.device:
        """The torch device to run on; 'auto' picks CUDA when it is available."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for but CUDA is not available")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """The weight/activation dtype: bfloat16 on GPU and float32 on CPU unless set explicitly."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    def resolve_compile(self, attention: str, device: torch.device) -> bool:
        """Whether to compile the decoder layers, for the attention path the engine runs on `device`.

        "auto" compiles the varlen path on CUDA, where the fused kernels were measured to pay (1.22x on W1).
        On the CPU the varlen path runs only with a kernel the caller brings, and compiling a tiny model's
        layers took minutes on a two-core host for no measured gain: "on" still compiles there."""
        if self.compile == "auto":
            return attention == "varlen" and device.type == "cuda"
        return self.compile == "on"

    def varlen_kernel_name(self, attention: str, device: torch.device) -> str:
        """The kernel the varlen path runs, by name: "none" off that path, "injected" for `varlen_kernel`,
        else the chosen one (resolve_attention_kernel)."""
        if attention != "varlen":
            return "none"
        if self.varlen_kernel is not None:
            return "injected"
        return self.resolve_attention_kernel(device)

    def resolve_attention_kernel(
        self, device: torch.device | None = None
    ) -> Literal["flash", "triton", "fa4"]:
        """The varlen path's kernel on `device` (models.attention.register_attention). "auto" is Triton on
        Hopper and later GPUs, where it was measured faster and checked (docs/benchmarks.md), when Triton is
        installed; flash elsewhere."""
        if self.attention_kernel == "flash":
            return "flash"
        if self.attention_kernel == "fa4":
            from models import fa4_attention

            if not fa4_attention.available():
                raise ValueError("attention_kernel='fa4' needs the flash-attn-4 package (and its CUDA DSL)")
            return "fa4"
        from models import triton_attention

        if self.attention_kernel == "auto":
            hopper = (
                device is not None
                and device.type == "cuda"
                and torch.cuda.get_device_capability(device) >= TRITON_AUTO_CAPABILITY
            )
            return "triton" if hopper and triton_attention.available() else "flash"
        if not triton_attention.available():
            raise ValueError("attention_kernel='triton' needs the triton package (CUDA torch ships it)")
        return "triton"

    def resolve_fused_mlp(
        self, device: torch.device, dtype: torch.dtype, attention: str, hidden_size: int
    ) -> bool:
        """Whether SiLU-gated MLPs run the fused kernel (models/fused_mlp.py): never on the exact path (the
        float32 reference stays HF's arithmetic); "auto" on Hopper and later GPUs in half precision from
        MIN_HIDDEN on; "on" wherever the kernel runs, else a ValueError saying why not."""
        from models import fused_mlp, triton_attention

        if self.fused_mlp == "off" or attention != "varlen":
            return False
        half = dtype in (torch.float16, torch.bfloat16)
        if self.fused_mlp == "auto":
            return (
                half
                and self.quantization == "none"  # FP8 projections keep their own path
                and device.type == "cuda"
                and torch.cuda.get_device_capability(device) >= TRITON_AUTO_CAPABILITY
                and fused_mlp.available()
                and hidden_size >= fused_mlp.MIN_HIDDEN
            )
        if not fused_mlp.available():
            raise ValueError("fused_mlp='on' needs the triton package (CUDA torch ships it)")
        if device.type == "cuda" and not half:
            raise ValueError(f"fused_mlp='on' runs in float16 or bfloat16 on CUDA, not {dtype}")
        if device.type != "cuda" and not triton_attention.interpreting():
            raise ValueError("fused_mlp='on' needs a CUDA device (or Triton's interpreter)")
        return True

    def resolve_graphs(self, device: torch.device, attention: str) -> bool:
        """Whether to replay small packed batches from CUDA graphs (the varlen path only: the exact path
        loops over items on the host, which a graph cannot record)."""
        if self.cuda_graphs == "off" or attention != "varlen":
            return False
        recordable = device.type == "cuda" or self.graph_recorder is not None
        if self.cuda_graphs == "on" and not recordable:
            raise ValueError("cuda_graphs='on' needs a CUDA device")
        return recordable

    def resolve_attention(
        self, device: torch.device, dtype: torch.dtype | None = None, softcap: float | None = None
    ) -> Literal["varlen", "reference"]:
        """The attention path: the varlen kernel on CUDA (or an injected kernel), exact SDPA otherwise.

        `softcap` is the model's attention logit soft-cap (Gemma 2): the varlen kernel cannot apply it, so
        such a model takes the exact path ('auto') or is refused ('varlen'), never an approximation.
        """
        # torch's varlen_attn is a flash kernel: float16/bfloat16 only; float32 would fail every batch.
        half = dtype is None or dtype in (torch.float16, torch.bfloat16)
        if self.attention == "auto":
            return "varlen" if device.type == "cuda" and half and softcap is None else "reference"
        if self.attention == "varlen" and softcap is not None:
            raise ValueError(
                f"this model caps attention logits (attn_logit_softcapping={softcap}), which the varlen "
                "kernel cannot do; use attention='auto' or 'reference' (the exact per-item path)"
            )
        if self.attention == "varlen" and device.type != "cuda" and self.varlen_kernel is None:
            raise ValueError(
                "attention='varlen' needs a CUDA device (torch's varlen_attn is CUDA-only); "
                "use attention='reference' on CPU"
            )
        if self.attention == "varlen" and not half and self.varlen_kernel is None:
            raise ValueError(
                "attention='varlen' runs in float16 or bfloat16 only (the flash kernel has no float32); "
                "use dtype='bfloat16' or attention='reference'"
            )
        return self.attention

"""ScorerConfig: the engine's settings (models/settings.py) for a Scorer built in code, with the hooks tests
use; its `resolve_*` methods turn "auto" into concrete choices on a device."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field, SkipValidation

from models.fp8 import Fp8Selection
from models.graphs import Recorder
from models.packing import Pooling
from models.settings import EngineSettings
from models.varlen import VarlenKernel

AttentionChoice = Literal["auto", "varlen", "reference"]
# "auto" takes the Triton attention kernel from this compute capability on (Hopper), where it was measured.
TRITON_AUTO_CAPABILITY = (9, 0)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class ScorerConfig(EngineSettings):
    """EngineSettings for a Scorer built in code, plus what only code sets (the attention path, injected
    kernels and graph recorders for CPU tests). `resolve_*` turn the "auto" values into concrete choices.

    A Scorer in a script or a benchmark keeps the defaults it has always had where they differ from a
    deployed worker's: the larger budget a one-off call can use, prefixes not looked for, and no request
    limits (its caller sends what it means to score).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    max_batch_tokens: int = Field(16384, gt=0)
    graph_max_tokens: int | None = Field(8192, ge=1)
    share_prefix_min_tokens: int = Field(0, ge=0)
    max_request_items: int | None = Field(None, gt=0)
    max_request_tokens: int | None = Field(None, gt=0)
    # "varlen" or "reference" (exact per-item SDPA); "auto": varlen on CUDA in half precision.
    attention: AttentionChoice = "auto"
    # Replaces torch's varlen_attn for attention="varlen"; lets CPU tests drive the GPU wrapper logic.
    varlen_kernel: SkipValidation[VarlenKernel | None] = None
    # Replaces CUDA graph recording; lets CPU tests drive the padding and buffer logic of the graphed path.
    graph_recorder: SkipValidation[Recorder | None] = None
    # A causal decoder's last layer runs its query and output projections and its MLP only at the rows a
    # batch pools (models/pooled_rows.py), on the varlen path; False only to measure what that saves
    # (bench/w1.py, bench/l1.py).
    last_layer_pooled_rows: bool = True

    @classmethod
    def of(cls, settings: EngineSettings, **hooks: Any) -> ScorerConfig:
        """The config of a worker's engine: its settings as given, and the code-only fields `hooks`."""
        return cls(**settings.engine_settings(), **hooks)

    @property
    def fp8_selection(self) -> Fp8Selection:
        """The projections that run in FP8 under quantization='fp8' (models/fp8.py)."""
        return Fp8Selection(self.fp8_projections, self.fp8_keep_layers)

    def resolve_pooling(self, model_default: Pooling) -> Pooling:
        """The pooling to run: the setting, or the model's own when 'auto'."""
        if self.pooling == "auto":
            return model_default
        return self.pooling

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
            if self.deterministic:  # a choice of kernel by the batch would make a sequence's bits follow it
                return "flash"
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
                # FP8 MLP projections keep their own path; an MLP kept in the model dtype takes the kernel
                and (self.quantization == "none" or self.fp8_projections == "attention")
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

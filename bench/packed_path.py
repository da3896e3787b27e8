"""Drives our packed Scorer (models/) for the benchmarks: model directory, requests, results as arrays."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.hf_paths import PathOutput

# Files of a HF model directory that describe the weights; everything else write_tiny_model leaves is the
# tokenizer, which the benchmark model borrows (its requests are token ids, so the vocabulary is unused).
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def scorer_available() -> str | None:
    """None when models.Scorer imports; otherwise why not (the benchmark then runs the baselines only)."""
    try:
        from models import Scorer, ScorerConfig, write_tiny_model  # noqa: F401
    except Exception as exc:  # any import failure means the same thing here: no packed path to time
        return f"{type(exc).__name__}: {exc}"
    return None


def attach_tokenizer(model_dir: Path) -> list[str]:
    """Copy the tokenizer files of a tiny llama from models.write_tiny_model into model_dir."""
    from models import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_model(tmp, architecture="llama", seed=0, num_labels=1)
        copied = []
        for path in sorted(Path(tmp).iterdir()):
            if path.is_file() and path.name not in _MODEL_FILES and not path.name.endswith(".safetensors"):
                shutil.copy2(path, model_dir / path.name)
                copied.append(path.name)
    return copied


def save_model_dir(model: torch.nn.Module, model_dir: Path) -> list[str]:
    """Write the in-memory model (safetensors) plus a tokenizer: what Scorer(model_dir) loads."""
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)  # type: ignore[operator]
    return attach_tokenizer(model_dir)


def random_model_dir(model_class: Any, config: Any, device: str, target: Path) -> Path:
    """A model of `model_class` with random weights (seed 0, bf16 on CUDA, float32 on the CPU), built on
    `device` and saved with a tokenizer at `target`; the in-memory copy is freed."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype)
    save_model_dir(model.eval(), target)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return target


def make_requests(token_ids: Sequence[torch.Tensor], hidden: bool = True) -> list[Any]:
    """One single-item token-id request per row, each asking for its pooled hidden state."""
    from schemas import ScoreRequest

    return [
        ScoreRequest(request_id=f"w1-{i}", items=(tuple(row.tolist()),), return_pooled_hidden_states=hidden)
        for i, row in enumerate(token_ids)
    ]


def make_scorer(
    model_dir: Path,
    max_batch_tokens: int,
    dtype: str = "bfloat16",
    deterministic: bool = False,
    compile: str = "auto",
    cuda_graphs: str = "auto",
    share_prefix_min_tokens: int = 0,
    attention_kernel: str = "auto",
    fused_mlp: str = "auto",
    last_layer_pooled_rows: bool = True,
    deterministic_tile_rows: int | None = None,
    prefix_cache_mib: int = 0,
    device: str = "cuda",
) -> Any:
    from models import Scorer, ScorerConfig

    config = ScorerConfig(
        device=device,
        dtype=dtype,
        attention="varlen" if device == "cuda" else "auto",  # the CPU has no varlen kernel of its own
        max_batch_tokens=max_batch_tokens,
        deterministic=deterministic,
        compile=compile,  # type: ignore[arg-type]
        cuda_graphs=cuda_graphs,  # type: ignore[arg-type]
        share_prefix_min_tokens=share_prefix_min_tokens,
        attention_kernel=attention_kernel,  # type: ignore[arg-type]
        fused_mlp=fused_mlp,  # type: ignore[arg-type]
        last_layer_pooled_rows=last_layer_pooled_rows,
        prefix_cache_mib=prefix_cache_mib,
        # None: the setting's own default
        **({} if deterministic_tile_rows is None else {"deterministic_tile_rows": deterministic_tile_rows}),
    )
    return Scorer(str(model_dir), config)


def run_scorer(scorer: Any, requests: Sequence[Any], chunks: Sequence[Sequence[int]]) -> list[Any]:
    """Score the requests in the given token-budget chunks (as the worker's batcher would hand them over)."""
    per_chunk = (scorer.score([requests[i] for i in chunk]) for chunk in chunks)
    return in_request_order(len(requests), chunks, per_chunk)


def in_request_order(
    count: int, chunks: Sequence[Sequence[int]], per_chunk: Iterable[Sequence[Any]]
) -> list[Any]:
    """Results given chunk by chunk (each in its chunk's order) put back in the order of the `count`
    requests the chunks index; None for a request no chunk holds."""
    results: list[Any] = [None] * count
    for chunk, chunk_results in zip(chunks, per_chunk, strict=True):
        for index, result in zip(chunk, chunk_results, strict=True):
            results[index] = result
    return results


def launch_ahead(scorer: Any, groups: Iterable[Sequence[Any]]) -> Iterator[list[Any]]:
    """Each group's results, in order, every group launched before the one ahead of it is finished (as the
    worker's model thread runs batches that queue): the host builds one group's results while the device
    runs the next. A group is taken from `groups` only when it is launched."""
    pending = None
    for group in groups:
        launched = scorer.launch(group)
        if pending is not None:
            yield scorer.finish(pending)
        pending = launched
    if pending is not None:
        yield scorer.finish(pending)


def results_to_arrays(results: Sequence[Any], hidden_size: int, asked: bool = True) -> PathOutput:
    """Scores and pooled hidden states as float32 arrays; raises on any error result or missing row.
    Requests that did not ask for hidden states (`asked` False) give a [n, 0] hidden array, and must have
    none."""
    bad = [r for r in results if r is None or r.status.value != "ok"]
    if bad:
        first = bad[0]
        detail = "missing" if first is None else f"{first.error.code.value}: {first.error.message}"
        raise RuntimeError(f"{len(bad)} of {len(results)} requests failed; first: {detail}")
    scores = np.array([r.scores[0] for r in results], dtype=np.float32)
    if not asked:
        if any(r.pooled_hidden_states is not None for r in results):
            raise RuntimeError("hidden states came back for requests that did not ask for them")
        return PathOutput(scores=scores, hidden=np.zeros((len(results), 0), dtype=np.float32))
    hidden = np.zeros((len(results), hidden_size), dtype=np.float32)
    for i, result in enumerate(results):
        if result.pooled_hidden_states is None:
            raise RuntimeError(f"request {result.request_id} asked for hidden states and got none")
        hidden[i] = result.pooled_hidden_states[0].to_numpy().reshape(hidden_size)
    return PathOutput(scores=scores, hidden=hidden)


def stage_timings(results: Sequence[Any]) -> dict[str, float]:
    """Mean of each stage timing the Scorer reports per result (diagnostic only)."""
    sums: dict[str, float] = {}
    for result in results:
        for key, value in (result.timings or {}).items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return {key: value / max(len(results), 1) for key, value in sums.items()}

"""Mixture-of-experts blocks on the packed path (models/moe.py) against HF's own blocks in float32: the
router's choices and weights, the block's output on packed tokens, Qwen3-Next's shared expert, the edge
routings, and the engine paths that take or refuse a model with experts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tolerances import gamma, unit_roundoff
from transformers import AutoConfig

from models import Scorer, ScorerConfig
from models.errors import ModelLoadError
from models.fused_mlp import FusedMlps
from models.layers import decoder_layers
from models.moe import MoeBlocks, _experts, packed_block_forward, route, sparse_blocks
from schemas import ScoreRequest

HIDDEN, EXPERTS, TOP_K, WIDTH = 64, 8, 2, 32


def _config(kind: str, **extra: Any) -> Any:
    fields: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": WIDTH,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 32,
    }
    if kind == "qwen3_next":
        fields["shared_expert_intermediate_size"] = 48
        fields["layer_types"] = ["full_attention"]
    fields.update(extra)
    config = AutoConfig.for_model(kind, **fields)
    config._experts_implementation = "eager"  # HF's loop over experts: the plainest reference
    return config


def _block(kind: str, seed: int, **extra: Any) -> torch.nn.Module:
    """HF's sparse block of `kind`, float32, every parameter random at a scale where routing matters."""
    if kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock as Block
    block = Block(_config(kind, **extra))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return block.eval()


def _tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randn(1, count, HIDDEN, generator=torch.Generator().manual_seed(seed))  # a packed row


def _atol(expected: torch.Tensor) -> float:
    # Two float32 computations of the same block in other orders: gate/up (HIDDEN terms), then down (WIDTH),
    # then the weighted sum over TOP_K experts, each at the output's scale (at least 1); the router's weights
    # carry its HIDDEN-term logits and a softmax over EXPERTS into the product.
    length = HIDDEN + WIDTH + TOP_K + HIDDEN + EXPERTS
    return 2 * gamma(length, torch.float32) * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("normalize", [True, False])
def test_the_router_picks_hf_experts_and_weights(normalize: bool) -> None:
    block = _block("qwen3_moe", seed=1, norm_topk_prob=normalize)
    tokens = _tokens(40, seed=2)[0]
    _, hf_weights, hf_experts = block.gate(tokens)
    weights, experts = route(tokens, block.gate.weight, TOP_K, normalize)
    assert torch.equal(experts, hf_experts)  # the same arithmetic, step for step: the same choices
    # Identical operations in the same order on the same device: the same bits.
    assert torch.equal(weights, hf_weights)
    assert torch.allclose(weights.sum(-1), torch.ones(40), atol=4 * unit_roundoff(torch.float32)) == normalize


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("count", [1, 37])
def test_the_packed_block_matches_hf(kind: str, count: int) -> None:
    block = _block(kind, seed=3)
    tokens = _tokens(count, seed=4)
    with torch.no_grad():
        expected = block(tokens)
        actual = packed_block_forward(block)(tokens)
        rows = packed_block_forward(block)(tokens[0])  # the pooled rows' [R, H] shape
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=_atol(expected), rtol=0)
    torch.testing.assert_close(rows, expected[0], atol=_atol(expected), rtol=0)


def test_every_token_to_one_expert_and_experts_without_tokens() -> None:
    """A router that sends every token to experts 5 and 2 (the others get none): the grouped runs of the
    empty experts are empty, and the output is still HF's."""
    block = _block("qwen3_moe", seed=5)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[5] = 1.0
        block.gate.weight[2] = 0.5
    tokens = _tokens(23, seed=6).abs()  # positive features: expert 5's logit is the largest, 2's next
    with torch.no_grad():
        _, _, chosen = block.gate(tokens[0])
        assert set(chosen.flatten().tolist()) == {5, 2}
        expected = block(tokens)
        actual = packed_block_forward(block)(tokens)
    torch.testing.assert_close(actual, expected, atol=_atol(expected), rtol=0)


def _grouped_cases(seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(tokens, experts, weights): the router's own choices; expert 3 in every token's first slot (most
    experts take none, one takes every token); a single token."""
    block = _block("qwen3_moe", seed=seed)
    tokens = _tokens(70, seed=seed + 1)[0]
    weights, experts = route(tokens, block.gate.weight, TOP_K, True)
    crowded = experts.clone()
    crowded[:, 0] = 3
    crowded[:, 1] = torch.where(crowded[:, 1] == 3, 4, crowded[:, 1])
    return [(tokens, experts, weights), (tokens, crowded, weights), (tokens[:1], experts[:1], weights[:1])]


@pytest.mark.parametrize("kernel", ["grouped_mm", "triton"])
def test_the_grouped_kernels_agree_with_the_loop_over_experts(kernel: str) -> None:
    """torch._grouped_mm with the offsets and transposed stacked weights the CUDA path hands it (torch's CPU
    kernel), and the Triton kernel (its interpreter, float32): the same as one matmul per expert, empty
    experts and one crowded expert included."""
    if kernel == "grouped_mm" and torch.__version__ < "2.13":
        pytest.skip("torch's grouped product has a CPU kernel from 2.13 (the GPU suite runs it on CUDA)")
    if kernel == "triton":
        pytest.importorskip("triton")
    stacked = _block("qwen3_moe", seed=7).experts
    for tokens, experts, weights in _grouped_cases(7):
        with torch.no_grad():
            looped = _experts(tokens, experts, weights, stacked.gate_up_proj, stacked.down_proj, "loop")
            grouped = _experts(tokens, experts, weights, stacked.gate_up_proj, stacked.down_proj, kernel)
        torch.testing.assert_close(grouped, looped, atol=_atol(looped), rtol=0)


def test_blocks_swap_in_only_while_entered() -> None:
    block = _block("qwen3_moe", seed=9)
    layer = torch.nn.Module()
    layer.mlp = block
    blocks = MoeBlocks.of([layer])
    assert blocks is not None and sparse_blocks([layer]) == [block]
    assert "forward" not in block.__dict__
    with blocks:
        assert "forward" in block.__dict__
    assert "forward" not in block.__dict__  # HF's forward for everything else (the self-check)
    assert MoeBlocks.of([torch.nn.Linear(2, 2)]) is None


def test_an_moe_model_keeps_its_mlps_off_the_fused_kernel(tiny_qwen3_moe_dir: Path) -> None:
    """The fused MLP kernel takes dense SiLU-gated MLPs of known classes; neither a sparse block nor
    Qwen3-MoE's dense MLP class is one of them."""
    scorer = Scorer(tiny_qwen3_moe_dir, ScorerConfig(device="cpu"))
    layers = decoder_layers(scorer.hf_model.base_model)
    assert FusedMlps.of(layers) is None
    assert len(sparse_blocks(layers or ())) == 2  # the middle layer is dense


def test_the_deterministic_setting_runs_an_moe_model_item_by_item(tiny_qwen3_moe_dir: Path) -> None:
    config = ScorerConfig(device="cpu", deterministic=True, deterministic_tile_rows=64)
    scorer = Scorer(tiny_qwen3_moe_dir, config)
    assert scorer.executor.row_tiles is None
    request = ScoreRequest(request_id="r", items=((5, 6, 7, 8), (9, 10)), query=(4, 11))
    alone = [
        scorer.score([ScoreRequest(request_id="a", items=(item,), query=(4, 11))]) for item in request.items
    ]
    together = scorer.score([request])[0]
    assert together.scores == tuple(result[0].scores[0] for result in alone)


def test_lora_on_experts_is_refused(tiny_qwen3_moe_dir: Path, tmp_path: Path) -> None:
    """PEFT adapts a mixture of experts' MLP through the experts' stacked parameters (target_parameters);
    an older adapter names each expert's projection. Both are refused at start-up, with the reason."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_qwen3_moe_dir))
    peft = get_peft_model(
        model, LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["gate_proj", "up_proj", "q_proj"])
    )
    peft.save_pretrained(str(tmp_path / "stacked"))
    per_expert = tmp_path / "per-expert"
    per_expert.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": ["gate_proj"]}
    (per_expert / "adapter_config.json").write_text(json.dumps(config))
    prefix = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.zeros(4, 64), f"{prefix}.lora_B.weight": torch.zeros(32, 4)},
        str(per_expert / "adapter_model.safetensors"),
    )
    for name in ("stacked", "per-expert"):
        with pytest.raises(ModelLoadError, match="experts"):
            Scorer(tiny_qwen3_moe_dir, ScorerConfig(device="cpu", adapters=f"{name}={tmp_path / name}"))

"""Tensor parallelism on gloo (CPU processes): a model split across 2 ranks (every decoder family) and 4 ranks
(the families taking each branch of the cutting: FOUR_RANK_FAMILIES) scores as the unsplit model does, with
mixed per-request flags, shared prefixes and multi-item requests; each rank holds only its share while
loading; a rank that dies or hangs is noticed within the bound.

This process is rank 0 (models.parallel.start_group); the followers are processes it starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tolerances import assert_scored_alike

from models import Scorer, ScorerConfig, parallel
from models.errors import DeviceLostError, ModelLoadError
from models.families import family, tensor_parallel_refusal
from models.moe import sparse_blocks
from models.parallel import LeaderEngine, start_group
from models.selfcheck import run_self_check
from models.tensor_parallel import (
    ProjectionNormShard,
    RowParallelExperts,
    RowParallelLinear,
    Shard,
    head_shares,
    shares,
)
from models.tiny import DECODERS, write_tiny_model
from schemas import HiddenDType, ScoreRequest, ScoreResult
from worker.broker import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUERY = tuple(range(40, 70))  # 30 tokens: longer than the 16-token sliding windows of the tiny models
LABELS = 3


def _requests() -> list[ScoreRequest]:
    """Mixed flags in one call: hidden states in each dtype or none, softmax or not, a multi-item request
    whose query is shared, three requests sharing one prompt, text and token ids, an item alone."""
    return [
        ScoreRequest("multi", query=QUERY, items=((5, 6, 7), tuple(range(100, 118)), (30,)),
                     return_pooled_hidden_states=True, hidden_states_dtype=HiddenDType.BFLOAT16),
        *(
            ScoreRequest(f"best-of-{i}", items=(QUERY + response,), apply_softmax=i == 1,
                         return_pooled_hidden_states=i != 2, hidden_states_dtype=HiddenDType.FLOAT16)
            for i, response in enumerate(((200, 201), (200, 202, 203), (300,)))
        ),
        ScoreRequest("text", query="which fox jumps", items=("the quick brown fox", "a lazy dog"),
                     return_pooled_hidden_states=True),
        ScoreRequest("alone", items=((9, 10, 11, 12, 13),), apply_softmax=True),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    return {family: write_tiny_model(root / family, family, seed=5, num_labels=LABELS) for family in DECODERS}


def _config(world: int, **values: Any) -> ScorerConfig:
    return ScorerConfig(
        device="cpu", dtype="float32", tensor_parallel=world, share_prefix_min_tokens=4,
        tensor_parallel_timeout_s=values.pop("timeout_s", 30.0), **values,
    )  # fmt: skip


@pytest.fixture(scope="module")
def unsplit(family_dirs: dict[str, Path]) -> dict[str, tuple[Scorer, list[ScoreResult]]]:
    """Each family's unsplit scorer and its results for _requests(), computed once for every group size."""
    requests = _requests()
    scorers = {family: Scorer(model_dir, _config(1)) for family, model_dir in family_dirs.items()}
    return {family: (scorer, scorer.score(requests)) for family, scorer in scorers.items()}


@pytest.fixture
def group() -> Iterator[list[LeaderEngine]]:
    """The groups a test starts; each closed at its end (its followers told to exit)."""
    started: list[LeaderEngine] = []
    yield started
    for leader in started:
        leader.close()


# The families split over four ranks as well as two. Every tiny decoder has 4 query and 2 key-value heads:
# at two ranks each rank holds one key-value head, at four each is copied to two ranks. What the cutting
# (models/tensor_parallel.py) does differently at four is the same for every family taking one of its
# branches: the key-value copies (head_shares), the fused qkv and gate_up projections' offsets with those
# copies and the head counts read from the config (Phi-3), the q/k norms' sums over the group counting each
# copied key-value head (OLMo 2; OLMo 3 takes the same branch), the experts' columns cut four ways (Qwen3
# MoE), separate q/k/v and gate/up projections (Llama). What else a family adds (windows, soft-capping,
# sandwich norms, partial rotary, per-head q/k norms) acts within a rank's heads whatever their number, and
# the two-rank run checks it for every family.
FOUR_RANK_FAMILIES = ("llama", "phi3", "olmo2", "qwen3_moe")


@pytest.mark.parametrize("world", [2, 4])
def test_split_scores_as_the_unsplit_model_for_every_family(
    family_dirs: dict[str, Path],
    unsplit: dict[str, tuple[Scorer, list[ScoreResult]]],
    world: int,
    group: list[LeaderEngine],
) -> None:
    """Every family at two ranks; at four, the FOUR_RANK_FAMILIES (the cutting's every branch) and every
    family's refusal."""
    requests = _requests()
    for name, model_dir in family_dirs.items():
        refusal = tensor_parallel_refusal(name, world)
        if refusal is not None:
            # Refused before any follower starts or any rank joins: the next family's group still can.
            with pytest.raises(ModelLoadError, match=re.escape(refusal)):
                start_group(model_dir, _config(world))
            continue
        if world == 4 and name not in FOUR_RANK_FAMILIES:
            continue
        reference, want = unsplit[name]
        leader = start_group(model_dir, _config(world))
        group.append(leader)
        got = leader.score_prepared([leader.prepare(request) for request in requests])
        for request, got_result, want_result in zip(requests, got, want, strict=True):
            assert got_result.ok, (name, got_result.error)
            assert len(got_result.scores) == len(request.items)
            # Each rank sums its heads' and columns' share, the group adds the shares: the same terms as
            # one device's sums, in another order (tolerances: any order of a sum is within gamma of it).
            assert_scored_alike(got_result, want_result, reference, [request])
        _check_split(leader.scorer, name, world)
        if world == 2:  # the start-up check, run on every rank in step
            assert leader.run_everywhere(run_self_check).items > 0
        leader.close()
        group.remove(leader)


def test_the_four_rank_families_take_every_branch_of_the_cutting(
    unsplit: dict[str, tuple[Scorer, list[ScoreResult]]],
) -> None:
    """What FOUR_RANK_FAMILIES stands for holds of the tiny models: key-value heads copied at four ranks,
    and among them a fused qkv projection, a fused gate_up one, separate ones, q/k norms over whole
    projections and sparse experts."""
    layers = {name: unsplit[name][0].hf_model.base_model.layers[0] for name in FOUR_RANK_FAMILIES}
    for name in FOUR_RANK_FAMILIES:
        config = unsplit[name][0].hf_model.config.get_text_config()
        assert config.num_key_value_heads < 4 <= config.num_attention_heads, name
    assert any(hasattr(layer.self_attn, "qkv_proj") for layer in layers.values())
    assert any(hasattr(layer.self_attn, "q_proj") for layer in layers.values())
    assert any(hasattr(layer.mlp, "gate_up_proj") for layer in layers.values())
    assert any(hasattr(layer.mlp, "gate_proj") for layer in layers.values())
    assert any(sparse_blocks([layer]) for layer in layers.values())
    declared = [family(name) for name in FOUR_RANK_FAMILIES]
    assert any(d is not None and d.qk_norm == "projection" for d in declared)


def _check_split(scorer: Scorer, family_name: str, world: int) -> None:
    """Rank 0 holds its share only: its projections are cut and its output projections sum across ranks."""
    config = scorer.hf_model.config.get_text_config()
    layer = scorer.hf_model.base_model.layers[0]
    attention = layer.self_attn
    o_proj = attention.o_proj
    assert isinstance(o_proj, RowParallelLinear)
    head_dim = attention.head_dim
    assert o_proj.linear.in_features == config.num_attention_heads // world * head_dim, family_name
    if sparse_blocks([layer]):  # each expert's columns cut, the routed sum completed across the ranks
        experts = layer.mlp.experts
        assert isinstance(experts, RowParallelExperts)
        assert experts.inner.down_proj.shape[-1] == -(-config.moe_intermediate_size // world), family_name
        assert experts.inner.gate_up_proj.shape[1] == 2 * experts.inner.down_proj.shape[-1], family_name
    else:
        assert isinstance(layer.mlp.down_proj, RowParallelLinear)
        assert layer.mlp.down_proj.linear.in_features == -(-config.intermediate_size // world), family_name
    embedding = scorer.hf_model.get_input_embeddings()
    assert embedding.weight.shape[0] == -(-config.vocab_size // world)
    declared = family(family_name)
    if declared is not None and declared.qk_norm == "projection":  # OLMo 2 and 3: norms over the group's sum
        assert isinstance(attention.q_norm, ProjectionNormShard), family_name
        assert attention.q_norm.weight.shape[0] == config.num_attention_heads // world * head_dim


def test_deterministic_setting_holds_in_a_group(
    family_dirs: dict[str, Path], group: list[LeaderEngine]
) -> None:
    requests = _requests()
    leader = start_group(family_dirs["qwen3"], _config(2, deterministic=True))
    group.append(leader)
    first = leader.score_prepared([leader.prepare(request) for request in requests])
    again = leader.score_prepared([leader.prepare(request) for request in reversed(requests)])
    for one, other in zip(first, reversed(again), strict=True):
        assert one.scores == other.scores
        assert one.pooled_hidden_states == other.pooled_hidden_states
    leader.close()  # told to exit, the followers leave at once, with status 0 (not killed at the deadline)
    assert [follower.returncode for follower in leader._followers] == [0]


@pytest.mark.parametrize("kind", ["forked", "interpreter"])
def test_followers_forked_on_the_cpu_and_in_interpreters_of_their_own_on_gpus(
    kind: str,
    family_dirs: dict[str, Path],
    unsplit: dict[str, tuple[Scorer, list[ScoreResult]]],
    group: list[LeaderEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU a follower is forked from the template process that imported the engine; on GPUs each is
    an interpreter of its own (`python -m models.parallel`), taken here on the CPU: both name themselves
    after their rank, score as the unsplit model and leave with status 0 when told to."""
    if kind == "interpreter":
        monkeypatch.setattr(parallel, "_ForkedFollower", parallel._follower_process)
    requests = _requests()
    leader = start_group(family_dirs["llama"], _config(2))
    group.append(leader)
    (follower,) = leader._followers
    assert isinstance(follower, subprocess.Popen if kind == "interpreter" else parallel._ForkedFollower)
    assert Path(f"/proc/{follower.pid}/comm").read_text().strip() == "tp-rank-1"
    reference, want = unsplit["llama"]
    got = leader.score_prepared([leader.prepare(request) for request in requests])
    for request, got_result, want_result in zip(requests, got, want, strict=True):
        assert_scored_alike(got_result, want_result, reference, [request])  # as in the split test above
    leader.close()
    assert follower.returncode == 0


def test_fp8_projections_in_a_group_pass_the_start_up_check(
    family_dirs: dict[str, Path], group: list[LeaderEngine]
) -> None:
    """FP8 swaps each rank's cut projections (the output and down projections' per-token scales then span
    the rank's columns only); the self-check holds them to its FP8 bound, measured on the same inputs."""
    leader = start_group(family_dirs["llama"], _config(2, quantization="fp8"))
    group.append(leader)
    assert leader.run_everywhere(run_self_check).items > 0
    assert leader.scorer.info.quantization == "fp8"


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world", "rank", "expected"),
    [
        (32, 8, 4, 1, ((8, 16), (2, 4))),
        (32, 8, 8, 7, ((28, 32), (7, 8))),
        (4, 2, 4, 3, ((3, 4), (1, 2))),  # fewer key-value heads than ranks: head 1 serves ranks 2 and 3
        (64, 8, 16, 5, ((20, 24), (2, 3))),
    ],
)
def test_each_rank_reads_the_key_value_heads_of_its_query_heads(
    heads: int, kv_heads: int, world: int, rank: int, expected: tuple[tuple[int, int], tuple[int, int]]
) -> None:
    q, kv = head_shares(heads, kv_heads, Shard(rank, world))
    assert (q, kv) == expected
    group = heads // kv_heads
    assert all(kv[0] <= head // group < kv[1] for head in range(*q))


def test_uneven_splits_are_refused_or_spread() -> None:
    with pytest.raises(ModelLoadError, match="do not split evenly"):
        head_shares(6, 2, Shard(0, 4))
    with pytest.raises(ModelLoadError, match="cannot share"):
        head_shares(12, 2, Shard(0, 3))
    assert [shares(10, 4, rank) for rank in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_code_only_hooks_are_refused(family_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="cannot reach the other ranks"):
        start_group(family_dirs["llama"], _config(2, graph_recorder=lambda *a: None))


# -- failures -------------------------------------------------------------------------------------------


def test_a_follower_killed_is_noticed_and_every_call_fails_after(
    family_dirs: dict[str, Path], group: list[LeaderEngine]
) -> None:
    lost: list[float] = []
    leader = start_group(family_dirs["llama"], _config(2), on_lost=lambda: lost.append(time.monotonic()))
    group.append(leader)
    requests = _requests()
    assert all(r.ok for r in leader.score_prepared([leader.prepare(r) for r in requests]))
    follower = leader._followers[0]
    killed = time.monotonic()
    follower.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and lost[0] - killed < 2.0, "the leader did not notice its follower's exit"
    with pytest.raises(DeviceLostError):
        leader.score_prepared([leader.prepare(r) for r in requests])


def _watched(
    family_dirs: dict[str, Path], group: list[LeaderEngine], timeout_s: float
) -> tuple[LeaderEngine, subprocess.Popen[bytes]]:
    """A group of two with a short timeout whose leader ignores a lost follower; and its follower."""
    leader = start_group(family_dirs["llama"], _config(2, timeout_s=timeout_s), on_lost=lambda: None)
    group.append(leader)
    return leader, leader._followers[0]


def test_a_hung_follower_fails_the_call_within_the_timeout(
    family_dirs: dict[str, Path], group: list[LeaderEngine]
) -> None:
    timeout_s = 4.0
    leader, follower = _watched(family_dirs, group, timeout_s)
    prepared = [leader.prepare(r) for r in _requests()]
    follower.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(DeviceLostError):
            leader.score_prepared(prepared)
        # The call's broadcast waits for the follower up to the timeout (gloo's), and no longer.
        assert time.monotonic() - started < timeout_s * 2 + 2
    finally:
        follower.send_signal(signal.SIGKILL)
        follower.send_signal(signal.SIGCONT)


def test_followers_exit_when_the_leader_goes_quiet(
    family_dirs: dict[str, Path], group: list[LeaderEngine]
) -> None:
    timeout_s = 3.0
    leader, follower = _watched(family_dirs, group, timeout_s)
    leader._stop.set()  # no heartbeat: to the follower, a leader that hangs
    started = time.monotonic()
    code = follower.wait(timeout=timeout_s * 3 + 10)
    assert code != 0
    assert time.monotonic() - started < timeout_s * 3 + 10


# -- loading shard by shard -----------------------------------------------------------------------------

# Big enough that weights, not Python's own allocations, make the resident memory: 8 layers of hidden 512,
# MLP 2048, vocabulary 8192, float32: 150 MB.
LOADING_SHAPES = {
    "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 256, "num_labels": 1,
    "pad_token_id": 0, "tie_word_embeddings": False,
}  # fmt: skip


def _write_loading_model(target: Path) -> int:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model("llama", **LOADING_SHAPES)
    config.architectures = ["LlamaForSequenceClassification"]
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.save_pretrained(str(target))
    return sum(p.numel() * p.element_size() for p in model.parameters())


LOADING_RANK = r"""
import json, os, re, sys, datetime
import torch, torch.distributed as dist
from pathlib import Path
from models.tensor_parallel import Shard, load_sharded

rank, world, port, model_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=120))
status = lambda: Path("/proc/self/status").read_text()
kib = lambda field: int(re.search(rf"^{field}:\s+(\d+) kB", status(), re.M).group(1))
Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from here
before = kib("VmRSS")
loaded, held = load_sharded(model_dir, device=torch.device("cpu"), dtype=torch.float32,
                            attn_implementation="sdpa", shard=Shard(rank, world))
peak = kib("VmHWM")
print(json.dumps({"rank": rank, "held": held, "before_kib": before, "peak_kib": peak}))
dist.barrier()
dist.destroy_process_group()
"""


def test_each_rank_holds_only_its_share_while_loading(tmp_path: Path) -> None:
    world = 4
    whole = _write_loading_model(tmp_path / "model")
    largest = 2048 * 512 * 4  # the largest tensor of a layer (gate, up, down): what one read may map at once
    port = free_port()
    script = tmp_path / "rank.py"
    script.write_text(LOADING_RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    model_dir = str(tmp_path / "model")
    command = [sys.executable, str(script)]
    ranks = [
        subprocess.Popen(
            [*command, str(rank), str(world), str(port), model_dir],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    reports = []
    for process in ranks:
        out, _ = process.communicate(timeout=300)
        assert process.returncode == 0
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for report in reports:
        grew = (report["peak_kib"] - report["before_kib"]) * 1024
        # The rank's share (a quarter of the layers, a quarter of the vocabulary, the norms and head whole)
        # plus one tensor's read through its file's mapping, plus 32 MiB of the allocator's and Python's own.
        assert report["held"] < 0.3 * whole
        assert grew <= report["held"] + largest + 32 * 2**20, report
        assert grew < 0.5 * whole, report
    print(
        "loading:", [(r["rank"], r["held"] >> 20, (r["peak_kib"] - r["before_kib"]) >> 10) for r in reports]
    )


def test_fp8_on_one_device_loads_layer_by_layer(
    family_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FP8 on one device: each layer's projections are quantized as soon as the layer is read, while the
    later layers are still unread (no storage), so the model's dtype never holds more than one layer."""
    import models.fp8
    import models.tensor_parallel
    from models.fp8 import Fp8Linear

    filling: list[torch.nn.Module] = []
    unread_at_each: list[int] = []
    quantize, fill = models.fp8.quantize_layers, models.tensor_parallel.fill

    def watched_quantize(layers: torch.nn.ModuleList, *args: Any) -> tuple[int, int]:
        unread_at_each.append(sum(1 for p in filling[0].parameters() if p.is_meta))
        return quantize(layers, *args)

    def watched_fill(model: torch.nn.Module, *args: Any, **kwargs: Any) -> int:
        filling.append(model)
        return fill(model, *args, **kwargs)

    monkeypatch.setattr(models.fp8, "quantize_layers", watched_quantize)
    monkeypatch.setattr(models.tensor_parallel, "fill", watched_fill)
    scorer = Scorer(family_dirs["llama"], ScorerConfig(device="cpu", dtype="float32", quantization="fp8"))
    layers = scorer.hf_model.base_model.layers
    assert len(unread_at_each) >= len(layers)
    # Layer i was quantized while the later layers (and the final norm, the head) had no values yet.
    assert all(unread > 0 for unread in unread_at_each[: len(layers)])
    assert isinstance(layers[0].self_attn.o_proj.linear, Fp8Linear)
    assert scorer.info.quantization == "fp8"

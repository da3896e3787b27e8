"""Tiny random-weight *ForSequenceClassification models with a locally trained tokenizer (tests, demos)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

from models.families import CLASSIFIER_MODEL_TYPES, DECODER_MODEL_TYPES
from models.linear_attention import HYBRID_MODEL_TYPES
from models.loading import quiet_progress_bars

# Decoders with a classifier; the judge-only families (no *ForSequenceClassification in transformers) are
# written as judges whatever is asked.
DECODERS = CLASSIFIER_MODEL_TYPES
JUDGE_ONLY = tuple(name for name in DECODER_MODEL_TYPES if name not in CLASSIFIER_MODEL_TYPES)
# Hybrid decoders: Gated DeltaNet layers (models/linear_attention.py) with full attention every fourth layer.
HYBRIDS = HYBRID_MODEL_TYPES
# The decoders written as classifiers or judges alike (the hybrids among them).
CAUSAL = DECODERS
# The decoders that FP8 projections, LoRA adapters and the prefix cache serve: the hybrids refuse those at
# start-up (their Gated DeltaNet layers have no such path).
NON_HYBRID_DECODERS = tuple(name for name in DECODERS if name not in HYBRIDS)
# Cross-encoders: bidirectional attention, a query/item pair template, a pooler or dense head chain.
ENCODERS = ("bert", "roberta", "xlm-roberta", "deberta-v2", "modernbert")
ARCHITECTURES = DECODERS + JUDGE_ONLY + ENCODERS
SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")  # ids 0..3 in this order
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(4)
_VOCAB_SIZE = 512

# A built-in English corpus (a few hundred words) to train the tokenizer on: no download, same every time.
_CORPUS = """
The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden fence.
A reward model reads a prompt and a response, then returns a single number that says how good the answer is.
Scores are computed for every item of a request; the query comes first unless the item is placed before it.
Streaming workers read requests from a topic, batch them by tokens, run the model, and publish the results.
When the weather is fine we walk along the river, count the boats, and talk about books, music and science.
Mathematics, physics, chemistry and biology explain how the world works, from atoms to stars and galaxies.
She asked whether the library opens early on Sunday morning, and he answered that it opens at nine o'clock.
Good answers are helpful, honest and harmless; bad answers are rude, wrong, or they ignore the question.
Please summarise the following article in three sentences and list the main people who are mentioned.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten appear in many simple examples.
The city council will meet on Tuesday to discuss new parks, safer streets, cleaner water and cheaper buses.
Cooking dinner takes time: wash the vegetables, cut the onions, boil the pasta and season the sauce well.
Computers store text as tokens; a tokenizer splits words into pieces and maps every piece to an integer id.
In spring the garden is full of flowers, birds sing in the trees and children play until the sun goes down.
Is this response correct? Yes, it is correct. No, it is not correct. Maybe it needs more detail and care.
""".strip()


# The pair templates of the encoder families, with <s> and </s> in the roles of [CLS] and [SEP].
_TEMPLATES = {
    # BERT: [CLS] A [SEP] B [SEP], the second segment with token type 1.
    "bert": ("<s> $A </s>", "<s> $A </s> $B:1 </s>:1"),
    # RoBERTa / XLM-R: <s> A </s></s> B </s>, one token type.
    "xlm-roberta": ("<s> $A </s>", "<s> $A </s> </s> $B </s>"),
    "roberta": ("<s> $A </s>", "<s> $A </s> </s> $B </s>"),
    # DeBERTa v3 and ModernBERT: [CLS] A [SEP] B [SEP], no token types.
    "deberta-v2": ("<s> $A </s>", "<s> $A </s> $B </s>"),
    "modernbert": ("<s> $A </s>", "<s> $A </s> $B </s>"),
}


# A minimal chat template for the decoders' tokenizers: each turn between <s> and </s>, as "role: text".
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def train_tokenizer(seed: int, vocab_size: int = _VOCAB_SIZE, architecture: str = "llama") -> Tokenizer:
    """A small byte-level BPE tokenizer with <pad>, <unk>, <s> and </s>: BOS-prepending for decoders, the
    family's single and pair templates for encoders."""
    tokenizer = Tokenizer(BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The seed picks the order of the corpus lines, so different seeds give (slightly) different merges.
    lines = _CORPUS.splitlines()
    order = torch.randperm(len(lines), generator=torch.Generator().manual_seed(seed)).tolist()
    tokenizer.train_from_iterator([lines[i] for i in order], trainer=trainer)
    single, pair = _TEMPLATES.get(architecture, ("<s> $A", "<s> $A $B"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[("<s>", BOS_ID), ("</s>", EOS_ID)]
    )
    return tokenizer


# A small mixture of experts: 8 experts of width 32, 2 a token, renormalised (Qwen3-MoE's routing); three
# layers, the middle one dense (mlp_only_layers), so that both kinds of MLP and the last layer's sparse block
# (at the pooled rows) are exercised.
_MOE_FIELDS: dict[str, Any] = {
    "head_dim": 16,
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
}


def tiny_config(
    architecture: str, vocab_size: int, num_labels: int, overrides: dict[str, Any] | None = None
) -> PretrainedConfig:
    """A small config of `architecture` (GQA with 4 query and 2 KV heads) for a sequence classifier, its
    family's quirks switched on; `overrides`: config fields that replace the tiny ones (a variant)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}, got {architecture!r}")
    if architecture in ENCODERS:
        return _encoder_config(architecture, vocab_size, num_labels)
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        # Larger than HF's 0.02 so that attention patterns and every layer visibly change the output.
        "initializer_range": 0.1,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "num_labels": num_labels,
    }
    fields.update(_FAMILY_FIELDS.get(architecture, {}))
    fields.update(overrides or {})
    if architecture == "gemma4_text":
        fields["vocab_size_per_layer_input"] = vocab_size  # the per-layer inputs' own table, as small
    if architecture in HYBRIDS:
        fields.update(_hybrid_fields(architecture))
    config = AutoConfig.for_model(architecture, **fields)
    config.architectures = [_class_name(architecture, judge=architecture in JUDGE_ONLY)]
    return config


# Each family's quirks switched on at the tiny size. Sliding windows of 16 are shorter than the test prompts.
_GEMMA_FIELDS: dict[str, Any] = {
    "sliding_window": 16,
    "head_dim": 16,
    "query_pre_attn_scalar": 24,  # not head_dim: a scale taken from head_dim would show
    # Alternating local and global layers, as the real models have them.
    "layer_types": ["sliding_attention", "full_attention"],
}
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 32},  # qwen3 decouples head_dim from hidden_size / heads; exercise that
    "mistral": {"sliding_window": 16},
    "phi3": {"sliding_window": 16},
    # Small enough that random-weight attention scores are really capped.
    "gemma2": {**_GEMMA_FIELDS, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
    "gemma3_text": _GEMMA_FIELDS,
    # The middle layer without rotary positions (no_rope_layers: 1 keeps it, 0 drops it).
    "smollm3": {"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1]},
    "qwen3_moe": _MOE_FIELDS,
    "olmo3": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
    # Rotary on the first half of each head only, in interleaved pairs; biased q/k/v.
    "glm4": {"head_dim": 16, "partial_rotary_factor": 0.5, "attention_bias": True},
    # Four layers: sliding and global alternating, the last two reusing the keys and values of the first two
    # (num_kv_shared_layers); global layers twice as wide per head with one key-value head whose keys are
    # the values (attention_k_eq_v); per-layer inputs; capped logits.
    "gemma4_text": {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "sliding_window": 16,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "hidden_size_per_layer_input": 8,
        "final_logit_softcapping": 3.0,
        "hidden_activation": "gelu_pytorch_tanh",
    },
}


def _class_name(architecture: str, judge: bool) -> str:
    """The transformers class a tiny model of `architecture` is saved as: its classifier, or causal LM."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    names = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if judge else MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    return str(names[architecture])


def _hybrid_fields(architecture: str) -> dict[str, Any]:
    """Gated DeltaNet layers with full attention every fourth layer, as the real models have them: more
    value heads than key heads (each key head serving two), a partial rotary, gated attention output."""
    fields: dict[str, Any] = {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }
    if architecture == "qwen3_next":
        # Sparse MoE blocks on every layer: 8 experts, 2 per token, and the gated shared expert.
        fields.update(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
            norm_topk_prob=True,
        )  # fmt: skip
    return fields


def _encoder_config(architecture: str, vocab_size: int, num_labels: int) -> PretrainedConfig:
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        # RoBERTa positions start after the pad id: room for 512 tokens.
        "max_position_embeddings": 512 + PAD_ID + 2,
        "initializer_range": 0.1,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "num_labels": num_labels,
        "type_vocab_size": 2 if architecture == "bert" else 1,
        # Dropout is off at inference anyway; zero keeps HF's training-mode forward equal too.
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    if architecture == "deberta-v2":
        # DeBERTa v3's shape: disentangled relative attention, log-bucketed positions, no absolute ones.
        fields.update(
            type_vocab_size=0, relative_attention=True, pos_att_type=["p2c", "c2p"],
            position_biased_input=False, max_relative_positions=-1, position_buckets=16,
            norm_rel_ebd="layer_norm", share_att_key=True, pooler_hidden_size=64, pooler_dropout=0.0,
            pooler_hidden_act="gelu",
        )  # fmt: skip
    if architecture == "modernbert":
        # Local attention of 8 tokens (4 each side) on every layer but each third: test items are longer.
        fields.update(
            local_attention=8, global_attn_every_n_layers=3, num_hidden_layers=3, classifier_pooling="mean",
            cls_token_id=BOS_ID, sep_token_id=EOS_ID, type_vocab_size=None, attention_bias=True,
            norm_bias=True, mlp_bias=True, classifier_bias=True, decoder_bias=True,
            global_rope_theta=160000.0, local_rope_theta=10000.0,
        )  # fmt: skip
        fields.pop("type_vocab_size")
    config = AutoConfig.for_model(architecture, **fields)
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForSequenceClassification"]
    return config


# The two process reward model families (`prm`): "head", Qwen2.5-Math-PRM's layout (a two-class MLP head at
# every token, read at a special separator token); "lm", Math-Shepherd's (a causal LM read at a step tag
# through the logits of a "good" and a "bad" token).
PRM_KINDS = ("head", "lm")
PRM_SEPARATORS = {"head": "<extra_0>", "lm": " ки"}
PRM_LABELS = ("+", "-")  # Math-Shepherd's good and bad tokens


def write_tiny_model(
    path: str | Path,
    architecture: str = "llama",
    seed: int = 0,
    num_labels: int = 1,
    judge: bool = False,
    prm: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random-weight model (safetensors) and its tokenizer to `path`; deterministic from `seed`.

    `judge`: a *ForCausalLM of a decoder architecture instead of a classifier (scored on label tokens).
    `prm`: a process reward model of a decoder architecture (PRM_KINDS), its step separator one token of its
    tokenizer and declared in config.json (`score_worker_step_separator`).
    `overrides`: config fields in place of the tiny ones (tiny_config).
    Decoders' tokenizers carry a small chat template, so `messages` can be tried on them.
    """
    if prm is not None and prm not in PRM_KINDS:
        raise ValueError(f"prm must be one of {', '.join(PRM_KINDS)}, not {prm!r}")
    judge = judge or prm == "lm" or architecture in JUDGE_ONLY
    if architecture in JUDGE_ONLY and prm == "head":
        raise ValueError(f"{architecture} has no classifier in transformers: it is written as a judge only")
    if (judge or prm) and architecture not in DECODERS + JUDGE_ONLY:
        raise ValueError(f"a judge or PRM is a decoder: pick a decoder architecture, not {architecture!r}")
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed, architecture=architecture)
    if prm == "head":
        tokenizer.add_special_tokens([PRM_SEPARATORS[prm]])  # one id after the trained vocabulary
    elif prm == "lm":
        tokenizer.add_tokens([PRM_SEPARATORS[prm]])
    labels = 2 if prm == "head" else num_labels
    config = tiny_config(architecture, tokenizer.get_vocab_size(), labels, overrides)
    if judge:
        config.architectures = [_class_name(architecture, judge=True)]
    auto: Any = AutoModelForCausalLM if judge else AutoModelForSequenceClassification
    with torch.random.fork_rng(devices=[]):  # seeded init without disturbing the caller's RNG state
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
        if prm == "head":
            hidden = config.hidden_size
            model.score = torch.nn.Sequential(
                torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
            )
    if prm == "head":
        prefix = _class_name(architecture, judge=False).removesuffix("ForSequenceClassification")
        config.architectures = [f"{prefix}ForProcessRewardModel"]
    # save_pretrained writes the class's own name into config
    architectures = list(config.architectures or ())
    _fill_zero_initialised(model, seed)
    with quiet_progress_bars():
        model.save_pretrained(str(target))
    _fast_tokenizer(tokenizer, architecture, config.max_position_embeddings).save_pretrained(str(target))
    _fix_architectures(target, architectures)
    if prm is not None:
        _declare_step_separator(target, prm)
    return target


def _fast_tokenizer(tokenizer: Tokenizer, architecture: str, max_positions: int) -> PreTrainedTokenizerFast:
    """The trained tokenizer as transformers saves it, with the special tokens and inputs of its kind."""
    encoder = architecture in ENCODERS
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=512 if encoder else max_positions,
        **({"cls_token": "<s>", "sep_token": "</s>"} if encoder else {}),
        # Token types only where the model has more than one (BERT); XLM-R has none.
        model_input_names=["input_ids", "token_type_ids", "attention_mask"]
        if architecture == "bert"
        else ["input_ids", "attention_mask"],
        **({} if encoder else {"chat_template": CHAT_TEMPLATE}),
    )


def _declare_step_separator(target: Path, prm: str) -> None:
    """config.json names the separator; the "head" family's also carries the auto_map of the real model
    (whose code this directory does not ship: score-worker loads the layout with transformers' classes)."""
    config_path = target / "config.json"
    saved = json.loads(config_path.read_text())
    saved["score_worker_step_separator"] = PRM_SEPARATORS[prm]
    if prm == "head":
        saved["auto_map"] = {"AutoModel": "modeling_prm.ProcessRewardModel"}
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def _fill_zero_initialised(model: torch.nn.Module, seed: int) -> None:
    """HF initialises biases to zero and norms to one; random values make a wrong q/k-norm or bias show."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            norm = "norm" in name.lower()  # decoders' *_layernorm / norm, encoders' LayerNorm
            if name.endswith("bias") or norm:
                base = 1.0 if norm and name.endswith("weight") else 0.0
                noise = torch.randn(parameter.shape, generator=generator) * 0.1
                parameter.copy_(base + noise)


def _fix_architectures(target: Path, architectures: list[str]) -> None:
    """from_config models record their own class; make sure config.json names the classification class."""
    config_path = target / "config.json"
    saved = json.loads(config_path.read_text())
    saved["architectures"] = architectures
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def add_arguments(parser: argparse.ArgumentParser, more_architectures: tuple[str, ...] = ()) -> None:
    """Arguments of `score-worker make-tiny-model` (`more_architectures`: those another writer adds)."""
    parser.add_argument("directory", type=Path, help="where to write the model (created if missing)")
    parser.add_argument("--architecture", choices=ARCHITECTURES + more_architectures, default="llama")
    parser.add_argument("--seed", type=int, default=0, help="weights and tokenizer are deterministic from it")
    parser.add_argument("--num-labels", type=int, default=1, help="outputs of the head (1 = reward model)")
    parser.add_argument(
        "--judge",
        action="store_true",
        help="a causal LM scored on label tokens instead of a classifier (always, for "
        f"{', '.join(JUDGE_ONLY)}: transformers has no classifier for it)",
    )
    parser.add_argument(
        "--prm",
        choices=PRM_KINDS,
        help="a process reward model: 'head' (Qwen2.5-Math-PRM's two-class head at a separator token) or "
        "'lm' (Math-Shepherd's causal LM read at a step tag)",
    )


def run(args: argparse.Namespace) -> int:
    """Write the tiny model; returns the process exit code."""
    if args.num_labels < 1:
        print("--num-labels must be at least 1")
        return 2
    if (args.judge or args.prm) and args.architecture not in DECODERS + JUDGE_ONLY:
        print(f"--judge and --prm need a decoder architecture ({', '.join(DECODERS + JUDGE_ONLY)})")
        return 2
    if args.prm == "head" and args.architecture in JUDGE_ONLY:
        print(f"{args.architecture} has no classifier in transformers: --prm head cannot be written")
        return 2
    target = write_tiny_model(
        args.directory, args.architecture, args.seed, args.num_labels, args.judge, args.prm
    )
    judge = args.judge or args.architecture in JUDGE_ONLY
    kind = "judge (causal LM)" if judge else f"model ({args.num_labels} label(s))"
    if args.prm:
        kind = f"process reward model ({args.prm}), step separator {PRM_SEPARATORS[args.prm]!r}"
    print(f"wrote a tiny {args.architecture} {kind}, seed {args.seed}, to {target}")
    return 0

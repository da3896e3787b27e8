"""Load a local HuggingFace *ForSequenceClassification directory: checks, model, head, tokenizer."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging
from transformers.utils.import_utils import is_accelerate_available

from models.checkpoint_heads import (
    ACTIVATIONS,
    adapt_head,
    checkpoint_keys,
    encoder_head,
    find_head,
    head_name,
    mlp_head,
    read_value_head,
    refuse_value_head,
)
from models.errors import ModelLoadError
from models.families import CLASSIFIER_MODEL_TYPES, UNSERVED, check_config
from models.families import DECODER_MODEL_TYPES as DECODER_MODEL_TYPES
from models.linear_attention import HYBRID_MODEL_TYPES
from models.load_report import held_load_report, report_unused
from models.packing import Pooling
from models.vision import (
    VISION_FAMILIES,
    VisionPrompts,
    check_vision_type,
    is_vision_judge,
    load_vision,
    plain_attention,
)
from models.vision_packed import attention_implementations, packs_images

# DECODER_MODEL_TYPES (models/families.py): model types whose packed forward is covered by tests against
# HF's padded forward. Others may work, but an untested architecture must not silently return wrong scores,
# so they are refused.
# Cross-encoders: bidirectional attention inside each item, the tokenizer's pair template, CLS pooling.
ENCODER_MODEL_TYPES = ("bert", "xlm-roberta", "roberta", "deberta-v2", "modernbert")


def packable(model_type: str) -> bool:
    """Whether transformers' implementation of `model_type` takes its attention from the attention interface
    (then it runs packed with ours). Models whose attention is their own code (DeBERTa's disentangled
    relative attention) cannot, and take the plain path: HF's own forward on a padded batch."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    if model_type in HYBRID_MODEL_TYPES:
        # Their full-attention layers call the interface; the Gated DeltaNet layers run ours
        # (models/linear_attention.py) on the packed row. HF leaves the class flag off for the latter.
        return True
    # A family without a classifier (Gemma 4's text model) loads as a judge: its causal LM class says.
    name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)
    name = name or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    return bool(getattr(model_class, "_supports_attention_backend", False))


# Image-text classifiers (models/vision.py): HF's own forward on a padded batch, pixel values beside the ids.
SUPPORTED_MODEL_TYPES = DECODER_MODEL_TYPES + ENCODER_MODEL_TYPES + tuple(VISION_FAMILIES)
# RoBERTa's position ids start after the pad id and skip pad tokens (HF's create_position_ids_from_input_ids).
_PAD_OFFSET_POSITIONS = ("xlm-roberta", "roberta")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class LoadedModel:
    """The parts of a loaded directory the engine uses."""

    model: PreTrainedModel
    base: nn.Module  # the decoder stack; its output is the hidden state after the final norm
    head: nn.Module  # the classification head, applied to pooled rows only
    tokenizer: Any | None  # a transformers tokenizer, or None when the directory has none (token ids only)
    vocab_size: int  # rows of the input embedding: the bound for token ids
    max_position_embeddings: int
    name: str
    pad_token_id: int | None  # where HF's LAST pooling stops: the last token that is not this id
    default_pooling: Pooling  # what the model's own HF head pools
    encoder: bool = False  # bidirectional attention; query and item form a text pair
    token_types: bool = False  # the model embeds segment ids (BERT)
    # RoBERTa-style positions: pad id + 1 + index, pad tokens keeping the pad id (None: 0 + index)
    position_pad: int | None = None
    packable: bool = True  # False: the plain padded path (the model's attention is not pluggable)
    judge: bool = False  # a causal LM: `head` is its lm_head, scored on label tokens only
    final_softcap: float | None = None  # a judge's cap on its logits, tanh(x / cap) * cap (Gemma 2)
    value_head: bool = False  # a TRL value head on a causal LM: HF's own forward does not compute the score
    step_separator: int | str | None = None  # config.json's score_worker_step_separator (process rewards)
    vision: VisionPrompts | None = None  # an image-text model's processor; None: text only


def read_config(model_dir: Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """Read and check config.json without importing any model code.

    A directory that ships its own model code (`auto_map`) is refused unless `trust_remote_code`: loading it
    runs that code. With the opt-in, its model type need not be one transformers knows.
    """
    if not model_dir.is_dir():
        raise ModelLoadError(
            f"model path {str(model_dir)!r} is not a directory; pass a local HuggingFace "
            "model directory (config.json, *.safetensors, tokenizer files)"
        )
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{str(model_dir)!r} has no config.json; it must be a HuggingFace model directory"
        )
    try:
        config: dict[str, Any] = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(config_path)!r}: {exc}") from exc
    architectures = config.get("architectures") or []
    if config.get("model_type") in UNSERVED and not config.get("auto_map"):
        raise ModelLoadError(
            f"model type {config.get('model_type')!r} is not supported: {UNSERVED[config['model_type']]}"
        )
    judge = is_judge(config)
    if not config.get("auto_map"):  # a model's own code is its own (trust_remote_code, below)
        check_vision_type(config.get("model_type"), judge)
    if is_process_reward_model(config):
        # Qwen2.5-Math-PRM's layout: transformers' own classes with its two-layer head; its remote code,
        # which only defines that head, is never run.
        config.pop("auto_map", None)
    elif not judge and not any(str(arch).endswith("ForSequenceClassification") for arch in architectures):
        raise ModelLoadError(
            f"{str(model_dir)!r} holds {architectures or 'no declared architecture'}, not a "
            "*ForSequenceClassification model (classification or reward head) nor a *ForCausalLM judge of "
            f"a supported decoder type ({', '.join(DECODER_MODEL_TYPES)})"
        )
    model_type = config.get("model_type")
    if config.get("auto_map"):
        if not trust_remote_code:
            raise ModelLoadError(
                f"{str(model_dir)!r} ships its own model code (auto_map in config.json); loading it runs "
                "that code, so score-worker does so only with trust_remote_code set (only for code you trust)"
            )
        return config
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not judge and model_type in DECODER_MODEL_TYPES and model_type not in CLASSIFIER_MODEL_TYPES:
        raise ModelLoadError(
            f"transformers has no sequence classifier for {model_type!r}; it loads as a judge only "
            "(*ForCausalLM scored on label_token_ids)"
        )
    check_config(config)
    return config


def is_process_reward_model(config: dict[str, Any]) -> bool:
    """A `*ForProcessRewardModel` of a supported decoder type (Qwen2.5-Math-PRM's layout): the decoder, then
    `score` = Linear(H, H), ReLU, Linear(H, 2) at every token; its scores are read at step separators."""
    architectures = [str(arch) for arch in config.get("architectures") or []]
    return (
        any(arch.endswith("ForProcessRewardModel") for arch in architectures)
        and config.get("model_type") in DECODER_MODEL_TYPES
    )


def step_separator(config: dict[str, Any]) -> int | str | None:
    """The step separator config.json declares (`score_worker_step_separator`: a token id or its text)."""
    value = config.get("score_worker_step_separator")
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    if isinstance(value, str) and value:
        return value
    raise ModelLoadError(
        f"score_worker_step_separator in config.json is {value!r}; declare the step separator's token id "
        "(an integer >= 0) or its text, or remove the key"
    )


def is_judge(config: dict[str, Any]) -> bool:
    """A causal LM of a supported decoder type, or an image-text family's generation model where it is
    served as a judge: scored by the logits of label tokens (label_token_ids)."""
    architectures = [str(arch) for arch in config.get("architectures") or []]
    if is_vision_judge(config.get("model_type"), architectures):
        return True
    classifier = any(arch.endswith("ForSequenceClassification") for arch in architectures)
    causal = any(arch.endswith("ForCausalLM") for arch in architectures)
    return causal and not classifier and config.get("model_type") in DECODER_MODEL_TYPES


def declared_head(config: dict[str, Any]) -> dict[str, Any] | None:
    """The head declared in config.json, checked: {"type": "mlp", "activation": one of ACTIVATIONS}."""
    declared = config.get("score_worker_head")
    if declared is None:
        return {"type": "mlp", "activation": "relu"} if is_process_reward_model(config) else None
    if not isinstance(declared, dict) or declared.get("type") != "mlp":
        raise ModelLoadError(
            f'score_worker_head in config.json is {declared!r}; declare {{"type": "mlp", "activation": '
            f'"relu"}} (activations: {", ".join(ACTIVATIONS)}) or remove it for the model\'s own head'
        )
    if declared.get("activation") not in ACTIVATIONS:
        raise ModelLoadError(
            f"score_worker_head.activation is {declared.get('activation')!r}; use one of "
            f"{', '.join(ACTIVATIONS)}"
        )
    return declared


def _load_tokenizer(model_dir: Path, trust_remote_code: bool, *, encoder: bool) -> Any | None:
    """The directory's tokenizer, or None where it has no tokenizer files (token-id requests only); a
    cross-encoder must have one."""
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        if encoder:
            raise ModelLoadError(
                f"{str(model_dir)!r} holds a cross-encoder without tokenizer files; its pair template "
                "([CLS] query [SEP] item [SEP]) comes from the tokenizer, so add them to the directory"
            )
        return None
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception as exc:  # any failure here means the directory's tokenizer files are unusable
        raise ModelLoadError(
            f"cannot load the tokenizer of {str(model_dir)!r}: {type(exc).__name__}: {exc}"
        ) from exc


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Turn off the tqdm bars of transformers and huggingface_hub for one call, then restore their setting.

    Loading prints a "Loading weights" bar (and saving a "Writing model shards" bar) on stderr, which floods a
    service's logs; log warnings (e.g. the load report of unexpected weights) are not affected.
    """
    transformers_bars = hf_logging.is_progress_bar_enabled()
    hub_bars = not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # also huggingface_hub's bars
    try:
        yield
    finally:
        if transformers_bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # huggingface_hub's too
        if not hub_bars:
            disable_progress_bars()
        elif not transformers_bars:
            enable_progress_bars()


# Weights that load through Python's unpickler (torch.load): a crafted file can run code as it is read.
_PICKLE_WEIGHTS = ("pytorch_model*.bin", "pytorch_model.bin.index.json")


def _safetensors_only(model_dir: Path, allow_pickle_weights: bool) -> bool:
    """Whether the weights load from safetensors only (from_pretrained's use_safetensors).

    A directory whose only weights are pickles is refused unless `allow_pickle_weights`; where safetensors
    exist they are always the ones read, so a pickle beside them is never opened.
    """
    if any(model_dir.glob("*.safetensors")):
        return True
    pickles = sorted({path.name for pattern in _PICKLE_WEIGHTS for path in model_dir.glob(pattern)})
    if pickles and not allow_pickle_weights:
        raise ModelLoadError(
            f"{str(model_dir)!r} has its weights only as pickle files ({', '.join(pickles[:3])}), and "
            "loading a pickle can run code hidden in it. Convert them to safetensors, or, for weights you "
            "trust, set allow_pickle_weights (SCORE_WORKER_ALLOW_PICKLE_WEIGHTS=true, --allow-pickle-weights)"
        )
    return not pickles


def _placement(device: torch.device) -> dict[str, Any]:
    """from_pretrained arguments that load the weights straight onto a GPU instead of through host tensors.

    A modest gain (a 0.54B bf16 model on the H200, transformers 5.17: 0.72 s instead of 0.84 s). transformers
    needs accelerate for a device_map; without it the weights are loaded on the host and moved after.
    """
    if device.type != "cuda" or not is_accelerate_available():
        return {}
    return {"device_map": {"": device}}


def _check_all_weights_loaded(model_dir: Path, info: dict[str, Any]) -> None:
    """Refuse a checkpoint that lacks weights of the model (HF would initialise them randomly and only warn).

    The common case is a base or causal-LM checkpoint under a *ForSequenceClassification config: its head
    would be random and every score noise. Extra weights in the checkpoint (e.g. an lm_head) are harmless.
    """
    missing = sorted(info.get("missing_keys") or ())
    # mismatched entries are (name, checkpoint shape, model shape) in transformers 5
    mismatched = sorted(str(e[0] if isinstance(e, tuple) else e) for e in info.get("mismatched_keys") or ())
    absent = missing + mismatched
    if absent:
        shown = ", ".join(absent[:5]) + (f" and {len(absent) - 5} more" if len(absent) > 5 else "")
        raise ModelLoadError(
            f"The checkpoint in {str(model_dir)!r} has no (or wrongly shaped) weights for {shown}, which "
            "would be randomly initialised and make every score noise; point the worker at a trained "
            "*ForSequenceClassification checkpoint that includes its classification head."
        )


def load_model(
    model_dir: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str,
    trust_remote_code: bool = False,
    allow_pickle_weights: bool = False,
    packed_images: bool = True,
) -> LoadedModel:
    """Load weights, head and tokenizer; the model is in eval mode on `device`. `packed_images`: the
    image-text families that run packed do (models/vision_packed.py); else they run padded."""
    config = read_config(model_dir, trust_remote_code)
    remote_code = bool(config.get("auto_map"))
    model_type = str(config.get("model_type"))
    runs_packed, attention = _attention_choice(model_type, remote_code, attn_implementation, packed_images)
    model, info = _from_pretrained(
        model_dir,
        config,
        device=device,
        dtype=dtype,
        attn_implementation=attention,
        remote_code=remote_code,
        safetensors_only=_safetensors_only(model_dir, allow_pickle_weights),
    )
    judge, value_head = _judge_or_value_head(model_dir, model, is_judge(config), info)
    module: nn.Module = model  # PreTrainedModel.to's decorator hides Module.to's signature from mypy
    module.to(device).eval()
    if value_head is not None:
        value_head.to(device=device, dtype=dtype)
    base, embeddings = _base_and_embeddings(model)
    encoder = config.get("model_type") in ENCODER_MODEL_TYPES
    tokenizer = _load_tokenizer(model_dir, remote_code, encoder=encoder)
    max_positions, position_pad = _positions(config)
    vision = load_vision(model_dir, model_type, tokenizer) if model_type in VISION_FAMILIES else None
    return LoadedModel(
        model=model,
        base=base,
        head=value_head or _head(model, judge, encoder),
        value_head=value_head is not None,
        tokenizer=tokenizer,
        vocab_size=int(embeddings.num_embeddings),
        max_position_embeddings=max_positions,
        name=model_dir.resolve().name or str(config.get("_name_or_path", "")),
        pad_token_id=_pad_token_id(model),
        # HF's causal LMs have no pad rule: judges and TRL value heads read the prompt's true last token.
        default_pooling=(
            "last_token" if judge or value_head else _default_pooling(config) if encoder else "last"
        ),
        encoder=encoder,
        # Image-text models mark image tokens as type 1 (attended both ways within each image).
        token_types=vision is not None or (encoder and int(config.get("type_vocab_size") or 1) > 1),
        position_pad=position_pad,
        packable=runs_packed,
        judge=judge,
        final_softcap=_final_softcap(model) if judge else None,
        step_separator=step_separator(config),
        vision=vision,
    )


def _attention_choice(
    model_type: str, remote_code: bool, attn_implementation: str, packed_images: bool
) -> tuple[bool, str | dict[str, str]]:
    """Whether the model runs packed, and the attention implementation it is loaded with. A model's own
    code may ignore our attention, whatever type it claims: it runs the plain path. Image-text models too,
    but those whose packed forward is checked (models/vision_packed.py): their text model takes our
    attention, their vision tower HF's."""
    vision_packed = packs_images(model_type, packed_images)
    runs_packed = not remote_code and (vision_packed or packable(model_type))
    runs_packed = runs_packed and (model_type not in VISION_FAMILIES or vision_packed)
    if not runs_packed:
        return False, plain_attention(model_type)
    return True, attention_implementations(attn_implementation) if vision_packed else attn_implementation


def _judge_or_value_head(
    model_dir: Path, model: PreTrainedModel, judge: bool, info: dict[str, Any]
) -> tuple[bool, nn.Linear | None]:
    """Whether the model scores as a judge, and its TRL value head if it has one: a causal LM with a value
    head is a reward model after all (its score is the value head at the last token, not label logits). A
    classifier's checkpoint may hold no value head, and its head tensors are adapted to its head."""
    unexpected = info.get("unexpected_keys") or ()
    if not judge:
        refuse_value_head(model_dir, model, unexpected)
        adapt_head(model, model_dir, unexpected)
        return False, None
    value_head = read_value_head(model_dir, model)
    return value_head is None, value_head


@held_load_report()  # it would call the head weights placed here and in load_model missing or unexpected
def _from_pretrained(
    model_dir: Path,
    config: dict[str, Any],
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str | dict[str, str],
    remote_code: bool,
    safetensors_only: bool,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """HF's model with a declared MLP head in place of the linear one HF builds, every weight of the
    checkpoint loaded (ModelLoadError otherwise); and HF's loading info."""
    judge = is_judge(config)
    try:
        with quiet_progress_bars():
            auto: Any = AutoModelForCausalLM if judge else AutoModelForSequenceClassification
            if judge and str(config.get("model_type")) in VISION_FAMILIES:
                auto = AutoModelForImageTextToText
            model, info = auto.from_pretrained(
                str(model_dir),
                dtype=dtype,
                attn_implementation=attn_implementation,
                output_loading_info=True,
                trust_remote_code=remote_code,
                use_safetensors=safetensors_only,
                **_placement(device),
            )
    except Exception as exc:  # missing or corrupt weights, unknown config keys: all are load failures
        raise ModelLoadError(
            f"cannot load the model in {str(model_dir)!r}: {type(exc).__name__}: {exc}"
        ) from exc
    declared = declared_head(config)
    if declared is not None and not judge:
        # HF built its own linear head and reports its weights missing: the declared head replaces it.
        name = head_name(model)
        head = mlp_head(model_dir, name, declared["activation"], checkpoint_keys(model_dir))
        setattr(model, name, head.to(dtype=dtype))
        info["missing_keys"] = [k for k in info.get("missing_keys") or () if not k.startswith(f"{name}.")]
        info["unexpected_keys"] = [
            k for k in info.get("unexpected_keys") or () if not k.startswith(f"{name}.")
        ]
    _check_all_weights_loaded(model_dir, info)
    # The head's weights (a bias included) and a judge's value head are placed in load_model, or refused.
    report_unused(model_dir, info.get("unexpected_keys") or (), ["v_head"] if judge else [head_name(model)])
    return model, info


def _base_and_embeddings(model: PreTrainedModel) -> tuple[nn.Module, nn.Embedding]:
    """The transformer under the head and its token embedding table: the parts the engine runs itself."""
    base = getattr(model, model.base_model_prefix, None)
    if not isinstance(base, nn.Module):
        raise ModelLoadError(
            f"{type(model).__name__} has no base model attribute {model.base_model_prefix!r}"
        )
    embeddings = model.get_input_embeddings()
    if not isinstance(embeddings, nn.Embedding):
        raise ModelLoadError(f"{type(model).__name__} has no token embedding table")
    return base, embeddings


def _positions(config: dict[str, Any]) -> tuple[int, int | None]:
    """The longest prompt the position table holds, and the pad id its positions start after (RoBERTa's
    family: positions count from pad_token_id + 1), or None."""
    text = config.get("text_config") or {}  # an image-text model keeps its text model's limit there
    max_positions = int(
        config.get("max_position_embeddings") or text.get("max_position_embeddings") or 2**31 - 1
    )
    if config.get("model_type") not in _PAD_OFFSET_POSITIONS:
        return max_positions, None
    position_pad = int(config.get("pad_token_id") or 0)
    return max_positions - position_pad - 1, position_pad


def _final_softcap(model: PreTrainedModel) -> float | None:
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    return float(cap) if cap else None


def _head(model: PreTrainedModel, judge: bool, encoder: bool) -> nn.Module:
    if judge:
        return _judge_head(model)
    return encoder_head(model) if encoder else find_head(model)


def _judge_head(model: PreTrainedModel) -> nn.Module:
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise ModelLoadError(f"{type(model).__name__} has no linear lm_head to score label tokens with")
    return head


def _default_pooling(config: dict[str, Any]) -> Pooling:
    """Encoders pool their first token, except where the config says otherwise (ModernBERT's mean)."""
    return "mean" if config.get("classifier_pooling") == "mean" else "cls"


def _pad_token_id(model: PreTrainedModel) -> int | None:
    pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else None

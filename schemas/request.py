"""The scoring request: what a producer asks for, validated on construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from enum import StrEnum

from schemas._checks import (
    Input,
    check_bool,
    check_choice,
    check_input,
    check_int,
    check_metadata,
    check_request_id,
    check_token_ids,
    describe,
    invalid,
    is_array,
    quoted,
)
from schemas.compare import Compare, check_compare, check_compare_fields, check_reward_column
from schemas.errors import ErrorCode, SchemaError
from schemas.images import ContentPart, check_content_parts, check_images, image_parts
from schemas.tensor import HiddenDType, check_dtype
from schemas.version import SCHEMA_VERSION

MAX_LABEL_TOKEN_IDS = 256
MAX_MESSAGES = 256
MAX_ROLE_CHARS = 32
MAX_REQUIRES = 64
MAX_STEP_SEPARATOR_CHARS = 64
_SHOWN_UNKNOWN = 3  # unknown names quoted in one sentence; an error result echoes it, so it stays short


class Truncation(StrEnum):
    """Which part of a prompt longer than the model's limit gives up tokens, and from which end."""

    NONE = "none"
    QUERY_LEFT = "query_left"
    QUERY_RIGHT = "query_right"
    ITEM_LEFT = "item_left"
    ITEM_RIGHT = "item_right"


_TRUNCATIONS = frozenset(truncation.value for truncation in Truncation)


class TokenOutputs(StrEnum):
    """Which tokens of each item get their own outputs beside the item's pooled one."""

    STEPS = "steps"  # every step separator token (process reward models)
    TOKENS = "tokens"  # every token, or those of `token_range`


def check_token_outputs(value: object) -> TokenOutputs | None:
    """nil, or "steps" or "tokens"."""
    hint = 'send nil, "steps" (at each step separator) or "tokens".'
    return check_choice(value, TokenOutputs, "token_outputs", hint)


def check_step_separator(value: object) -> int | str | None:
    """nil, a token id, or a string of 1 to 64 characters (which must be one token of the model's)."""
    if value is None:
        return None
    if isinstance(value, str):
        if not 1 <= len(value) <= MAX_STEP_SEPARATOR_CHARS:
            raise invalid(
                f"step_separator has {len(value)} characters; send the separator's token id, or its text of "
                f"1 to {MAX_STEP_SEPARATOR_CHARS} characters."
            )
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(
            f"step_separator must be nil, a token id (an integer >= 0) or the separator's text, not "
            f"{describe(value)}."
        )
    return int(value)


def check_token_range(value: object) -> tuple[int | None, int | None] | None:
    """nil, or [start, stop] as a Python slice of each prompt's tokens: negative counts from the end, nil
    is the start or the end."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise invalid(
            f"token_range must be nil or an array [start, stop], not {describe(value)}; e.g. [0, nil] for "
            f"every token, [-16, nil] for the last 16."
        )
    bounds: list[int | None] = []
    for name, bound in zip(("start", "stop"), value, strict=True):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
            raise invalid(f"token_range's {name} must be an integer or nil, not {describe(bound)}.")
        bounds.append(None if bound is None else int(bound))
    return bounds[0], bounds[1]


MAX_ADAPTER_CHARS = 128


def check_adapter(value: object) -> str | None:
    """nil, or an adapter's name of 1 to 128 characters."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ADAPTER_CHARS:
        raise invalid(
            f"adapter must be nil or an adapter's name of 1 to {MAX_ADAPTER_CHARS} characters, not "
            f"{describe(value)}."
        )
    return value


MAX_HEADS = 16


def check_heads(value: object) -> tuple[str, ...] | None:
    """nil, or 1 to 16 distinct head names of 1 to 128 characters each."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_HEADS:
        raise invalid(
            f"heads must be nil or an array of 1 to {MAX_HEADS} head names, not {describe(value)}; send the "
            f"names of heads this worker serves."
        )
    names = tuple(value)
    for index, name in enumerate(names):
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_ADAPTER_CHARS:
            raise invalid(f"heads[{index}] must be a head's name of 1 to {MAX_ADAPTER_CHARS} characters.")
    if len(set(names)) != len(names):
        raise invalid("heads names a head twice; send each head's name once.")
    return names


def _check_token_output_fields(request: ScoreRequest) -> None:
    """The token-output fields go together: each of them only with the kind that reads it."""
    kind = request.token_outputs
    if request.step_separator is not None and kind is not TokenOutputs.STEPS:
        raise invalid('step_separator is set but token_outputs is not "steps"; send both, or neither.')
    if request.token_range is not None and kind is not TokenOutputs.TOKENS:
        raise invalid('token_range is set but token_outputs is not "tokens"; send both, or neither.')
    if kind is None:
        if request.return_token_hidden_states:
            raise invalid(
                'return_token_hidden_states is true but token_outputs is nil; send token_outputs "steps" or '
                '"tokens" to say at which tokens.'
            )
        return
    if not (request.return_token_scores or request.return_token_hidden_states):
        raise invalid(
            "token_outputs is set but return_token_scores and return_token_hidden_states are both false; ask "
            "for one of them, or send token_outputs nil."
        )


def check_version(value: object) -> int:
    """The schema version: an integer, and one this code speaks."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"version must be an integer, not {describe(value)}; send version {SCHEMA_VERSION}.")
    if value != SCHEMA_VERSION:
        raise SchemaError(
            ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
            f"Schema version {value} is not supported by this worker; send version {SCHEMA_VERSION}.",
        )
    return value


def _kind(value: Input) -> str:
    return "text" if isinstance(value, str) else "an array of token ids"


def check_items(value: object, query: Input | None) -> tuple[Input, ...]:
    """Items as a tuple of inputs, all of the same kind as each other and as the query."""
    if not isinstance(value, list | tuple):
        raise invalid(
            f"items must be an array of inputs, not {describe(value)}; send an array (it may be empty) of "
            f"strings or of token-id arrays."
        )
    items = tuple(check_input(item, f"items[{index}]") for index, item in enumerate(value))
    # Text and token ids cannot be joined faithfully (re-tokenizing shifts boundary tokens), so refuse a mix.
    first_name, first = ("query", query) if query is not None else ("items[0]", items[0] if items else None)
    if first is None:
        return items
    for index, item in enumerate(items):
        if isinstance(item, str) != isinstance(first, str):
            raise invalid(
                f"{first_name} is {_kind(first)} but items[{index}] is {_kind(item)}; send the query and "
                f"every item as text, or all of them as arrays of token ids."
            )
    return items


def check_truncation(value: object) -> Truncation:
    """The truncation rule, from the enum or its exact wire spelling."""
    if isinstance(value, Truncation):
        return value
    if isinstance(value, str) and value in _TRUNCATIONS:
        return Truncation(value)
    shown = quoted(value) if isinstance(value, str) else describe(value)
    raise invalid(
        f'truncate is {shown}; send one of "none", "query_left", "query_right", "item_left" or "item_right".'
    )


def check_label_token_ids(value: object) -> tuple[int, ...] | None:
    """nil, or 1 to 256 distinct token ids (the labels a judge model is scored on)."""
    if value is None:
        return None
    if not is_array(value):
        raise invalid(
            f"label_token_ids must be nil or an array of token ids, not {describe(value)}; send nil, or 1 to "
            f"{MAX_LABEL_TOKEN_IDS} distinct token ids."
        )
    if not 1 <= len(value) <= MAX_LABEL_TOKEN_IDS:
        raise invalid(
            f"label_token_ids has {len(value)} ids; send nil (to score with the model's own head), or 1 to "
            f"{MAX_LABEL_TOKEN_IDS} distinct token ids."
        )
    ids = check_token_ids(value, "label_token_ids", text_allowed=False)
    if len(set(ids)) != len(ids):
        first: dict[int, int] = {}
        for index, token in enumerate(ids):
            if token in first:
                raise invalid(
                    f"label_token_ids[{index}] repeats {token} (label_token_ids[{first[token]}]); send each "
                    f"label's token id once."
                )
            first[token] = index
    return ids


def _check_message_parts(
    role: object, content: object, field: str
) -> tuple[str, str | tuple[ContentPart, ...]]:
    if role is None:
        raise invalid(
            f"{field}.role is missing; send the speaker's role as a string of 1 to {MAX_ROLE_CHARS} "
            f'characters, e.g. "user".'
        )
    if not isinstance(role, str):
        raise invalid(
            f'{field}.role must be a string, not {describe(role)}; send the speaker\'s role, e.g. "user".'
        )
    if not 1 <= len(role) <= MAX_ROLE_CHARS:
        raise invalid(
            f"{field}.role has {len(role)} characters; send a role of 1 to {MAX_ROLE_CHARS} characters, "
            f'e.g. "user".'
        )
    if content is None:
        raise invalid(f"{field}.content is missing; send the message text as a string (it may be empty).")
    if isinstance(content, list | tuple):
        return role, check_content_parts(content, f"{field}.content")
    if not isinstance(content, str):
        raise invalid(
            f"{field}.content must be a string or an array of parts, not {describe(content)}; send the "
            f'message text as a string, or parts such as [{{"type": "image"}}, {{"type": "text", ...}}].'
        )
    return role, content


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of the conversation that comes before the assistant's reply (each item is that reply)."""

    role: str
    content: str | tuple[ContentPart, ...]  # text, or parts placing the request's images among texts

    def __post_init__(self) -> None:
        object.__setattr__(self, "content", _check_message_parts(self.role, self.content, "message")[1])

    def as_template_turn(self) -> dict[str, object]:
        """The message as chat templates read it."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        return {"role": self.role, "content": [part.as_template_part() for part in self.content]}


def _check_message(value: object, field: str) -> ChatMessage:
    if isinstance(value, ChatMessage):
        return value
    if not isinstance(value, Mapping):
        raise invalid(
            f"{field} must be a map {{role, content}}, not {describe(value)}; send a map with a string role "
            f"and a string content."
        )
    # A misspelt key would otherwise drop part of the conversation without a word.
    extra = [key for key in value if key not in ("role", "content")]
    if extra:
        raise invalid(
            f"{field} has the key {quoted(extra[0], 40)}, which a message does not take; send only role and "
            f"content (keep your own data in metadata)."
        )
    role, content = _check_message_parts(value.get("role"), value.get("content"), field)
    return ChatMessage(role, content)


def check_messages(value: object) -> tuple[ChatMessage, ...] | None:
    """nil, or 1 to 256 chat messages (ChatMessage instances, or maps {role, content} from the wire)."""
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise invalid(
            f"messages must be nil or an array of maps {{role, content}}, not {describe(value)}; send nil, "
            f"or 1 to {MAX_MESSAGES} messages."
        )
    if not 1 <= len(value) <= MAX_MESSAGES:
        raise invalid(
            f"messages has {len(value)} messages; send nil (no conversation), or 1 to {MAX_MESSAGES} "
            f"messages."
        )
    return tuple(_check_message(message, f"messages[{index}]") for index, message in enumerate(value))


def _check_chat(request: ScoreRequest) -> None:
    """With messages, each item is the assistant's reply: text, after the conversation, with no query."""
    if request.query is not None:
        raise invalid(
            "query is set together with messages; send the conversation in messages and query nil (each "
            "item is the assistant's reply to it)."
        )
    if request.item_first:
        raise invalid(
            "item_first is true together with messages; send item_first false (each item is the assistant's "
            "reply, so it comes after the conversation)."
        )
    for index, item in enumerate(request.items):
        if not isinstance(item, str):
            raise invalid(
                f"items[{index}] is an array of token ids but messages is set; send every item as text (the "
                f"assistant's reply), or send token ids without messages."
            )


def _check_image_places(request: ScoreRequest) -> None:
    """Images go with text prompts; with messages, each image part takes the next image, one for one."""
    placed = sum(image_parts(message.content) for message in request.messages or ())
    if request.images is None:
        if placed:
            raise invalid(
                f"messages place {placed} image(s) but images is nil; send the encoded images in images, in "
                f"the order their parts appear."
            )
        return
    if request.messages is not None and placed != len(request.images):
        raise invalid(
            f'messages place {placed} image(s) (parts {{"type": "image"}}) but images has '
            f"{len(request.images)}; send one image per image part, in the order the parts appear."
        )
    if any(not isinstance(value, str) for value in (request.query, *request.items) if value is not None):
        raise invalid(
            "images come with token-id inputs; send the query and items as text with images (the model's "
            "processor places the image tokens in the text)."
        )
    if request.truncate is not Truncation.NONE:
        raise invalid(
            'truncate is set on a request with images; send truncate "none" with images (an image\'s '
            "tokens cannot be cut)."
        )


def check_requires(value: object) -> tuple[str, ...] | None:
    """nil, or names of request fields the producer needs understood; any other name is refused."""
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise invalid(
            f"requires must be nil or an array of request field names, not {describe(value)}; send nil, or "
            f'up to {MAX_REQUIRES} names such as "messages".'
        )
    if len(value) > MAX_REQUIRES:
        raise invalid(f"requires has {len(value)} names; send at most {MAX_REQUIRES}, each field once.")
    for index, name in enumerate(value):
        if not isinstance(name, str):
            raise invalid(
                f"requires[{index}] must be a string, not {describe(name)}; send a request field name such "
                f'as "messages".'
            )
    names: tuple[str, ...] = tuple(value)
    unknown = [name for name in dict.fromkeys(names) if name not in REQUEST_FIELDS]
    if unknown:
        shown = ", ".join(quoted(name, 40) for name in unknown[:_SHOWN_UNKNOWN])
        if len(unknown) > _SHOWN_UNKNOWN:
            shown += f" and {len(unknown) - _SHOWN_UNKNOWN} more"
        them = "it" if len(unknown) == 1 else "them"
        raise invalid(
            f"requires names {shown}, which this worker does not understand (it knows the request fields of "
            f"schema version {SCHEMA_VERSION}); send the request to a worker that does, or remove {them} "
            f"from requires if your results do not depend on {them}."
        )
    return names


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """One scoring request: a prompt per item (query + item, or item + query), scored by the model."""

    request_id: str
    items: tuple[Input, ...]
    query: Input | None = None
    item_first: bool = False
    apply_softmax: bool = False
    return_pooled_hidden_states: bool = False
    hidden_states_dtype: HiddenDType = HiddenDType.FLOAT32
    metadata: object = None
    label_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    truncate: Truncation = Truncation.NONE
    requires: tuple[str, ...] | None = None
    # Unix time in milliseconds after which the result is no longer wanted (EXPIRED instead of a score).
    deadline_ms: int | None = None
    # Milliseconds the request stays wanted, counted from its record's timestamp.
    ttl_ms: int | None = None
    # Outputs at chosen tokens of each item (process rewards at step separators, token-level outputs).
    token_outputs: TokenOutputs | None = None
    step_separator: int | str | None = None  # nil: the model's own (config.json score_worker_step_separator)
    token_range: tuple[int | None, int | None] | None = None  # nil: every token of the prompt
    return_token_scores: bool = True
    return_token_hidden_states: bool = False
    # The LoRA adapter (by the name a worker serves it under) to score with; nil: the base model.
    adapter: str | None = None
    # Extra heads (by the names a worker serves them under) to score each item with, beside its own.
    heads: tuple[str, ...] | None = None
    # Encoded images (PNG, JPEG, WebP), in the order the prompt places them (schemas/images.py).
    images: tuple[bytes, ...] | None = None
    # Preferences between the items (schemas/compare.py), from the reward in column `reward_column` of each
    # item's scores (nil: the only column).
    compare: Compare | None = None
    reward_column: int | None = None
    version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        request_id = check_request_id(self.request_id)
        try:
            self._validate()
        except SchemaError as error:
            raise error.with_request_id(request_id) from None

    def _validate(self) -> None:
        check_version(self.version)
        # Before the other fields: one this worker does not know may change how they are meant to be read,
        # and "not understood" is then the error the producer can act on.
        object.__setattr__(self, "requires", check_requires(self.requires))
        query = None if self.query is None else check_input(self.query, "query")
        object.__setattr__(self, "query", query)
        object.__setattr__(self, "items", check_items(self.items, query))
        for field in (
            "item_first", "apply_softmax", "return_pooled_hidden_states", "return_token_scores",
            "return_token_hidden_states",
        ):  # fmt: skip
            check_bool(getattr(self, field), field)
        dtype = HiddenDType(check_dtype(self.hidden_states_dtype, "hidden_states_dtype"))
        object.__setattr__(self, "hidden_states_dtype", dtype)
        object.__setattr__(self, "label_token_ids", check_label_token_ids(self.label_token_ids))
        object.__setattr__(self, "messages", check_messages(self.messages))
        if self.messages is not None:
            _check_chat(self)
        object.__setattr__(self, "truncate", check_truncation(self.truncate))
        for field, minimum in (("deadline_ms", 0), ("ttl_ms", 1)):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, check_int(value, field, minimum))
        object.__setattr__(self, "token_outputs", check_token_outputs(self.token_outputs))
        object.__setattr__(self, "step_separator", check_step_separator(self.step_separator))
        object.__setattr__(self, "token_range", check_token_range(self.token_range))
        _check_token_output_fields(self)
        object.__setattr__(self, "adapter", check_adapter(self.adapter))
        object.__setattr__(self, "heads", check_heads(self.heads))
        object.__setattr__(self, "images", check_images(self.images))
        _check_image_places(self)
        object.__setattr__(self, "compare", check_compare(self.compare))
        object.__setattr__(self, "reward_column", check_reward_column(self.reward_column))
        check_compare_fields(self.compare, self.reward_column, len(self.items), self.token_outputs)
        check_metadata(self.metadata)

    def expires_at_ms(self, record_timestamp_ms: int, default_ttl_ms: int = 0) -> int | None:
        """Unix milliseconds after which this request is expired: the earlier of `deadline_ms` and the
        time-to-live from its record's timestamp (the request's own `ttl_ms`, else `default_ttl_ms` when
        positive); None when neither applies."""
        ttl = self.ttl_ms if self.ttl_ms is not None else (default_ttl_ms or None)
        limits = [self.deadline_ms, None if ttl is None else record_timestamp_ms + ttl]
        present = [limit for limit in limits if limit is not None]
        return min(present) if present else None


# What a worker of this version understands in `requires`: exactly the request's wire keys.
REQUEST_FIELDS: frozenset[str] = frozenset(field.name for field in dataclass_fields(ScoreRequest))

"""Turn a ScoreRequest into token-id prompts (one per item) and validate them against the model's limits."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from models.compare import RewardRule
from models.images import ImageError
from models.vision import ImageInputs, VisionPrompts
from schemas import ErrorCode, ScoreRequest, TokenOutputs, Truncation
from schemas._checks import Input

Prompt = tuple[int, ...]
_PROBE = "first words"  # a text whose tokens show where a tokenizer puts its special tokens


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: one token-id prompt per item, ready to be packed into a forward batch."""

    request: ScoreRequest
    prompts: tuple[Prompt, ...]
    tokenize_s: float
    # Segment ids per prompt (0 for the query, 1 for the item), for encoders with token types (BERT).
    token_types: tuple[Prompt, ...] | None = None
    # Tokens truncation removed from each prompt; None when the request asked no truncation.
    truncated: tuple[int, ...] | None = None
    # With token_outputs: per prompt, the positions read (step separators, or the token range), in order.
    positions: tuple[tuple[int, ...], ...] | None = None
    head_floats: int = 0  # floats per item of the extra heads the request names
    # With images: per prompt, its images as the model's forward takes them (models/vision.py).
    pixel_values: tuple[ImageInputs, ...] | None = None

    @property
    def num_tokens(self) -> int:
        """Total prompt tokens of the request (what it costs in a batch's token budget)."""
        return sum(len(prompt) for prompt in self.prompts)

    @property
    def num_positions(self) -> int:
        """Positions its token outputs read, over all its prompts (0 without token_outputs)."""
        return sum(len(at) for at in self.positions or ())


class PromptError(Exception):
    """An item cannot be scored; carries the outward error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class PairTemplate:
    """Where an encoder's tokenizer puts its special tokens around one text or a pair, with token types.

    Read off the tokenizer itself (`from_tokenizer`), so token-id inputs get exactly the layout that text
    inputs get: [CLS] q [SEP] i [SEP] for BERT, <s> q </s></s> i </s> for RoBERTa and XLM-R.
    """

    single: tuple[Prompt, Prompt]  # (before, after) a lone sequence
    pair: tuple[Prompt, Prompt, Prompt]  # before the first, between the two, after the second
    pair_types: tuple[int, int, int, int, int] | None  # types of: before, first, between, second, after

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> PairTemplate:
        first, second = _PROBE, "second words"
        a = list(tokenizer(first, add_special_tokens=False)["input_ids"])
        b = list(tokenizer(second, add_special_tokens=False)["input_ids"])
        encoded = tokenizer(first, second)
        both = list(encoded["input_ids"])
        i = _find(both, a, 0)
        j = _find(both, b, i + len(a))
        types = encoded.get("token_type_ids")
        pair_types = None
        if types is not None and any(types):
            pair_types = (types[0] if i else 0, types[i], types[i + len(a)] if j > i + len(a) else types[i],
                          types[j], types[-1] if len(both) > j + len(b) else types[j])  # fmt: skip
        return cls(
            single=single_template(tokenizer),
            pair=(tuple(both[:i]), tuple(both[i + len(a) : j]), tuple(both[j + len(b) :])),
            pair_types=pair_types,
        )

    def segments(
        self, first: tuple[str, Prompt], second: tuple[str, Prompt] | None
    ) -> list[tuple[str, Prompt]]:
        """One prompt as named segments: the template's fixed tokens around the first and second parts."""
        if second is None:
            before, after = self.single
            return [("fixed", before), first, ("fixed", after)]
        before, between, after = self.pair
        return [("fixed", before), first, ("fixed", between), second, ("fixed", after)]

    def join_segments(self, segments: list[tuple[str, Prompt]]) -> tuple[Prompt, Prompt | None]:
        """`segments`' output back into token ids and token types (after a part was cut)."""
        parts = [tokens for _, tokens in segments]
        return self.join(parts[1], parts[3] if len(parts) == 5 else None)

    def join(self, first: Prompt, second: Prompt | None) -> tuple[Prompt, Prompt | None]:
        """Token ids and (when the model has them) token types of one prompt."""
        if second is None:
            before, after = self.single
            return before + first + after, None
        before, between, after = self.pair
        ids = before + first + between + second + after
        if self.pair_types is None:
            return ids, None
        t = self.pair_types
        types = (
            (t[0],) * len(before) + (t[1],) * len(first) + (t[2],) * len(between)
            + (t[3],) * len(second) + (t[4],) * len(after)
        )  # fmt: skip
        return ids, types


def _find(haystack: list[int], needle: list[int], start: int) -> int:
    for index in range(start, len(haystack) - len(needle) + 1):
        if haystack[index : index + len(needle)] == needle:
            return index
    raise ValueError("the tokenizer's template does not contain the probe text's tokens unchanged")


@dataclass(frozen=True)
class PromptBuilder:
    """Tokenizes and checks prompts for one model."""

    tokenizer: Any | None
    vocab_size: int
    max_input_tokens: int
    # Encoders: query and item are a text pair in the tokenizer's template (None for decoders).
    template: PairTemplate | None = None
    # Causal-LM judges score label tokens (label_token_ids); other models score with their own head.
    judge: bool = False
    max_request_items: int | None = None
    max_request_tokens: int | None = None
    # The model's own step separator (config.json): a token id or its text; None: requests must name one.
    step_separator: int | str | None = None
    adapters: tuple[str, ...] = ()  # the LoRA adapters served, by name
    heads: tuple[tuple[str, int], ...] = ()  # the extra heads served: (name, floats per item)
    vision: VisionPrompts | None = None  # an image-text model's processor; None: requests without images
    reward_rule: RewardRule | None = None  # which scores a comparison reads; None: compare is refused

    def adapter_index(self, request: ScoreRequest) -> int:
        """The index of the request's adapter among those served (-1: the base model)."""
        return -1 if request.adapter is None else self.adapters.index(request.adapter)

    def prepare(self, request: ScoreRequest) -> PreparedRequest:
        """Build and check every item's prompt; raises PromptError for the first bad item."""
        started = time.perf_counter()
        # Before tokenizing: a request with 100,000 items must cost nothing but this comparison.
        if self.max_request_items is not None and len(request.items) > self.max_request_items:
            raise PromptError(
                ErrorCode.TOO_MANY_ITEMS,
                f"The request has {len(request.items)} items, more than this worker's limit of "
                f"{self.max_request_items} (max_request_items); split it into several requests.",
            )
        self._check_labels(request)
        self._check_compare(request)
        self._check_token_outputs(request)
        self._check_adapter(request)
        head_floats = self._head_floats(request)
        token_types, pixel_values = None, None
        if request.images is not None:
            prompts, token_types, pixel_values = self._build_images(request)
        elif request.messages is not None:
            prompts = self._build_chat(request)
        elif self.template is None:
            prompts = self._build(request)
        else:
            prompts, token_types = self._build_pairs(request)
        truncated = None
        if request.truncate is not Truncation.NONE:
            prompts, token_types, truncated = self._truncate(request, prompts, token_types)
        for index, prompt in enumerate(prompts):
            self._check(index, prompt)
        # Text that spells the image token out is a client's mistake; token ids are taken as sent (alone
        # or beside text-only requests they score as HF would; a batch they share with images is split).
        if self.vision is not None and request.images is None and _has_text(request):
            try:
                self.vision.check_text_only(prompts)
            except ImageError as exc:
                raise PromptError(exc.code, exc.message) from None
        total = sum(len(prompt) for prompt in prompts)
        if self.max_request_tokens is not None and total > self.max_request_tokens:
            raise PromptError(
                ErrorCode.REQUEST_TOO_LONG,
                f"The request's prompts have {total} tokens in all, more than this worker's limit of "
                f"{self.max_request_tokens} (max_request_tokens); split it into several requests.",
            )
        return PreparedRequest(
            request=request,
            prompts=prompts,
            tokenize_s=time.perf_counter() - started,
            token_types=token_types,
            truncated=truncated,
            positions=self._positions(request, prompts),
            head_floats=head_floats,
            pixel_values=pixel_values,
        )

    def _head_floats(self, request: ScoreRequest) -> int:
        """The floats per item of the heads the request names; PromptError for a head not served."""
        widths = dict(self.heads)
        for name in request.heads or ():
            if name not in widths:
                instead = "heads nil for the model's own head alone"
                raise _not_served(ErrorCode.HEAD_NOT_FOUND, "head", name, tuple(widths), instead)
        return sum(widths[name] for name in request.heads or ())

    def _check_compare(self, request: ScoreRequest) -> None:
        if request.compare is None:
            return
        if self.reward_rule is None:
            raise PromptError(
                ErrorCode.COMPARE_NOT_SUPPORTED,
                "This engine does not compare items; send compare nil and compare the scores yourself.",
            )
        refusal = self.reward_rule.refusal(request)
        if refusal is not None:
            raise PromptError(*refusal)

    def _check_adapter(self, request: ScoreRequest) -> None:
        if request.adapter is not None and request.adapter not in self.adapters:
            instead = "adapter nil for the base model"
            raise _not_served(ErrorCode.ADAPTER_NOT_FOUND, "adapter", request.adapter, self.adapters, instead)

    def _check_token_outputs(self, request: ScoreRequest) -> None:
        if request.token_outputs is None or not request.return_token_scores or self.template is None:
            return
        raise PromptError(
            ErrorCode.TOKEN_OUTPUTS_NOT_SUPPORTED,
            "This model is a cross-encoder: its head reads the first token through a pooler and means "
            "nothing at other tokens, so it has no per-token scores; send return_token_scores false "
            "(hidden states at tokens are available), or use a decoder model.",
        )

    def _positions(
        self, request: ScoreRequest, prompts: tuple[Prompt, ...]
    ) -> tuple[tuple[int, ...], ...] | None:
        """The positions each prompt's token outputs read: its step separators, or its token range."""
        if request.token_outputs is None:
            return None
        if request.token_outputs is TokenOutputs.STEPS:
            separator = self.separator_id(request.step_separator)
            return tuple(tuple(i for i, token in enumerate(p) if token == separator) for p in prompts)
        start, stop = request.token_range or (None, None)
        return tuple(tuple(range(len(p))[start:stop]) for p in prompts)

    def separator_id(self, asked: int | str | None) -> int:
        """The step separator's token id: the request's, else the model's; PromptError when there is none,
        when it is outside the vocabulary, or when its text is not exactly one token."""
        separator = asked if asked is not None else self.step_separator
        if separator is None:
            raise PromptError(
                ErrorCode.STEP_SEPARATOR_INVALID,
                "This model declares no step separator (score_worker_step_separator in its config.json); "
                "send step_separator, the token id or text that ends each step.",
            )
        if isinstance(separator, str):
            tokenizer = self._text_tokenizer()
            ids = list(tokenizer(separator, add_special_tokens=False)["input_ids"])
            if len(ids) != 1:
                raise PromptError(
                    ErrorCode.STEP_SEPARATOR_INVALID,
                    f"step_separator {separator[:64]!r} is {len(ids)} tokens in this model's tokenizer, not "
                    "one; send the token id of the separator, or a text that is a single token.",
                )
            separator = int(ids[0])
        if separator >= self.vocab_size:
            raise PromptError(
                ErrorCode.STEP_SEPARATOR_INVALID,
                f"step_separator {separator} is outside the model's vocabulary of {self.vocab_size}; send a "
                "token id of this model's tokenizer.",
            )
        return separator

    def _check_labels(self, request: ScoreRequest) -> None:
        labels = request.label_token_ids
        if labels is not None and not self.judge:
            raise PromptError(
                ErrorCode.LABEL_IDS_NOT_SUPPORTED,
                "This model scores with its own classification head, not with label tokens; send "
                "label_token_ids nil, or send the request to a causal-LM judge model.",
            )
        if not self.judge:
            return
        if labels is None:
            raise PromptError(
                ErrorCode.LABEL_IDS_REQUIRED,
                "This is a causal-LM judge model: it scores the logits of label tokens; send "
                "label_token_ids, the token ids of the labels (e.g. of ' Yes' and ' No') in its tokenizer.",
            )
        largest = max(labels)
        if largest >= self.vocab_size:
            raise PromptError(
                ErrorCode.LABEL_ID_OUT_OF_RANGE,
                f"label_token_ids has {largest}, outside the model's vocabulary of {self.vocab_size}; send "
                "label ids from this model's tokenizer.",
            )

    def _build_chat(self, request: ScoreRequest) -> tuple[Prompt, ...]:
        """The conversation and each item as the assistant's reply, rendered whole by the chat template
        (end-of-turn tokens included), the way reward models are fed conversations."""
        conversation = self._conversation(request)
        return tuple(
            self._render([*conversation, {"role": "assistant", "content": str(item)}])
            for item in request.items
        )

    @staticmethod
    def _conversation(request: ScoreRequest) -> list[dict[str, object]]:
        return [m.as_template_turn() for m in request.messages or ()]

    def _build_images(
        self, request: ScoreRequest
    ) -> tuple[tuple[Prompt, ...], tuple[Prompt, ...], tuple[ImageInputs, ...]]:
        """Prompts holding the request's images: the conversation rendered by the chat template (its image
        parts become the processor's image marks), or the images' marks before each query and item; the
        model's processor turns marks into image tokens and images into pixel values."""
        if self.vision is None:
            raise PromptError(
                ErrorCode.IMAGES_NOT_SUPPORTED,
                "This model reads text only; send the request without images, or to a vision-language model.",
            )
        images = request.images or ()
        if request.messages is not None:
            tokenizer, conversation = self._chat_tokenizer(), self._conversation(request)
            turns = [[*conversation, {"role": "assistant", "content": str(item)}] for item in request.items]
            texts = [str(tokenizer.apply_chat_template(one, tokenize=False)) for one in turns]
        else:
            marks, query = self.vision.placeholders(len(images)), str(request.query or "")
            texts = [
                marks + (f"{item}{query}" if request.item_first else f"{query}{item}")
                for item in request.items
            ]
        try:
            # A rendered conversation holds its special tokens already; a plain text gets the tokenizer's.
            built = self.vision.encode(images, texts, special_tokens=request.messages is None)
        except ImageError as exc:
            raise PromptError(exc.code, exc.message) from None
        return built.prompts, built.token_types, built.pixel_values

    def _render(self, turns: list[dict[str, object]], generation_prompt: bool = False) -> Prompt:
        rendered = self._chat_tokenizer().apply_chat_template(
            turns, tokenize=True, add_generation_prompt=generation_prompt
        )
        return _as_prompt(rendered)

    def _chat_tokenizer(self) -> Any:
        tokenizer = self._text_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(
                ErrorCode.CHAT_TEMPLATE_MISSING,
                "This model's tokenizer has no chat template, so messages cannot be rendered; render the "
                "conversation into query yourself and send messages nil.",
            )
        return tokenizer

    def _truncate(
        self, request: ScoreRequest, prompts: tuple[Prompt, ...], token_types: tuple[Prompt, ...] | None
    ) -> tuple[tuple[Prompt, ...], tuple[Prompt, ...] | None, tuple[int, ...]]:
        """Cut the part `truncate` names in every prompt longer than the limit, by as much as it must lose."""
        out, types, cut = list(prompts), list(token_types) if token_types is not None else None, []
        for index, prompt in enumerate(prompts):
            excess = len(prompt) - self.max_input_tokens
            if excess <= 0:
                cut.append(0)
                continue
            segments = self._segments(request, index)
            role = "query" if request.truncate.value.startswith("query") else "item"
            at = next((i for i, (name, _) in enumerate(segments) if name == role), None)
            if at is None or len(segments[at][1]) < excess:
                have = 0 if at is None else len(segments[at][1])
                raise PromptError(
                    ErrorCode.INPUT_TOO_LONG,
                    f"Item {index} has {len(prompt)} prompt tokens, more than the limit of "
                    f"{self.max_input_tokens}, and its {role} has only {have} tokens to give up; shorten "
                    f"the other part or truncate it instead.",
                )
            tokens = segments[at][1]
            kept = (
                tokens[excess:] if request.truncate.value.endswith("left") else tokens[: len(tokens) - excess]
            )
            segments[at] = (role, kept)
            out[index], segment_types = self._join(segments)
            if types is not None:
                types[index] = segment_types or (0,) * len(out[index])
            cut.append(excess)
        return tuple(out), None if types is None else tuple(types), tuple(cut)

    def _segments(self, request: ScoreRequest, index: int) -> list[tuple[str, Prompt]]:
        """A prompt as named token segments ("query", "item", fixed template tokens), so that one part can
        be cut. Text parts are tokenized separately here (only for prompts that must lose tokens)."""
        item = request.items[index]
        if request.messages is not None:
            conversation = self._conversation(request)
            prefix = self._render(conversation, generation_prompt=True)
            whole = self._render([*conversation, {"role": "assistant", "content": str(item)}])
            shared = _shared_length(prefix, whole)
            return [("query", whole[:shared]), ("item", whole[shared:])]
        query = request.query
        item_ids, query_ids = self._ids(item), (None if query is None else self._ids(query))
        first, second = ("item", item_ids), (None if query_ids is None else ("query", query_ids))
        if query_ids is not None and not request.item_first:
            first, second = ("query", query_ids), ("item", item_ids)
        if self.template is not None:
            return self.template.segments(first, second)
        if isinstance(item, str):  # a decoder's text prompt: the tokenizer's specials around the joined text
            before, after = single_template(self._text_tokenizer())
            return [("fixed", before), first, *([second] if second else []), ("fixed", after)]
        return [first, *([second] if second else [])]

    def _ids(self, value: Input) -> Prompt:
        if isinstance(value, str):
            return _as_prompt(self._text_tokenizer()(value, add_special_tokens=False)["input_ids"])
        return tuple(value)

    def _join(self, segments: list[tuple[str, Prompt]]) -> tuple[Prompt, Prompt | None]:
        if self.template is None:
            return tuple(t for _, tokens in segments for t in tokens), None
        return self.template.join_segments(segments)

    def _build_pairs(self, request: ScoreRequest) -> tuple[tuple[Prompt, ...], tuple[Prompt, ...] | None]:
        """Encoders: (query, item) as the tokenizer's pair (item first with item_first), or the item alone."""
        assert self.template is not None
        if not request.items:
            return (), None
        query = request.query
        if isinstance(request.items[0], str):
            tokenizer = self._text_tokenizer()
            texts = [item for item in request.items if isinstance(item, str)]
            if query is None:
                encoded = tokenizer(texts, verbose=False)
            elif request.item_first:
                encoded = tokenizer(texts, [str(query)] * len(texts), verbose=False)
            else:
                encoded = tokenizer([str(query)] * len(texts), texts, verbose=False)
            prompts = tuple(tuple(int(t) for t in ids) for ids in encoded["input_ids"])
            types = encoded.get("token_type_ids") if self.template.pair_types is not None else None
            return prompts, None if types is None else tuple(tuple(int(t) for t in row) for row in types)
        joined = []
        for item in request.items:
            ids = tuple(item) if not isinstance(item, str) else ()
            if query is None or isinstance(query, str):
                joined.append(self.template.join(ids, None))
            elif request.item_first:
                joined.append(self.template.join(ids, tuple(query)))
            else:
                joined.append(self.template.join(tuple(query), ids))
        if self.template.pair_types is None:
            return tuple(ids for ids, _ in joined), None
        # A lone sequence is all segment 0.
        return tuple(ids for ids, _ in joined), tuple(t or (0,) * len(ids) for ids, t in joined)

    def _build(self, request: ScoreRequest) -> tuple[Prompt, ...]:
        if not request.items:
            return ()
        if isinstance(request.items[0], str):
            return self._build_text(request)
        # Token ids are joined verbatim: re-tokenizing decoded text would change tokens at the boundary.
        query: Prompt = (
            () if request.query is None or isinstance(request.query, str) else tuple(request.query)
        )
        items = [tuple(item) for item in request.items if not isinstance(item, str)]
        return tuple(item + query if request.item_first else query + item for item in items)

    def _text_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise PromptError(
                ErrorCode.INVALID_REQUEST,
                "This model directory has no tokenizer, so text cannot be scored; "
                "send query and items as token ids.",
            )
        return self.tokenizer

    def _build_text(self, request: ScoreRequest) -> tuple[Prompt, ...]:
        tokenizer = self._text_tokenizer()
        query = request.query if isinstance(request.query, str) else ""
        texts = [
            item + query if request.item_first else query + item
            for item in request.items
            if isinstance(item, str)
        ]
        # The concatenated text is tokenized with the model's special tokens (e.g. BOS), as HF would.
        encoded = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
        return tuple(tuple(int(token) for token in ids) for ids in encoded)

    def _check(self, index: int, prompt: Sequence[int]) -> None:
        if not prompt:
            raise PromptError(
                ErrorCode.EMPTY_INPUT,
                f"Item {index} has an empty prompt (0 tokens); send a non-empty query or item.",
            )
        if len(prompt) > self.max_input_tokens:
            raise PromptError(
                ErrorCode.INPUT_TOO_LONG,
                f"Item {index} has {len(prompt)} prompt tokens, more than the limit of "
                f"{self.max_input_tokens}; shorten the query or the item.",
            )
        largest = max(prompt)
        if largest >= self.vocab_size:
            raise PromptError(
                ErrorCode.TOKEN_ID_OUT_OF_RANGE,
                f"Item {index} has token id {largest}, outside the model's vocabulary of {self.vocab_size}; "
                "send ids from this model's tokenizer.",
            )


def _has_text(request: ScoreRequest) -> bool:
    return request.messages is not None or any(isinstance(v, str) for v in (request.query, *request.items))


def _not_served(code: ErrorCode, kind: str, name: str, served: tuple[str, ...], instead: str) -> PromptError:
    """The error for a request naming an adapter or a head (`kind`) this worker does not serve."""
    shown = ", ".join(repr(one) for one in served[:8]) or "none"
    return PromptError(
        code,
        f"This worker serves no {kind} named {name[:128]!r} (it serves {shown}); send one of those names, "
        f"or {instead}.",
    )


def _as_prompt(ids: Any) -> Prompt:
    """Token ids from a tokenizer call: a list, or a mapping with input_ids (apply_chat_template in 5.x)."""
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return tuple(int(token) for token in ids)


def single_template(tokenizer: Any) -> tuple[Prompt, Prompt]:
    """The special tokens a tokenizer puts before and after one text (e.g. BOS before, nothing after)."""
    bare = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(_PROBE)["input_ids"])
    at = _find(full, bare, 0)
    return tuple(full[:at]), tuple(full[at + len(bare) :])


def _shared_length(a: Prompt, b: Prompt) -> int:
    """Length of the common prefix of two token sequences."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))

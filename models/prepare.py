"""Turn a ScoreRequest into token-id prompts (one per item) and validate them against the model's limits."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from schemas import ErrorCode, ScoreRequest

Prompt = tuple[int, ...]


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: one token-id prompt per item, ready to be packed into a forward batch."""

    request: ScoreRequest
    prompts: tuple[Prompt, ...]
    tokenize_s: float

    @property
    def num_tokens(self) -> int:
        """Total prompt tokens of the request (what it costs in a batch's token budget)."""
        return sum(len(prompt) for prompt in self.prompts)


class PromptError(Exception):
    """An item cannot be scored; carries the outward error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class PromptBuilder:
    """Tokenizes and checks prompts for one model."""

    tokenizer: Any | None
    vocab_size: int
    max_input_tokens: int

    def prepare(self, request: ScoreRequest) -> PreparedRequest:
        """Build and check every item's prompt; raises PromptError for the first bad item."""
        started = time.perf_counter()
        prompts = self._build(request)
        for index, prompt in enumerate(prompts):
            self._check(index, prompt)
        return PreparedRequest(request=request, prompts=prompts, tokenize_s=time.perf_counter() - started)

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

    def _build_text(self, request: ScoreRequest) -> tuple[Prompt, ...]:
        if self.tokenizer is None:
            raise PromptError(
                ErrorCode.INVALID_REQUEST,
                "This model directory has no tokenizer, so text cannot be scored; "
                "send query and items as token ids.",
            )
        query = request.query if isinstance(request.query, str) else ""
        texts = [
            item + query if request.item_first else query + item
            for item in request.items
            if isinstance(item, str)
        ]
        # The concatenated text is tokenized with the model's special tokens (e.g. BOS), as HF would.
        encoded = self.tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
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

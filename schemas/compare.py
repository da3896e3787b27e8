"""Preferences between a request's items: the `compare` and `reward_column` request fields and the result
fields that answer them (`rewards`, `preference`, `ranking`, `best_probability`), checked on both sides."""

from __future__ import annotations

from enum import StrEnum

from schemas._checks import PLAIN_FLOAT_TYPES, check_choice, check_float, check_int, describe, invalid
from schemas.errors import ErrorCode, SchemaError

# The most columns a reward can be read from: a judge's label ids (MAX_LABEL_TOKEN_IDS) or a head's labels.
MAX_REWARD_COLUMN = 1 << 16


class Compare(StrEnum):
    """What a request asks about its items beside their scores."""

    PAIRWISE = "pairwise"  # two items A, B: P(A beats B) = sigmoid(r_A - r_B), Bradley-Terry
    RANK = "rank"  # items best first, and each one's Plackett-Luce probability of being the best


def check_compare(value: object) -> Compare | None:
    """nil, "pairwise" or "rank"."""
    hint = 'send nil, "pairwise" (two items) or "rank" (two or more items).'
    return check_choice(value, Compare, "compare", hint)


def check_reward_column(value: object) -> int | None:
    """nil, or the index of the column of each item's scores that is its reward."""
    if value is None:
        return None
    return check_int(value, "reward_column", 0)


def compare_invalid(message: str) -> SchemaError:
    """A compare request whose shape has no comparison to answer (COMPARE_INVALID)."""
    return SchemaError(ErrorCode.COMPARE_INVALID, message)


def check_compare_fields(
    compare: Compare | None, reward_column: int | None, items: int, token_outputs: object
) -> None:
    """compare goes with items that can be compared, and reward_column with compare."""
    if compare is None:
        if reward_column is not None:
            raise compare_invalid(
                'reward_column is set but compare is nil; send compare "pairwise" or "rank" with it, or '
                "reward_column nil."
            )
        return
    if compare is Compare.PAIRWISE and items != 2:
        raise compare_invalid(
            f'compare is "pairwise" but the request has {items} items; send exactly two items (A and B), '
            'or compare "rank" for more.'
        )
    if compare is Compare.RANK and items < 2:
        raise compare_invalid(
            f'compare is "rank" but the request has {items} item(s); send two or more items to rank.'
        )
    if token_outputs is not None:
        # Steps and tokens have scores of their own: which of them is an item's reward would be a guess.
        raise compare_invalid(
            "compare is set together with token_outputs; a comparison reads each item's pooled score, so "
            "send the two in separate requests."
        )


def check_floats(value: object, field: str) -> tuple[float, ...] | None:
    """nil, or an array of floats (one per item: rewards, best_probability)."""
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise invalid(f"{field} must be nil or an array of floats, not {describe(value)}.")
    if set(map(type, value)) <= PLAIN_FLOAT_TYPES:
        return tuple(value)
    return tuple(check_float(number, f"{field}[{index}]") for index, number in enumerate(value))


def check_ranking(value: object) -> tuple[int, ...] | None:
    """nil, or item indices, best first."""
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise invalid(f"ranking must be nil or an array of item indices, not {describe(value)}.")
    return tuple(check_int(index, f"ranking[{place}]", 0) for place, index in enumerate(value))


def check_outcome(
    items: int,
    rewards: tuple[float, ...] | None,
    preference: float | None,
    ranking: tuple[int, ...] | None,
    best_probability: tuple[float, ...] | None,
) -> None:
    """An OK result's comparison fields: a reward per item, a preference between exactly two, a ranking that
    orders every item once, a probability per item; each field of the answer only beside its rewards."""
    if rewards is None:
        if (preference, ranking, best_probability) != (None, None, None):
            raise invalid("preference, ranking or best_probability is set without rewards; send the rewards.")
        return
    if len(rewards) != items:
        raise invalid(f"rewards has {len(rewards)} floats for {items} items; send one per item.")
    if preference is not None and items != 2:
        raise invalid(f"preference is set for {items} items; it compares exactly two.")
    if ranking is not None and sorted(ranking) != list(range(items)):
        raise invalid(f"ranking is {list(ranking)[:16]} for {items} items; send each item index once.")
    if best_probability is not None and len(best_probability) != items:
        raise invalid(
            f"best_probability has {len(best_probability)} floats for {items} items; send one per item."
        )

"""SamplingParams' integer fields fit the device's int32; text prompts are valid Unicode."""

import re

import numpy as np
import pytest

from paxkv import SamplingParams
from paxkv.host.request import check_token_ids, normalize_prompt


@pytest.mark.parametrize(
    "field, value",
    [("n", 2**64), ("top_k", 2**31), ("max_tokens", 2**40), ("logprobs", 2**31), ("seed", 2**31)],
)
def test_integer_fields_past_int32_are_value_errors_naming_them(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value} must be"):
        SamplingParams(**{field: value})
    SamplingParams(**{field: 2**31 - 1})  # the largest is taken


def test_stop_token_ids_past_int32():
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\]=2147483648"):
        SamplingParams(stop_token_ids=[1, 2**31])


def test_a_lone_surrogate_is_a_value_error():
    with pytest.raises(ValueError, match=r"not valid Unicode.*position 2"):
        normalize_prompt("ab\ud800c")
    with pytest.raises(ValueError, match="not valid Unicode"):
        normalize_prompt({"prompt": "\udfff"})
    assert normalize_prompt("ab") == ("ab", None)


def test_stop_strings_are_bounded_in_count_and_length():
    from paxkv.host.request import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

    SamplingParams(stop=["ab"] * MAX_STOP_STRINGS)  # the limits are taken
    SamplingParams(stop="x" * MAX_STOP_STRING_CHARS)
    with pytest.raises(ValueError, match=rf"stop has {MAX_STOP_STRINGS + 1} strings, over"):
        SamplingParams(stop=["ab"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=rf"stop\[1\] has {MAX_STOP_STRING_CHARS + 1} characters"):
        SamplingParams(stop=["ok", "x" * (MAX_STOP_STRING_CHARS + 1)])
    assert MAX_STOP_STRINGS == MAX_STOP_STRING_CHARS == 1024  # as SamplingParams' doc says


def test_stop_token_ids_are_bounded_in_count():
    from paxkv.host.request import MAX_STOP_TOKEN_IDS

    assert len(SamplingParams(stop_token_ids=[7] * MAX_STOP_TOKEN_IDS).stop_token_ids) == 1024
    with pytest.raises(ValueError, match=r"stop_token_ids has 1025 ids, over the limit of 1024"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    with pytest.raises(ValueError, match=r"stop_token_ids has 1025 ids"):  # an array too
        SamplingParams(stop_token_ids=np.arange(MAX_STOP_TOKEN_IDS + 1))


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        ([1, True], TypeError, "ids[1] must be an integer, got True (bool)"),
        ([1, 2, -2], ValueError, "ids[2]=-2 must be in [0, 99]"),
        ([1, 2.0], TypeError, "ids[1] must be an integer, got 2.0 (float)"),
        ([100, 1], ValueError, "ids[0]=100 must be in [0, 99]"),
    ],
)
def test_token_ids_errors_name_the_first_bad_entry(ids, error, message):
    with pytest.raises(error, match=re.escape(message)):
        check_token_ids("ids", ids, hi=99)


def test_token_ids_pass_through_as_ints():
    assert check_token_ids("ids", [0, 99, 5], hi=99) == [0, 99, 5]
    assert check_token_ids("ids", (np.int64(3), 4), hi=99) == [3, 4]
    assert check_token_ids("ids", np.array([7, 8], np.int32), hi=99) == [7, 8]
    assert check_token_ids("ids", [], hi=99) == []

"""Incremental detokenization against decoding the whole sequence, and stop strings.

The oracle is the tokenizer's own `decode` of all the tokens: streamed text, token by
token, must concatenate to it exactly, whatever splits characters across tokens.
"""

import random
import time

import pytest
from bpe_tokenizer import TEXT, bpe_tokenizer

from paxkv.models import ByteTokenizer
from paxkv.text.detokenizer import (
    IncrementalDetokenizer,
    StopStrings,
    Utf8Stream,
    WindowStream,
    decode_stream,
)


class PlainBytes:
    """The byte tokenizer without a streaming decoder of its own: `WindowStream` decodes it."""

    vocab_size = 256
    decode = staticmethod(ByteTokenizer().decode)

    def encode(self, text, *, add_special_tokens=True):
        return list(text.encode())


class Words:
    """Ids index `words`; `decode` joins them and counts the ids it was given."""

    def __init__(self, words):
        self.words = list(words)
        self.vocab_size = len(self.words)
        self.decoded: list[int] = []

    def encode(self, text, *, add_special_tokens=True):
        return [self.words.index(w) for w in text.split("|")]

    def decode(self, ids):
        self.decoded.append(len(ids))
        return "".join(self.words[i] for i in ids)


def _streamed(stream, ids) -> str:
    return "".join(stream.step(t) for t in ids) + stream.flush()


TOKENIZERS = {"byte": ByteTokenizer, "plain_bytes": PlainBytes, "bpe": bpe_tokenizer}


@pytest.mark.parametrize("name", TOKENIZERS)
def test_streamed_text_is_the_whole_decode(name):
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(0)
    valid = tokenizer.encode(TEXT * 2)
    for trial in range(200):
        if trial % 2:  # cut anywhere, often inside a character
            ids = valid[: rng.randrange(1, len(valid) + 1)]
        else:  # any tokens: invalid UTF-8, stray continuation bytes, special tokens
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert _streamed(decode_stream(tokenizer), ids) == tokenizer.decode(ids), ids


def test_each_stream_is_the_tokenizers_own_or_a_window():
    assert isinstance(decode_stream(ByteTokenizer()), Utf8Stream)
    assert isinstance(decode_stream(PlainBytes()), WindowStream)
    assert type(decode_stream(bpe_tokenizer())).__name__ == "_HFDecodeStream"  # DecodeStream


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_character_split_over_tokens_appears_when_complete(name):
    tokenizer = TOKENIZERS[name]()
    stream = decode_stream(tokenizer)
    euro = list("€".encode())  # three bytes
    if name == "bpe":
        euro = [tokenizer._tokenizer.token_to_id(c) for c in ("â", "Ĥ", "¬")]
    assert [stream.step(t) for t in euro] == ["", "", "€"]
    # Two bytes of it, then the end: the whole decode's U+FFFD.
    assert [stream.step(t) for t in euro[:2]] == ["", ""] and stream.flush() == "\ufffd"


def test_window_stream_decodes_a_few_tokens_per_step_whatever_the_length():
    words = Words(["a", "b", "cd", " "])
    stream = WindowStream(words.decode)
    ids = [i % 4 for i in range(500)]
    assert _streamed(stream, ids) == words.decode(ids)
    assert max(words.decoded[:-1]) <= 2  # the previous text's tokens and the new one


def _detok(tokenizer, **kw):
    return IncrementalDetokenizer(decode_stream(tokenizer), **kw)


def _add(detok, ids) -> int | None:
    """Adds tokens until a stop string ends the text; how many it took then, else None."""
    for i, t in enumerate(ids):
        if detok.add(t):
            return i + 1
    return None


@pytest.mark.parametrize(
    "stop, include, text, taken, reason",
    [
        (["STOP"], False, "abc", 7, "STOP"),  # cut before it, at the byte that completed it
        (["STOP"], True, "abcSTOP", 7, "STOP"),  # or after it
        (["a"], False, "", 1, "a"),  # at the very first token
        (["cS", "bcS"], False, "a", 4, "bcS"),  # both end at the same token: first start wins
        (["cSTO", "bc"], False, "a", 3, "bc"),  # the one completed first wins
        (["é!"], False, "abcSTOPd", 11, "é!"),  # a multi-byte character split over tokens
        (["zz"], False, "abcSTOPdé!x", None, None),
    ],
)
def test_stop_strings_cut_the_text_as_vllm_does(stop, include, text, taken, reason):
    detok = _detok(ByteTokenizer(), stop=stop, include_stop_str_in_output=include)
    assert _add(detok, list("abcSTOPdé!x".encode())) == taken
    detok.finish()
    assert (detok.text(), detok.stop_reason) == (text, reason)


def test_a_token_completing_two_stop_strings_ends_at_the_earliest_start():
    words = Words(["a", "xbcdy", "z"])
    detok = _detok(words, stop=["cd", "bcd"])
    assert _add(detok, [0, 1, 2]) == 2
    assert detok.stop_reason == "bcd" and detok.text() == "ax"
    detok = _detok(words, stop=["cd", "bcd"], include_stop_str_in_output=True)
    assert _add(detok, [0, 1, 2]) == 2
    assert detok.stop_reason == "bcd" and detok.text() == "axbcd"


def test_a_stop_string_starting_in_earlier_text_is_found_and_only_the_tail_scanned():
    words = Words(["ab", "cd", "ef", "STOP"[:2], "STOP"[2:]])
    detok = _detok(words, stop=["bcdefST"])
    assert _add(detok, [0, 1, 2, 3]) == 4 and detok.text() == "a"
    detok = _detok(words, stop=["STOP"])
    assert _add(detok, [0, 1, 2, 3, 4]) == 5 and detok.text() == "abcdef"


def test_streamed_text_holds_back_what_a_stop_string_may_cut():
    ids = list(b"abcSTOPdef")
    for include in (False, True):
        cumulative = _detok(ByteTokenizer(), stop=["STOP"], include_stop_str_in_output=include)
        delta = _detok(
            ByteTokenizer(),
            stop=["STOP"],
            include_stop_str_in_output=include,
            keep_text=False,
            deltas=True,
        )
        shown, deltas = [], []
        for t in ids:
            ended = cumulative.add(t)
            assert delta.add(t) == ended
            if ended:
                cumulative.finish()
                delta.finish()
            shown.append(cumulative.text())
            deltas.append(delta.take_delta())
            if ended:
                break
        final = "abcSTOP" if include else "abc"
        assert "".join(deltas) == shown[-1] == final
        # Every text shown is a prefix of the final one: nothing shown was cut later.
        assert all(final.startswith(s) for s in shown)
        if not include:  # three characters (len("STOP") - 1) held back while running
            assert shown[:4] == ["", "", "", "a"]


def test_holding_back_without_stop_strings_is_nothing():
    detok = _detok(ByteTokenizer(), deltas=True)
    assert [(detok.add(t), detok.take_delta()) for t in b"ab"] == [(False, "a"), (False, "b")]
    with pytest.raises(RuntimeError, match="keeps no text"):
        _detok(ByteTokenizer(), keep_text=False).text()
    with pytest.raises(RuntimeError, match="keeps no delta"):
        _detok(ByteTokenizer()).take_delta()


def _first_match_by_scanning(stops, text, before):
    """The oracle: each string searched over `text` on its own (the scan StopStrings
    replaces); the earliest start among matches ending after `before`, then the first
    listed."""
    best = None
    for rank, stop in enumerate(stops):
        i = text.find(stop)
        while i >= 0 and i + len(stop) <= before:
            i = text.find(stop, i + 1)
        if i >= 0 and (best is None or (i, rank) < best):
            best = (i, rank)
    return None if best is None else (best[0], stops[best[1]])


def test_stop_strings_find_the_match_that_scanning_each_string_finds():
    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choices("abc", k=rng.randint(1, 12)))
        new = rng.randint(1, len(text))
        index = StopStrings(stops)
        want = _first_match_by_scanning(stops, text, len(text) - new)
        assert index.first_match(text, new) == want, (stops, text, new)


def test_many_stop_strings_cost_per_token_what_a_few_do():
    # 200k strings (3 lengths): a scan of each string per token would take minutes of
    # CPU here; matching by length takes a few lookups per character.
    rng = random.Random(1)
    stops = ["".join(rng.choices("xyz", k=rng.randint(12, 14))) for _ in range(200_000)]
    text = "".join(rng.choices("abcdefgh ", k=1000)) + "STOP"
    detok = _detok(ByteTokenizer(), stop=[*stops, "STOP"], keep_text=False, deltas=True)
    start = time.thread_time()
    assert _add(detok, list(text.encode())) == len(text)
    assert detok.stop_reason == "STOP"
    assert time.thread_time() - start < 2.0

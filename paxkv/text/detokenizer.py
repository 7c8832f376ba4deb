"""Incremental detokenization: a completion's text, built from its tokens as they become
final, and the stop strings matched on it.

Each step decodes only the tokens it produced, so the host's text work per step is
proportional to them, not to the length of the sequence. A token that ends inside a
character (a UTF-8 byte of the byte tokenizer, a byte-level BPE token holding part of
one) adds no text until the tokens that complete it arrive.

Plain Python, no JAX: the host core uses it. A tokenizer provides its own streaming
decoder with `decode_stream()` (the byte tokenizer's UTF-8 decoder, the `tokenizers`
library's `DecodeStream`); any other object with `decode(ids) -> str` is decoded over a
small window of recent tokens, as vLLM's prefix and read offsets do.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"  # what an incomplete or invalid UTF-8 sequence decodes to


class TokenStream(Protocol):
    """Text of a sequence of token ids, one token at a time."""

    def step(self, token: int) -> str:
        """The text that `token` completes: "" while it ends inside a character."""
        ...

    def flush(self) -> str:
        """The text of the tokens held back by `step`, as decoding the whole sequence
        renders them (U+FFFD for an incomplete character); the stream then holds none."""
        ...


class Utf8Stream:
    """Token ids that are UTF-8 bytes (`ByteTokenizer`): the concatenated text equals
    `bytes(ids).decode("utf-8", errors="replace")`."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token: int) -> str:
        """The text `token` (a byte, 0..255) completes."""
        return self._decoder.decode(bytes((token,)))

    def flush(self) -> str:
        """U+FFFD for an incomplete character held back, else ""."""
        return self._decoder.decode(b"", final=True)


def window_text(
    decode: Callable[[list[int]], str], context: list[int], ids: list[int], head: str | None = None
) -> str:
    """The text that `ids` add after `context` (the tokens just before them), decoded
    together as decoding the whole sequence would: the context gives spaces and merges
    across the boundary their right form. `head` is `decode(context)` if known."""
    if head is None:
        head = decode(context) if context else ""
    return decode(context + ids)[len(head) :]


class WindowStream:
    """Any `decode(ids) -> str`, decoded over a window of recent tokens (vLLM's prefix
    and read offsets): the window starts at the tokens of the last text returned and
    ends at the newest token, so each step costs a few tokens' decoding. Text is held
    back while it ends in U+FFFD (a character still incomplete)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._context: list[int] = []  # the tokens of the last text returned
        self._head = ""  # their text, decoded alone
        self._pending: list[int] = []  # tokens since, whose text is not returned yet

    def step(self, token: int) -> str:
        """The text `token` completes with the tokens held back before it."""
        self._pending.append(token)
        text = window_text(self._decode, self._context, self._pending, self._head)
        if not text or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return text

    def flush(self) -> str:
        """The held-back tokens' text, incomplete characters included."""
        if not self._pending:
            return ""
        text = window_text(self._decode, self._context, self._pending, self._head)
        self._advance()
        return text

    def _advance(self) -> None:
        self._context, self._pending = self._pending, []
        self._head = self._decode(self._context)


def decode_stream(tokenizer: Any) -> TokenStream:
    """A new streaming decoder of `tokenizer`: its own (`tokenizer.decode_stream()`),
    else a `WindowStream` over its `decode`."""
    make = getattr(tokenizer, "decode_stream", None)
    return make() if make is not None else WindowStream(tokenizer.decode)


class StopStrings:
    """A request's stop strings, indexed once (shared by its completions) for matching
    text as it grows.

    Finding the strings that end in new text costs, per new character, one set lookup
    per distinct length of the strings, whatever their number: no scan of each string
    over the text. Repeated strings count once, at their first place in the list.
    """

    def __init__(self, strings: Sequence[str]) -> None:
        self.strings = tuple(strings)
        self._rank: dict[str, int] = {}  # each string -> its first place in the list
        for i, stop in enumerate(self.strings):
            self._rank.setdefault(stop, i)
        self._lengths = sorted({len(stop) for stop in self._rank})
        self.max_len = self._lengths[-1] if self._lengths else 0

    def first_match(self, window: str, new: int) -> tuple[int, str] | None:
        """Among the strings ending in the last `new` characters of `window`, the one
        that starts first (then the one listed first): `(its start in window, it)`;
        None if none ends there."""
        best: tuple[int, int] | None = None  # (start, rank)
        size = len(window)
        for end in range(max(size - new, 0) + 1, size + 1):
            for length in self._lengths:
                start = end - length
                if start < 0 or (best is not None and start > best[0]):
                    continue
                rank = self._rank.get(window[start:end])
                if rank is not None and (best is None or (start, rank) < best):
                    best = (start, rank)
        return None if best is None else (best[0], self.strings[best[1]])


class IncrementalDetokenizer:
    """The text of one completion, built one final token at a time, with stop strings.

    Stop strings are matched on the text after each token, looking only for strings
    that end in the token's text (`StopStrings`), so a token costs in proportion to
    its text, not to the number of strings or the length of the completion. The first token whose text
    completes one ends the text: `stop_reason` is the string, and the text is cut
    before it (after it with `include_stop_str_in_output`), as vLLM cuts it. Among
    strings the same token completes, the one that starts first wins (then the one
    listed first).

    While the completion runs, the text shown (`text`, `take_delta`) holds back its
    last `max(len(stop)) - 1` characters (without `include_stop_str_in_output`), so
    nothing shown is cut later; `finish` shows the rest.

    Args:
      stream: the tokenizer's streaming decoder (`decode_stream`).
      stop: the stop strings (non-empty), or a request's `StopStrings` (built once for
        its completions).
      include_stop_str_in_output: keep a matched stop string in the text.
      keep_text: keep the whole text, for `text` (cumulative and final outputs).
      deltas: keep the text not yet taken, for `take_delta` (delta outputs).
    """

    def __init__(
        self,
        stream: TokenStream,
        *,
        stop: Sequence[str] | StopStrings = (),
        include_stop_str_in_output: bool = False,
        keep_text: bool = True,
        deltas: bool = False,
    ) -> None:
        self._stream = stream
        self._stop = stop if isinstance(stop, StopStrings) else StopStrings(stop)
        self._include = include_stop_str_in_output
        self._scan = max(self._stop.max_len - 1, 0)  # old chars a new match may start in
        self._holdback = 0 if include_stop_str_in_output else self._scan
        self._keep_text = keep_text
        self._deltas = deltas
        self._chunks: list[str] = []  # the text, in pieces (joined when read)
        self._length = 0  # characters of text
        self._tail = ""  # its last `_scan` characters
        self._unsent: list[str] = []  # the text after what `take_delta` returned
        self._unsent_length = 0
        self.stop_reason: str | None = None  # the stop string that ended the text
        self.finished = False

    def add(self, token: int) -> bool:
        """Appends `token`'s text; True when it completes a stop string, which ends the
        text (as `finish` does: add nothing more)."""
        return self._append(self._stream.step(token))

    def finish(self) -> None:
        """Ends the text: adds what the stream held back (unless a stop string ended it)
        and shows everything."""
        if not self.finished and self.stop_reason is None:
            self._append(self._stream.flush())
        self.finished = True

    @property
    def length(self) -> int:
        """Characters of text so far, held-back ones included."""
        return self._length

    def text(self) -> str:
        """The text so far (less what is held back while running). Needs `keep_text`."""
        if not self._keep_text:
            raise RuntimeError("this detokenizer keeps no text (keep_text=False)")
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        text = self._chunks[0] if self._chunks else ""
        shown = self._length if self.finished else self._length - self._holdback
        return text if shown >= len(text) else text[: max(shown, 0)]

    def take_delta(self) -> str:
        """The text added since the last call (less what is held back while running).
        Needs `deltas`."""
        if not self._deltas:
            raise RuntimeError("this detokenizer keeps no delta (deltas=False)")
        ready = self._unsent_length - (0 if self.finished else self._holdback)
        if ready <= 0:
            return ""
        unsent = "".join(self._unsent)
        self._unsent = [unsent[ready:]] if ready < len(unsent) else []
        self._unsent_length -= ready
        return unsent[:ready]

    def _append(self, piece: str) -> bool:
        if not piece:
            return False
        # A string ending inside the tail would have ended the text already.
        match = (
            self._stop.first_match(self._tail + piece, len(piece)) if self._stop.strings else None
        )
        if self._keep_text:
            self._chunks.append(piece)
        if self._deltas:
            self._unsent.append(piece)
            self._unsent_length += len(piece)
        before = self._length - len(self._tail)  # where the scanned window starts
        self._length += len(piece)
        if self._scan:
            self._tail = (self._tail + piece)[-self._scan :]
        if match is None:
            return False
        start, stop = match
        self.stop_reason = stop
        self._cut(before + start + (len(stop) if self._include else 0))
        self.finished = True
        return True

    def _cut(self, length: int) -> None:
        """Keeps the first `length` characters. Only characters not shown yet go: the
        holdback keeps every character a stop string could start in."""
        removed = self._length - length
        if removed <= 0:
            return
        if self._keep_text:
            self._chunks[:] = ["".join(self._chunks)[:length]]
        if self._deltas:
            if removed > self._unsent_length:
                raise RuntimeError(f"a stop string cuts {removed} characters, some already shown")
            unsent = "".join(self._unsent)
            self._unsent = [unsent[: len(unsent) - removed]]
            self._unsent_length -= removed
        self._length = length

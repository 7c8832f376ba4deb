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


class IncrementalDetokenizer:
    """The text of one completion, built one final token at a time, with stop strings.

    Stop strings are matched on the text after each token, scanning only the token's
    text and the `max(len(stop)) - 1` characters before it. The first token whose text
    completes one ends the text: `stop_reason` is the string, and the text is cut
    before it (after it with `include_stop_str_in_output`), as vLLM cuts it. Among
    strings the same token completes, the one that starts first wins (then the one
    listed first).

    While the completion runs, the text shown (`text`, `take_delta`) holds back its
    last `max(len(stop)) - 1` characters (without `include_stop_str_in_output`), so
    nothing shown is cut later; `finish` shows the rest.

    Args:
      stream: the tokenizer's streaming decoder (`decode_stream`).
      stop: the stop strings (non-empty).
      include_stop_str_in_output: keep a matched stop string in the text.
      keep_text: keep the whole text, for `text` (cumulative and final outputs).
      deltas: keep the text not yet taken, for `take_delta` (delta outputs).
    """

    def __init__(
        self,
        stream: TokenStream,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        keep_text: bool = True,
        deltas: bool = False,
    ) -> None:
        self._stream = stream
        self._stop = tuple(stop)
        self._include = include_stop_str_in_output
        self._scan = max(map(len, self._stop), default=1) - 1  # old chars a new match may start in
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
        match = self._match(piece) if self._stop else None
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

    def _match(self, piece: str) -> tuple[int, str] | None:
        """The first stop string the window (tail + piece) holds: `(where it starts in
        the window, the string)`. One ending inside the tail would have ended the text."""
        window = self._tail + piece
        best = None
        for stop in self._stop:
            i = window.find(stop)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

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

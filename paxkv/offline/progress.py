"""Log records written above an open tqdm progress bar, not into the middle of it.

A bar redraws its line with carriage returns and no newline, so a record a console
handler writes while it is open lands after the bar's text, mid-line (the engine's
periodic stats line, for one). `logging_above_bars` sends those records through
`tqdm.write`, which clears the open bars, writes the record, and redraws them: tqdm's
own `logging_redirect_tqdm`, extended to absl's handler, which it does not recognise.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import IO

from absl import logging as absl_logging
from tqdm import tqdm


class _AboveBars:
    """A console stream whose writes go above the open bars (`tqdm.write`)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        tqdm.write(text, file=self._stream, end="")

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str):  # isatty, encoding, fileno: the stream's
        return getattr(self._stream, name)

    # Equal to its stream: absl's handler copies a record to stderr when its stream is not.
    def __eq__(self, other: object) -> bool:
        return other is self or other == self._stream

    def __hash__(self) -> int:
        return hash(self._stream)


@contextlib.contextmanager
def logging_above_bars() -> Iterator[None]:
    """While open, the console handlers of the root logger (a `StreamHandler` on stdout
    or stderr, and absl's handler when it writes there) write each record above the
    open tqdm bars. Other handlers (log files) are untouched; nesting is harmless.

    Not covered: a record absl writes before its flags are parsed, or with
    `--logtostderr`, which it writes to `sys.stderr` itself.
    """
    consoles = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    handlers = [
        h.python_handler if isinstance(h, absl_logging.ABSLHandler) else h
        for h in logging.root.handlers
    ]
    swapped = []
    for handler in handlers:
        stream = getattr(handler, "stream", None)
        if (
            isinstance(handler, logging.StreamHandler)
            and not isinstance(stream, _AboveBars)
            and stream in consoles
        ):
            swapped.append((handler, stream))
            handler.setStream(_AboveBars(stream))
    try:
        yield
    finally:
        for handler, stream in reversed(swapped):
            handler.setStream(stream)

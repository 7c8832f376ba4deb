"""Rendering a Jinja template nobody vouches for, within bounds of time and size. No JAX.

A client's chat template runs in jinja2's sandbox, and beyond it: a trace function
checks the clock at every line of template code (nested loops included), the output is
counted as it is generated, and the operations that could build a huge value at once
(`'x' * 10**9`, a format width, a big power) are refused before they run.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
import time
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    """Bounds on rendering a template nobody vouches for (a server's client's).

    Rendering stops with ValueError after `time_s` seconds of template code, or when the
    output, or a string, list or number the template builds, would pass `max_chars`
    characters (digits, items). The template runs in the calling thread: a server
    renders in a worker thread so that its event loop goes on meanwhile.
    """

    time_s: float = 2.0
    max_chars: int = 1 << 22


def load_jinja2() -> Any:
    """The jinja2 module; ImportError saying what to install without it."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ImportError(
            "chat templates need jinja2 (>=3.1.6): pip install -e '.[tokenizers]', or "
            "'.[serve]' for paxkv-serve"
        ) from None
    return jinja2


def require_jinja2() -> None:
    """Raises ImportError, saying what to install, when chat templates cannot be rendered."""
    load_jinja2()


def render_bounded(compiled: Any, context: dict[str, Any], limits: RenderLimits) -> str:
    """`compiled.render(**context)` within `limits`: a trace function on this thread
    checks the time at every line of template code (loops included), and the output is
    counted as it is generated. What C code could build at once (`'x' * 10**9`, a
    format width) is refused before it is built, by the environment (`_compile`)."""
    jinja2 = load_jinja2()
    deadline = time.monotonic() + limits.time_s

    def check_line(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            if time.monotonic() > deadline:
                raise jinja2.sandbox.SecurityError(
                    f"rendering took longer than the limit of {limits.time_s} s"
                )
            for value in frame.f_locals.values():  # a string doubled line after line
                attrs = getattr(value, "_Namespace__attrs", None)
                for v in attrs.values() if isinstance(attrs, dict) else (value,):
                    if isinstance(v, (str, list, tuple)):
                        _check_size(len(v), limits)
        return check_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return check_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        parts, size = [], 0
        for part in compiled.generate(**context):
            size += len(part)
            _check_size(size, limits, "the rendered prompt")
            parts.append(part)
    finally:
        sys.settrace(previous)
    return "".join(parts)


# The file name Jinja gives the code of templates compiled from strings.
_TEMPLATE_FILE = "<template>"


def _check_size(n: int, limits: RenderLimits, what: str = "a value the template builds") -> None:
    if n > limits.max_chars:
        raise load_jinja2().sandbox.SecurityError(
            f"{what} would be {n} long, over the limit of {limits.max_chars}"
        )


def bounded_environment(base: type, limits: RenderLimits) -> type:
    """`base` (a sandboxed environment class) refusing, before they run, the operations
    whose result would pass `limits.max_chars`: sequence repetition and concatenation,
    big powers and products, and calls or format strings with a size past it."""
    big = re.compile(r"\d{" + str(len(str(limits.max_chars))) + ",}")

    def check_format(text: Any) -> None:
        if isinstance(text, str) and any(int(d) > limits.max_chars for d in big.findall(text)):
            raise load_jinja2().sandbox.SecurityError("a format width over the limit")

    def check_args(args: Sequence[Any]) -> None:
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool):
                _check_size(abs(a), limits, "a size passed to a call")
            check_format(a)

    def checked(f: Any) -> Any:
        @functools.wraps(f)  # keeps Jinja's pass_context / pass_environment marks
        def filter_(*args: Any, **kwargs: Any) -> Any:
            check_args((*args, *kwargs.values()))
            return f(*args, **kwargs)

        return filter_

    class Bounded(base):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.filters = {name: checked(f) for name, f in self.filters.items()}

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            sized = (str, list, tuple)
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, sized) and isinstance(times, int):
                        _check_size(len(seq) * max(times, 0), limits)
                if isinstance(left, int) and isinstance(right, int):
                    _check_size(left.bit_length() + right.bit_length(), limits)
            elif operator == "**" and isinstance(left, int) and isinstance(right, int):
                _check_size(abs(right) * max(1, abs(left).bit_length()), limits)
            elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
                _check_size(len(left) + len(right), limits)
            elif operator == "%":
                check_format(left)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            check_args((*args, *kwargs.values()))
            # "{:>99999999}".format(...): the sandbox wraps str.format
            method = getattr(__obj, "__wrapped__", __obj)
            check_format(getattr(method, "__self__", None))
            return super().call(__context, __obj, *args, **kwargs)

    return Bounded

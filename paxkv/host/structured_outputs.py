"""What a constrained request's output must match: a JSON schema, any JSON object, a
regular expression, one of several strings, or a grammar. Plain Python: the spec is
checked here for its form; the engine compiles it against its tokenizer
(`paxkv.text.grammar`) and rejects a schema, pattern or grammar that does not compile.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from paxkv.host.mappings import dataclass_of

MAX_CHOICES = 1024  # strings of `StructuredOutputs.choice`
MAX_SPEC_CHARS = 1 << 20  # a schema (as JSON), pattern or grammar, in characters

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """The constraint on a request's output: exactly one field is set (vLLM's
    `StructuredOutputsParams`).

    - `json`: a JSON schema (a dict, or its JSON text); the output is one JSON value
      that validates against it.
    - `json_object`: True; the output is one JSON object (OpenAI's JSON mode).
    - `regex`: the output matches this regular expression (Rust `regex` syntax), whole.
    - `choice`: the output is one of these strings.
    - `grammar`: the output is a sentence of this context-free grammar, in Lark syntax
      or GBNF/EBNF (llama.cpp's), whose start rule is `start` (Lark) or `root` (GBNF).

    `whitespace_pattern` (with `json` or `json_object`): a regex the whitespace between
    JSON tokens must match (None: any JSON whitespace); `disable_any_whitespace`: none
    at all (compact JSON, vLLM's option). The output ends when
    the constraint is complete and can go no further (finish reason "stop"), or at EOS
    where the constraint allows it, or at max_tokens (then it is cut short).
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, "
                f"choice, grammar; got {set_ or 'none'}"
            )
        if self.json is not None:
            put("json", _schema_text(self.json))
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r:.80}"
                )
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise TypeError(
                    f"structured_outputs.{name} must be a str, got {value!r:.80} "
                    f"({type(value).__name__})"
                )
            if not value.strip() and name != "whitespace_pattern":
                raise ValueError(f"structured_outputs.{name} is empty")
            _check_size(name, value)
        if self.choice is not None:
            put("choice", _choices(self.choice))
        json_like = self.json is not None or self.json_object
        for name in ("whitespace_pattern", "disable_any_whitespace"):
            if getattr(self, name) not in (None, False) and not json_like:
                raise ValueError(f"structured_outputs.{name} applies to json and json_object only")

    @property
    def kind(self) -> str:
        """Which constraint it is: one of `KINDS`."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """A hashable identity of the constraint (equal specs compile once)."""
        return dataclasses.astuple(self)

    @classmethod
    def of(cls, value: Any) -> StructuredOutputs | None:
        """`SamplingParams.structured_outputs` as given: a `StructuredOutputs`, a mapping
        of its fields (as JSON sends it), or None."""
        return dataclass_of(cls, value, "structured_outputs")


def _schema_text(schema: Any) -> str:
    """A JSON schema as compact JSON text: a mapping (or bool), or its JSON text."""
    if isinstance(schema, str):
        _check_size("json", schema)
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, (Mapping, bool)):
        raise TypeError(
            f"structured_outputs.json must be a JSON schema (an object), got {schema!r:.80}"
        )
    try:
        text = json.dumps(schema, separators=(",", ":"))  # key order kept: it is the output's
    except (TypeError, ValueError) as e:
        raise TypeError(f"structured_outputs.json is not JSON-serialisable: {e}") from None
    _check_size("json", text)
    return text


def _choices(choice: Any) -> tuple[str, ...]:
    if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence):
        raise TypeError(f"structured_outputs.choice must be a list of str, got {choice!r:.80}")
    if not choice:
        raise ValueError("structured_outputs.choice is empty")
    if len(choice) > MAX_CHOICES:
        raise ValueError(
            f"structured_outputs.choice has {len(choice)} strings, over the limit of {MAX_CHOICES}"
        )
    for i, c in enumerate(choice):
        if not isinstance(c, str):
            raise TypeError(f"structured_outputs.choice[{i}] must be a str, got {c!r:.80}")
        if not c:
            raise ValueError(f"structured_outputs.choice[{i}] is an empty string")
    _check_size("choice", "".join(choice))
    return tuple(choice)


def _check_size(name: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(
            f"structured_outputs.{name} has {len(text)} characters, over the limit of "
            f"{MAX_SPEC_CHARS}"
        )

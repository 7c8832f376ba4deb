"""The structured-output fields of a request, as OpenAI and vLLM clients send them,
turned into one `StructuredOutputs` (400 naming the field for a bad one).

- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
- vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" |
  "json_object": ..., "disable_any_whitespace", "whitespace_pattern"}`.
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, with
  `guided_whitespace_pattern` (and `guided_decoding_backend`, taken and ignored: the
  server has one backend, llguidance).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from paxkv.host.structured_outputs import StructuredOutputs

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
FIELDS = ("response_format", "structured_outputs", *_GUIDED)
# How an error about `StructuredOutputs` reads for each request field.
_RENAMES = {
    "response_format": (("structured_outputs.json ", "response_format.json_schema.schema "),),
    **{f: ((f"structured_outputs.{k}", f),) for f, k in _GUIDED.items()},
}


class StructuredOutputsError(ValueError):
    """A bad structured-output field of a request; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_outputs(
    body: Mapping[str, Any], *, disable_any_whitespace: bool = False
) -> StructuredOutputs | None:
    """The request's constraint (None: none), compiled once here to check it (llguidance,
    tokenizer-free); `StructuredOutputsError` naming the field it came from when it is
    malformed or does not compile, or when a request sets more than one. With
    `disable_any_whitespace` (the server's), a JSON constraint allows no whitespace
    unless `structured_outputs` sets that field itself."""
    given = [f for f in FIELDS if body.get(f) is not None and body[f] != {"type": "text"}]
    if not given:
        return None
    if len(given) > 1:
        raise StructuredOutputsError(f"set one of {', '.join(given)}, not several", given[1])
    field = given[0]
    try:
        if field == "response_format":
            spec = _response_format(body[field])
        elif field == "structured_outputs":
            spec = StructuredOutputs.of(body[field])
        else:
            spec = StructuredOutputs(**{_GUIDED[field]: body[field]})
            pattern = body.get("guided_whitespace_pattern")
            if pattern is not None:
                try:
                    spec = dataclasses.replace(spec, whitespace_pattern=pattern)
                except (TypeError, ValueError) as e:
                    message = str(e).replace(
                        "structured_outputs.whitespace_pattern", "guided_whitespace_pattern"
                    )
                    raise StructuredOutputsError(message, "guided_whitespace_pattern") from None
        own = field == "structured_outputs" and "disable_any_whitespace" in body[field]
        json_like = spec.kind in ("json", "json_object") and spec.whitespace_pattern is None
        if disable_any_whitespace and json_like and not own:
            spec = dataclasses.replace(spec, disable_any_whitespace=True)
        from paxkv.text.grammar import check_compiles

        check_compiles(spec)
    except StructuredOutputsError:
        raise
    except ImportError as e:
        raise StructuredOutputsError(f"{field} is not available: {e}", field) from None
    except (TypeError, ValueError) as e:
        message = str(e)
        for old, new in _RENAMES.get(field, ()):
            message = message.replace(old, new)
        raise StructuredOutputsError(message.replace("structured_outputs", field), field) from None
    return spec


def _response_format(value: Any) -> StructuredOutputs:
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise TypeError(
            f'structured_outputs must be an object with a "type" (text, json_object or '
            f"json_schema), got {value!r:.80}"
        )
    kind = value["type"]
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise ValueError(
            f"structured_outputs.type={kind!r} must be text, json_object or json_schema"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise TypeError('structured_outputs.json_schema must be an object with a "schema"')
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise TypeError(f"structured_outputs.json_schema.strict must be a boolean, got {strict!r}")
    schema = spec.get("schema")
    if schema is None:  # OpenAI allows it: any JSON object, then
        return StructuredOutputs(json_object=True)
    return StructuredOutputs(json=schema)

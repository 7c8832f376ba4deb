"""Settings given as a dataclass or as a mapping of its fields (as JSON and vLLM's
dict-style arguments send them). No JAX."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def dataclass_of(cls: type[T], value: Any, name: str) -> T | None:
    """`value` as a `cls`: itself, a mapping of its fields, or None (None); TypeError
    for anything else and ValueError naming an unknown key, both naming `name`."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be a {cls.__name__} or a mapping of its fields, "
            f"got {value!r:.80} ({type(value).__name__})"
        )
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; it takes {sorted(fields)}")
    return cls(**value)

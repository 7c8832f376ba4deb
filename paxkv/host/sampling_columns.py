"""The columns of the packed per-sequence sampling arrays, by name. No JAX.

A step's sampling parameters travel as `floats f32[S, len(SAMPLING_FLOATS)]` and
`ints i32[S, len(SAMPLING_INTS)]`, one row per sequence (`paxkv.host.batch`,
`paxkv.engine.device.sampling.SamplingBatch`). Every reader and writer picks a column through
`FLOAT_COLUMN` / `INT_COLUMN`, so the order is written down here only.
"""

from __future__ import annotations

import numpy as np

from paxkv.host.request import SamplingParams

SAMPLING_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
# "lora_slot": the device slot of the sequence's LoRA adapter (0: none,
# `paxkv.host.lora_slots`), which the step's projections read per row.
SAMPLING_INTS = ("top_k", "seed", "lora_slot", "counter")
FLOAT_COLUMN = {name: i for i, name in enumerate(SAMPLING_FLOATS)}
INT_COLUMN = {name: i for i, name in enumerate(SAMPLING_INTS)}

# The value of each float in padding rows: greedy, no truncation, no penalty.
FLOAT_PADDING = {
    "temperature": 0.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
# The penalties, and the columns that hold them: a row whose penalties all equal their
# padding value has none.
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
PENALTY_COLUMNS = [FLOAT_COLUMN[name] for name in PENALTIES]
# The ints a sequence keeps for its whole life (the persistent batch's rows hold them);
# the counter changes every step.
ROW_INTS = ("top_k", "seed", "lora_slot")
ROW_INT_COLUMNS = [INT_COLUMN[name] for name in ROW_INTS]
# The same columns as a slice (they are adjacent), for a write without fancy indexing.
ROW_INT_SLICE = slice(ROW_INT_COLUMNS[0], ROW_INT_COLUMNS[-1] + 1)
assert list(range(len(SAMPLING_INTS)))[ROW_INT_SLICE] == ROW_INT_COLUMNS

_PADDING_ROW = np.asarray([FLOAT_PADDING[name] for name in SAMPLING_FLOATS], np.float32)


def sampling_floats(params: SamplingParams) -> tuple[float, ...]:
    """The float columns (`SAMPLING_FLOATS`) of `params`, in order."""
    return tuple(getattr(params, name) for name in SAMPLING_FLOATS)


def padding_floats(rows: int) -> np.ndarray:
    """f32[rows, len(SAMPLING_FLOATS)] of padding rows (`FLOAT_PADDING`)."""
    out = np.empty((rows, len(SAMPLING_FLOATS)), np.float32)
    out[:] = _PADDING_ROW
    return out


def penalises(params: SamplingParams) -> bool:
    """Whether `params` apply a penalty (a row of them would be in `has_penalties`)."""
    return any(getattr(params, name) != FLOAT_PADDING[name] for name in PENALTIES)


def has_penalties(floats: np.ndarray) -> np.ndarray:
    """bool[S]: which rows of `floats` (f32[S, len(SAMPLING_FLOATS)]) apply a penalty."""
    return (floats[:, PENALTY_COLUMNS] != _PADDING_ROW[PENALTY_COLUMNS]).any(axis=1)

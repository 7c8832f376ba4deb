"""Sleep and wake: an idle engine gives back its device memory, and takes it again.

RL with the trainer and the rollout engine on the same chips steps them in turn, and
each needs the memory the other holds. `Engine.sleep(level=1)` frees the KV pool (and
forgets the prefix cache, whose pages are gone); `level=2` also frees the parameters,
copied to host memory first (`weights="host"`: pinned host memory where the platform
has memory kinds, TPU and GPU, and the CPU's) or dropped (`weights="drop"`, when the
trainer will push new ones with `update_weights` before `wake_up`). Running sequences
are preempted first (they recompute their K/V after waking, nothing is lost).
`Engine.wake_up` places everything back in the shardings it had, so no step
recompiles. While asleep the engine steps nothing: requests wait for the wake-up
(`requests="wait"`) or are refused (`"refuse"`).

The parameters of a sleeping engine are abstract (`jax.ShapeDtypeStruct`s that keep
their device shardings): `update_weights` still checks and places new ones, and
`wake_up` then keeps those rather than the host copy.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

import jax
from flax import nnx

LEVELS = (1, 2)
WEIGHTS = ("host", "drop")
REQUESTS = ("wait", "refuse")


class EngineAsleep(RuntimeError):
    """A request submitted to an engine asleep with `requests="refuse"`."""


@dataclasses.dataclass
class Asleep:
    """What a sleeping engine released: its `level`, what became of its weights
    (`weights`: "host", "drop", None at level 1) and their host copy, and what requests
    submitted meanwhile do (`requests`)."""

    level: int
    weights: str | None
    requests: str
    host_params: list[jax.Array] | None = None  # the Param leaves, in flat-state order
    released_bytes: int = 0


def check(level: int, weights: str, requests: str) -> None:
    """ValueError naming an argument of `Engine.sleep` out of its choices."""
    if level not in LEVELS or isinstance(level, bool):
        raise ValueError(f"sleep level={level!r} must be one of {LEVELS}")
    if weights not in WEIGHTS:
        raise ValueError(f"sleep weights={weights!r} must be one of {WEIGHTS}")
    if requests not in REQUESTS:
        raise ValueError(f"sleep requests={requests!r} must be one of {REQUESTS}")


def release_arrays(tree: Any) -> int:
    """Deletes the live device arrays of `tree`; the bytes they held (over all devices)."""
    leaves = [a for a in jax.tree.leaves(tree) if isinstance(a, jax.Array) and not a.is_deleted()]
    jax.block_until_ready(leaves)
    freed = sum(a.nbytes for a in leaves)
    for a in leaves:
        a.delete()
    return freed


def _host_sharding(sharding: Any) -> Any:
    """`sharding` in pinned host memory; None where its devices have no such memory."""
    devices = sharding.device_set
    if all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in devices):
        return sharding.with_memory_kind("pinned_host")
    return None


def offload_params(params: nnx.State, *, keep: bool) -> tuple[nnx.State, list | None, Any]:
    """`params` with every `nnx.Param` leaf abstract (shape, dtype, device sharding),
    the leaves' host copies (with `keep`; else None), and a callable that, once the
    caller has let go of `params`, returns the device bytes that were freed. The arrays
    are not deleted: a buffer the caller's own model still holds (`Engine(model)` shares
    its buffers) stays alive, and is not counted."""
    flat = nnx.to_flat_state(params)
    arrays = [v.get_value() for _, v in flat if isinstance(v, nnx.Param)]
    host = None
    if keep:
        targets = [_host_sharding(a.sharding) for a in arrays]
        host = [
            jax.device_put(a, s) if s is not None else jax.device_get(a)
            for a, s in zip(arrays, targets, strict=True)
        ]
        jax.block_until_ready([h for h in host if isinstance(h, jax.Array)])
    abstract = nnx.from_flat_state(
        [
            (p, v.replace(_abstract(v.get_value())) if isinstance(v, nnx.Param) else v)
            for p, v in flat
        ]
    )
    held = [(_buffers(a), a.nbytes) for a in arrays]
    del flat, arrays

    def freed() -> int:
        gc.collect()  # NNX variables can sit in reference cycles that hold their arrays
        live = set().union(*(_buffers(a) for a in jax.live_arrays()))
        return sum(n for buffers, n in held if not buffers & live)

    return abstract, host, freed


def _buffers(a: jax.Array) -> set[int]:
    """The device buffers of `a`'s shards (another array may share them: an array
    put where it already is)."""
    return {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}


def _abstract(a: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


def missing_params(params: nnx.State) -> bool:
    """Whether `params` has abstract Param leaves (`offload_params`'s, not replaced)."""
    return any(
        isinstance(v.get_value(), jax.ShapeDtypeStruct)
        for _, v in nnx.to_flat_state(params)
        if isinstance(v, nnx.Param)
    )


def restore_params(params: nnx.State, host: list | None) -> tuple[nnx.State, int]:
    """`params` with its abstract Param leaves placed back from `host` in their device
    shardings; the bytes placed. ValueError when they were dropped."""
    flat = nnx.to_flat_state(params)
    if not missing_params(params):
        return params, 0  # new weights arrived while asleep (`update_weights`)
    if host is None:
        raise ValueError(
            "wake_up: sleep(level=2, weights='drop') dropped the weights, and none came "
            "since: update_weights(...) the engine before wake_up(), or sleep with "
            "weights='host'"
        )
    abstract = [v.get_value() for _, v in flat if isinstance(v, nnx.Param)]
    back = jax.device_put(host, [a.sharding for a in abstract])
    jax.block_until_ready(back)
    it = iter(back)
    restored = nnx.from_flat_state(
        [(p, v.replace(next(it)) if isinstance(v, nnx.Param) else v) for p, v in flat]
    )
    return restored, sum(a.nbytes for a in back)


class Timer:
    """Wall seconds since it was made."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def seconds(self) -> float:
        """Seconds so far."""
        return time.perf_counter() - self.t0

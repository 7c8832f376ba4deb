"""The shape of a serving mesh, and which model dimensions it shards. Plain Python, no JAX.

A mesh has a `model` axis (tensor parallelism: each device holds a slice of every
layer's heads and MLP columns) and a `data` axis (independent replicas, each with its
own engine, scheduler and page pool). Launch flags spell it `model:4,data:2`.

The sharding rule, shared by `paxkv.sharding` (which places the arrays) and
`paxkv.planner.parameters` and `paxkv.planner.capacity` (which count their bytes): a dimension is split over the `model` axis
when its size is a multiple of the axis size, and replicated otherwise. Attention
(q/k/v/o and the KV pages) is split by KV head, so it is sharded exactly when
`num_kv_heads % model == 0`; with fewer KV heads than model devices every device holds
every KV head.
"""

from __future__ import annotations

import dataclasses
import math

MODEL_AXIS = "model"
DATA_AXIS = "data"
AXES = (DATA_AXIS, MODEL_AXIS)  # mesh axis order: replicas outermost


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """`model` devices per replica times `data` replicas."""

    model: int = 1
    data: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {axis}={size!r} must be a positive integer")

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        """`"model:4,data:2"` -> `MeshShape(model=4, data=2)`; an axis left out has size 1.

        Raises ValueError saying which part is wrong (the caller names the text).
        """
        sizes: dict[str, int] = {}
        for part in text.split(","):
            name, sep, value = (s.strip() for s in part.partition(":"))
            if not sep or not name or not value:
                raise ValueError(f"{part.strip()!r} is not axis:size (e.g. model:4,data:2)")
            if name not in AXES:
                raise ValueError(f"unknown mesh axis {name!r}; the axes are {' and '.join(AXES)}")
            if name in sizes:
                raise ValueError(f"mesh axis {name!r} is given twice")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(f"mesh axis {name} size {value!r} is not an integer") from None
        return cls(**sizes)

    def __str__(self) -> str:
        return f"{MODEL_AXIS}:{self.model},{DATA_AXIS}:{self.data}"

    @property
    def num_devices(self) -> int:
        """Devices of the mesh: model x data."""
        return self.model * self.data

    def splits(self, size: int) -> bool:
        """Whether a dimension of `size` is split over the model axis (else replicated)."""
        return size % self.model == 0

    def kv_head_factor(self, num_kv_heads: int, num_heads: int) -> int:
        """How many times each KV head is repeated so the model axis splits them: 1 when
        it already does, or when no repetition can (the query heads must still divide
        evenly among the repeated KV heads: then the KV heads are replicated)."""
        if self.splits(num_kv_heads):
            return 1
        factor = self.model // math.gcd(num_kv_heads, self.model)
        return factor if num_heads % (num_kv_heads * factor) == 0 else 1

    def kv_heads_per_device(self, num_kv_heads: int, num_heads: int | None = None) -> int:
        """KV heads each device stores: its shard; with `num_heads` given, its shard of
        the repeated heads (`kv_head_factor`) where repeating makes them split; else all
        of them (replicated)."""
        if num_heads is not None:
            num_kv_heads *= self.kv_head_factor(num_kv_heads, num_heads)
        return num_kv_heads // self.model if self.splits(num_kv_heads) else num_kv_heads


ONE_DEVICE = MeshShape()  # no mesh: one device, one replica

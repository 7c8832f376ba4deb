"""The bytes a device has for the KV cache: its nominal memory less the weights, times
the share kept for the cache, or a budget given directly. Plain Python, no JAX.

    budget = KVBudget.on_device("H100", weights_bytes=weights_bytes(model), kv_fraction=0.9)
    budget.kv_budget_bytes
"""

from __future__ import annotations

import dataclasses

GIB = 2**30
# Nominal memory per device, in GiB (the runtime keeps a little of it for itself).
DEVICE_HBM_GIB: dict[str, float] = {
    "v5e": 16,
    "v6e": 32,
    "v5p": 95,
    "A100": 80,
    "H100": 80,
    "H200": 141,
}
# The platform of each device (the cache's layout differs on TPU: `layout.scale_lanes`).
DEVICE_PLATFORM: dict[str, str] = {
    "v5e": "tpu",
    "v6e": "tpu",
    "v5p": "tpu",
    "A100": "gpu",
    "H100": "gpu",
    "H200": "gpu",
}


def device_of(name: str) -> str:
    """The chip of a device name: a TPU slice name (`v5e-8`, `v6e-16`: the chip and
    how many) names its chip; any other name is itself."""
    chip, dash, count = name.partition("-")
    return chip if dash and count.isdigit() and chip.lower().startswith("v") else name


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """Bytes for the KV cache, and where they come from.

    On a device: `kv_fraction` of the memory left after the weights, the rest kept for
    activations and the runtime. Given directly: `device` is None.
    """

    kv_budget_bytes: int
    weights_bytes: int
    device: str | None = None
    device_bytes: int | None = None
    kv_fraction: float | None = None

    @classmethod
    def on_device(cls, device: str, *, weights_bytes: int, kv_fraction: float) -> KVBudget:
        """`kv_fraction` of what `device` (a `DEVICE_HBM_GIB` name, any case) has left
        after `weights_bytes`."""
        names = {name.lower(): name for name in DEVICE_HBM_GIB}
        chip = device_of(device)
        if chip.lower() not in names:
            raise ValueError(
                f"device={device!r} is not one of {sorted(DEVICE_HBM_GIB)} (a TPU slice name "
                "such as v5e-8 names its chip)"
            )
        device = chip
        if not 0 < kv_fraction <= 1:
            raise ValueError(f"kv_fraction={kv_fraction} must be in (0, 1]")
        device = names[device.lower()]
        device_bytes = int(DEVICE_HBM_GIB[device] * GIB)
        if weights_bytes >= device_bytes:
            raise ValueError(
                f"the weights need {weights_bytes} bytes ({weights_bytes / GIB:.2f} GiB), no less "
                f"than all of {device}'s {device_bytes / GIB:.0f} GiB: nothing is left for the KV cache"
            )
        return cls(
            kv_budget_bytes=int((device_bytes - weights_bytes) * kv_fraction),
            weights_bytes=weights_bytes,
            device=device,
            device_bytes=device_bytes,
            kv_fraction=kv_fraction,
        )

    @classmethod
    def given(cls, kv_budget_bytes: int, *, weights_bytes: int) -> KVBudget:
        """A budget of `kv_budget_bytes` given directly, beside `weights_bytes` of weights."""
        if kv_budget_bytes <= 0:
            raise ValueError(f"kv_budget_bytes={kv_budget_bytes} must be positive")
        return cls(kv_budget_bytes=int(kv_budget_bytes), weights_bytes=weights_bytes)

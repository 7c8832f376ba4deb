"""Which LoRA adapter each device slot holds, and which to evict. No JAX.

The device holds `max_loras` adapter slots (1..max_loras; slot 0 is "no adapter").
A sequence is admitted only once its adapter has a slot: one it already holds, a free
one, or the least-recently-used slot that no sequence in the persistent batch holds
(`in_use`, the batch rows' count). A slot given to another adapter is recorded as a
load, which the engine writes to the device before the next step dispatches
(`take_loads`). An adapter's key changes whenever its weights do (a new load of the
name, `update_lora`), so a slot never serves weights other than those it was loaded with.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs under, as vLLM names it: `lora_name` (what requests
    and the server call it), `lora_int_id` (a positive id, unique per adapter) and
    `lora_path` (a PEFT checkpoint directory)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise TypeError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id} must be at least 1 (0: no adapter)")
        if not isinstance(self.lora_path, str):
            raise TypeError(f"lora_path must be a str, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        """`lora_name`."""
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        """`lora_int_id`."""
        return self.lora_int_id

    @property
    def path(self) -> str:
        """`lora_path`."""
        return self.lora_path


class LoRASlots:
    """An LRU of adapter keys over `num_slots` device slots (numbered from 1).

    Args:
      num_slots: `max_loras`.
      in_use: whether a sequence holding pages runs under slot s (such a slot is never
        evicted).
    """

    def __init__(self, num_slots: int, in_use: Callable[[int], bool]) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras={num_slots} must be at least 1")
        self.num_slots = num_slots
        self.in_use = in_use
        self._slots: OrderedDict[Hashable, int] = OrderedDict()  # key -> slot, LRU first
        self._free = list(range(num_slots, 0, -1))
        self._loads: list[tuple[int, Hashable]] = []  # (slot, key) to write
        self.loads = 0  # adapters written to a slot
        self.evictions = 0  # adapters a slot was taken from

    def acquire(self, key: Hashable) -> int | None:
        """The slot holding adapter `key` (made the most recent), after recording its
        load into a free or evicted slot if it holds none; None when every slot is in use."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._slots.items() if not self.in_use(s)), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            self.evictions += 1
        self._slots[key] = slot
        self._loads = [(s, k) for s, k in self._loads if s != slot]
        self._loads.append((slot, key))
        self.loads += 1
        return slot

    def slot_of(self, key: Hashable) -> int | None:
        """The slot holding `key`, or None."""
        return self._slots.get(key)

    def take_loads(self) -> list[tuple[int, Hashable]]:
        """The `(slot, key)` writes recorded since the last call, in order."""
        loads, self._loads = self._loads, []
        return loads

    def forget(self, key: Hashable) -> None:
        """Drops `key` (its weights were replaced or unloaded): its slot is free once no
        sequence holds it, and a pending load of it is not made."""
        slot = self._slots.pop(key, None)
        if slot is None:
            return
        if self.in_use(slot):  # its pending load is still needed by those who hold it
            self._slots[("forgotten", key)] = slot  # held until its sequences leave
            self._slots.move_to_end(("forgotten", key), last=False)
        else:
            self._loads = [(s, k) for s, k in self._loads if k != key]
            self._free.append(slot)

    def clear(self) -> None:
        """Forgets every slot (the device's contents were lost: sleep, a failed write)."""
        self._slots.clear()
        self._loads.clear()
        self._free = list(range(self.num_slots, 0, -1))

    @property
    def resident(self) -> dict[Hashable, int]:
        """Key -> slot of the adapters held, least recent first."""
        return {k: s for k, s in self._slots.items() if not _forgotten(k)}


def _forgotten(key: Hashable) -> bool:
    return isinstance(key, tuple) and len(key) == 2 and key[0] == "forgotten"

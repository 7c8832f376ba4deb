"""The LoRA adapters an engine serves: known by name, read once, written to device slots.

An adapter is added by name with a PEFT checkpoint directory (`add`, or the first
request naming it, as vLLM does) or with a tree in memory (`update`: a trainer's
adapter, replaced in place). Adding reads and checks it against the model at once, so
a bad adapter is refused before any request runs under it; its slot contents stay in
host memory (`LoRAAdapters.host_bytes`). Each version of an adapter's weights has a key
of its own: the prefix cache and the device slots key pages and slots by it, so nothing
computed under old weights serves the new.

Which slot an adapter gets is the scheduler's decision (`paxkv.host.lora_slots`);
`flush`, called before every step is dispatched, writes the slots it recorded.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from paxkv.host.lora_slots import LoRARequest, LoRASlots


@dataclasses.dataclass
class _Adapter:
    request: LoRARequest
    key: tuple[str, int]  # (name, version): what slots and cached pages are keyed by
    contents: dict[tuple, np.ndarray]  # one slot's contents by state path


class LoRAAdapters:
    """The adapters of an engine whose runner has slots (`EngineConfig.enable_lora`).

    Args:
      runner: a `ModelRunner` (`lora_slot_contents`, `write_lora_slot`).
      slots: the scheduler's slot LRU, whose loads `flush` writes.
    """

    def __init__(self, runner: Any, slots: LoRASlots, live_keys: Callable[[], set] = set) -> None:
        self.runner = runner
        self.slots = slots
        self.live_keys = live_keys  # the keys unfinished sequences run under
        self._adapters: dict[str, _Adapter] = {}
        # Replaced or removed adapters' contents, by key, while a sequence that started
        # under them may still need their slot (a preempted one, resuming).
        self._retired: dict[tuple, dict[tuple, np.ndarray]] = {}
        self._versions = itertools.count(1)

    def add(self, request: LoRARequest) -> bool:
        """Reads and checks `request`'s adapter (ValueError naming the file and field);
        False, changing nothing, when the same adapter (name, id and path) is known."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a paxkv.LoRARequest, got {request!r}")
        known = self._adapters.get(request.lora_name)
        if known is not None:
            if known.request == request:
                return False
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} is loaded already as {known.request}; "
                "remove it first (remove_lora) to load another under that name"
            )
        for other in self._adapters.values():
            if other.request.lora_int_id == request.lora_int_id:
                raise ValueError(
                    f"lora_int_id={request.lora_int_id} is taken by adapter "
                    f"{other.request.lora_name!r}"
                )
        if not request.lora_path:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} is not loaded and has no lora_path"
            )
        contents = self.runner.lora_slot_contents(request.lora_path)
        self._install(request, contents)
        return True

    def update(
        self, name: str, state_dict: Mapping[str, Any], adapter_config: Mapping[str, Any]
    ) -> None:
        """Replaces (or adds, with a new id) adapter `name`'s weights by a PEFT-named
        `state_dict` with its `adapter_config` fields (r, lora_alpha, ...). Requests
        already running keep the old weights until they end; new ones get the new."""
        contents = self.runner.lora_slot_contents((state_dict, adapter_config))
        known = self._adapters.pop(name, None)
        if known is not None:
            self._retire(known)
            request = known.request
        else:
            taken = {a.request.lora_int_id for a in self._adapters.values()}
            request = LoRARequest(name, next(i for i in itertools.count(1) if i not in taken))
        self._install(request, contents)

    def _install(self, request: LoRARequest, contents: dict[tuple, np.ndarray]) -> None:
        key = (request.lora_name, next(self._versions))
        self._adapters[request.lora_name] = _Adapter(request, key, contents)

    def remove(self, name: str) -> bool:
        """Forgets adapter `name`: new requests cannot name it, running ones finish
        under it. Whether it was known."""
        known = self._adapters.pop(name, None)
        if known is None:
            return False
        self._retire(known)
        return True

    def _retire(self, adapter: _Adapter) -> None:
        self.slots.forget(adapter.key)
        self._retired[adapter.key] = adapter.contents

    def key_for(self, request: LoRARequest | str) -> tuple[str, int]:
        """The key a request under `request` runs with, adding its adapter first if it
        is a `LoRARequest` not yet known; ValueError for an unknown name."""
        if isinstance(request, LoRARequest):
            self.add(request)
            name = request.lora_name
            if self._adapters[name].request != request:
                raise ValueError(f"{request} does not match the loaded adapter of that name")
        else:
            name = request
        known = self._adapters.get(name)
        if known is None:
            raise ValueError(
                f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self._adapters)})"
            )
        return known.key

    def request_of(self, name: str) -> LoRARequest:
        """The `LoRARequest` of loaded adapter `name`."""
        return self._adapters[name].request

    def current_key(self, name: str) -> tuple[str, int] | None:
        """The key of adapter `name`'s current weights; None when it is not loaded."""
        known = self._adapters.get(name)
        return None if known is None else known.key

    def requests(self) -> list[LoRARequest]:
        """The adapters known, in the order they were added."""
        return [a.request for a in self._adapters.values()]

    @property
    def host_bytes(self) -> int:
        """Host memory the known adapters' slot contents take."""
        return sum(sum(v.nbytes for v in a.contents.values()) for a in self._adapters.values())

    def flush(self) -> None:
        """Writes the slots the scheduler gave adapters since the last flush. A failed
        write forgets every slot (their contents are not known) and raises."""
        if self._retired:  # forget the retired weights no sequence runs under any more
            live = self.live_keys()
            self._retired = {k: c for k, c in self._retired.items() if k in live}
        contents = {a.key: a.contents for a in self._adapters.values()} | self._retired
        try:
            for slot, key in self.slots.take_loads():
                self.runner.write_lora_slot(slot, contents.get(key))
        except BaseException:
            self.slots.clear()
            raise
